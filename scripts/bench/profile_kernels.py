"""Profile the attention server's fused kernel: latency over (query length, KV length) and fused-call
shapes, forward and forward+backward, for :class:`cadlib.core.measured.MeasuredCost`.

* ``task`` rows: one fused call of ``n_seg`` identical causal segments, ``q_len`` queries the suffix
  of ``kv_len`` KV tokens each; ``n_seg`` makes the call big enough to time (about ``--target-pairs``
  causal pairs, at most ``--max-seg``), so a row is a segment's cost inside a fused call.
* ``fused`` rows: one shape at ``n_seg`` = 1, 4, 16, 64: the call's fixed cost (intercept).

CUDA events after warm-up (perf_counter on the CPU); points run cheapest first within
``--time-budget-s`` (per backend, shared equally), the ones not reached are listed in
``not_reached``. Writes ``{"meta", "config", "results"}`` with :func:`cadlib.infra.results.save_result`.

    python scripts/bench/profile_kernels.py --backends fa4,torch_flash --time-budget-s 170 \\
        --out results/kernel_profile_h200.json                              # 1x H200, llama3-8b heads
    python scripts/bench/profile_kernels.py --device cpu --quick --out /tmp/kp.json  # CPU, tiny, sdpa_ref
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from cadlib.bench.meters import backend_versions
from cadlib.bench.profile import DTYPES, FULL, QUICK, grid, measure
from cadlib.infra.results import RESULTS_DIR, save_result
from cadlib.runtime import kernels

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    ap.add_argument("--backends", default=None, help="comma-separated; default fa4,torch_flash on CUDA, "
                    "sdpa_ref on the CPU")
    ap.add_argument("--dtype", default=None, choices=tuple(DTYPES), help="default bf16 (fp32 on the CPU)")
    ap.add_argument("--quick", action="store_true", help="tiny grid and heads (a CPU smoke run)")
    ap.add_argument("--time-budget-s", type=float, default=170.0, help="wall-clock budget for all points")
    ap.add_argument("--out", default=None, help="JSON path (default results/kernel_profile_<device>.json)")
    args = ap.parse_args(argv)
    if not args.time_budget_s > 0:
        ap.error(f"--time-budget-s must be > 0, got {args.time_budget_s}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but CUDA is not available; use --device cpu --quick")
    g = QUICK if args.quick else FULL
    dtype = DTYPES[args.dtype or ("fp32" if device.type == "cpu" else "bf16")]
    avail = kernels.available_backends(device)
    wanted = args.backends.split(",") if args.backends else (
        [b for b in ("fa4", "torch_flash") if b in avail] or ["sdpa_ref"])
    backends = []
    for b in wanted:
        try:
            backends.append(kernels.resolve_backend(b, device, dtype))
        except ValueError as e:
            print(f"skipping backend {b}: {e}", flush=True)
    if not backends:
        ap.error(f"none of --backends {wanted} is usable here (available: {avail})")
    pts = grid(g)
    gen = torch.Generator(device=device).manual_seed(0)
    rows, not_reached = [], []
    t_all = time.perf_counter()
    for bi, backend in enumerate(backends):
        deadline = t_all + args.time_budget_s * (bi + 1) / len(backends)
        for kind, q, k, n in pts:
            if time.perf_counter() > deadline:
                not_reached.append({"backend": backend, "kind": kind, "q_len": q, "kv_len": k, "n_seg": n})
                continue
            t0 = time.perf_counter()
            rec = {"backend": backend, "kind": kind, "q_len": q, "kv_len": k, "n_seg": n,
                   **measure(backend, q, k, n, g["heads"], dtype, device, g["warmup"], g["iters"], gen)}
            rec["wall_s"] = time.perf_counter() - t0
            rows.append(rec)
            fwd, fb = rec.get("fwd_ms", float("nan")), rec.get("fwd_bwd_ms", float("nan"))
            print(f"{backend:>11} {kind:>5} q {q:>6} kv {k:>6} x{n:<3} fwd {fwd:9.3f} ms "
                  f"fwd+bwd {fb:9.3f} ms", flush=True)
    hq, hkv, d = g["heads"]
    cfg = {"device": str(device), "backends": backends, "dtype": str(dtype).replace("torch.", ""),
           "n_heads": hq, "n_kv_heads": hkv, "head_dim": d, "quick": args.quick, "grid": g,
           "time_budget_s": args.time_budget_s, "causal": True}
    tag = "cpu_quick" if args.quick else device.type
    path = Path(args.out) if args.out else RESULTS_DIR / f"kernel_profile_{tag}.json"
    save_result(path, cfg, rows, not_reached=not_reached, backend_versions=backend_versions(),
                wall_s=time.perf_counter() - t_all)
    print(f"wrote {path} ({len(rows)} points, {len(not_reached)} not reached)", flush=True)


if __name__ == "__main__":
    main()

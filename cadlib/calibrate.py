"""Calibrate the what-if on your GPU: ``python -m cadlib.calibrate --out mygpu.json``.

Times, on the visible GPU, the three tables the replay prices a step from, in the formats it reads
(:mod:`cadlib.analysis.whatif.gpu_table` loads the file without torch):

1. **the attention kernel's latency grid** (:mod:`cadlib.bench.profile`, as
   ``results/kernel_profile_h200.json``): fused calls of ``n_seg`` causal segments of ``q`` queries
   over ``k`` KV tokens, ``pairs = n_seg (q k - q (q - 1) / 2)``; the rate ``pairs / seconds``
   prices any task (:class:`cadlib.core.measured.MeasuredCost`), at the model's heads;
2. **the linear-layer token grid** of the model's TP shard (:mod:`cadlib.bench.layers`, as the
   replay's cache ``results/replay/times_h200.json``): one layer's linear parts and the LM head on
   :data:`cadlib.analysis.replay.times.LINEAR_GRID`, each ``--linear`` variant (``reference``: every
   token through the norms; ``fused-sp``: the fused blocks, sequence parallelism's norms on tokens /
   TP), and one optimizer step;
3. **the intra-node all-to-all** when several GPUs are visible (one NCCL process per GPU,
   ``all_to_all_single`` of 64 and 256 MiB per rank; ``GB/s = bytes (w - 1) / w / seconds``), else a
   note that it was skipped.

Points run in that order, the kernel grid cheapest first, until ``--budget-s``; those not reached are
listed in the file (``not_reached``). On one H200 the whole default run takes about 2-3 minutes
(the grids of the committed tables: 27 + 4 kernel points, 14 token counts per variant).

    python -m cadlib.calibrate --out mygpu.json                       # llama3-8b, TP 8, FA4 if importable
    python -m cadlib.calibrate --model llama-34b --tp 8 --linear fused-sp --out mygpu.json
    python -m cadlib.calibrate --smoke --out /tmp/cpu.json            # CPU, tiny shapes (CI)
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .analysis.replay.times import LINEAR_GRID, head_key, linear_key, optimizer_key
from .analysis.whatif.gpu_table import FORMAT, GpuTableError, load
from .bench.layers import Head, blocks_of, sp_of, time_head, time_linear, time_optimizer
from .bench.meters import backend_versions
from .bench.profile import FULL, QUICK, grid, measure
from .bench.timer import time_fn
from .core.cost import MODELS, as_model
from .infra.groups import destroy, init_from_env
from .infra.results import atomic_write_json, save_result
from .runtime import kernels
from .runtime.model import DecoderLayer

VARIANTS = {"reference": "", "fused-sp": "fused-sp"}
"""``--linear`` names and the replay's variant keys (:data:`cadlib.analysis.replay.times.LINEAR_VARIANTS`)."""

A2A_MIB = (64, 256)
"""All-to-all sizes per rank (MiB): 256 as the committed probe, 64 to see the latency's share."""
SMOKE_A2A_MIB = (1, 4)
"""The smoke run's sizes (gloo CPU processes)."""

KERNEL_SHARE = 0.6
"""The kernel grid stops at this share of ``--budget-s``, so the linear grid always gets its turn."""

SMOKE_LINEAR_GRID = LINEAR_GRID[:2]
"""The smoke run's token counts: two, the fewest :func:`cadlib.analysis.replay.times.interp` takes."""


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m cadlib.calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the calibration file to write (JSON)")
    ap.add_argument("--model", default=None,
                    help=f"one of {', '.join(MODELS)} (default llama3-8b; tiny with --smoke)")
    ap.add_argument("--tp", type=int, default=None,
                    help="TP degree: the linear grid is one GPU's shard (default 8; 1 with --smoke)")
    ap.add_argument("--backend", default="auto",
                    help=f"attention kernel: auto (fa4 if importable, else torch_flash), or one of "
                         f"{', '.join(kernels.BACKENDS)}")
    ap.add_argument("--linear", default=None,
                    help=f"comma-separated linear variants: {', '.join(VARIANTS)} (default both; "
                         "reference with --smoke: the fused blocks need a GPU)")
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="stop timing new points after this many seconds")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model and grids (a check, no numbers)")
    ap.add_argument("--a2a-procs", type=int, default=None,
                    help="processes of the all-to-all (default: every visible GPU; 0 skips it; with --smoke, "
                         "gloo CPU processes)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap


def _bar(total: int, quiet: bool):
    """A tqdm bar on stderr (none without tqdm or with ``--quiet``): ``(update, close)``."""
    if quiet:
        return (lambda n=1, desc=None: None), (lambda: None)
    try:
        from tqdm import tqdm
    except ImportError:
        return (lambda n=1, desc=None: None), (lambda: None)
    bar = tqdm(total=total, desc="calibrating", unit="point", file=sys.stderr)

    def update(n=1, desc=None):
        if desc:
            bar.set_description(desc)
        bar.update(n)
    return update, bar.close


def choose_backend(name: str, device, dtype, head_dim: int) -> str:
    """``auto``: FA4 when importable here, else torch's flash kernel (``sdpa_ref`` on the CPU)."""
    if name == "auto":
        avail = kernels.available_backends(device)
        name = next((b for b in ("fa4", "torch_flash") if b in avail), "sdpa_ref")
    return kernels.resolve_backend(name, device, dtype, head_dim)


# ------------------------------------------------------------------------------------- all-to-all
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _a2a_rank(rank: int, world: int, port: int, pg: str, mibs, out: str) -> None:
    """One process of the all-to-all: ``all_to_all_single`` of each size, median of 7 after 2 warm-ups."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    d = init_from_env(pg)
    rows = []
    for mib in mibs:
        n = mib * 2 ** 20 // 2
        x = torch.ones(n - n % world, dtype=torch.bfloat16, device=d.device)
        y = torch.empty_like(x)
        ms = time_fn(lambda: dist.all_to_all_single(y, x, group=d.group), d.device, iters=7, warmup=2,
                     group=d.group)["median_ms"]
        rows.append({"ctas": "nccl default" if pg == "nccl" else pg, "mib_per_rank": mib, "world": world,
                     "a2a_ms": ms, "a2a_gbps": x.numel() * 2 * (world - 1) / world / ms / 1e6})
    if rank == 0:
        atomic_write_json(out, rows)
    destroy()


def time_all_to_all(procs: int, pg: str, mibs) -> dict:
    """The all-to-all over ``procs`` processes on this machine (one per GPU under NCCL)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "a2a.json")
        torch.multiprocessing.spawn(_a2a_rank, args=(procs, _free_port(), pg, tuple(mibs), out), nprocs=procs)
        with open(out) as f:
            return {"gpus": procs, "backend": pg, "rows": json.load(f)}


# ------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    model = a.model or ("tiny" if a.smoke else "llama3-8b")
    tp = a.tp if a.tp is not None else (1 if a.smoke else 8)
    try:
        spec_full = as_model(model)
        spec = spec_full.shard(tp)
    except ValueError as e:
        ap.error(str(e))
    linear = a.linear if a.linear is not None else ("reference" if a.smoke else "reference,fused-sp")
    variants = [v.strip() for v in linear.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        ap.error(f"--linear {linear!r}: choose from {', '.join(VARIANTS)} (comma-separated)")
    if not a.budget_s > 0:
        ap.error(f"--budget-s must be > 0, got {a.budget_s}")
    if not Path(a.out).resolve().parent.is_dir():
        ap.error(f"--out {a.out}: its folder does not exist")
    mibs = SMOKE_A2A_MIB if a.smoke else A2A_MIB
    if a.smoke:
        device, dtype, g, lin_grid = torch.device("cpu"), torch.float32, QUICK, SMOKE_LINEAR_GRID
    else:
        if not torch.cuda.is_available():
            ap.error("no CUDA GPU is visible; calibrate on a GPU, or --smoke for the CPU check")
        device, dtype, g, lin_grid = torch.device("cuda"), torch.bfloat16, FULL, LINEAR_GRID
        g = {**g, "heads": (spec_full.n_heads, spec_full.n_kv_heads, spec_full.head_dim)}
    try:
        backend = choose_backend(a.backend, device, dtype, spec_full.head_dim)
    except ValueError as e:
        ap.error(f"--backend {a.backend}: {e}")
    n_gpu = torch.cuda.device_count() if device.type == "cuda" else 0
    procs = a.a2a_procs if a.a2a_procs is not None else (n_gpu if n_gpu > 1 else 0)
    if procs == 1 or procs < 0 or (device.type == "cuda" and procs > n_gpu):
        ap.error(f"--a2a-procs must be 0 or 2..{max(n_gpu, 2)} here, got {procs}")

    pts = grid(g)
    total = len(pts) + len(variants) * len(lin_grid) * 2 + 1 + (1 if procs else 0)
    update, close = _bar(total, a.quiet)
    t0 = time.perf_counter()
    over = lambda share=1.0: time.perf_counter() - t0 > a.budget_s * share  # noqa: E731
    gen = torch.Generator(device=device).manual_seed(0)
    rows, not_reached, skipped = [], [], []

    # 1. the kernel grid, cheapest first
    for kind, q, k, n in pts:
        if over(KERNEL_SHARE):
            not_reached.append({"kind": kind, "q_len": q, "kv_len": k, "n_seg": n})
        else:
            t = time.perf_counter()
            rows.append({"backend": backend, "kind": kind, "q_len": q, "kv_len": k, "n_seg": n,
                         **measure(backend, q, k, n, g["heads"], dtype, device, g["warmup"], g["iters"], gen),
                         "wall_s": time.perf_counter() - t})
        update(1, f"kernel q {q} kv {k}")
    if not_reached:
        skipped.append(f"{len(not_reached)} of {len(pts)} kernel points "
                       f"(past {KERNEL_SHARE:.0%} of the budget)")
    hq, hkv, d = g["heads"]
    dt = str(dtype).replace("torch.", "")
    kernel = {"config": {"device": str(device), "backends": [backend], "dtype": dt,
                         "n_heads": hq, "n_kv_heads": hkv, "head_dim": d, "quick": a.smoke, "grid": g,
                         "causal": True},
              "results": rows, "not_reached": not_reached}

    # 2. the linear grid of the TP shard, each variant, and the optimizer
    times, lin_missed = {}, []
    for name in variants:
        var = VARIANTS[name]
        layer = DecoderLayer(spec, recompute="mlp", blocks=blocks_of(var), dtype=dtype, device=device)
        head = Head(spec, device, dtype, blocks_of(var))
        for n in lin_grid:
            sp = sp_of(var, tp, n, spec, device, dtype)
            for key, fn in ((linear_key(spec, backend, n, var, tp),
                             lambda: time_linear(layer, spec, n, device, dtype, 2, sp)),
                            (head_key(spec, backend, n, var, tp),
                             lambda: time_head(head, spec, n, device, 2, sp))):
                if over():
                    lin_missed.append(key)
                else:
                    times[key] = {**fn(), "linear": name, "tp": tp}
                update(1, f"{name} {key.split('|', 1)[0]} {n}")
        layer = head = sp = None                     # free the variant's weights and buffers
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if lin_missed:
        skipped.append(f"{len(lin_missed)} linear and head points (over the budget)")
    okey = optimizer_key(spec, backend)
    if over():
        skipped.append("the optimizer step (over the budget)")
    else:
        times[okey] = time_optimizer(spec, device, dtype, 3)
    update(1, "optimizer")

    # 3. the all-to-all
    if procs and not over():
        a2a = time_all_to_all(procs, "nccl" if device.type == "cuda" else "gloo", mibs)
        update(1, "all-to-all")
    elif procs:
        a2a = {"skipped": "over the budget"}
        skipped.append("the all-to-all (over the budget)")
    else:
        a2a = {"skipped": f"{n_gpu or 'no'} GPU visible: the all-to-all needs several (the what-if keeps the "
                          "committed link model)" if n_gpu <= 1 else "--a2a-procs 0"}
    close()

    cfg = {"format": FORMAT, "model": spec_full.name, "tp": tp, "backend": backend,
           "linear": [VARIANTS[v] for v in variants], "linear_names": variants, "dtype": dt,
           "device": str(device), "smoke": a.smoke, "budget_s": a.budget_s, "linear_grid": list(lin_grid),
           "a2a_mib": list(mibs), "gpus_visible": n_gpu}
    path = save_result(a.out, cfg, {"kernel": kernel, "times": times, "all_to_all": a2a},
                       skipped=skipped, not_reached={"kernel": not_reached, "linear": lin_missed},
                       backend_versions=backend_versions(), wall_s=time.perf_counter() - t0)
    try:
        table = load(path, model=spec_full.name, backend=backend)
    except GpuTableError as e:
        print(f"wrote {path}, but it cannot price a step: {e}", file=sys.stderr)
        return 3
    print(f"wrote {path}: {len(rows)} kernel points, {len(times)} linear/head/optimizer entries, "
          f"all-to-all {table.link_gbps() or a2a.get('skipped')}; {time.perf_counter() - t0:.0f} s on "
          f"{table.device}" + (f"; skipped: {'; '.join(skipped)}" if skipped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Block-sparse attention benchmark: kernels x sparsity x length x block size x heads, forward and backward.

LongCA-bench's sparse-kernel study on :mod:`cadlib.data.sparse` masks (uniform blocks of 64 and 128;
variable blocks averaging 128-1024, at least 128) with :mod:`cadlib.runtime.kernels.sparse` (``flex``,
``fa4``, ``sdpa``). Heads ``Hq:Hkv`` (GQA 64:8 and MHA 64:64): one block pattern per KV head, as the
benchmark draws them. Work is counted from the exact mask area (forward ``4 * D * Hq/H * area``,
backward 2.5x), never from ``sparsity * T^2``.

Per cell (kernel, mask family, block, sparsity, length, heads): the block structures are built outside
the timed call; forward and backward are timed like ``scripts/bench/bench_kernels.py`` (one untimed call,
``--warmup`` calls, ``--reps`` CUDA-event timings after an L2 flush; median and 20/80% quantiles; fewer
repetitions for a slow cell). The first cell of each (kernel, family, block, heads) is also checked at
``--check-len`` tokens against the dense masked reference in fp32 (``max_err`` of o, ``grad_err`` of dq,
dk, dv). A cell that runs out of memory is ``E``, one the kernel does not support ``X`` (its own message
recorded), one that fails otherwise ``!``, one not reached in ``--time-budget-s`` ``-``: never a crash.
Cells run in priority order (``--sparsities`` in the order given, then the variable masks), so a short
budget covers every kernel, block, heads and length at the first sparsity; ``--merge`` keeps the cells an
earlier run measured and runs only the others (run the same command again to continue).

    python scripts/bench/bench_sparse.py --out results/bench_sparse_h200.json --merge --time-budget-s 300
    python scripts/bench/bench_sparse.py --smoke          # CPU, tiny, seconds
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
import warnings
from pathlib import Path

_T0 = time.monotonic()

import torch  # noqa: E402

from bench_kernels import DTYPES  # noqa: E402

from cadlib.bench.inputs import rand  # noqa: E402
from cadlib.bench.meters import reset_peak, tflops  # noqa: E402
from cadlib.bench.timer import flush_buffer, time_kernel  # noqa: E402
from cadlib.data.sparse import SPARSE_TYPES, VARIABLE, make_sparse_mask  # noqa: E402
from cadlib.infra.results import save_result  # noqa: E402
from cadlib.runtime.kernels import available_backends, sparse  # noqa: E402

SEQLENS = (16384, 32768, 65536, 131072)
HEADS = ("64:8", "64:64")
SYMBOL = {"X": "unsupported", "E": "out of memory", "!": "failed", "-": "not reached (time budget)"}
KEY = ("kernel", "family", "block", "sparsity", "seqlen", "heads", "direction")


def _grad(device, kernel) -> bool:
    """FlexAttention has no backward on the CPU (its inputs must not require grad there)."""
    return not (device.type == "cpu" and kernel == "flex")


def static_unsupported(kernel: str, family: str, device: torch.device) -> str | None:
    """Why ``kernel`` cannot run ``family`` masks here, decided without running (None: try it)."""
    if kernel == "fa4":
        if "fa4" not in available_backends(device):
            return "FA4 needs CUDA (compute capability >= 9.0) and flash-attn-4"
        if family == VARIABLE:
            return ("FA4 block sparsity lists whole tiles; variable blocks cut tiles and would need a CuTe "
                    "mask_mod for the partial ones")
    if kernel == "flex" and device.type != "cuda":
        return None
    return None


def _classify(e: BaseException) -> tuple[str, str]:
    msg = f"{type(e).__name__}: {e}"
    if isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in msg.lower():
        return "E", msg[:300]
    if isinstance(e, (sparse.SparseUnsupported, NotImplementedError, AssertionError, ValueError)):
        return "X", msg[:500]                      # the kernel's own check refused this configuration
    return "!", msg[:500]


def _inputs(T, hq, hkv, d, dtype, device, seed, grad):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = rand(gen, T, hq, d, device, dtype)
    k, v = (rand(gen, T, hkv, d, device, dtype) for _ in range(2))
    dout = rand(gen, T, hq, d, device, dtype)
    for t in (q, k, v):
        t.requires_grad_(grad)
    return q, k, v, dout


def _rel(a, b) -> float:
    return float((a.detach().float() - b.detach().float()).abs().max() / b.detach().float().abs().max())


def check(kernel, family, block, sparsity, heads, args, device, dtype, flex_fn) -> dict:
    """Errors against the fp32 dense masked reference at ``--check-len`` tokens."""
    T, (hq, hkv) = args.check_len, heads
    m = make_sparse_mask(family, T, block, sparsity, heads=hkv, seed=args.seed)
    grad = _grad(device, kernel)
    q, k, v, dout = _inputs(T, hq, hkv, args.head_dim, dtype, device, args.seed + 1, grad)
    out = sparse.setup(kernel, m, q, k, v, flex_fn)()
    ref, _ = sparse.reference_attention(q, k, v, m)
    res = {"check_len": T, "max_err": _rel(out, ref)}
    if grad:
        try:                            # a backward that does not compile leaves the forward's check standing
            got = torch.autograd.grad(out, (q, k, v), dout)
        except Exception as e:
            res["grad_error"] = _classify(e)[1]
            return res
        want = torch.autograd.grad(ref, (q, k, v), dout)
        res["grad_err"] = max(_rel(g, w) for g, w in zip(got, want))
    return res


def run_cell(kernel, m, heads, args, device, dtype, flush, flex_fn) -> list[dict]:
    """The fwd and bwd records of one cell."""
    hq, hkv = heads
    T = m.total
    block = int(m.params.get("block", m.params.get("avg_block")))
    base = {"kernel": kernel, "family": m.name, "block": block,
            "sparsity": m.params["sparsity"], "seqlen": T, "heads": f"{hq}:{hkv}", "q_heads": hq,
            "kv_heads": hkv, "head_dim": args.head_dim, "area": m.area(), "density": m.sparsity()}
    recs = {}
    reset_peak(device)
    grad = _grad(device, kernel)
    try:
        q, k, v, dout = _inputs(T, hq, hkv, args.head_dim, dtype, device, args.seed, grad)
        t0 = time.perf_counter()
        fwd = sparse.setup(kernel, m, q, k, v, flex_fn)
        build_ms = (time.perf_counter() - t0) * 1e3
    except Exception as e:                          # building the mask structures: OOM or refused
        status, err = _classify(e)
        return [{**base, "direction": d, "status": status, "error": err} for d in ("fwd", "bwd")]
    for direction in ("fwd", "bwd"):
        rec = {**base, "direction": direction, "build_ms": build_ms}
        if direction == "bwd" and not grad:
            recs[direction] = {**rec, "status": "X", "error": "FlexAttention has no backward on the CPU"}
            continue
        try:
            t0 = time.perf_counter()
            out = fwd()                                      # compiles / autotunes: untimed
            if direction == "bwd":
                out.backward(dout)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            first_ms = (time.perf_counter() - t0) * 1e3
            del out
            warmup, reps = args.warmup, args.reps
            if first_ms > args.slow_ms:
                warmup, reps = 0, min(reps, 2)
            if direction == "fwd":
                ctx = torch.no_grad() if grad else torch.enable_grad()
                with ctx:
                    st = time_kernel(fwd, device, iters=reps, warmup=warmup, flush=flush)
            else:
                for t in (q, k, v):
                    t.grad = None
                st = time_kernel(lambda o: o.backward(dout), device, iters=reps, warmup=warmup, flush=flush,
                                 pre=fwd)
            flops = m.flops(hq, args.head_dim, direction)
            rec.update(status="ok", first_ms=first_ms, flops=flops,
                       tflops=tflops(flops, st["median_ms"]), **st)
        except Exception as e:
            status, err = _classify(e)
            rec.update(status=status, error=err)
            if status == "!":
                rec["trace"] = traceback.format_exc(limit=4)[-1500:]
        if device.type == "cuda":
            rec["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
        recs[direction] = rec
    q = k = v = dout = fwd = None  # noqa: F841  (free them before the next cell)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return [recs["fwd"], recs["bwd"]]


def cells(args) -> list[tuple]:
    """(family, block, sparsity, heads, seqlen) in priority order (module docstring)."""
    out = []
    fams = args.families.split(",")
    for s in args.sparsities:
        for fam in fams:
            if fam == VARIABLE:
                continue
            for b in args.blocks:
                out += [(fam, b, s, h, T) for h in args.heads for T in args.seqlens]
    if VARIABLE in fams:
        for s in args.sparsities:
            for b in args.avg_blocks:
                out += [(VARIABLE, b, s, h, T) for h in args.heads for T in args.seqlens]
    return out


def table(rows: list[dict], direction: str) -> str:
    """Kernel x (block, heads, sparsity) TF/s at the longest length measured, or the status symbol."""
    done = [r for r in rows if r["direction"] == direction]
    if not done:
        return ""
    T = max(r["seqlen"] for r in done)
    lines = [f"{direction} TF/s at {T} tokens (family block heads sparsity: kernels)"]
    groups = sorted({(r["family"], r["block"], r["heads"], r["sparsity"]) for r in done if r["seqlen"] == T})
    kernels = sorted({r["kernel"] for r in done})
    for g in groups:
        cell = {r["kernel"]: (f"{r['tflops']:.3g}" if r["status"] == "ok" else r["status"])
                for r in done
                if r["seqlen"] == T and (r["family"], r["block"], r["heads"], r["sparsity"]) == g}
        lines.append(f"{g[0][:8]:>8} {g[1]:>5} {g[2]:>6} {g[3]:>4}: " + "  ".join(f"{kn} {cell.get(kn, '')}"
                                                                          for kn in kernels))
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernels", default=None,
                   help=f"comma-separated, from: {', '.join(sparse.SPARSE_KERNELS)}")
    p.add_argument("--families", default=",".join(SPARSE_TYPES))
    p.add_argument("--blocks", default="64,128", help="uniform block sizes")
    p.add_argument("--avg-blocks", default="128,1024", help="average block sizes of the variable masks")
    p.add_argument("--sparsities", default="0.5,0.1,0.9", help="kept fractions, in priority order")
    p.add_argument("--seqlens", default=",".join(str(s) for s in SEQLENS))
    p.add_argument("--heads", default=",".join(HEADS), help="Hq:Hkv pairs")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--slow-ms", type=float, default=300.0, help="a first call above this: 2 reps, no warm-up")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--check-len", type=int, default=2048)
    p.add_argument("--time-budget-s", type=float, default=None, help="start no new cell after this long")
    p.add_argument("--out", default="results/bench_sparse.json")
    p.add_argument("--merge", action="store_true",
                   help="keep the cells --out already measured, run the others")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, fp32, seconds")
    args = p.parse_args(argv)
    if args.smoke:
        args.seqlens, args.heads, args.head_dim, args.dtype = "256", "4:2,4:4", 16, "fp32"
        args.blocks, args.avg_blocks, args.sparsities, args.check_len = "64", "128", "0.5", 256
        args.warmup, args.reps = 0, 2
        args.kernels = args.kernels or "flex,sdpa,fa4"
        if args.out == "results/bench_sparse.json":
            args.out = "results/bench_sparse_smoke.json"
    args.kernels = (args.kernels or "flex,fa4").split(",")
    for k in args.kernels:
        if k not in sparse.SPARSE_KERNELS:
            p.error(f"unknown kernel {k!r}; choose from: {', '.join(sparse.SPARSE_KERNELS)}")
    for f in args.families.split(","):
        if f not in SPARSE_TYPES:
            p.error(f"unknown family {f!r}; choose from: {', '.join(SPARSE_TYPES)}")
    args.blocks = [int(x) for x in args.blocks.split(",")]
    args.avg_blocks = [int(x) for x in args.avg_blocks.split(",")]
    args.sparsities = [float(x) for x in args.sparsities.split(",")]
    args.seqlens = [int(x) for x in args.seqlens.split(",")]
    args.heads = [tuple(int(y) for y in h.split(":")) for h in args.heads.split(",")]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")   # CPU smoke
    device = torch.device("cuda") if torch.cuda.is_available() and not args.smoke else torch.device("cpu")
    dtype = DTYPES[args.dtype] if device.type == "cuda" else torch.float32
    out = Path(args.out)
    rows = json.loads(out.read_text()).get("results", []) if args.merge and out.exists() else []
    done = {tuple(r[k] for k in KEY) for r in rows if r.get("status") in ("ok", "X", "E")}
    flex_fn = torch.compile(sparse.flex_attention) if device.type == "cuda" else None
    flush = flush_buffer(device)
    checked: set = set()
    config = {**{k: v for k, v in vars(args).items()}, "device": str(device),
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    for fam, block, s, heads, T in cells(args):
        masks = {}
        for kernel in args.kernels:
            key = (kernel, fam, block, s, T, f"{heads[0]}:{heads[1]}")
            if all(key + (d,) in done for d in ("fwd", "bwd")):
                continue
            base = {"kernel": kernel, "family": fam, "block": block, "sparsity": s, "seqlen": T,
                    "heads": key[5], "q_heads": heads[0], "kv_heads": heads[1], "head_dim": args.head_dim}
            why = static_unsupported(kernel, fam, device)
            late = args.time_budget_s is not None and time.monotonic() - _T0 > args.time_budget_s
            if why is not None or late:
                recs = [{**base, "direction": d, "status": "X" if why else "-", "error": why or "time budget"}
                        for d in ("fwd", "bwd")]
            else:
                if "m" not in masks:
                    masks["m"] = make_sparse_mask(fam, T, block, s, heads=heads[1], seed=args.seed)
                recs = run_cell(kernel, masks["m"], heads, args, device, dtype, flush, flex_fn)
                group = (kernel, fam, block, heads)
                if group not in checked and all(r["status"] == "ok" for r in recs[:1]):
                    checked.add(group)
                    try:
                        res = check(kernel, fam, block, s, heads, args, device, dtype, flex_fn)
                    except Exception as e:
                        res = {"check_error": _classify(e)[1]}
                    for r in recs:
                        r["check"] = res
            rows = [r for r in rows if tuple(r[k] for k in KEY[:-1]) != key] + recs
            brief = "  ".join(f"{r['direction']} " + (f"{r['median_ms']:.2f} ms {r['tflops']:.3g} TF/s"
                                                     if r["status"] == "ok" else f"{r['status']} "
                                                     f"{r.get('error', '')[:70]}") for r in recs)
            print(f"{kernel:>5} {fam[:8]:>8} b{block:<5} s{s:<4} {key[5]:>6} {T:>7}: {brief}", flush=True)
            save_result(out, config, rows, symbols=SYMBOL)
    for d in ("fwd", "bwd"):
        print(table(rows, d))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

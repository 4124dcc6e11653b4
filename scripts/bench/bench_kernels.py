"""Kernel x mask benchmark: attention backends on the 12 mask types (+ 2 long variants), fwd and bwd.

Each backend declares the masks it supports; a cell it does not support is ``X``, one that runs out
of memory ``E``, one that fails otherwise ``!`` (the error is recorded), one skipped for the time
budget or after a slower smaller size ``-``. Work is counted from the exact mask area
(:meth:`cadlib.data.masks.Mask.flops`: forward ``4 * area * Hq * D``, backward 2.5x), never from what a
kernel computes, so TF/s compare across backends.

Backends (``BACKENDS``)::

    sdpa_math, sdpa_efficient   torch SDPA; full/causal by flag, every other mask as a dense boolean mask
    sdpa_flash, sdpa_cudnn      torch SDPA; full and causal only
    torch_flash                 torch's built-in FA2 varlen (cadlib.runtime.kernels), masks with a varlen form
    fa4                         FlashAttention-4: varlen masks (cadlib.runtime.kernels), its sliding windows
    flash_attn                  FlashAttention-2 varlen (cadlib.runtime.kernels) when importable
    flex                        FlexAttention, torch.compile'd, block mask from the mask's slices
    flex_eager, sdpa_ref        CPU smoke only (unfused flex; cadlib's per-segment reference)

Timing (GPU): per cell one untimed call (compilation, autotuning; fewer repetitions when it is slow),
``--warmup`` untimed calls, then ``--reps`` calls each after an L2 flush
(a 256 MB write), CUDA events around the kernel alone; median and 20/80% quantiles; peak memory
(``max_memory_allocated``, inputs included). The smallest size of each (backend, mask) is also
checked against a float32 dense reference (``max_err``). Results are saved after every cell, so an
interrupted run keeps what it measured; ``--merge`` adds to an existing file (replacing equal cells).

Heads: ``--heads 64:8,64:64`` measures GQA and MHA (LongCA-bench's two settings); every record carries
its ``heads``. Draws: with ``--draws N`` every mask whose documents are drawn (``DRAWN_MASKS``) is timed on
``N`` independent draws (seeds ``seed .. seed + N - 1``; the benchmark takes 30), each with one untimed
call and ``--draw-reps`` timed ones; the record gives the median over the draws of each draw's median
and the 20/80% quantiles across draws (``median_ms``, ``q20_ms``, ``q80_ms``; TF/s per draw from its own
area: ``tflops``, ``tflops_q20``, ``tflops_q80``), and the draws themselves (``per_draw``).

    python scripts/bench/bench_kernels.py --backends fa4,torch_flash --out results/bench_kernels.json --merge
    python scripts/bench/bench_kernels.py --smoke        # CPU, tiny, seconds
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

_T0 = time.monotonic()          # --time-budget-s counts from here (torch import and CUDA start included)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from cadlib.bench.inputs import rand  # noqa: E402
from cadlib.bench.meters import reset_peak, tflops  # noqa: E402
from cadlib.bench.timer import flush_buffer, time_kernel  # noqa: E402
from cadlib.core.paper import LONGCA_DRAWS  # noqa: E402
from cadlib.data.masks import ALL_TYPES, FULL, Mask, make_mask  # noqa: E402
from cadlib.infra.results import atomic_write_json, save_result  # noqa: E402
from cadlib.runtime import kernels  # noqa: E402
from cadlib.runtime.kernels import flex as flex_masks  # noqa: E402

BACKENDS = ("sdpa_math", "sdpa_efficient", "sdpa_flash", "sdpa_cudnn", "torch_flash", "fa4", "flash_attn",
            "flex", "flex_eager", "sdpa_ref")
GPU_DEFAULT = ("sdpa_math", "sdpa_efficient", "sdpa_flash", "sdpa_cudnn", "torch_flash", "fa4", "flash_attn",
               "flex")
SMOKE_BACKENDS = ("sdpa_math", "flex_eager", "sdpa_ref")
SEQLENS = (1024, 2048, 4096, 8192, 16384, 24576, 32768, 40960, 49152)
DTYPES = kernels.TORCH_DTYPES
SYMBOL = {"X": "unsupported", "E": "out of memory", "!": "failed", "-": "skipped"}
DRAWN_MASKS = ("full_document", "causal_document", "share_question", "causal_blockwise", "prefix_lm_document",
               "block_causal_document", "full_document_long", "causal_document_long")
"""The masks whose documents are drawn from a distribution (LongCA-bench's document-type masks)."""
BENCH_DRAWS = LONGCA_DRAWS
DEFAULT_HEADS = "64:8"


# ---------------------------------------------------------------------------------------------------
# Backends: each returns (fwd, bwd_prepare, bwd) closures over prepared inputs
# ---------------------------------------------------------------------------------------------------

class Unsupported(Exception):
    pass


def dense_mask(mask: Mask, device) -> torch.Tensor:
    """Boolean ``[T, T]`` built slice by slice on ``device`` (no host ``T x T`` array)."""
    T = mask.total
    out = torch.zeros(T, T, dtype=torch.bool, device=device)
    for a, b, c, d, kind in zip(mask.q0, mask.q1, mask.k0, mask.k1, mask.kind):
        a, b, c, d, kind = int(a), int(b), int(c), int(d), int(kind)
        if kind == FULL:
            out[a:b, c:d] = True
            continue
        j = torch.arange(b - a, device=device)[:, None]
        t = torch.arange(d - c, device=device)[None, :]
        cond = {1: t <= j + (d - c) - (b - a), 2: t >= j, 3: (t <= j + (d - c) - (b - a)) & (t >= j)}[kind]
        out[a:b, c:d] |= cond
    return out


def _plain(mask: Mask):
    """``is_causal`` for the single-slice full/causal masks, else None."""
    if mask.name in ("full", "causal"):
        return mask.name == "causal"
    return None


def _sdpa(variant: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = {"sdpa_math": SDPBackend.MATH, "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
             "sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[variant]

    def setup(mask, q, k, v, dout):
        is_causal = _plain(mask)          # flash/cuDNN never get here without one (statically_unsupported)
        attn_mask = dense_mask(mask, q.device) if is_causal is None else None
        qh, kh, vh, dh = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v, dout))
        qh, kh, vh = (t.requires_grad_(True) for t in (qh, kh, vh))
        gqa = {"enable_gqa": True} if kh.shape[1] != qh.shape[1] else {}

        def call(kk, vv, **kw):
            with sdpa_kernel([which]):
                return F.scaled_dot_product_attention(qh, kk, vv, attn_mask=attn_mask,
                                                      is_causal=bool(is_causal), **kw)
        try:
            call(kh, vh, **gqa)
        except RuntimeError:                  # this SDPA backend takes no GQA: expand the KV heads
            if not gqa:
                raise
            rep = qh.shape[1] // kh.shape[1]
            kh = kh.detach().repeat_interleave(rep, 1).requires_grad_(True)
            vh = vh.detach().repeat_interleave(rep, 1).requires_grad_(True)
            gqa = {}

        def fwd():
            return call(kh, vh, **gqa)

        def bwd(out):
            out.backward(dh)
        return fwd, fwd, bwd
    return setup


def _varlen(backend: str):
    def setup(mask, q, k, v, dout):
        try:
            vf = mask.to_varlen()
        except ValueError:
            raise Unsupported from None
        dev = q.device
        if vf.k_index is not None:
            idx = torch.as_tensor(vf.k_index, device=dev)
            k, v = k.index_select(0, idx), v.index_select(0, idx)
        cu_q, cu_k = (torch.as_tensor(c, device=dev) for c in (vf.cu_q, vf.cu_k))
        args = (cu_q, cu_k, vf.max_q, vf.max_k)

        def fwd():
            return kernels.attend(q, k, v, *args, causal=vf.causal, backend=backend)

        def bwd(res):
            kernels.attend_backward(dout, q, k, v, res[0], res[1], *args, causal=vf.causal, backend=backend)
        return fwd, fwd, bwd
    return setup


def _fa4(mask, q, k, v, dout):
    """FA4: the sliding windows through its windowed ``flash_attn_func`` (``window_size=(left, right)``,
    query ``i`` sees keys ``[i - left, i + right]``), every varlen-expressible mask through
    :mod:`cadlib.runtime.kernels`, nothing else."""
    if mask.name not in ("sliding_window_causal", "sliding_window"):
        return _varlen("fa4")(mask, q, k, v, dout)
    from flash_attn.cute import flash_attn_func

    w = int(mask.params["window"])
    window = (w, 0 if mask.name == "sliding_window_causal" else w)
    qb, kb, vb = (t.unsqueeze(0).clone().requires_grad_(True) for t in (q, k, v))     # [1, T, H, D]

    def fwd():
        res = flash_attn_func(qb, kb, vb, causal=False, window_size=window)
        out = res[0] if isinstance(res, tuple) else res
        return out[0], None                          # [T, Hq, D], like the varlen backends

    def bwd(res):
        res[0].backward(dout)
    return fwd, fwd, bwd


_FLEX = {}


def _flex(compiled: bool):
    def setup(mask, q, k, v, dout):
        from torch.nn.attention.flex_attention import flex_attention

        if compiled and "fn" not in _FLEX:
            _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)    # one wrapper for every cell
        fn = _FLEX["fn"] if compiled else flex_attention
        bm = flex_masks.block_mask(mask, q.device, block_size=128,
                                   compile=compiled and q.device.type == "cuda")
        qh, kh, vh, dh = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v, dout))
        grad = q.device.type == "cuda"              # FlexAttention has no backward on the CPU
        qh, kh, vh = (t.requires_grad_(grad) for t in (qh, kh, vh))
        gqa = kh.shape[1] != qh.shape[1]

        def fwd():
            return fn(qh, kh, vh, block_mask=bm, enable_gqa=gqa)

        def bwd(out):
            out.backward(dh)
        return fwd, fwd, (bwd if grad else None)
    return setup


SETUP = {**{b: _sdpa(b) for b in ("sdpa_math", "sdpa_efficient", "sdpa_flash", "sdpa_cudnn")},
         "torch_flash": _varlen("torch_flash"), "fa4": _fa4, "flash_attn": _varlen("flash_attn"),
         "sdpa_ref": _varlen("sdpa_ref"), "flex": _flex(True), "flex_eager": _flex(False)}


def available(backend: str, device: torch.device) -> str | None:
    """None when ``backend`` can run on ``device``, else the reason."""
    if backend in ("torch_flash", "fa4", "flash_attn", "sdpa_ref"):
        return None if backend in kernels.available_backends(device) else f"{backend} not available here"
    if backend in ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flex") and device.type != "cuda":
        return f"{backend} needs CUDA"
    if backend in ("flex", "flex_eager"):
        try:
            import torch.nn.attention.flex_attention  # noqa: F401
        except ImportError as e:
            return f"FlexAttention not importable: {e}"
    return None


# ---------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------

def _reference_error(mask, q, k, v, out) -> float:
    """``max |out - ref| / max |ref|`` against float32 SDPA math with the dense mask."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rep = q.shape[1] // k.shape[1]
    qh, kh, vh = (t.float().transpose(0, 1).unsqueeze(0)
                  for t in (q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)))
    with sdpa_kernel([SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=dense_mask(mask, q.device))
    ref = ref[0].transpose(0, 1)                                  # [T, Hq, D]
    got = out[0] if isinstance(out, tuple) else out[0].transpose(0, 1)
    return float((got.float() - ref).abs().max() / ref.abs().max())


def statically_unsupported(backend: str, mask: Mask) -> str | None:
    """Why ``backend`` cannot run ``mask`` at all, decided without running it (None: it can, or only a
    run can tell): the SDPA flash/cuDNN backends take only the one-slice full/causal masks, the varlen
    backends only masks with a varlen form (FA4 also the two sliding windows)."""
    if backend in ("sdpa_flash", "sdpa_cudnn") and _plain(mask) is None:
        return "only the one-slice full/causal masks"
    if backend in ("torch_flash", "flash_attn", "fa4", "sdpa_ref"):
        if backend == "fa4" and mask.name in ("sliding_window_causal", "sliding_window"):
            return None
        try:
            mask.to_varlen()
        except ValueError:
            return "no varlen form"
    return None


def run_cell(backend, mask, heads, dim, dtype, device, flush, args, check: bool) -> list[dict]:
    """fwd and bwd records of one (backend, mask, seqlen)."""
    T = mask.total
    base = {"backend": backend, "mask": mask.name, "seqlen": T, "area": mask.area(),
            "sparsity": mask.sparsity(), "heads": heads_str(heads)}
    gen = torch.Generator(device=device).manual_seed(args.seed)
    recs = []
    reset_peak(device)
    baseline = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    try:
        q = rand(gen, T, heads[0], dim, device, dtype)
        k, v = (rand(gen, T, heads[1], dim, device, dtype) for _ in range(2))
        dout = rand(gen, T, heads[0], dim, device, dtype)
        fwd, pre, bwd = SETUP[backend](mask, q, k, v, dout)
        t0 = time.perf_counter()
        first = fwd()                                    # also compiles / autotunes, untimed
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t_first = time.perf_counter() - t0
        err = _reference_error(mask, q, k, v, first) if check and T <= args.check_max_len else None
        del first
        warmup, reps = args.warmup, args.reps
        if t_first * 1e3 > args.slow_ms / 3:             # a slow cell: fewer repetitions
            warmup, reps = min(warmup, 1), min(reps, 3)
        for direction in ("fwd", "bwd"):
            if bwd is None and direction == "bwd":
                recs.append({**base, "direction": direction, "status": "X", "error": "no backward here"})
                continue
            if direction == "fwd":
                st = time_kernel(fwd, device, iters=reps, warmup=warmup, flush=flush)
            else:
                st = time_kernel(bwd, device, iters=reps, warmup=warmup, flush=flush, pre=pre)
            flops = mask.flops(heads[0], dim, direction)
            recs.append({**base, "direction": direction, "status": "ok", **st, "flops": flops,
                         "tflops": tflops(flops, st["median_ms"]), "max_err": err})
        peak = ((torch.cuda.max_memory_allocated(device) - baseline) / 1e9 if device.type == "cuda"
                else None)                                   # inputs, masks, kernel workspace
        for r in recs:
            r["peak_mem_gb"] = peak
    except Unsupported:
        recs = [{**base, "direction": d, "status": "X"} for d in ("fwd", "bwd")]
    except torch.cuda.OutOfMemoryError:
        recs = [{**base, "direction": d, "status": "E"} for d in ("fwd", "bwd")]
    except Exception as e:                                # a failing backend must not stop the run
        msg = f"{type(e).__name__}: {e}"
        if "out of memory" in msg.lower():
            recs = [{**base, "direction": d, "status": "E"} for d in ("fwd", "bwd")]
        else:
            tb = traceback.format_exc(limit=3)
            recs = [{**base, "direction": d, "status": "!", "error": msg[:500], "trace": tb[-1500:]}
                    for d in ("fwd", "bwd")]
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return recs


def heads_str(heads) -> str:
    return f"{heads[0]}:{heads[1]}"


def parse_heads(text: str) -> list[tuple[int, int]]:
    """``"64:8,64:64"`` (pairs) or the older ``"64,8"`` (one pair) -> ``[(64, 8), (64, 64)]``."""
    if ":" not in text:
        return [tuple(int(x) for x in text.split(","))]
    return [tuple(int(x) for x in pair.split(":")) for pair in text.split(",")]


def run_draws(backend, name, T, heads, dtype, device, flush, args, check: bool) -> list[dict]:
    """fwd and bwd records of ``args.draws`` draws of mask ``name`` (module docstring): each draw's
    median, then the median and 20/80% quantiles across draws."""
    sub = argparse.Namespace(**{**vars(args), "warmup": 0, "reps": args.draw_reps})
    per = []
    for i in range(args.draws):
        mask = make_mask(name, T, args.seed + i, window=args.window, block=args.block)
        per.append(run_cell(backend, mask, heads, args.head_dim, dtype, device, flush, sub, check and i == 0))
        if any(r["status"] != "ok" for r in per[-1]):
            return [{**r, "draws": i + 1, "error": f"draw {i} (seed {args.seed + i}): " + r.get("error", "")}
                    for r in per[-1]]
    out = []
    for j in range(2):
        recs = [p[j] for p in per]
        ms = np.array([r["median_ms"] for r in recs])
        tf = np.array([r["tflops"] for r in recs])
        out.append({**recs[0], "draws": args.draws, "reps": args.draw_reps, "median_ms": float(np.median(ms)),
                    "q20_ms": float(np.quantile(ms, 0.2)), "q80_ms": float(np.quantile(ms, 0.8)),
                    "tflops": float(np.median(tf)), "tflops_q20": float(np.quantile(tf, 0.2)),
                    "tflops_q80": float(np.quantile(tf, 0.8)),
                    "area": int(np.median([r["area"] for r in recs])),
                    "sparsity": float(np.median([r["sparsity"] for r in recs])),
                    "flops": float(np.median([r["flops"] for r in recs])),
                    "peak_mem_gb": max((r["peak_mem_gb"] for r in recs if r.get("peak_mem_gb") is not None),
                                       default=None),
                    "per_draw": [{"seed": args.seed + i, "median_ms": r["median_ms"], "tflops": r["tflops"],
                                  "area": r["area"]} for i, r in enumerate(recs)]})
    return out


def _key(r: dict) -> tuple:
    return (r["backend"], r["mask"], r["seqlen"], r.get("heads", DEFAULT_HEADS))


def _with_heads(rows: list[dict], config: dict | None) -> list[dict]:
    """Rows of files written before records carried their heads get the file's ``--heads``."""
    default = heads_str(parse_heads((config or {}).get("heads") or DEFAULT_HEADS.replace(":", ","))[0])
    return [r if "heads" in r else {**r, "heads": default} for r in rows]


# ---------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------

def _brief(r: dict) -> str:
    if r["status"] == "ok":
        return f"{r['median_ms']:.2f} ms {r['tflops']:.3g} TF/s"
    return f"{r['status']} {r.get('error', '')[:80]}"


def table(rows: list[dict], seqlen: int, direction: str, heads: str = DEFAULT_HEADS) -> str:
    """Mask x backend: TF/s at ``seqlen`` and ``heads`` or the status symbol."""
    cells = {(r["mask"], r["backend"]): (f"{r['tflops']:.3g}" if r["status"] == "ok" else r["status"])
             for r in rows if r["seqlen"] == seqlen and r["direction"] == direction
             and r.get("heads", DEFAULT_HEADS) == heads}
    masks = [m for m in ALL_TYPES if any(k[0] == m for k in cells)]
    backs = [b for b in BACKENDS if any(k[1] == b for k in cells)]
    lines = [f"{direction} TF/s at {seqlen} tokens, heads {heads}",
             "mask".ljust(24) + "".join(b.rjust(15) for b in backs)]
    for m in masks:
        lines.append(m.ljust(24) + "".join(cells.get((m, b), "").rjust(15) for b in backs))
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backends", default=None, help=f"comma-separated, from: {', '.join(BACKENDS)}")
    p.add_argument("--masks", default=",".join(ALL_TYPES))
    p.add_argument("--seqlens", default=",".join(str(s) for s in SEQLENS))
    p.add_argument("--heads", default=DEFAULT_HEADS, help="Hq:Hkv pairs, e.g. 64:8,64:64 (or the older 64,8)")
    p.add_argument("--draws", type=int, default=1,
                   help=f"draws of each document-type mask (LongCA-bench: {BENCH_DRAWS}); median, 20/80%%")
    p.add_argument("--draw-reps", type=int, default=3, help="timed calls per draw (after one untimed)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--block", type=int, default=1024)
    p.add_argument("--check", type=int, default=1,
                   help="1: check the smallest size against a dense reference")
    p.add_argument("--check-max-len", type=int, default=4096)
    p.add_argument("--slow-ms", type=float, default=1500.0,
                   help="after a fwd or bwd median above this, skip larger sizes of that (backend, mask)")
    p.add_argument("--time-budget-s", type=float, default=None, help="start no new cell after this long")
    p.add_argument("--out", default="results/bench_kernels.json")
    p.add_argument("--merge", action="store_true", help="add to --out, replacing equal cells")
    p.add_argument("--combine", nargs="+", default=None, metavar="JSON",
                   help="only merge these result files (later ones win on equal cells) into --out")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, sdpa_math/flex_eager/sdpa_ref")
    args = p.parse_args(argv)
    if args.smoke:
        args.seqlens = "256"
        args.heads = "4:2" if args.heads == DEFAULT_HEADS else args.heads
        args.head_dim, args.dtype = 16, "fp32"
        args.warmup, args.reps, args.window, args.block = 1, 3, 32, 64
        args.backends = args.backends or ",".join(SMOKE_BACKENDS)
        if args.out == "results/bench_kernels.json":
            args.out = "results/bench_kernels_smoke.json"
    for b in (args.backends or "").split(","):
        if b and b not in BACKENDS:
            p.error(f"unknown backend {b!r}; choose from: {', '.join(BACKENDS)}")
    for m in args.masks.split(","):
        if m not in ALL_TYPES:
            p.error(f"unknown mask {m!r}; choose from: {', '.join(ALL_TYPES)}")
    try:
        hs = parse_heads(args.heads)
    except ValueError:
        hs = []
    if not hs or any(len(h) != 2 or h[0] % h[1] for h in hs):
        p.error(f"--heads must be Hq:Hkv pairs with Hq a multiple of Hkv (e.g. 64:8,64:64), "
                f"got {args.heads!r}")
    if args.draws < 1:
        p.error(f"--draws must be >= 1, got {args.draws}")
    return args


def _mask_of(rec: dict, cache: dict) -> Mask:
    """The mask of a result record (its type and size, the benchmark's default parameters)."""
    key = (rec["mask"], rec["seqlen"])
    if key not in cache:
        cache[key] = make_mask(rec["mask"], rec["seqlen"], 0)
    return cache[key]


def _flat(values: list) -> list:
    return [x for v in values for x in (_flat(v) if isinstance(v, list) else [v])]


def combine(paths: list[str], out: Path) -> list[dict]:
    """Merge result files of separate runs (e.g. one per GPU) into one; later files win on equal cells,
    except that a cell a later run did not reach (``-``) keeps an earlier run's result."""
    rows: dict = {}
    metas, configs, masks = [], [], {}
    for path in paths:
        res = json.loads(Path(path).read_text())
        metas.append(res.get("meta"))
        configs.append(res.get("config"))
        for r in _with_heads(res.get("results", []), res.get("config")):
            key = (*_key(r), r["direction"])
            if r.get("status") == "-":
                static = statically_unsupported(r["backend"], _mask_of(r, masks))
                if static is not None:
                    r = {**r, "status": "X", "error": f"unsupported ({static}; decided without running)"}
            if r.get("status") != "-" or key not in rows:
                rows[key] = r
    merged = list(rows.values())
    path = save_result(out, {"combined_from": [str(p) for p in paths], "configs": configs}, merged,
                       parts_meta=metas)
    # the measurement's provenance is the parts' (the machine that merges them only merged)
    res = json.loads(path.read_text())
    res["meta"]["combined_on"] = res["meta"].get("device")
    for key in ("device", "torch", "cuda", "commit", "date"):
        vals = _flat([(m or {}).get(key) for m in metas])     # (a part may itself be combined)
        vals = list(dict.fromkeys(json.dumps(v) for v in vals))
        res["meta"][key] = json.loads(vals[0]) if len(vals) == 1 else [json.loads(v) for v in vals]
    atomic_write_json(path, res)
    return merged


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.combine:
        rows = combine(args.combine, Path(args.out))
        for direction in ("fwd", "bwd"):
            for h in sorted({r["heads"] for r in rows}):
                print(table(rows, max(r["seqlen"] for r in rows), direction, h))
        print(f"wrote {args.out} ({len(rows)} records from {len(args.combine)} files)")
        return 0
    device = torch.device("cuda") if torch.cuda.is_available() and not args.smoke else torch.device("cpu")
    default = GPU_DEFAULT if device.type == "cuda" else SMOKE_BACKENDS
    backends = (args.backends or ",".join(default)).split(",")
    heads_list = parse_heads(args.heads)
    seqlens = [int(s) for s in args.seqlens.split(",")]
    dtype = DTYPES[args.dtype]
    if device.type == "cpu" and dtype != torch.float32:
        dtype = torch.float32
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
    out = Path(args.out)
    rows: list[dict] = []
    if args.merge and out.exists():
        old = json.loads(out.read_text())
        rows = _with_heads(old.get("results", []), old.get("config"))
    config = {**vars(args), "device": str(device), "backends_run": backends}
    flush = flush_buffer(device)
    t_start = _T0
    for heads in heads_list:
        for backend in backends:
            why = available(backend, device)
            for name in args.masks.split(","):
                too_slow = None
                for i, T in enumerate(seqlens):
                    key = (backend, name, T, heads_str(heads))
                    mask = make_mask(name, T, args.seed, window=args.window, block=args.block)
                    base = {"backend": backend, "mask": name, "seqlen": T, "area": mask.area(),
                            "sparsity": mask.sparsity(), "heads": heads_str(heads)}
                    over = args.time_budget_s is not None and time.monotonic() - t_start > args.time_budget_s
                    static = None if why is not None else statically_unsupported(backend, mask)
                    if why is not None or static is not None or too_slow is not None or over:
                        if why is not None:
                            status, err = "X", why
                        elif static is not None:           # it cannot run this mask: not tried
                            status, err = "X", f"unsupported ({static}; decided without running)"
                        else:
                            status, err = "-", too_slow or "time budget"
                        recs = [{**base, "direction": d, "status": status, "error": err}
                                for d in ("fwd", "bwd")]
                    elif args.draws > 1 and name in DRAWN_MASKS:
                        recs = run_draws(backend, name, T, heads, dtype, device, flush, args,
                                         check=bool(args.check) and i == 0)
                    else:
                        recs = run_cell(backend, mask, heads, args.head_dim, dtype, device, flush, args,
                                        check=bool(args.check) and i == 0)
                    slow = [r["median_ms"] for r in recs
                            if r["status"] == "ok" and r["median_ms"] > args.slow_ms]
                    if slow:
                        too_slow = f"a smaller size took {max(slow):.0f} ms > --slow-ms {args.slow_ms:.0f}"
                    rows = [r for r in rows if _key(r) != key] + recs
                    fr = {r["direction"]: r for r in recs}
                    print(f"{backend:>15} {name:>24} {T:>6} {heads_str(heads):>6}: "
                          + "  ".join(f"{d} " + _brief(fr[d]) for d in ("fwd", "bwd")), flush=True)
                    save_result(out, config, rows)
    for direction in ("fwd", "bwd"):
        for h in heads_list:
            if rows:
                print(table(rows, max(r["seqlen"] for r in rows), direction, heads_str(h)))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

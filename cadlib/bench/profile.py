"""The attention server's kernel latency grid (``scripts/bench/profile_kernels.py``, :mod:`cadlib.calibrate`):
the points and how one is timed, for :class:`cadlib.core.measured.MeasuredCost`.

A ``task`` point is one fused call of ``n_seg`` identical causal segments, ``q_len`` queries the suffix
of ``kv_len`` KV tokens each, so ``pairs = n_seg (q k - q (q - 1) / 2)`` causal pairs; ``n_seg`` is
chosen so a call holds about ``target_pairs`` pairs (at most ``max_seg``). A ``fused`` point is one
shape at ``n_seg`` = 1, 4, 16, 64: the fixed cost of a call, ``t(n) = overhead + n t_1``.
"""
from __future__ import annotations

import torch

from ..core.measured import segment_pairs
from ..runtime import kernels
from .inputs import rand
from .timer import time_fn

FULL = {"q": [128, 256, 512, 1024, 2048, 8192], "kv": [128, 512, 2048, 8192, 32768, 65536],
        "fused": (512, 8192), "heads": (32, 8, 128), "target_pairs": 1 << 28, "max_seg": 64,
        "warmup": 2, "iters": 5}
QUICK = {"q": [16, 32, 64], "kv": [16, 64, 256], "fused": (32, 64), "heads": (4, 2, 16),
         "target_pairs": 1 << 14, "max_seg": 8, "warmup": 1, "iters": 2}
DTYPES = kernels.TORCH_DTYPES


def grid(g: dict) -> list[tuple[str, int, int, int]]:
    """``(kind, q_len, kv_len, n_seg)`` points, cheapest (total pairs) first."""
    pts = []
    for q in g["q"]:
        for k in g["kv"]:
            if k >= q:
                n = int(min(g["max_seg"], max(1, g["target_pairs"] // segment_pairs(q, k))))
                pts.append(("task", q, k, n))
    q, k = g["fused"]
    pts += [("fused", q, k, n) for n in (1, 4, 16, 64) if n <= max(g["max_seg"], 4)]
    return sorted(pts, key=lambda p: segment_pairs(p[1], p[2]) * p[3])


def measure(backend, q_len, kv_len, n_seg, heads, dtype, device, warmup, iters, gen) -> dict:
    """One point: the forward and the forward+backward of the fused call, median and min of ``iters``
    timed runs after ``warmup`` (``fwd_ms``, ``fwd_min_ms``, ``fwd_bwd_ms``, ``fwd_bwd_min_ms``); a pass
    that runs out of memory or fails is recorded as ``<pass>_skipped`` / ``<pass>_error``."""
    hq, hkv, d = heads
    q = rand(gen, n_seg * q_len, hq, d, device, dtype)
    k, v = (rand(gen, n_seg * kv_len, hkv, d, device, dtype) for _ in range(2))
    cu_q = (torch.arange(n_seg + 1, device=device) * q_len).to(torch.int32)
    cu_k = (torch.arange(n_seg + 1, device=device) * kv_len).to(torch.int32)
    dout = torch.randn_like(q)
    rec = {}

    def fwd():
        return kernels.attend(q, k, v, cu_q, cu_k, q_len, kv_len, backend=backend)

    def fwd_bwd():
        o, lse = fwd()
        kernels.attend_backward(dout, q, k, v, o, lse, cu_q, cu_k, q_len, kv_len, backend=backend)

    for name, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        try:
            t = time_fn(fn, device, iters=iters, warmup=warmup)
            rec[f"{name}_ms"], rec[f"{name}_min_ms"] = t["median_ms"], t["min_ms"]
        except torch.cuda.OutOfMemoryError as e:
            rec[f"{name}_skipped"] = f"out of memory: {str(e).splitlines()[0]}"
        except Exception as e:  # record and go on
            rec[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return rec

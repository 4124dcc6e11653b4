"""Each CP mechanism's communication volume in closed form: bytes one rank sends, forward and backward.

With ``T`` tokens on ``W`` ranks in equal shards (``n = T / W``), ``Hq``, ``Hkv`` heads of dimension ``D``,
``b`` bytes per element of q, k, v and 4 per fp32 element, a Ulysses group of ``u`` ranks, ``R = W / u``
ring positions, ``h = Hkv / u`` KV heads per Ulysses rank (1 where KV heads are replicated, ``u`` a
multiple of ``Hkv``) and ``a = (u - 1) / u``, what our implementations send per rank
(:func:`equal_shard`)::

    ring        fwd (W - 1) n 2Hkv D b                      K, V blocks around the ring
                bwd (W - 1) n 2Hkv D b + W n 2Hkv D 4       again, and the fp32 dK, dV accumulators home
    allgather   fwd (W - 1) M 2Hkv D b                      M = most rows of shared documents on a rank
                bwd 2 (W - 1) M 2Hkv D b                    re-gather; dK, dV to their owners (all-to-all)
    ulysses     fwd a n (2 Hq D b + 2 u h D b + Hq 4)       q, k, v to head sharding; o and lse back
                bwd a n (2 Hq D b + 2 u h D b)              dO out; dq, dk, dv back
    usp         ulysses over u, plus the ring of R positions with blocks of u n tokens and h heads:
                fwd (R - 1) u n 2h D b,   bwd (R - 1) u n 2h D b + R u n 2h D 4
    loongtrain  usp's, except the dK, dV accumulators: w inner hops per window step and one outer hop
                (windows of w positions, nw = R / w): (R [w > 1] + nw [nw > 1]) u n 2h D 4
    cad         the plan's tokens (cadlib.core.plan.Plan.token_matrices): Q and K, V out, O and lse back;
                backward dO out, dq and dk, dv back (the servers keep what they received)

(a ring of one rank, or a group with nothing shared, sends nothing). :func:`per_rank` gives the exact
bytes of every rank for any layout (unequal shards, several documents), from the same data path; the
multi-process check (``cadlib.cp.check --suite volume``) counts the bytes the implementations hand to
``torch.distributed`` (:mod:`cadlib.cp.traffic`) and pins both equal to it.

LongCA-bench derives such volumes in its section 2.3; that text could not be read here, so these are
derived from our data paths (which follow the published mechanisms) and checked against what they send.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..core.layout import global_rows
from ..core.plan import Plan
from .allgather import shared_docs
from .loongtrain import default_loongtrain_ulysses, default_window, window_sources
from .protocol import contiguous_layout, split_points, zigzag_layout
from .usp import default_ulysses_size

FP32 = 4


def kv_heads_per_rank(hq: int, hkv: int, u: int) -> int:
    """KV heads a Ulysses rank holds: ``Hkv / u``, or 1 when ``u`` is a multiple of ``Hkv`` (replicas)."""
    if hq % u or (hkv % u and u % hkv):
        raise ValueError(f"Ulysses over {u} ranks needs Hq ({hq}) a multiple of {u} and Hkv ({hkv}) a "
                         f"multiple or a divisor of {u}")
    return hkv // u if hkv % u == 0 else 1


def grid(name: str, world: int, ulysses_size: int | None = None, window_size: int | None = None):
    """``(u, R, w)`` of a mechanism on ``world`` ranks, with the mechanisms' defaults."""
    if name == "ulysses":
        return world, 1, 1
    if name == "usp":
        u = default_ulysses_size(world) if ulysses_size is None else int(ulysses_size)
        return u, world // u, world // u
    if name == "loongtrain":
        u = default_loongtrain_ulysses(world) if ulysses_size is None else int(ulysses_size)
        R = world // u
        return u, R, default_window(R) if window_size is None else int(window_size)
    return 1, world, world


def equal_shard(name: str, total: int, world: int, heads: tuple[int, int], head_dim: int, elem_bytes: int,
                ulysses_size: int | None = None, window_size: int | None = None,
                shared_rows: int | None = None) -> dict:
    """The module docstring's closed forms: ``{"fwd": bytes, "bwd": bytes}`` one rank sends, for equal
    shards (``total`` a multiple of ``2 * world``). ``allgather`` takes ``shared_rows`` (``M``; default
    ``n``: one document over every rank); ``cad`` has no closed form (use :func:`per_rank` with its plan)."""
    hq, hkv = heads
    D, b, W = head_dim, elem_bytes, world
    if W < 1 or total % (2 * W):
        raise ValueError(f"equal shards need total ({total}) a multiple of 2 * world ({2 * W})")
    n = total // W
    if W == 1:
        return {"fwd": 0, "bwd": 0}
    kv_row = 2 * hkv * D
    if name == "ring":
        return {"fwd": (W - 1) * n * kv_row * b, "bwd": (W - 1) * n * kv_row * b + W * n * kv_row * FP32}
    if name == "allgather":
        M = n if shared_rows is None else int(shared_rows)
        return {"fwd": (W - 1) * M * kv_row * b, "bwd": 2 * (W - 1) * M * kv_row * b}
    if name in ("ulysses", "usp", "loongtrain"):
        u, R, w = grid(name, W, ulysses_size, window_size)
        h = kv_heads_per_rank(hq, hkv, u)
        hu = hq // u                                   # query heads per Ulysses rank: a n Hq = (u - 1) n hu
        fwd = (u - 1) * n * (2 * hu * D * b + 2 * h * D * b + hu * FP32)
        bwd = (u - 1) * n * (2 * hu * D * b + 2 * h * D * b)
        if R > 1:
            blk = u * n * 2 * h * D
            fwd += (R - 1) * blk * b
            hops = R if name != "loongtrain" else (R if w > 1 else 0) + (R // w if R // w > 1 else 0)
            bwd += (R - 1) * blk * b + hops * blk * FP32
        return {"fwd": fwd, "bwd": bwd}
    raise ValueError(f"no closed form for {name!r}; choose one of: ring, allgather, ulysses, usp, loongtrain "
                     "(cad: per_rank with its plan)")


def _usp_parts(doc_lens, W, u):
    """USP's grid: the zigzag layout of the ``R`` ring positions and each position's ``u`` part sizes."""
    R = W // u
    ring = zigzag_layout(doc_lens, R) if R > 1 else contiguous_layout(doc_lens, 1)
    parts = [np.diff(split_points(global_rows(ring, g).size, u)) for g in range(R)]
    return ring, parts


def per_rank(name: str, doc_lens: Sequence[int], world: int, heads: tuple[int, int], head_dim: int,
             elem_bytes: int, causal: bool = True, ulysses_size: int | None = None,
             window_size: int | None = None, plan: Plan | None = None, return_lse: bool = True) -> dict:
    """``{"fwd": [bytes per rank], "bwd": [...]}`` each rank sends, exact for any layout (module
    docstring). ``cad`` needs its ``plan``; its servers return the fp32 lse with ``return_lse``."""
    hq, hkv = heads
    D, b, W = head_dim, elem_bytes, world
    T = int(sum(doc_lens))
    fwd, bwd = np.zeros(W, dtype=np.int64), np.zeros(W, dtype=np.int64)
    kv_row = 2 * hkv * D
    if name in ("ring", "allgather"):
        lay = zigzag_layout(doc_lens, W)
        sizes = lay.tokens_per_rank()
        if W > 1 and name == "ring":
            for r in range(W):
                fwd[r] = (T - sizes[(r + 1) % W]) * kv_row * b
                bwd[r] = fwd[r] + T * kv_row * FP32
        elif W > 1:
            sh = shared_docs(lay)
            M = max(sum(c.length for c in chunks if sh[c.doc]) for chunks in lay.ranks)
            if sh.any():
                fwd[:] = (W - 1) * M * kv_row * b
                bwd[:] = 2 * fwd
        return {"fwd": fwd.tolist(), "bwd": bwd.tolist()}
    if name in ("ulysses", "usp", "loongtrain"):
        u, R, w = grid(name, W, ulysses_size, window_size)
        h = kv_heads_per_rank(hq, hkv, u)
        ring, parts = _usp_parts(doc_lens, W, u) if name != "ulysses" else (
            None, [np.diff(split_points(T, W))])
        block = ring.tokens_per_rank() if ring is not None else np.array([T])
        for r in range(W):
            g, i = divmod(r, u)
            n, N = int(parts[g][i]), int(parts[g].sum())
            if u > 1:
                fwd[r] += (u - 1) * n * (hq // u) * D * b + 2 * (u - 1) * n * h * D * b \
                    + (N - n) * (hq // u) * (D * b + FP32)
                bwd[r] += (u - 1) * n * (hq // u) * D * b + (N - n) * (hq // u + 2 * h) * D * b
            if R > 1:
                row = 2 * h * D
                if name == "usp":
                    fwd[r] += (T - block[(g + 1) % R]) * row * b
                    bwd[r] += (T - block[(g + 1) % R]) * row * b + T * row * FP32
                else:
                    nw, src = R // w, window_sources(g, R, w)
                    kv = [src[t * w + k] for t in range(nw) for k in range(w) if k + 1 < w]
                    kv += [src[t * w] for t in range(nw) if t + 1 < nw]
                    acc = (T if w > 1 else 0) + (sum(block[src[t * w]] for t in range(nw)) if nw > 1 else 0)
                    fwd[r] += sum(block[s] for s in kv) * row * b
                    bwd[r] += sum(block[s] for s in kv) * row * b + acc * row * FP32
        return {"fwd": fwd.tolist(), "bwd": bwd.tolist()}
    if name == "cad":
        if plan is None:
            raise ValueError("cad's volume follows its plan: pass plan=")
        q, kv = plan.token_matrices()
        q, kv = q[:W, :W], kv[:W, :W]
        q_row, o_row = hq * D * b, hq * D * b + (hq * FP32 if return_lse else 0)
        fwd = q.sum(1) * q_row + kv.sum(1) * kv_row * b + q.sum(0) * o_row
        bwd = q.sum(1) * hq * D * b + q.sum(0) * q_row + kv.sum(0) * kv_row * b
        return {"fwd": fwd.astype(np.int64).tolist(), "bwd": bwd.astype(np.int64).tolist()}
    raise ValueError(f"unknown CP mechanism {name!r}")

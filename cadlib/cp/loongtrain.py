"""LoongTrain: Ulysses head parallelism around a *double ring* (LongCA-bench's fifth CP mechanism).

The ``W = u * R`` ranks form USP's grid (:mod:`cadlib.cp.usp`): Ulysses inside groups of ``u`` ranks, the
zigzag-balanced sequence over ``R`` ring positions. LoongTrain replaces the ring of the ``R`` positions by
a double ring: the positions are cut into ``nw = R / w`` windows of ``w`` consecutive positions
(e.g. ``12 = 3 x 4``), position ``p = a * w + j`` is index ``j`` of window ``a``. K, V blocks travel

* on the **inner ring**, inside a window, ``j -> j + 1`` (``w - 1`` hops per window step), and
* on the **outer ring**, between windows, ``(a, j) -> (a + 1, j)`` (``nw - 1`` hops), each position with
  its own outer peer, so every position's inter-window link works at once.

In window step ``t`` and inner step ``i`` position ``(a, j)`` holds the block of position
``((a - t) mod nw, (j - i) mod w)``; over the ``nw * w = R`` steps it sees every block once, in ONE fused
varlen call per step (:func:`cadlib.cp.ring.ring_steps`), partial results merged by log-sum-exp in fp32 as
in :mod:`cadlib.cp.ring`. The outer hop of the next window's block starts before the window's inner loop,
so it overlaps that loop's compute. Per position the K, V bytes sent are those of the plain ring
(``R - 1`` blocks: ``nw - 1`` outer, ``nw (w - 1)`` inner); what changes is which link carries them.

Backward replays the schedule: each block's fp32 dK, dV accumulator travels with it, ``w`` inner hops
per window step (back to the position that took the block off the outer ring, with the window's
contributions summed), then one outer hop, so after ``nw`` window steps every accumulator is home.
``w = R`` (one window) is the ring, ``w = 1`` a ring of windows; ``u = W`` is Ulysses.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.layout import Layout
from ..runtime.kernels import attend, attend_backward
from .protocol import global_rank
from .ring import RingStep, merge_partial, p2p_shift, ring_steps
from .usp import USPCP

TAG_KV_INNER, TAG_KV_OUTER, TAG_D_INNER, TAG_D_OUTER = 0, 1, 2, 3
"""Point-to-point tags of the four concurrent streams (matched by tag where the backend does, as gloo)."""


def default_window(positions: int) -> int:
    """The smallest divisor ``w`` of the ring positions with ``1 < w < R`` (so both rings carry blocks),
    else ``R`` (one window: the plain ring)."""
    return next((d for d in range(2, positions) if positions % d == 0), positions)


def default_loongtrain_ulysses(world: int) -> int:
    """2 from 8 ranks on (Ulysses, inner and outer rings all exercised at 8 = 2 x (2 x 2)), else 1."""
    return 2 if world >= 8 and world % 2 == 0 else 1


def window_sources(position: int, positions: int, window: int) -> list[int]:
    """The block each step of ``position`` holds: ``((a - t) mod nw) * w + (j - i) mod w`` for window step
    ``t`` and inner step ``i`` (module docstring), in step order."""
    nw = positions // window
    a, j = divmod(position, window)
    return [((a - t) % nw) * window + (j - i) % window for t in range(nw) for i in range(window)]


@dataclass
class DoubleRingMeta:
    position: int
    positions: int
    window: int
    sizes: list[int]            # tokens per ring position (the block each one sends)
    steps: list[RingStep]       # window step t, inner step i at t * window + i
    inner_next: int             # default-group ranks of the inner (j +- 1) and outer (a +- 1) peers
    inner_prev: int
    outer_next: int
    outer_prev: int

    @property
    def windows(self) -> int:
        return self.positions // self.window


def build_double_ring_meta(layout: Layout, position: int, causal: bool, window: int, group=None) -> DoubleRingMeta:
    """The double ring's steps and peers for ``position`` of ``layout`` (host numpy)."""
    R = layout.n_ranks
    if window < 1 or R % window:
        raise ValueError(f"window_size must divide the {R} ring positions, got {window}")
    nw, (a, j) = R // window, divmod(position, window)
    steps = ring_steps(layout, position, causal, window_sources(position, R, window))
    return DoubleRingMeta(position, R, window, [int(x) for x in layout.tokens_per_rank()], steps,
                          global_rank(group, a * window + (j + 1) % window),
                          global_rank(group, a * window + (j - 1) % window),
                          global_rank(group, ((a + 1) % nw) * window + j),
                          global_rank(group, ((a - 1) % nw) * window + j))


def _inner(send, recv_rows, m: DoubleRingMeta, group, tag):
    return p2p_shift(send, recv_rows, m.inner_next, m.inner_prev, group, tag)


def _outer(send, recv_rows, m: DoubleRingMeta, group, tag):
    return p2p_shift(send, recv_rows, m.outer_next, m.outer_prev, group, tag)


def _block(m: DoubleRingMeta, t: int, i: int) -> int:
    """The block position ``m.position`` holds at window step ``t``, inner step ``i`` (any integers)."""
    a, j = divmod(m.position, m.window)
    return ((a - t) % m.windows) * m.window + (j - i) % m.window


class DoubleRingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, m: DoubleRingMeta, group, attn_backend):
        acc_o = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        acc_l = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        outer = torch.stack([k, v], 1)
        for t in range(m.windows):
            wait_outer = (_outer(outer, m.sizes[_block(m, t + 1, 0)], m, group, TAG_KV_OUTER)
                          if t + 1 < m.windows else None)
            cur = outer
            for i in range(m.window):
                st = m.steps[t * m.window + i]
                wait = _inner(cur, m.sizes[_block(m, t, i + 1)], m, group, TAG_KV_INNER) if i + 1 < m.window else None
                if st.q_rows.size:
                    qr, kr, cq, ck = st.on(q.device)
                    o, lse = attend(q.index_select(0, qr), cur[:, 0].index_select(0, kr),
                                    cur[:, 1].index_select(0, kr), cq, ck, st.max_q, st.max_k, causal=st.causal,
                                    backend=attn_backend)
                    merge_partial(acc_o, acc_l, qr, o, lse)
                if wait is not None:
                    cur = wait()
            if wait_outer is not None:
                outer = wait_outer()
        out = acc_o.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, acc_l)
        ctx.m, ctx.group, ctx.attn_backend = m, group, attn_backend
        ctx.mark_non_differentiable(acc_l)
        return out, acc_l

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        m, group = ctx.m, ctx.group
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        outer = torch.stack([k, v], 1)
        outer_d = torch.zeros(outer.shape, dtype=torch.float32, device=q.device)    # dK, dV of that block
        for t in range(m.windows):
            wait_outer = (_outer(outer, m.sizes[_block(m, t + 1, 0)], m, group, TAG_KV_OUTER)
                          if t + 1 < m.windows else None)
            cur, cur_d = outer, outer_d
            for i in range(m.window):
                st = m.steps[t * m.window + i]
                wait = _inner(cur, m.sizes[_block(m, t, i + 1)], m, group, TAG_KV_INNER) if i + 1 < m.window else None
                if st.q_rows.size:
                    qr, kr, cq, ck = st.on(q.device)
                    g = attend_backward(dout.index_select(0, qr), q.index_select(0, qr),
                                        cur[:, 0].index_select(0, kr), cur[:, 1].index_select(0, kr),
                                        out.index_select(0, qr), lse.index_select(0, qr), cq, ck, st.max_q,
                                        st.max_k, causal=st.causal, backend=ctx.attn_backend)
                    dq.index_add_(0, qr, g[0].float())
                    cur_d[:, 0].index_add_(0, kr, g[1].float())
                    cur_d[:, 1].index_add_(0, kr, g[2].float())
                if m.window > 1:       # the accumulator follows its block; after w hops it is back
                    cur_d = _inner(cur_d, m.sizes[_block(m, t, i + 1)], m, group, TAG_D_INNER)()
                if wait is not None:
                    cur = wait()
            outer_d = cur_d
            if m.windows > 1:          # on to the next window; after nw hops every accumulator is home
                outer_d = _outer(outer_d, m.sizes[_block(m, t + 1, 0)], m, group, TAG_D_OUTER)()
            if wait_outer is not None:
                outer = wait_outer()
        return (dq.to(q.dtype), outer_d[:, 0].to(k.dtype), outer_d[:, 1].to(v.dtype), None, None, None)


def double_ring_attention(q, k, v, meta: DoubleRingMeta, group, attn_backend: str | None = None):
    """``(out, lse)`` of this position's queries; differentiable in q, k, v (module docstring)."""
    return DoubleRingAttention.apply(q, k, v, meta, group, attn_backend)


class LoongTrainCP(USPCP):
    """Ulysses over ``ulysses_size`` ranks around a double ring of windows of ``window_size`` positions
    (defaults: :func:`default_loongtrain_ulysses`, :func:`default_window`)."""

    name = "loongtrain"
    default_ulysses = staticmethod(default_loongtrain_ulysses)

    def __init__(self, group, doc_lens, causal: bool = True, attn_backend: str | None = None,
                 ulysses_size: int | None = None, window_size: int | None = None):
        self.window_size = window_size
        super().__init__(group, doc_lens, causal, attn_backend, ulysses_size=ulysses_size)

    def build_ring(self) -> None:
        w = default_window(self.R) if self.window_size is None else int(self.window_size)
        if w < 1 or self.R % w:
            raise ValueError(f"window_size must divide the {self.R} ring positions (world {self.world} / "
                             f"ulysses_size {self.u}), got {w}")
        self.window = w
        self.ring_meta = build_double_ring_meta(self.ring_layout, self.g if self.R > 1 else 0, self.causal, w,
                                                self.ring_group)

    def ring_attention(self, q, k, v):
        return double_ring_attention(q, k, v, self.ring_meta, self.ring_group, self.attn_backend)

"""Ring attention with point-to-point K, V passing, zigzag-balanced, merged by log-sum-exp in fp32.

Rank ``r`` of a ring of ``W`` holds its tokens in layout order (the zigzag layout: pieces ``r`` and
``2W - 1 - r`` of the global sequence, so causal work is equal). In step ``s = 0 .. W-1`` it holds the
K, V block of rank ``src = (r - s) mod W`` and computes the part of its queries' attention that falls
on those keys, in ONE fused varlen call (:func:`cadlib.runtime.kernels.attend`), while the block travels on to
``r + 1`` (``isend``/``irecv`` started before the call: communication overlapped with compute).

Per local query chunk ``c`` (doc ``d``, ``[a, b)``) and source chunk ``c'`` of the same document:
``c'`` before ``c`` is seen in full, ``c'`` after ``c`` not at all (causal), and ``c' = c`` (step 0
only) causally. So in step 0 each segment is [full chunks ; c] with bottom-right causal alignment,
and in later steps each is [full chunks] without a causal mask; query chunks that see nothing in a
step are left out of that call. Full (non-causal) masks see every chunk of the document.

Partial results merge exactly, in fp32 (``o_s`` normalised, ``l_s`` its log-sum-exp)::

    l = logaddexp(l_acc, l_s);   o_acc = o_acc * exp(l_acc - l) + o_s * exp(l_s - l)

Backward replays the ring: each step's ``attend_backward`` uses the final ``o`` and ``l`` (so its
``P = exp(S - l)`` are the true probabilities), ``dQ`` accumulates locally in fp32, and the fp32 dK, dV
accumulator of each block travels with it and returns to its owner after ``W`` hops.

No padding is needed: block sizes differ per rank and are known on the host from the layout.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from ..core.layout import Layout
from ..runtime.kernels import attend, attend_backward
from .protocol import CPMechanism, global_rank, zigzag_layout


@dataclass
class RingStep:
    src: int
    causal: bool
    q_rows: np.ndarray
    kv_rows: np.ndarray
    cu_q: np.ndarray
    cu_k: np.ndarray
    max_q: int
    max_k: int
    dev: dict = field(default_factory=dict, repr=False)

    def on(self, device):
        key = str(device)
        if key not in self.dev:
            def t(a, dtype=torch.int64):
                return torch.as_tensor(np.ascontiguousarray(a)).to(device=device, dtype=dtype)
            self.dev[key] = (t(self.q_rows), t(self.kv_rows), t(self.cu_q, torch.int32),
                             t(self.cu_k, torch.int32))
        return self.dev[key]


@dataclass
class RingMeta:
    rank: int
    world: int
    sizes: list[int]            # tokens per ring rank (the block each one sends)
    steps: list[RingStep]
    next_peer: int              # default-group ranks of r + 1 and r - 1
    prev_peer: int

    @property
    def n_local(self) -> int:
        return self.sizes[self.rank]


def ring_steps(layout: Layout, rank: int, causal: bool, sources: list[int]) -> list[RingStep]:
    """One :class:`RingStep` per source rank in ``sources`` (the order the K, V blocks arrive in): which
    local query rows see which rows of that block (host numpy). The step whose source is ``rank`` itself
    holds the diagonal chunks, causally."""
    offs = layout.local_offsets()
    mine = list(zip(layout.ranks[rank], offs[rank]))
    steps = []
    for src in sources:
        theirs = sorted(zip(layout.ranks[src], offs[src]), key=lambda co: (co[0].doc, co[0].start))
        step_causal = causal and src == rank
        qr, kr, lq, lk = [], [], [], []
        for c, o in mine:
            full = [(c2, o2) for c2, o2 in theirs if c2.doc == c.doc
                    and (not causal or c2.end <= c.start)]
            keys = [np.arange(o2, o2 + c2.length) for c2, o2 in full]
            if step_causal:
                keys.append(np.arange(o, o + c.length))        # the diagonal chunk, last
            n_k = int(sum(len(x) for x in keys))
            if n_k == 0:
                continue
            qr.append(np.arange(o, o + c.length))
            kr += keys
            lq.append(c.length)
            lk.append(n_k)

        def cum(x):
            return np.concatenate([[0], np.cumsum(x)]).astype(np.int32)
        def cat(xs):
            return np.concatenate(xs).astype(np.int64) if xs else np.zeros(0, dtype=np.int64)
        steps.append(RingStep(src, step_causal, cat(qr), cat(kr), cum(lq), cum(lk),
                              int(max(lq, default=0)), int(max(lk, default=0))))
    return steps


def build_ring_meta(layout: Layout, rank: int, causal: bool, group=None) -> RingMeta:
    """Per step ``s``, the block of rank ``(rank - s) mod W``: which local query rows see which of its rows."""
    W = layout.n_ranks
    steps = ring_steps(layout, rank, causal, [(rank - s) % W for s in range(W)])
    sizes = [int(x) for x in layout.tokens_per_rank()]
    return RingMeta(rank, W, sizes, steps, global_rank(group, (rank + 1) % W),
                    global_rank(group, (rank - 1) % W))


def p2p_shift(send: torch.Tensor, recv_rows: int, next_peer: int, prev_peer: int, group, tag: int = 0):
    """Start sending ``send`` to ``next_peer`` and receiving ``recv_rows`` rows from ``prev_peer``
    (default-group ranks); returns a waiter giving the received tensor. Empty transfers are skipped on
    both sides (both know the sizes from the layout). ``tag`` keeps concurrent streams apart where the
    backend matches messages by tag."""
    recv = send.new_empty((recv_rows, *send.shape[1:]))
    ops = []
    if send.shape[0]:
        ops.append(dist.P2POp(dist.isend, send.contiguous(), next_peer, group, tag))
    if recv_rows:
        ops.append(dist.P2POp(dist.irecv, recv, prev_peer, group, tag))
    works = dist.batch_isend_irecv(ops) if ops else []

    def wait():
        for w in works:
            w.wait()
        return recv
    return wait


def _shift(send: torch.Tensor, recv_rows: int, m: RingMeta, group, tag: int = 0):
    """:func:`p2p_shift` to ``r + 1`` from ``r - 1``: the K, V stream (tag 0) and the dK, dV stream (1)."""
    return p2p_shift(send, recv_rows, m.next_peer, m.prev_peer, group, tag)


def merge_partial(acc_o, acc_l, rows, o, lse):
    """Log-sum-exp merge of a partial result into the fp32 accumulators at ``rows``."""
    old_l = acc_l.index_select(0, rows)
    new_l = torch.logaddexp(old_l, lse)
    w_old = torch.exp(old_l - new_l).nan_to_num(0.0)
    w_new = torch.exp(lse - new_l).nan_to_num(0.0)
    merged = acc_o.index_select(0, rows) * w_old[..., None] + o.float() * w_new[..., None]
    acc_o.index_copy_(0, rows, merged)
    acc_l.index_copy_(0, rows, new_l)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, m: RingMeta, group, attn_backend):
        kv = torch.stack([k, v], 1)
        acc_o = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        acc_l = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        cur = kv
        for s, st in enumerate(m.steps):
            wait = _shift(cur, m.sizes[m.steps[s + 1].src], m, group) if s + 1 < m.world else None
            if st.q_rows.size:
                qr, kr, cq, ck = st.on(q.device)
                o, lse = attend(q.index_select(0, qr), cur[:, 0].index_select(0, kr),
                                cur[:, 1].index_select(0, kr), cq, ck, st.max_q, st.max_k, causal=st.causal,
                                backend=attn_backend)
                merge_partial(acc_o, acc_l, qr, o, lse)
            if wait is not None:
                cur = wait()
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
        cur = torch.stack([k, v], 1)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)      # accumulators of block src
        dv = torch.zeros_like(dk)
        for s, st in enumerate(m.steps):
            nxt = m.steps[s + 1].src if s + 1 < m.world else None
            wait_kv = _shift(cur, m.sizes[nxt], m, group) if nxt is not None else None
            if st.q_rows.size:
                qr, kr, cq, ck = st.on(q.device)
                g = attend_backward(dout.index_select(0, qr), q.index_select(0, qr),
                                    cur[:, 0].index_select(0, kr), cur[:, 1].index_select(0, kr),
                                    out.index_select(0, qr), lse.index_select(0, qr), cq, ck, st.max_q,
                                    st.max_k, causal=st.causal, backend=ctx.attn_backend)
                dq.index_add_(0, qr, g[0].float())
                dk.index_add_(0, kr, g[1].float())
                dv.index_add_(0, kr, g[2].float())
            if m.world > 1:    # pass the accumulators on; receive those of the next block (last: our own)
                dkv = _shift(torch.stack([dk, dv], 1), m.sizes[nxt if nxt is not None else m.rank], m, group,
                             tag=1)()
                dk, dv = dkv[:, 0].contiguous(), dkv[:, 1].contiguous()
            if wait_kv is not None:
                cur = wait_kv()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def ring_attention(q, k, v, meta: RingMeta, group, attn_backend: str | None = None):
    """``(out, lse)`` of this rank's queries; differentiable in q, k, v (see the module docstring)."""
    return RingAttention.apply(q, k, v, meta, group, attn_backend)


class RingCP(CPMechanism):
    """Ring P2P attention on the zigzag layout of the global sequence."""

    name = "ring"

    def __init__(self, group, doc_lens, causal: bool = True, attn_backend: str | None = None):
        super().__init__(group, doc_lens, causal, attn_backend)
        self.set_layout(zigzag_layout(self.doc_lens, self.world))
        self.meta = build_ring_meta(self.layout, self.rank, self.causal, group)

    def apply_attn(self, q, k, v):
        self.check_qkv(q, k, v)
        return ring_attention(q, k, v, self.meta, self.group, self.attn_backend)

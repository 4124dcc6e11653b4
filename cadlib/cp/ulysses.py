"""Ulysses (DeepSpeed-Ulysses): all-to-all from sequence sharding to head sharding and back.

Each of the ``u`` ranks holds a contiguous part of the sequence with all heads. One all-to-all gives
every rank the WHOLE sequence for ``Hq / u`` query heads (and their KV heads); attention then needs
no further communication (one fused varlen call over the documents), and a second all-to-all returns
the output to sequence sharding::

    [n_i, H, D] --a2a(seq -> head)--> [N, H/u, D] --attend--> [N, Hq/u, D] --a2a(head -> seq)--> [n_i, Hq, D]

``Hq`` must be a multiple of ``u``. KV heads: if ``Hkv`` is a multiple of ``u`` they are split like
the query heads; if ``u`` is a multiple of ``Hkv`` (the group is larger than the KV head count) each
rank gets a replica of the one KV head its query heads read, and the backward sums the replicas'
gradients. Parts may have different lengths (no divisibility requirement on the sequence).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .protocol import CPMechanism, contiguous_layout
from .ring import build_ring_meta, ring_attention


def _a2a(send: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    recv = send.new_empty((int(sum(recv_splits)), *send.shape[1:]))
    dist.all_to_all_single(recv, send.contiguous(), list(recv_splits), list(send_splits), group=group)
    return recv


def seq_to_head(x: torch.Tensor, parts: list[int], me: int, group) -> torch.Tensor:
    """``[n_me, H, D]`` (this rank's part) -> ``[sum(parts), H/u, D]`` (all parts, this rank's heads)."""
    u = len(parts)
    if u == 1:
        return x
    n, h, d = x.shape
    send = x.reshape(n, u, h // u, d).transpose(0, 1).reshape(u * n, h // u, d)
    return _a2a(send, [n] * u, parts, group)


def head_to_seq(y: torch.Tensor, parts: list[int], me: int, group) -> torch.Tensor:
    """Inverse of :func:`seq_to_head`: ``[sum(parts), h, D]`` -> ``[n_me, h * u, D]``."""
    u = len(parts)
    if u == 1:
        return y
    n = parts[me]
    recv = _a2a(y, parts, [n] * u, group)
    return recv.view(u, n, *y.shape[1:]).transpose(0, 1).reshape(n, u * y.shape[1], y.shape[2])


class SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, parts, me, group):
        ctx.args = (parts, me, group)
        return seq_to_head(x, parts, me, group)

    @staticmethod
    def backward(ctx, g):
        return head_to_seq(g.contiguous(), *ctx.args), None, None, None


class HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, parts, me, group):
        ctx.args = (parts, me, group)
        return head_to_seq(y, parts, me, group)

    @staticmethod
    def backward(ctx, g):
        return seq_to_head(g.contiguous(), *ctx.args), None, None, None


def kv_head_map(hq: int, hkv: int, u: int) -> list[int] | None:
    """KV heads to send, in rank-major order, when they must be replicated (``Hkv`` not a multiple of
    ``u``): rank ``p`` reads KV head ``(p * Hq / u) // (Hq / Hkv)``. None when no replication is needed.
    Raises ValueError when the heads cannot be spread over ``u`` ranks."""
    if hq % u:
        raise ValueError(f"Ulysses over {u} ranks needs the query heads ({hq}) to be a multiple of {u}")
    if hkv % u == 0:
        return None
    if u % hkv:
        raise ValueError(f"Ulysses over {u} ranks needs the KV heads ({hkv}) to be a multiple or a divisor "
                         f"of {u}")
    return [(p * hq // u) // (hq // hkv) for p in range(u)]


def ulysses_attention(q, k, v, parts: list[int], me: int, group, inner):
    """Sequence-parallel attention by head sharding; ``inner(q, k, v) -> (out, lse)`` runs on the
    gathered sequence with this rank's heads. Returns ``(out [n_me, Hq, D], lse [n_me, Hq])``."""
    u = len(parts)
    reps = kv_head_map(q.shape[1], k.shape[1], u)
    if reps is not None:
        idx = torch.as_tensor(reps, device=k.device)
        k, v = k.index_select(1, idx), v.index_select(1, idx)
    qh, kh, vh = (SeqToHead.apply(t, parts, me, group) for t in (q, k, v))
    out, lse = inner(qh, kh, vh)
    out = HeadToSeq.apply(out, parts, me, group)
    lse = head_to_seq(lse.unsqueeze(-1), parts, me, group).squeeze(-1)
    return out, lse


class UlyssesCP(CPMechanism):
    """Ulysses over the whole group on the contiguous layout; inside, one varlen call over the
    documents of the whole sequence."""

    name = "ulysses"

    def __init__(self, group, doc_lens, causal: bool = True, attn_backend: str | None = None):
        super().__init__(group, doc_lens, causal, attn_backend)
        self.set_layout(contiguous_layout(self.doc_lens, self.world))
        self.parts = [int(x) for x in self.tokens_per_rank()]
        self.inner_meta = build_ring_meta(contiguous_layout(self.doc_lens, 1), 0, self.causal)

    def apply_attn(self, q, k, v):
        self.check_qkv(q, k, v)
        kv_head_map(q.shape[1], k.shape[1], self.world)             # ValueError before any collective
        return ulysses_attention(q, k, v, self.parts, self.rank, self.group,
                                 lambda a, b, c: ring_attention(a, b, c, self.inner_meta, None,
                                                                self.attn_backend))

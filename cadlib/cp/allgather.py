"""Per-document context parallelism by all-gathering K and V (Llama-3 style), on any linear layout.

Each rank holds its tokens in layout order (``layout.ranks[rank]``'s chunks one after another) and
computes attention for exactly those queries. Causal per document: token ``i`` of a document attends
to tokens ``[0, i]`` of the same document (``causal=False``: to the whole document). A document held
by one rank needs nothing from elsewhere; the K, V rows of every document held by more than one rank
("shared" documents) are all-gathered over the group, so each rank can read any shared document's
prefix. Then ONE fused varlen call (:func:`cadlib.runtime.kernels.attend`) computes every local chunk
``(d, s, e)`` as one segment: queries = the chunk's ``e - s`` rows, KV = document ``d``'s prefix
``[0, e)`` (bottom-right causal alignment, as on an attention server)::

    o_i = sum_{j <= i, doc(j) = doc(i)} softmax_j(q_i . k_j / sqrt(D)) v_j

Data path (``W`` ranks; ``c_p`` = rows of shared documents on rank ``p``, ``M = max_p c_p``)::

    forward   send = [k, v][shared rows] padded to M rows   --all_gather_into_tensor-->  [W*M] rows
              buf  = [local k,v ; gathered]                  (one buffer, gathered into its tail)
              out, lse = attend(q, buf_k[kv_rows], buf_v[kv_rows], cu_q, cu_k)     (ONE call)
    backward  re-gather K, V (nothing but q, k, v, o, lse is kept), then
              dq, dk_seg, dv_seg = attend_backward(...)                             (ONE call)
              dbuf (fp32) .index_add_(kv_rows, dk_seg / dv_seg)
              dbuf[gathered part] in the input dtype --all_to_all_single (M rows to each owner)-->
              owner sums the W received blocks in fp32 and adds them at its shared rows.

The all-to-all moves the same bytes as a reduce-scatter but lets the owner do the sum in fp32.
Split sizes and index maps are built once per ``(layout, rank)`` on the host (numpy) and cached on the
layout object (which must not change afterwards); the index tensors go to the device once. No device
value is read on the host in the communication path.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ..core.layout import Layout
from ..runtime.kernels import attend, attend_backward
from .protocol import CPMechanism, zigzag_layout

_CACHE_ATTR = "_cp_allgather_meta"
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""``all_gather_into_tensor`` (renamed ``all_gather_single`` in newer torch)."""


# ---------------------------------------------------------------------------------------------------
# Host metadata
# ---------------------------------------------------------------------------------------------------

def shared_docs(layout: Layout) -> np.ndarray:
    """Boolean per document: held by more than one rank (its K, V are all-gathered)."""
    arr = layout.chunk_array()
    holders = np.zeros(layout.n_docs, dtype=np.int64)
    if len(arr):
        pairs = np.unique(arr[:, 0] * layout.n_ranks + arr[:, 3])
        np.add.at(holders, pairs // layout.n_ranks, 1)
    return holders > 1


def gathered_tokens(layout: Layout, rank: int | None = None) -> int:
    """KV tokens every rank holds after the all-gather: all tokens of documents held by more than one
    rank (padding rows not counted). With ``rank``: only those that rank receives from the others
    (the gathered tokens minus its own rows of shared documents)."""
    sh = shared_docs(layout)
    total = int(np.asarray(layout.doc_lens, dtype=np.int64)[sh].sum())
    if rank is None:
        return total
    return total - int(sum(c.length for c in layout.ranks[rank] if sh[c.doc]))


@dataclass
class GatherMeta:
    """One rank's view of a layout's all-gather attention (host arrays; see the module docstring)."""

    rank: int
    world: int
    n_local: int
    causal: bool
    send_index: np.ndarray          # local rows of shared documents, in local order (c_rank of them)
    pad: int                        # M = max_p c_p: rows every rank contributes to the all-gather
    active: bool                    # any shared document at all (same on every rank)
    kv_rows: np.ndarray             # rows of [local ; gathered] per KV segment token
    cu_q: np.ndarray                # int32 [n_chunks + 1]
    cu_k: np.ndarray                # int32 [n_chunks + 1]
    max_q: int
    max_k: int

    @property
    def n_buf(self) -> int:
        return self.n_local + (self.world * self.pad if self.active else 0)

    def to(self, device) -> "DeviceGatherMeta":
        """The index maps on ``device`` (a new copy each call: :func:`prepare` caches it, on the layout,
        so that the device copy refers to this object and not the other way round: a cycle would keep
        every finished step's metadata alive until a full garbage collection)."""
        def t(a, dtype=torch.int64):
            return torch.as_tensor(np.ascontiguousarray(a)).to(device=device, dtype=dtype)
        return DeviceGatherMeta(self, t(self.send_index), t(self.kv_rows), t(self.cu_q, torch.int32),
                                t(self.cu_k, torch.int32))


@dataclass
class DeviceGatherMeta:
    meta: GatherMeta
    send_index: torch.Tensor
    kv_rows: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor


def build_meta(layout: Layout, rank: int, causal: bool = True) -> GatherMeta:
    """Split sizes and index maps of ``rank`` for ``layout`` (pure numpy, no device)."""
    if not 0 <= rank < layout.n_ranks:
        raise ValueError(f"rank {rank} is outside the layout's ranks 0..{layout.n_ranks - 1}")
    sh = shared_docs(layout)
    offsets = layout.local_offsets()
    # position of every shared-document token in the gathered buffer: p * M + its index among p's
    # shared rows (p's shared rows are its chunks of shared documents, in local order)
    counts = [sum(c.length for c in chunks if sh[c.doc]) for chunks in layout.ranks]
    pad = max(counts) if counts else 0
    gpos = {int(d): np.empty(layout.doc_lens[d], dtype=np.int64) for d in np.flatnonzero(sh)}
    for p, chunks in enumerate(layout.ranks):
        pos = p * pad
        for c in chunks:
            if sh[c.doc]:
                gpos[c.doc][c.start:c.end] = np.arange(pos, pos + c.length)
                pos += c.length
    mine, offs = layout.ranks[rank], offsets[rank]
    n_local = int(sum(c.length for c in mine))
    send = [np.arange(o, o + c.length) for c, o in zip(mine, offs) if sh[c.doc]]
    # rows of [local ; gathered] for each token of each document this rank reads
    rows: dict[int, np.ndarray] = {}
    for c, o in zip(mine, offs):
        if sh[c.doc]:
            rows[c.doc] = gpos[c.doc] + n_local
        else:
            rows.setdefault(c.doc, np.full(layout.doc_lens[c.doc], -1, dtype=np.int64))
            rows[c.doc][c.start:c.end] = np.arange(o, o + c.length)
    lq = np.array([c.length for c in mine], dtype=np.int64)
    lk = np.array([c.end if causal else layout.doc_lens[c.doc] for c in mine], dtype=np.int64)
    kv_rows = [rows[c.doc][:k] for c, k in zip(mine, lk)]
    kv = np.concatenate(kv_rows) if kv_rows else np.zeros(0, dtype=np.int64)
    assert (kv >= 0).all(), "a document held by one rank must be complete on it"

    def cum(x):
        return np.concatenate([[0], np.cumsum(x)]).astype(np.int32)
    return GatherMeta(rank=rank, world=layout.n_ranks, n_local=n_local, causal=causal,
                      send_index=np.concatenate(send) if send else np.zeros(0, dtype=np.int64),
                      pad=int(pad), active=bool(sh.any()) and layout.n_ranks > 1, kv_rows=kv,
                      cu_q=cum(lq), cu_k=cum(lk), max_q=int(lq.max(initial=0)), max_k=int(lk.max(initial=0)))


def prepare(layout: Layout, group, device, causal: bool = True) -> DeviceGatherMeta:
    """This rank's metadata on ``device``, built once per ``(layout, rank, causal)`` and cached on the
    layout object. Raises ValueError when the layout's rank count differs from the group's size."""
    if not isinstance(layout, Layout):
        raise ValueError(f"layout must be a cadlib.core.layout.Layout, got {type(layout).__name__}")
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if layout.n_ranks != world:
        raise ValueError(f"the layout has {layout.n_ranks} ranks but the process group has {world}; "
                         "build the layout for the group you pass")
    cache = layout.__dict__.setdefault(_CACHE_ATTR, {})      # not a dataclass field: never serialised
    key = (rank, bool(causal))
    if key not in cache:
        cache[key] = build_meta(layout, rank, causal)
    dkey = (*key, str(device))
    if dkey not in cache:
        cache[dkey] = cache[key].to(device)
    return cache[dkey]


# ---------------------------------------------------------------------------------------------------
# Communication
# ---------------------------------------------------------------------------------------------------

def _gather_kv(k, v, dm: DeviceGatherMeta, group) -> torch.Tensor:
    """``[n_buf, 2, Hkv, D]``: local K, V then the all-gathered rows of shared documents."""
    m = dm.meta
    buf = k.new_empty((m.n_buf, 2, *k.shape[1:]))
    buf[:m.n_local, 0] = k
    buf[:m.n_local, 1] = v
    if m.active:
        send = k.new_zeros((m.pad, 2, *k.shape[1:]))
        idx = dm.send_index
        send[:idx.numel(), 0] = k.index_select(0, idx)
        send[:idx.numel(), 1] = v.index_select(0, idx)
        _all_gather(buf[m.n_local:], send, group=group)
    return buf


def _segments(buf, dm: DeviceGatherMeta):
    return buf[:, 0].index_select(0, dm.kv_rows), buf[:, 1].index_select(0, dm.kv_rows)


def _return_dkv(dk: torch.Tensor, dv: torch.Tensor, dm: DeviceGatherMeta, group, dtype):
    """Local fp32 ``dk, dv [n_local, Hkv, D]``: own part plus the owners' share of every rank's
    gradient of the gathered rows (sent in ``dtype``, summed in fp32)."""
    m = dm.meta
    dk_loc, dv_loc = dk[:m.n_local], dv[:m.n_local]
    if m.active:
        send = torch.stack([dk[m.n_local:], dv[m.n_local:]], 1).to(dtype)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)            # block p (M rows) -> rank p
        mine = recv.view(m.world, m.pad, *recv.shape[1:]).float().sum(0)[:dm.send_index.numel()]
        dk_loc.index_add_(0, dm.send_index, mine[:, 0])
        dv_loc.index_add_(0, dm.send_index, mine[:, 1])
    return dk_loc, dv_loc


class AllGatherAttention(torch.autograd.Function):
    """Forward: gather shared K, V, one fused call. Backward: re-gather, one fused backward call,
    dK/dV of gathered rows back to their owners, summed in fp32."""

    @staticmethod
    def forward(ctx, q, k, v, dm: DeviceGatherMeta, group, attn_backend, timeline):
        m = dm.meta
        ks, vs = _segments(_gather_kv(k, v, dm, group), dm)
        with _span(timeline, "attn"):
            out, lse = attend(q, ks, vs, dm.cu_q, dm.cu_k, m.max_q, m.max_k, causal=m.causal,
                              backend=attn_backend)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.dm, ctx.group, ctx.attn_backend, ctx.timeline = dm, group, attn_backend, timeline
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dm, m = ctx.dm, ctx.dm.meta
        ks, vs = _segments(_gather_kv(k, v, dm, ctx.group), dm)
        with _span(ctx.timeline, "attn'"):
            dq, dks, dvs = attend_backward(dout.contiguous(), q, ks, vs, out, lse, dm.cu_q, dm.cu_k, m.max_q,
                                           m.max_k, causal=m.causal, backend=ctx.attn_backend)
        dk = torch.zeros((m.n_buf, *k.shape[1:]), dtype=torch.float32, device=k.device)
        dv = torch.zeros_like(dk)
        dk.index_add_(0, dm.kv_rows, dks.float())          # a KV row read by several chunks: summed
        dv.index_add_(0, dm.kv_rows, dvs.float())
        dk, dv = _return_dkv(dk, dv, dm, ctx.group, k.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _span(timeline, phase: str):
    """``timeline.span("compute", phase)`` (a :class:`cadlib.runtime.stages.Timeline`), or nothing."""
    return timeline.span("compute", phase) if timeline is not None else contextlib.nullcontext()


def _check(q, k, v, n_local: int) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [n_local, heads, head_dim]; got shapes {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if not q.shape[0] == k.shape[0] == v.shape[0] == n_local:
        raise ValueError(f"q, k, v must have n_local={n_local} rows (this rank's tokens in layout "
                         f"order); got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[2] != k.shape[2] or k.shape[1] < 1 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q [.., Hq, D] and k [.., Hkv, D] need equal D and Hq a multiple of Hkv; got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ValueError(f"q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")


def layout_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout, group,
                     attn_backend: str | None = None, causal: bool = True, return_lse: bool = False,
                     timeline=None):
    """Per-document attention of this rank's tokens (layout order), K, V of documents held by several
    ranks all-gathered over ``group``. ``q [n_local, Hq, D]``, ``k, v [n_local, Hkv, D]``; returns
    ``o`` like ``q`` (and the float32 ``lse [n_local, Hq]`` with ``return_lse``). Differentiable in
    q, k, v. Every check happens before any collective. ``timeline`` (a :class:`cadlib.runtime.stages.Timeline`)
    records the kernel calls alone as ``("compute", "attn")`` / ``"attn'"`` spans, without the
    all-gathers and the waits for other ranks inside them."""
    dm = prepare(layout, group, q.device, causal)
    _check(q, k, v, dm.meta.n_local)
    o, lse = AllGatherAttention.apply(q, k, v, dm, group, attn_backend, timeline)
    return (o, lse) if return_lse else o


class AllGatherCP(CPMechanism):
    """The all-gather mechanism of the CP protocol: the zigzag layout of the global sequence and
    :func:`layout_attention` on it (the same function the end-to-end training calls)."""

    name = "allgather"

    def __init__(self, group, doc_lens, causal: bool = True, attn_backend: str | None = None):
        super().__init__(group, doc_lens, causal, attn_backend)
        self.set_layout(zigzag_layout(self.doc_lens, self.world))

    def apply_attn(self, q, k, v):
        self.check_qkv(q, k, v)
        return layout_attention(q, k, v, self.layout, self.group, self.attn_backend, causal=self.causal,
                                return_lse=True)

"""Server-side KV sharing: the shards of one document that a server holds read ONE copy of its KV.

A server's CA-tasks of document ``d`` need the KV prefixes ``[0, b_t)``; the dispatch receives the
prefix ``[0, max b_t)`` once, but the plain ("copy") fused call gathers one KV segment per task, so
the kernel reads ``sum_t b_t`` KV rows and the backward writes (and the server sums) one dK/dV per
copy. Here tasks of one document whose query ranges are contiguous in the document (``[a1, b1)``,
``[b1, b2)``, ...: the dispatch lists them adjacent, ascending) **merge** into one causal segment:
queries ``[a1, c)`` over KV ``[0, c)``, ``c`` the group's last end. Exact, because query ``i`` of the
segment attends ``[0, i]`` under the kernel's bottom-right alignment whatever task it came from.

Tasks of one document that are NOT contiguous on a server (DistCA's head/tail pairing, or shards cut
from both ends of a chunk) stay separate segments, each with its own prefix copy: a KV row then sits
in several segments and its dK/dV are summed, in fp32, once per distinct row (``rep_*`` below). Every
other row is read once and its gradient is written straight into the gradient buffer in the KV
dtype. When the merged segments read the whole KV buffer in order (one document, all local: the
composability benchmark), the kernel reads the buffer itself and its dK/dV are the result.

Plain ``numpy`` on the host (:func:`build_shared`), device copies once per device (:meth:`SharedKV.to`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MODES = ("merged", "copy")
"""Server KV modes: ``merged`` (this module) and ``copy`` (one prefix copy per task, the reference)."""
DEFAULT_MODE = "merged"


def check_mode(kv_share) -> str:
    """``kv_share`` validated (``None`` = ``DEFAULT_MODE``)."""
    mode = DEFAULT_MODE if kv_share is None else kv_share
    if mode not in MODES:
        raise ValueError(f"kv_share must be one of {', '.join(MODES)} (or None for {DEFAULT_MODE!r}); "
                         f"got {kv_share!r}")
    return mode


def _expand(starts, lens) -> np.ndarray:
    lens = np.asarray(lens, dtype=np.int64)
    if not lens.sum():
        return np.zeros(0, dtype=np.int64)
    head = np.cumsum(lens) - lens
    return np.repeat(np.asarray(starts, dtype=np.int64) - head, lens) + np.arange(int(lens.sum()))


@dataclass
class SharedKV:
    """The merged fused call of one server (host arrays; see the module docstring)."""

    cu_q: np.ndarray            # int32 [n_seg + 1]: merged segments' query lengths
    cu_k: np.ndarray            # int32 [n_seg + 1]: their KV prefix lengths (the group's last end)
    max_q: int
    max_k: int
    kv_rows: np.ndarray         # KV-buffer row per merged-segment KV token
    kv_identity: bool           # kv_rows == arange(n_kv_buf): the kernel reads the buffer as it is
    all_once: bool              # no row appears twice: dK/dV go straight into the buffer
    once_pos: np.ndarray        # positions in kv_rows of rows read once ...
    once_rows: np.ndarray       # ... and those rows
    rep_pos: np.ndarray         # positions of rows read by several segments ...
    rep_slot: np.ndarray        # ... their slot in the fp32 accumulator ...
    rep_rows: np.ndarray        # ... and the accumulator's rows (distinct)
    group: np.ndarray           # per task (dispatch order), its merged segment
    split_docs: int             # documents with > 1 segment on this server (non-contiguous shards)
    _device_cache: dict = field(default_factory=dict, repr=False)

    @property
    def n_segments(self) -> int:
        return int(self.cu_q.size - 1)

    def to(self, device) -> "DeviceSharedKV":
        import torch

        key = str(device)
        if key not in self._device_cache:
            t = lambda a, dt=torch.int64: torch.as_tensor(np.asarray(a, dtype=np.int64)).to(device, dt)  # noqa: E731
            self._device_cache[key] = DeviceSharedKV(
                meta=self, cu_q=t(self.cu_q, torch.int32), cu_k=t(self.cu_k, torch.int32),
                kv_rows=t(self.kv_rows), once_pos=t(self.once_pos), once_rows=t(self.once_rows),
                rep_pos=t(self.rep_pos), rep_slot=t(self.rep_slot), rep_rows=t(self.rep_rows))
        return self._device_cache[key]


@dataclass
class DeviceSharedKV:
    meta: SharedKV
    cu_q: object
    cu_k: object
    kv_rows: object
    once_pos: object
    once_rows: object
    rep_pos: object
    rep_slot: object
    rep_rows: object


def merge_groups(doc, a, b) -> np.ndarray:
    """Per task (in call order), its merged segment: a new one unless the task continues the previous
    task's query range in the same document (``doc`` equal and ``a == previous b``)."""
    doc, a, b = (np.asarray(x, dtype=np.int64) for x in (doc, a, b))
    if not doc.size:
        return np.zeros(0, dtype=np.int64)
    cont = np.r_[False, (doc[1:] == doc[:-1]) & (a[1:] == b[:-1])]
    return np.cumsum(~cont) - 1


def build_shared(doc, a, b, cu_q, cu_k, kv_rows, n_kv_buf: int) -> SharedKV:
    """Merge a server's tasks (call order: tasks to merge adjacent and ascending, as
    :func:`cadlib.dispatch.build_dispatch` lists them) into segments; ``cu_q``/``cu_k``/``kv_rows`` are
    the per-task call's. A merged segment reads the KV rows of its last task (its longest prefix)."""
    doc, a, b = (np.asarray(x, dtype=np.int64) for x in (doc, a, b))
    cu_q, cu_k = np.asarray(cu_q, dtype=np.int64), np.asarray(cu_k, dtype=np.int64)
    kv_rows = np.asarray(kv_rows, dtype=np.int64)
    n = doc.size
    if not (a.size == b.size == n and cu_q.size == cu_k.size == n + 1):
        raise ValueError(f"doc, a, b need one entry per task and cu_q, cu_k n_tasks + 1; got {n}, {a.size}, "
                         f"{b.size}, {cu_q.size}, {cu_k.size}")
    if n and not np.array_equal(np.diff(cu_k), b):
        raise ValueError("each task's KV segment must be its prefix [0, q_end): diff(cu_k) != q_end")
    g = merge_groups(doc, a, b)
    n_seg = int(g[-1]) + 1 if n else 0
    first = np.searchsorted(g, np.arange(n_seg))
    last = np.r_[first[1:], n] - 1
    seg_q = cu_q[last + 1] - cu_q[first]
    seg_k = b[last]
    rows = kv_rows[_expand(cu_k[last], seg_k)] if n_seg else np.zeros(0, dtype=np.int64)
    uniq, inv, cnt = np.unique(rows, return_inverse=True, return_counts=True)
    rep = cnt[inv] > 1
    rep_rows = uniq[cnt > 1]
    slot = np.searchsorted(rep_rows, rows[rep])
    seg_doc = doc[first]
    split = int(np.sum(np.bincount(np.unique(seg_doc, return_inverse=True)[1]) > 1)) if n_seg else 0
    cu = lambda x: np.r_[0, np.cumsum(x)].astype(np.int32)  # noqa: E731
    return SharedKV(cu_q=cu(seg_q), cu_k=cu(seg_k), max_q=int(seg_q.max(initial=0)),
                    max_k=int(seg_k.max(initial=0)), kv_rows=rows,
                    kv_identity=bool(rows.size == n_kv_buf and np.array_equal(rows, np.arange(n_kv_buf))),
                    all_once=not bool(rep.any()), once_pos=np.flatnonzero(~rep), once_rows=rows[~rep],
                    rep_pos=np.flatnonzero(rep), rep_slot=slot, rep_rows=rep_rows, group=g,
                    split_docs=split)


def scatter_kv_grad(seg_grad, sh: DeviceSharedKV, n_rows: int, dtype):
    """dK (or dV) of the merged call's KV rows into a ``[n_rows, ...]`` buffer of ``dtype``: rows read
    once are written as they are; rows read by several segments are summed in fp32, rounded once."""
    import torch

    m = sh.meta
    if m.kv_identity:
        return seg_grad.to(dtype)
    out = seg_grad.new_zeros((n_rows, *seg_grad.shape[1:]), dtype=dtype)
    if m.all_once:
        return out.index_copy_(0, sh.kv_rows, seg_grad.to(dtype))
    out.index_copy_(0, sh.once_rows, seg_grad.index_select(0, sh.once_pos).to(dtype))
    acc = torch.zeros((m.rep_rows.size, *seg_grad.shape[1:]), dtype=torch.float32, device=seg_grad.device)
    acc.index_add_(0, sh.rep_slot, seg_grad.index_select(0, sh.rep_pos).float())
    return out.index_copy_(0, sh.rep_rows, acc.to(dtype))


def add_rows(dst, index, uniq, slot, src):
    """``dst[index] += src`` with repeated ``index`` entries summed (``uniq``/``slot``: ``index``'s
    distinct rows and each entry's position among them, from the host): only the touched rows are
    accumulated in fp32, then rounded once into ``dst`` (in place; returned)."""
    import torch

    if not index.numel():
        return dst
    acc = dst.index_select(0, uniq).float()
    acc.index_add_(0, slot, src.to(torch.float32))
    return dst.index_copy_(0, uniq, acc.to(dst.dtype))


# ---------------------------------------------------------------------------------------------------
# Accounting: how much a server's KV takes, copy vs merged
# ---------------------------------------------------------------------------------------------------

def kv_accounting(dispatch, kv_bytes_per_token: int, grad_bytes_per_token: int | None = None) -> dict:
    """A server's KV tokens and bytes in both modes (one layer; ``kv_bytes_per_token`` = K and V of
    one token, e.g. ``ModelSpec.kv_bytes``). ``unique`` = distinct KV rows the tasks read (what the
    server holds); ``copy``/``merged`` = rows the fused call reads. Memory on top of the KV buffer:
    forward the gathered rows (none when the merged call reads the buffer as it is); backward also the
    kernel's dK/dV of those rows plus the gradient buffer, with fp32 accumulators (2x a bf16 row) for
    every gathered row in copy mode and only for the rows summed in merged mode."""
    gb = kv_bytes_per_token if grad_bytes_per_token is None else grad_bytes_per_token
    sh = dispatch.shared()
    unique = int(np.unique(dispatch.kv_rows).size)
    n_buf = dispatch.n_local + dispatch.n_recv_kv
    copy_rows, merged_rows = int(len(dispatch.kv_rows)), int(sh.kv_rows.size)
    merged_gather = 0 if sh.kv_identity else merged_rows
    return {
        "unique_kv_tokens": unique, "copy_kv_tokens": copy_rows, "merged_kv_tokens": merged_rows,
        "kv_buffer_tokens": n_buf, "n_tasks": dispatch.n_tasks, "n_segments": sh.n_segments,
        "split_docs": sh.split_docs, "summed_rows": int(sh.rep_rows.size),
        "copy_fwd_bytes": copy_rows * kv_bytes_per_token,
        "merged_fwd_bytes": merged_gather * kv_bytes_per_token,
        "copy_bwd_bytes": copy_rows * (kv_bytes_per_token + gb) + n_buf * 2 * gb,
        "merged_bwd_bytes": merged_gather * kv_bytes_per_token + merged_rows * gb
        + (0 if sh.kv_identity else n_buf * gb) + int(sh.rep_rows.size) * 2 * gb,
    }


def sharing_stats(plan) -> dict:
    """Over every server of ``plan``: (server, document) pairs with several tasks, how many of them
    merge into one segment (contiguous shards) and how many stay split (non-contiguous: copies), and
    the KV rows the fused calls read in both modes vs the distinct rows. Host only."""
    from .dispatch import build_all

    keys = ("n_tasks", "n_segments", "split_docs", "unique_kv_tokens", "copy_kv_tokens", "merged_kv_tokens")
    tot = dict.fromkeys(keys, 0)
    shared_pairs = 0
    for d in build_all(plan):
        acc = kv_accounting(d, 1)
        for k in keys:
            tot[k] += acc[k]
        doc = np.asarray(d.task_doc, dtype=np.int64)
        if doc.size:
            per_doc = np.bincount(np.unique(doc, return_inverse=True)[1])
            shared_pairs += int(np.sum(per_doc > 1))
    tot["server_doc_pairs_with_several_tasks"] = shared_pairs
    tot["kv_read_copy_over_unique"] = tot["copy_kv_tokens"] / max(tot["unique_kv_tokens"], 1)
    tot["kv_read_merged_over_unique"] = tot["merged_kv_tokens"] / max(tot["unique_kv_tokens"], 1)
    return tot

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
composability benchmark), the kernel reads the buffer itself and its dK/dV are the result; with
``prefix`` (a sent-last plan, :mod:`cadlib.scheduling.sentlast`) also when they read its first rows in order (a
donor's kept rows): the kernel reads that prefix, and dK/dV are padded with zeros for the rest.

Plain ``numpy`` on the host (:func:`build_shared`); the device copies and the gradient scatter are
:mod:`cadlib.runtime.device` and :mod:`cadlib.runtime.server`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..core.plan import merge_groups
from ..core.ranges import Gather, IndexArray, Ranges, encoding, excl

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


SHARED_NAMES = ("kv_rows", "once_pos", "once_rows", "rep_pos", "rep_slot", "rep_rows")


@dataclass
class SharedKV:
    """The merged fused call of one server (host metadata; see the module docstring). The per-token
    arrays are attributes (:class:`cadlib.core.ranges.IndexArray`) held as runs in ``index``."""

    cu_q: np.ndarray            # int32 [n_seg + 1]: merged segments' query lengths
    cu_k: np.ndarray            # int32 [n_seg + 1]: their KV prefix lengths (the group's last end)
    max_q: int
    max_k: int
    kv_identity: bool           # kv_rows == arange(n_kv) (n_kv_buf, or less with prefix): read in place
    all_once: bool              # no row appears twice: dK/dV go straight into the buffer
    group: np.ndarray           # per task (dispatch order), its merged segment
    split_docs: int             # documents with > 1 segment on this server (non-contiguous shards)
    index: dict = field(repr=False)
    _host: dict = field(default_factory=dict, repr=False)
    _explicit: set = field(default_factory=set, repr=False)
    _device_cache: dict = field(default_factory=dict, repr=False)

    kv_rows = IndexArray()      # KV-buffer row per merged-segment KV token
    once_pos = IndexArray()     # positions in kv_rows of rows read once ...
    once_rows = IndexArray()    # ... and those rows
    rep_pos = IndexArray()      # positions of rows read by several segments ...
    rep_slot = IndexArray()     # ... their slot in the fp32 accumulator ...
    rep_rows = IndexArray()     # ... and the accumulator's rows (distinct)

    @property
    def n_segments(self) -> int:
        return int(self.cu_q.size - 1)

    @property
    def n_kv(self) -> int:
        """KV rows of the merged call (with ``kv_identity``, the buffer's first ``n_kv`` rows)."""
        return int(self.cu_k[-1])


def _segments(doc, a, b, cu_q):
    """The merge groups of tasks in call order: per task its group; per segment its first task,
    query length and KV length (its last task's end: the longest prefix of the group)."""
    n = doc.size
    g = merge_groups(doc, a, b)
    n_seg = int(g[-1]) + 1 if n else 0
    first = np.searchsorted(g, np.arange(n_seg))
    last = np.r_[first[1:], n][:n_seg] - 1
    return g, first, cu_q[last + 1] - cu_q[first], b[last]


def _cu(x) -> np.ndarray:
    return np.r_[0, np.cumsum(x)].astype(np.int32)


def build_shared(doc, a, b, cu_q, cu_k, kv_rows, n_kv_buf: int, prefix: bool = False) -> SharedKV:
    """Merge a server's tasks (call order: tasks to merge adjacent and ascending, as
    :func:`cadlib.dispatch.build.build_dispatch` lists them) into segments; ``cu_q``/``cu_k``/``kv_rows`` are
    the per-task call's, ``kv_rows`` an explicit array. A merged segment reads the KV rows of its last
    task (its longest prefix). Per token (rows read twice are found by sorting them): the reference
    for :func:`build_shared_runs`, and the path for a dispatch whose ``kv_rows`` was assigned.
    ``prefix``: the rows may be read in place as the first rows of the buffer, not only as all of it."""
    doc, a, b = (np.asarray(x, dtype=np.int64) for x in (doc, a, b))
    cu_q, cu_k = np.asarray(cu_q, dtype=np.int64), np.asarray(cu_k, dtype=np.int64)
    kv_rows = np.asarray(kv_rows, dtype=np.int64)
    n = doc.size
    if not (a.size == b.size == n and cu_q.size == cu_k.size == n + 1):
        raise ValueError(f"doc, a, b need one entry per task and cu_q, cu_k n_tasks + 1; got {n}, {a.size}, "
                         f"{b.size}, {cu_q.size}, {cu_k.size}")
    if n and not np.array_equal(np.diff(cu_k), b):
        raise ValueError("each task's KV segment must be its prefix [0, q_end): diff(cu_k) != q_end")
    g, first, seg_q, seg_k = _segments(doc, a, b, cu_q)
    last = np.r_[first[1:], n][:first.size] - 1
    rows = kv_rows[Ranges(cu_k[last], seg_k).numpy()]
    uniq, inv, cnt = np.unique(rows, return_inverse=True, return_counts=True)
    rep = cnt[inv] > 1
    rep_rows = uniq[cnt > 1]
    slot = np.searchsorted(rep_rows, rows[rep])
    seg_doc = doc[first]
    split = int(np.sum(np.bincount(np.unique(seg_doc, return_inverse=True)[1]) > 1)) if first.size else 0
    index = {k: Ranges.from_array(v) for k, v in (
        ("kv_rows", rows), ("once_pos", np.flatnonzero(~rep)), ("once_rows", rows[~rep]),
        ("rep_pos", np.flatnonzero(rep)), ("rep_slot", slot), ("rep_rows", rep_rows))}
    return SharedKV(cu_q=_cu(seg_q), cu_k=_cu(seg_k), max_q=int(seg_q.max(initial=0)),
                    max_k=int(seg_k.max(initial=0)),
                    kv_identity=bool((rows.size == n_kv_buf or prefix and rows.size < n_kv_buf)
                                     and np.array_equal(rows, np.arange(rows.size))),
                    all_once=not bool(rep.any()), group=g, split_docs=split, index=index)


def build_shared_runs(doc, a, b, cu_q, kv_map, n_kv_buf: int, prefix: bool = False) -> SharedKV:
    """:func:`build_shared` from the dispatch's KV map (:class:`cadlib.dispatch.kvexchange.KVMap`), in
    O(tasks + pieces), no per-token array. Every (document, position) has its own KV row, so a row is
    read by the segments of its document that reach its position: with ``c2`` the second-longest
    segment of the document (0 if it has only one), positions ``[0, c2)`` are read several times (summed
    in fp32) and ``[c2, c)`` once, by the longest segment. ``rep_rows`` lists the shared rows sorted,
    as ``np.unique`` does: the map's pieces below ``c2``, ordered by their first row."""
    doc, a, b = (np.asarray(x, dtype=np.int64) for x in (doc, a, b))
    cu_q = np.asarray(cu_q, dtype=np.int64)
    g, first, seg_q, seg_k = _segments(doc, a, b, cu_q)
    m = kv_map
    di = np.searchsorted(m.docs, doc[first])                   # each segment's document in the map
    big = int(seg_k.max(initial=0)) + 1
    o = np.argsort(di * big + seg_k, kind="stable")             # segments by (document, length)
    n_per = np.bincount(di, minlength=m.docs.size)
    end = np.cumsum(n_per)
    c2 = np.zeros(m.docs.size, dtype=np.int64)
    two = n_per > 1
    c2[two] = seg_k[o][end[two] - 2]
    sc2 = c2[di]
    cu_k = _cu(seg_k).astype(np.int64)[:-1]
    once = np.maximum(seg_k - sc2, 0)
    shared = np.minimum(seg_k, sc2)
    # the map's pieces below c2 in row order (rows of distinct pieces are disjoint), and the slot of
    # each shared position: its row's index among them
    plen = np.minimum(m.piece_hi, c2[m.piece_doc]) - m.piece_lo
    by_row = m.by_row[plen[m.by_row] > 0]
    slot0 = np.zeros(plen.size, dtype=np.int64)
    slot0[by_row] = excl(plen[by_row])
    keep = plen > 0
    slots = Ranges(slot0[keep], plen[keep])                     # shared positions, (doc, position) order
    rows = Gather(m.rows, Ranges(m.base[di], seg_k))
    kv_identity = False
    if (rows.size == n_kv_buf or prefix and rows.size < n_kv_buf) and not two.any():   # read once: order?
        grp = _pieces_of(m, di)
        kv_identity = Ranges(m.piece_row[grp], (m.piece_hi - m.piece_lo)[grp]).is_identity(rows.size)
    index = {"kv_rows": rows, "once_pos": Ranges(cu_k + sc2, once),
             "once_rows": Gather(m.rows, Ranges(m.base[di] + sc2, once)),
             "rep_pos": Ranges(cu_k, shared), "rep_slot": Gather(slots, Ranges(excl(c2)[di], shared)),
             "rep_rows": Ranges(m.piece_row[by_row], plen[by_row])}
    return SharedKV(cu_q=_cu(seg_q), cu_k=_cu(seg_k), max_q=int(seg_q.max(initial=0)),
                    max_k=int(seg_k.max(initial=0)), kv_identity=kv_identity, all_once=not two.any(),
                    group=g, split_docs=int(two.sum()), index=index)


def _pieces_of(m, di) -> np.ndarray:
    """The map's pieces of documents ``di`` (indices into ``m.docs``), document by document."""
    ptr = np.r_[0, np.cumsum(np.bincount(m.piece_doc, minlength=m.docs.size))]
    cnt = ptr[di + 1] - ptr[di]
    return np.repeat(ptr[di] - excl(cnt), cnt) + np.arange(int(cnt.sum()))


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
    kv = encoding(dispatch, "kv_rows")
    # a dispatch's map holds each (document, position) the tasks read once: its size is the distinct rows
    unique = kv.base.size if isinstance(kv, Gather) else int(np.unique(dispatch.kv_rows).size)
    n_buf = dispatch.n_local + dispatch.n_recv_kv
    copy_rows, merged_rows = kv.size, encoding(sh, "kv_rows").size
    summed = encoding(sh, "rep_rows").size
    merged_gather = 0 if sh.kv_identity else merged_rows
    return {
        "unique_kv_tokens": unique, "copy_kv_tokens": copy_rows, "merged_kv_tokens": merged_rows,
        "kv_buffer_tokens": n_buf, "n_tasks": dispatch.n_tasks, "n_segments": sh.n_segments,
        "split_docs": sh.split_docs, "summed_rows": summed,
        "copy_fwd_bytes": copy_rows * kv_bytes_per_token,
        "merged_fwd_bytes": merged_gather * kv_bytes_per_token,
        "copy_bwd_bytes": copy_rows * (kv_bytes_per_token + gb) + n_buf * 2 * gb,
        "merged_bwd_bytes": merged_gather * kv_bytes_per_token + merged_rows * gb
        + (0 if sh.kv_identity else n_buf * gb) + summed * 2 * gb,
    }

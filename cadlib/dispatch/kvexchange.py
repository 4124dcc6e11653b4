"""The deduplicated KV exchange of one rank, as runs (:mod:`cadlib.core.ranges`).

A server needs the prefix ``[0, e)`` of each document it serves a task of, ``e = max q_end`` over
those tasks; each owner sends its tokens of that prefix once per (server, document), grouped by
server, documents and positions ascending, and the server lays them out per owner, in that order,
after its local rows. :func:`kv_send` is the owner side (what this rank sends, one run per (my
chunk, server)), :func:`kv_map` the server side (where each needed (document, position) sits in
the KV buffer, one run per chunk piece): both O(chunks + tasks), sorting combined integer keys.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.layout import SortedChunks
from ..core.plan import Plan
from ..core.ranges import Ranges, excl, group_max, small


def kv_needs(plan: Plan) -> dict[tuple[int, int], int]:
    """``{(server, doc): e}``: the server needs KV prefix ``[0, e)`` of the doc, ``e = max q_end``."""
    key = plan.server * plan.layout.n_docs + plan.doc
    uk, inv = np.unique(key, return_inverse=True)
    e = np.zeros(uk.size, dtype=np.int64)
    np.maximum.at(e, inv, plan.q_end)
    n = plan.layout.n_docs
    return dict(zip(zip((uk // n).tolist(), (uk % n).tolist()), e.tolist()))


@dataclass
class KVMap:
    """Where the KV prefix tokens a server needs sit in its KV buffer ``cat([local, received])``:
    positions ``[0, e[i])`` of document ``docs[i]`` (ascending) are positions ``base[i] + p`` of
    ``rows``, whose runs are the pieces ``(piece_doc, piece_lo, piece_hi)`` (index into ``docs``, token
    range) in (document, position) order, starting at buffer row ``piece_row``; ``by_row`` lists the
    pieces by buffer row. Every (document, position) has its own row, so a row is read by as many KV
    segments as reach its position: what the merged call (:func:`cadlib.dispatch.kvshare.build_shared_runs`)
    needs to find shared rows by ranges."""

    docs: np.ndarray
    e: np.ndarray
    base: np.ndarray
    piece_doc: np.ndarray
    piece_lo: np.ndarray
    piece_hi: np.ndarray
    piece_row: np.ndarray
    by_row: np.ndarray
    rows: Ranges


def kv_send(plan: Plan, S: SortedChunks, rank: int, off):
    """Owner side of the KV exchange: for each other server ``s`` and document ``d`` I hold a chunk of,
    with prefix end ``e = max q_end`` over ``s``'s tasks of ``d``, the piece ``[start, min(end, e))``
    of each of my chunks of ``d`` starting below ``e``; grouped by server, documents and positions
    ascending. Returns the send runs, their distinct rows (per chunk, the longest piece sent: a prefix
    of the chunk) and each run's slot among them (runs of the same lengths), and the split sizes.
    ``off(j)``: the local rows of my chunks ``j`` (indices into ``S``).

    The needs ``(s, d, e)`` come from one sort of every task on a document I hold (that is every task
    on a head/tail layout); few full-length temporaries, gathers from my chunks' small arrays."""
    R, big = plan.layout.n_ranks, S.big
    mc = np.flatnonzero(S.rank == rank)                          # my chunks, by (doc, start)
    mkey, mstart, mend, moff = S.key[mc], S.start[mc], S.end[mc], off(mc)
    mdoc = mkey // big
    first = np.r_[True, mdoc[1:] != mdoc[:-1]] if mc.size else np.zeros(0, dtype=bool)
    hdocs, hptr = mdoc[first], np.flatnonzero(first)            # documents I hold, their first chunk
    hpos = np.full(plan.layout.n_docs, -1, dtype=np.int64)
    hpos[hdocs] = np.arange(hdocs.size)                          # document -> its index in hdocs
    h = hpos[plan.doc]
    m = (h >= 0) & (plan.server != rank)                        # tasks elsewhere on documents I hold
    group = h[m]
    group *= R
    group += plan.server[m]
    key, e = group_max(group, plan.q_end[m], big)              # needs, by (doc, server)
    del h, m, group
    nh = key // R
    ns = key - nh * R
    # my chunks of document nh starting below e: runs of my chunk indices, one per need
    jb = hptr[nh]
    cnt = np.searchsorted(mkey, hdocs[nh] * big + e, side="left") - jb
    pm = np.repeat(jb - excl(cnt), cnt) + np.arange(int(cnt.sum()))   # index into mc, per piece
    length = np.minimum(mend[pm], np.repeat(e, cnt)) - mstart[pm]
    to = np.repeat(ns, cnt)
    o = np.argsort(small(to, R), kind="stable")                # by server, then (doc, position)
    splits = np.bincount(to, weights=length, minlength=R).astype(np.int64)
    # per chunk, the longest piece sent (per document, the largest e of any server), in local order
    max_e = np.zeros(hdocs.size, dtype=np.int64)
    if nh.size:
        doc_first = np.flatnonzero(np.r_[True, nh[1:] != nh[:-1]])
        max_e[nh[doc_first]] = np.maximum.reduceat(e, doc_first)
    longest = np.clip(max_e[np.cumsum(first) - 1] - mstart, 0, mend - mstart)
    local = np.argsort(moff, kind="stable")
    base = np.empty(mc.size, dtype=np.int64)
    base[local] = excl(longest[local])
    pm, lens = pm[o], length[o]
    return Ranges(moff[pm], lens), Ranges(moff[local], longest[local]), Ranges(base[pm], lens), splits


def kv_map(S: SortedChunks, tdoc, tend, rank: int, n_local: int, R: int, off,
           recv_first: bool = False) -> tuple[KVMap, np.ndarray]:
    """Server side of the KV exchange: the prefixes ``[0, max q_end)`` of the documents of my tasks
    (``tdoc``, ``tend``), as the pieces of the chunks that hold them, each at its row of
    ``cat([local, received])``: local pieces at their local rows, received ones in the owners'
    send order (per owner, documents and positions ascending). ``recv_first`` (sent-last plans): the
    buffer is ``cat([received, local])`` instead, local rows after the received ones. Returns the map
    and the receive split sizes."""
    docs, e = group_max(tdoc, tend, S.big)
    j0 = S.ptr[docs]
    cnt = np.searchsorted(S.key, docs * S.big + e, side="left") - j0
    j = np.repeat(j0 - excl(cnt), cnt) + np.arange(int(cnt.sum()))   # chunk of each piece
    lo, hi, owner = S.start[j], S.end[j], S.rank[j]
    last = np.cumsum(cnt) - 1                                    # a document's last piece ends at e
    hi[last] = np.minimum(hi[last], e)
    plen = hi - lo
    counts = np.bincount(owner, weights=plen, minlength=R).astype(np.int64)
    n_own = int(counts[rank])
    counts[rank] = 0                                             # what I receive, per owner
    o = np.argsort(small(owner, R), kind="stable")              # per owner: (doc, position)
    k = np.bincount(owner, minlength=R)
    a, b = int(k[:rank].sum()), int(k[:rank + 1].sum())        # my own pieces: o[a:b]
    row = np.empty_like(plen)
    po = plen[o]
    cum = excl(po)
    cum[b:] -= n_own                                             # owners' blocks one after another
    recv0, local0 = (0, int(counts.sum())) if recv_first else (n_local, 0)
    row[o[:a]], row[o[b:]] = recv0 + cum[:a], recv0 + cum[b:]
    mine = o[a:b]
    row[mine] = off(j[mine]) + local0
    mine = mine[np.argsort(row[mine], kind="stable")]
    by_row = np.r_[o[:a], o[b:], mine] if recv_first else np.r_[mine, o[:a], o[b:]]
    kv_map = KVMap(docs=docs, e=e, base=excl(e), piece_doc=np.repeat(np.arange(docs.size), cnt),
                   piece_lo=lo, piece_hi=hi, piece_row=row, by_row=by_row,
                   rows=Ranges(row, plen))
    return kv_map, counts

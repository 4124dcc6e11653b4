"""Sent rows last: re-order each rank's tokens so that a donor's attention server reads in place.

A rank whose tasks are all served at home reads its query buffer, and often its KV buffer, as they
are (:class:`cadlib.dispatch.meta.Dispatch` ``q_identity``, :class:`cadlib.dispatch.kvshare.SharedKV`
``kv_identity``). A **donor**, a rank that sends some of its query rows to other servers, cannot: the
rows it keeps are scattered between the rows it sent, so its fused call gathers its query rows and
their KV rows (forward and again backward) and scatters dQ, dK, dV back; on 2x H200 that costs ~29 ns
per gathered row and layer (:func:`cadlib.analysis.runs.cost_check.server_overhead_fit`), on the slowest rank.

The order of a rank's tokens is free: positions are per token (RoPE is applied before dispatch),
the loss is a sum over tokens and a document's synthetic tokens are a function of (document,
position) (:mod:`cadlib.runtime.batches`). So once the scheduler has placed the tasks (position based, blind
to buffer order), :func:`sent_last` builds an EQUIVALENT plan, the same tasks on the same homes and
servers, on a layout in which each rank holds

    [ the pieces of its chunks it serves itself, in their old order | the pieces it sends away,
      one per task, in send order (by server, then plan order) | KV-only chunks (none in a plan
      that covers its layout; a nano-batch's context), in their old order ]

Its server then computes local rows ``[0, n_keep)`` and every received row, which the dispatch
reads in place (``q_keep``), the home side sends and gets back one slice, and the kept tasks of a
document whose sent part was the END of the rank's piece read their KV prefix as the kept rows
themselves, a prefix of the KV buffer. A document whose prefix lies on another rank reads it in place
when the server lays its buffers out received first (``Dispatch.recv_first``, chosen per server by
:func:`cadlib.dispatch.build.build_dispatch`). Documents whose START (or a middle shard) was sent still need
a KV gather. The plan is marked ``meta["sent_last"]``, which
lets the dispatch take those prefixes in place (it does not on other plans, so that plans without
the option run exactly as before).

Host work is O(chunks + tasks): pieces of tasks over chunks as ranges, one sort of combined keys.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.layout import Layout
from ..core.plan import Plan
from ..core.ranges import Ranges, ragged


@dataclass
class SentLast:
    """A re-ordered plan and, per rank, where its new local rows come from: new local row ``i`` of
    rank ``r`` is old local row ``perm[r].numpy()[i]`` (runs, one per piece)."""

    plan: Plan
    perm: list[Ranges]

    def old_rows(self, rank: int) -> np.ndarray:
        """``perm[rank]`` expanded: the old local row of each new local row."""
        return self.perm[rank].numpy()

    def new_rows(self, rank: int) -> np.ndarray:
        """The inverse: the new local row of each old local row."""
        old = self.old_rows(rank)
        inv = np.empty_like(old)
        inv[old] = np.arange(old.size)
        return inv


def sent_last(plan: Plan) -> SentLast:
    """The plan's tasks on a layout where each rank's rows sent to other servers come last (module
    docstring). Chunks not covered by any task (KV-only context) stay at the end of their rank, in
    order; a chunk must be covered by tasks wholly or not at all. A rank that sends nothing keeps its
    chunks as they are (and costs nothing here)."""
    lay = plan.layout
    R, ch = lay.n_ranks, lay.chunk_array()
    doc, a, b, home, server = plan.doc, plan.q_start, plan.q_end, plan.home, plan.server
    meta = {**plan.meta, "sent_last": True}
    donor = np.zeros(R, dtype=bool)
    donor[home[home != server]] = True
    if not donor.any():                                                  # nothing to re-order
        n = lay.tokens_per_rank()
        return SentLast(Plan.from_arrays(lay, doc, a, b, home, server, n_servers=plan.n_servers, meta=meta,
                                         chunks=ch, check=False), [Ranges([0], [x]) for x in n.tolist()])
    S, n_ch = lay.sorted_chunks(), ch.shape[0]
    clen = ch[:, 2] - ch[:, 1]
    cs = np.r_[0, np.cumsum(clen)]
    first, rp = cs[:-1], lay.rank_ptr()
    ts = np.flatnonzero(donor[home])                                     # tasks homed on donors
    # pieces of those tasks over the chunks (a task may span neighbouring chunks of its home; most
    # lie in one, which the chunk holding q_start tells)
    dt, bt = doc[ts], b[ts]
    j = np.searchsorted(S.key, dt * S.big + a[ts], side="right") - 1
    more = np.flatnonzero(bt > S.end[j])
    t = ts
    if more.size:
        j1 = j.copy()
        j1[more] = np.searchsorted(S.key, dt[more] * S.big + bt[more], side="left") - 1
        t, k = ragged(j1 - j + 1)
        j = j[t] + k
        t = ts[t]
    c = S.order[j]                                                       # chunk rows
    lo, hi = np.maximum(a[t], S.start[j]), np.minimum(b[t], S.end[j])
    if np.any(ch[c, 3] != home[t]):
        i = int(t[np.flatnonzero(ch[c, 3] != home[t])[0]])
        raise ValueError(f"task {plan._row(i)}: its query tokens are not all on home rank {int(home[i])}")
    mine = donor[ch[:, 3]]                                               # the donors' chunks
    cover = np.bincount(c, weights=hi - lo, minlength=n_ch).astype(np.int64)
    bad = mine & (cover != 0) & (cover != clen)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"chunk {tuple(ch[i].tolist())} (doc, start, end, rank) is covered by tasks in "
                         "part; sent_last needs every chunk covered wholly (or not at all: KV-only)")
    free = np.flatnonzero(mine & (cover == 0))                           # KV-only chunks, whole
    row0 = first - first[rp[ch[:, 3]]]                                  # each chunk's first local row
    sent = server[t] != home[t]
    # a donor's new order: kept pieces by old row, sent pieces by (server, task) and position,
    # KV-only chunks by old row; one stable sort of a combined key
    n_t = max(plan.n_tasks, 1)
    M = max(int(clen.sum()), R * n_t) + 1
    cls = np.r_[sent.astype(np.int64), np.full(free.size, 2)]
    old = np.r_[row0[c] + lo - ch[c, 1], row0[free]]
    sub = np.where(cls == 1, np.r_[server[t] * n_t + t, free], old)
    rank = np.r_[home[t], ch[free, 3]]
    order = np.argsort((rank * 3 + cls) * M + sub, kind="stable")
    gid = np.r_[np.where(sent, n_ch + t, c), free][order]                # pieces that may be one chunk
    pd, plo = np.r_[doc[t], ch[free, 0]][order], np.r_[lo, ch[free, 1]][order]
    phi, prank, pold = np.r_[hi, ch[free, 2]][order], rank[order], old[order]
    head = np.r_[True, (gid[1:] != gid[:-1]) | (plo[1:] != phi[:-1])] if gid.size else gid.astype(bool)
    h = np.flatnonzero(head)
    last = np.r_[h[1:], gid.size][:h.size] - 1
    # rank-major: the others' chunks as they are, each donor's new chunks in its block
    hp = np.searchsorted(prank[h], np.arange(R + 1))
    n_new = np.where(donor, np.diff(hp), np.diff(rp))
    base = np.r_[0, np.cumsum(n_new)]
    new = np.empty((int(base[-1]), 4), dtype=np.int64)
    rest = np.flatnonzero(~mine)
    new[base[ch[rest, 3]] + rest - rp[ch[rest, 3]]] = ch[rest]
    at = base[prank[h]] + np.arange(h.size) - hp[prank[h]]
    for col, x in enumerate((pd[h], plo[h], phi[last], prank[h])):
        new[at, col] = x
    new.flags.writeable = False                                          # Layout takes it without a copy
    layout = Layout.from_chunks(new, lay.doc_lens, R)
    pp = np.searchsorted(prank, np.arange(R + 1))
    plen = phi - plo
    n_local = cs[rp[1:]] - cs[rp[:-1]]
    perm = [Ranges(pold[pp[r]:pp[r + 1]], plen[pp[r]:pp[r + 1]]) if donor[r] else Ranges([0], [n_local[r]])
            for r in range(R)]
    out = Plan.from_arrays(layout, doc, a, b, home, server, n_servers=plan.n_servers, meta=meta, check=False)
    return SentLast(out, perm)


def sent_last_nanos(nanos, plans):
    """:func:`sent_last` for ping-pong's two nano-batches (:mod:`cadlib.scheduling.nanosplit`) and their plans:
    returns the nano-batches with their layouts re-ordered (``rows``: each rank's rows of its full
    local buffer, in the new order) and the re-ordered plans.

    Nano-batch B may read A's rows as KV-only context: its context chunks stay at the end of its
    layout (they are in no task of B's plan), the rows B takes of A's local buffer (``context``) are
    renumbered to A's new order, and B's query rows are re-ordered like any other. Every context row
    still holds the K, V of the same (document, position), so B's attention is unchanged."""
    from dataclasses import replace

    out_n, out_p = [], []
    new_a = None
    for i, (nb, p) in enumerate(zip(nanos, plans)):
        s = sent_last(p)
        rows, context = [], list(nb.context)
        for r in range(p.layout.n_ranks):
            old = s.old_rows(r)
            n_q = len(nb.rows[r])
            if not np.array_equal(old[n_q:], np.arange(n_q, old.size)):
                raise ValueError(f"nano-batch {'AB'[i]}, rank {r}: its KV-only rows are not its last rows")
            rows.append(np.asarray(nb.rows[r])[old[:n_q]])
            if i == 1 and context and len(context[r]):
                context[r] = new_a[r][np.asarray(context[r])]
        if i == 0:
            new_a = [s.new_rows(r) for r in range(p.layout.n_ranks)]
        out_n.append(replace(nb, layout=s.plan.layout, rows=rows, context=context))
        out_p.append(s.plan)
    return out_n, out_p

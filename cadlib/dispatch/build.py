"""The communication plan of CAD: all-to-all split sizes and index maps, built once per step.

Every rank holds the same global :class:`~cadlib.core.plan.Plan`. :func:`build_dispatch` turns it, for
one rank, into host metadata (numpy) that the forward and backward all-to-alls and the attention
server need, in O(chunks + tasks): split sizes, and every per-token index map below as runs of
consecutive rows (:mod:`cadlib.core.ranges`), never one entry per token. :func:`cadlib.runtime.device.to_device` copies the
runs to the device once, where each map is expanded on first use; reading a map on the host
(``dispatch.kv_rows``) expands it there. Nothing here touches a device tensor's values, so building
and moving it never synchronises the device.

Buffers (all row-major over tokens):

* **local buffer** of rank ``r``: its tokens in layout order, ``layout.ranks[r]``'s chunks one after
  another (``n_local`` rows). Q, K, V, O, dO, LSE of the linear layers live here.
* **Q exchange** (home -> server): rank ``r`` sends the query rows of its tasks served elsewhere,
  grouped by server, tasks in plan order. Self-served tasks are not sent.
* **KV exchange** (owner -> server), deduplicated: a server needs the prefix ``[0, e_{s,d})`` of each
  document ``d`` it serves, ``e_{s,d} = max q_end`` over its tasks of ``d``. Owner ``o`` sends each of
  its tokens of that prefix once per (server, document), grouped by server, documents ascending,
  positions ascending; tokens the server holds itself are not sent. Hence the KV send counts equal
  ``Plan.token_matrices()[1]``.
* **server buffers** ``cat([local[:q_keep], received])`` for Q (``q_keep = n_local`` but on sent-last
  plans, below) and ``cat([local, received])`` for KV. The fused kernel call reads, per served task
  ``t`` (longest KV prefix first), query rows ``q_rows`` (``n_q(t)`` of them, rows of ``cat([local,
  received])``) and a contiguous KV segment ``kv_rows`` = the document's prefix ``[0, q_end(t))``
  (gathered; a prefix shared by several tasks is received once and gathered several times).
  ``cu_q``/``cu_k`` delimit the segments.
* **return** of O/LSE/dQ (server -> home) reverses the Q exchange: ``ret_rows`` picks, from the
  server's output rows, the rows each home receives, in the order it sent them; the home writes them
  to ``q_send_index`` and its self-served rows from ``self_rows`` to ``self_local``. dK/dV contributions
  are scatter-added over ``kv_rows`` into the KV server buffer; its received part goes back along the
  reversed KV exchange and the owner adds it at ``kv_send_index``.

**In place** (``q_identity``): when a server's query rows, in call order, are local rows ``[0,
q_keep)`` then every received row, and its rank sends rows ``[q_keep, q_keep + n_send_q)`` away in
send order, the server reads ``cat([local[:q_keep], received])`` as it is and the home side sends and
gets back a slice. Only sent-last plans (:mod:`cadlib.scheduling.sentlast`, ``plan.meta["sent_last"]``) take
``q_keep < n_local`` and a merged KV call that reads a prefix of its buffer; others keep the rules
they were measured with (``q_keep = n_local``, the whole KV buffer). A sent-last server may also lay
its buffers out received first (``recv_first``: ``cat([received, local[:q_keep]])`` and ``cat([received
KV, local])``; every map above then counts rows in that order, and received dK/dV are the buffer's
first ``n_recv_kv`` rows), so that a document begun on another rank reads its prefix in place.
"""
from __future__ import annotations

import numpy as np

from ..core.layout import Layout, SortedChunks
from ..core.plan import Plan, merge_groups
from ..core.ranges import Gather, Ranges, excl, ragged, small
from .kvexchange import kv_map, kv_send
from .meta import Dispatch


def local_index_map(layout: Layout) -> list[np.ndarray]:
    """Per document, an int array: each token's row in its owner's local buffer (O(tokens); for tests
    and notebooks, not used by :func:`build_dispatch`)."""
    lidx = [np.empty(n, dtype=np.int64) for n in layout.doc_lens]
    for chunks, offs in zip(layout.ranks, layout.local_offsets()):
        for c, off in zip(chunks, offs):
            lidx[c.doc][c.start:c.end] = np.arange(off, off + c.length, dtype=np.int64)
    return lidx


def _cu(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64))]).astype(np.int32)


def _pieces(S: SortedChunks, doc, a, b) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Pieces of token ranges ``[a, b)`` of documents ``doc``: ``(range index, chunk, piece start, piece
    end)`` in range order, positions ascending (chunks index ``S``)."""
    j0 = np.searchsorted(S.key, doc * S.big + a, side="right") - 1
    j1 = np.searchsorted(S.key, doc * S.big + b, side="left") - 1
    grp, k = ragged(np.maximum(j1 - j0 + 1, 0))
    j = j0[grp] + k
    return grp, j, np.maximum(a[grp], S.start[j]), np.minimum(b[grp], S.end[j])


def _traffic(plan: Plan, S: SortedChunks) -> tuple[bool, bool]:
    """Whether any rank sends queries / KV at all, in O(chunks + tasks) without grouping: a task
    served away from its home needs its own query tokens' KV, so Q traffic implies KV traffic; else
    a server holds the whole prefix ``[0, q_end)`` of a task's document iff the run of chunks that
    one rank holds from token 0 on is its and reaches ``q_end``."""
    if np.any(plan.home != plan.server):
        return True, True
    n = S.doc.size
    if not n:                                                   # no chunk at all (an empty nano-batch)
        return False, False
    brk = np.r_[True, (S.doc[1:] != S.doc[:-1]) | (S.rank[1:] != S.rank[:-1])]
    heads = np.flatnonzero(brk)
    run_end = S.end[np.r_[heads[1:], n] - 1]
    first = S.ptr[:-1]                                          # every document has a chunk
    holder, held_to = S.rank[first], run_end[np.searchsorted(heads, first)]
    d, srv = plan.doc, plan.server
    return False, bool(np.any((holder[d] != srv) | (held_to[d] < plan.q_end)))


def build_dispatch(plan: Plan, rank: int) -> Dispatch:
    """Rank ``rank``'s communication plan for ``plan`` (host metadata). O(chunks + tasks) work in
    numpy: every index map is built as runs (a chunk piece, a task's received block, a document's
    prefix), never per token; no Python loop over tasks or tokens, no owner map. The only part that
    grows faster is the KV send side, one run per (my chunk, server that needs it), which is what the
    owner sends.

    On a sent-last plan the server's buffers may be laid out received first (``recv_first``): a
    document that began on another rank then reads [its received prefix | its local rows] in place,
    while received shards that CONTINUE a local document read in place only local first. Each server
    takes the layout that gathers fewer rows (received first on a tie); the choice is its own (the
    exchanges' send orders do not depend on it), at twice the host work of one build where the server
    gathers and receives (with nothing received the two layouts are one)."""
    if not plan.meta.get("sent_last"):
        return _build_dispatch(plan, rank, False)
    sends: dict = {}                      # the send side, the same for both layouts: built once
    first = _build_dispatch(plan, rank, True, sends)
    if not sum(first.gathered_rows()) or not (first.n_recv_q or first.n_recv_kv):
        return first                      # in place already, or nothing received: one layout
    local = _build_dispatch(plan, rank, False, sends)
    return local if sum(local.gathered_rows()) < sum(first.gathered_rows()) else first


def _build_dispatch(plan: Plan, rank: int, recv_first: bool, sends: dict | None = None) -> Dispatch:
    """One layout's dispatch; ``sends`` (a dict, empty on the first of two builds of one plan and rank)
    keeps the owner side of the KV exchange and the traffic flags, which the layout does not change."""
    layout = plan.layout
    R = layout.n_ranks
    if plan.n_servers != R:
        raise ValueError(f"plan has {plan.n_servers} servers but its layout {R} ranks; distributed CAD "
                         "runs one attention server per rank, so they must be equal")
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < R:
        raise ValueError(f"rank {rank} is outside the plan's ranks 0..{R - 1}")
    rank = int(rank)
    S = layout.sorted_chunks()
    first_row, last_row = layout.rank_ptr()[rank:rank + 2]
    mine_ch = layout.chunk_array()[first_row:last_row]
    n_local, offsets = int((mine_ch[:, 2] - mine_ch[:, 1]).sum()), layout.offsets(rank)

    def off(j):
        """Local rows of my chunks ``j`` (indices into ``S``)."""
        return offsets[S.order[j] - first_row]

    sends = {} if sends is None else sends
    if "traffic" not in sends:
        sends["traffic"] = _traffic(plan, S)
    q_traffic, kv_traffic = sends["traffic"]
    doc, a, b, home, server = plan.doc, plan.q_start, plan.q_end, plan.home, plan.server
    n_q = b - a
    index = {}

    # -- Q exchange, home side: my tasks served elsewhere, grouped by server, plan order ---------
    mine = np.flatnonzero((home == rank) & (server != rank))
    mine = mine[np.argsort(small(server[mine], R), kind="stable")]
    _, j, lo, hi = _pieces(S, doc[mine], a[mine], b[mine])
    index["q_send_index"] = Ranges(off(j) + lo - S.start[j], hi - lo)
    q_send_splits = np.bincount(server[mine], weights=n_q[mine], minlength=R).astype(np.int64)

    # -- Q exchange, server side: where each served task's query rows land ----------------------
    # Receive positions follow the homes' send order (plan order); the fused call then lists the
    # tasks longest KV prefix first (LPT): varlen kernels hand out tiles segment by segment, so the
    # longest tiles must not come last and leave SMs idle at the tail. Tasks of one document with
    # contiguous query ranges stay adjacent and ascending, so the merged call (cadlib.dispatch.kvshare) takes
    # them as one segment; groups go longest prefix first. Exception: a server whose query rows can be
    # its buffer in place (module docstring) lists its tasks in buffer order when that merges as much,
    # so that its call reads and writes the buffers without gather/scatter.
    served = np.flatnonzero(server == rank)
    remote = served[home[served] != rank]
    by_home = remote[np.argsort(small(home[remote], R), kind="stable")]
    q_recv_splits = np.bincount(home[remote], weights=n_q[remote], minlength=R).astype(np.int64)
    prefix = bool(plan.meta.get("sent_last"))
    n_recv = int(q_recv_splits.sum())
    recv0, local0 = (0, n_recv) if recv_first else (n_local, 0)   # where received / local rows start
    recv_start = np.zeros(len(doc), dtype=np.int64)
    recv_start[by_home] = recv0 + excl(n_q[by_home])

    def rows_of(order):
        """The query rows of tasks ``order`` in that order (runs), whether each run is local, and
        each task's first row."""
        grp, j, lo, hi = _pieces(S, doc[order], a[order], b[order])
        own_piece = (home[order] == rank)[grp]                 # self-served tasks: their local rows
        starts = recv_start[order][grp] + lo - a[order][grp]
        starts[own_piece] = off(j[own_piece]) + (lo - S.start[j])[own_piece] + local0
        return Ranges(starts, hi - lo), own_piece, starts[np.searchsorted(grp, np.arange(order.size))]

    served = _call_order(served, doc, a, b, S.big)
    q_rows, own_piece, first = rows_of(served)
    n_self = q_rows.size - n_recv                               # local rows this server computes
    q_keep = n_self if prefix else n_local
    # the rows sent away follow the kept ones (sent-last), or nothing is sent and none is KV-only
    tail = index["q_send_index"].is_arange(n_self, int(q_send_splits.sum())) if prefix else n_self == n_local

    def in_place(rows, own):
        """Whether ``rows`` are the query buffer ``cat([local[:q_keep], received])`` in order (``own``:
        local runs), or on a sent-last plan ``cat([received, local[:q_keep]])``."""
        if recv_first:
            return rows.is_identity(q_keep + n_recv)
        return Ranges(np.where(own, rows.starts, rows.starts - n_local + q_keep), rows.lens).is_identity(
            q_keep + n_recv)

    if tail and q_rows.size:
        # In buffer order this server's query rows need no gather and its outputs no scatter
        # (q_identity). Taken when it merges as many shards as LPT.

        def n_segments(order):
            return merge_groups(doc[order], a[order], b[order])[-1]

        buf = served[np.argsort(first, kind="stable")]
        rows = rows_of(buf)
        if in_place(*rows[:2]) and n_segments(buf) == n_segments(served):
            served, (q_rows, own_piece, first) = buf, rows
    q_identity = bool(tail and in_place(q_rows, own_piece))
    index["q_rows"] = q_rows

    # -- KV exchange: owner side (what I send) and server side (where what I need lands) -------------
    if "kv" not in sends:
        sends["kv"] = kv_send(plan, S, rank, off)
    index["kv_send_index"], index["kv_send_uniq"], index["kv_send_slot"], kv_send_splits = sends["kv"]
    kvm, kv_recv_splits = kv_map(S, doc[served], b[served], rank, n_local, R, off, recv_first=recv_first)
    index["kv_rows"] = Gather(kvm.rows, Ranges(kvm.base[np.searchsorted(kvm.docs, doc[served])], b[served]))

    # -- return path: received Q buffer order <- server output rows --------------------------------
    nq, nk = n_q[served], b[served]
    cu_q = _cu(nq)
    pos, is_remote = cu_q[:-1].astype(np.int64), home[served] != rank
    rem = np.flatnonzero(is_remote)
    rem = rem[np.argsort(recv_start[served[rem]], kind="stable")]
    index["ret_rows"] = Ranges(pos[rem], nq[rem])
    index["self_rows"] = Ranges(pos[~is_remote], nq[~is_remote])
    index["self_local"] = Ranges(q_rows.starts[own_piece] - local0, q_rows.lens[own_piece])
    return Dispatch(
        rank=rank, world=R, n_local=n_local,
        q_send_splits=q_send_splits.tolist(), q_recv_splits=q_recv_splits.tolist(),
        kv_send_splits=kv_send_splits.tolist(), kv_recv_splits=kv_recv_splits.tolist(),
        tasks=served.tolist(), cu_q=cu_q, cu_k=_cu(nk), max_q=int(nq.max(initial=0)),
        max_k=int(nk.max(initial=0)), index=index, q_traffic=q_traffic, kv_traffic=kv_traffic,
        q_identity=q_identity, q_keep=q_keep if q_identity else n_local, prefix=prefix, recv_first=recv_first,
        task_doc=doc[served], task_start=a[served], task_end=b[served], kv_map=kvm)


def _call_order(served: np.ndarray, doc, a, b, big: int) -> np.ndarray:
    """The served tasks in call order: merge groups (runs of contiguous query ranges of one document,
    :func:`cadlib.core.plan.merge_groups`) longest KV prefix first, tasks ascending inside a group
    (stable sorts of combined keys: ``np.lexsort`` is ~100x slower)."""
    s = served[np.argsort(doc[served] * big + a[served], kind="stable")]
    if not s.size:
        return s
    g = merge_groups(doc[s], a[s], b[s])
    last = np.r_[np.flatnonzero(np.diff(g)), g.size - 1]
    end = b[s][last][g]
    return s[np.argsort((big - end) * (int(g[-1]) + 1) + g, kind="stable")]


def build_all(plan: Plan) -> list[Dispatch]:
    """Every rank's :class:`Dispatch`, where one process needs them all (the replay, ``cadlib.verify``'s
    summary, :func:`simulate_exchange`, tests and notebooks); a rank running the plan builds its own."""
    return [build_dispatch(plan, r) for r in range(plan.layout.n_ranks)]


def simulate_exchange(dispatches: list[Dispatch], buffers: list[np.ndarray], kind: str) -> list[np.ndarray]:
    """Run one all-to-all in one process with numpy: ``kind`` ``"q"`` or ``"kv"``; ``buffers[r]`` is
    rank ``r``'s local buffer; returns each rank's received buffer (sources in rank order)."""
    if kind not in ("q", "kv"):
        raise ValueError(f"unknown exchange {kind!r}; choose one of: q, kv")
    R = len(dispatches)
    sent = []
    for d, buf in zip(dispatches, buffers):
        idx = d.q_send_index if kind == "q" else d.kv_send_index
        splits = d.q_send_splits if kind == "q" else d.kv_send_splits
        sent.append(np.split(buf[idx], np.cumsum(splits)[:-1]))
    out = []
    for dst in range(R):
        recv = [sent[src][dst] for src in range(R)]
        expect = dispatches[dst].q_recv_splits if kind == "q" else dispatches[dst].kv_recv_splits
        if [len(x) for x in recv] != list(expect):
            raise ValueError(f"rank {dst} expects {expect} rows but is sent {[len(x) for x in recv]}")
        out.append(np.concatenate(recv) if recv else buffers[dst][:0])
    return out

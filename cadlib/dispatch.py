"""The communication plan of CAD: all-to-all split sizes and index maps, built once per step.

Every rank holds the same global :class:`~cadlib.plan.Plan`. :func:`build_dispatch` turns it, for
one rank, into host metadata (numpy) that the forward and backward all-to-alls and the attention
server need; :meth:`Dispatch.to` moves the index arrays to the device once. Nothing here touches a
device tensor's values, so building it never synchronises the device.

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
* **server buffers** ``cat([local, received])`` for Q and for KV. The fused kernel call reads, per
  served task ``t`` (longest KV prefix first), query rows ``q_rows`` (``n_q(t)`` of them) and a contiguous KV
  segment ``kv_rows`` = the document's prefix ``[0, q_end(t))`` (gathered; a prefix shared by several
  tasks is received once and gathered several times). ``cu_q``/``cu_k`` delimit the segments.
* **return** of O/LSE/dQ (server -> home) reverses the Q exchange: ``ret_rows`` picks, from the
  server's output rows, the rows each home receives, in the order it sent them; the home writes them
  to ``q_send_index`` and its self-served rows from ``self_rows`` to ``self_local``. dK/dV contributions
  are scatter-added over ``kv_rows`` into the KV server buffer; its received part goes back along the
  reversed KV exchange and the owner adds it at ``kv_send_index``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .plan import Layout, Plan


@dataclass
class Dispatch:
    """One rank's view of a plan's communication (host metadata; see the module docstring)."""

    rank: int
    world: int
    n_local: int
    # Q exchange, home side and server side
    q_send_index: np.ndarray           # local rows sent, grouped by destination server
    q_send_splits: list[int]
    q_recv_splits: list[int]
    # KV exchange (deduplicated per (server, doc))
    kv_send_index: np.ndarray
    kv_send_splits: list[int]
    kv_recv_splits: list[int]
    # the fused kernel call on this server
    tasks: list[int]                   # plan indices of the tasks this rank serves, in call order
    q_rows: np.ndarray                 # rows of cat([local, q_recv]) per served query token
    kv_rows: np.ndarray                # rows of cat([local, kv_recv]) per task KV segment token
    cu_q: np.ndarray                   # int32 [n_tasks + 1]
    cu_k: np.ndarray                   # int32 [n_tasks + 1]
    max_q: int
    max_k: int
    # return path of per-query rows (O, LSE, dQ)
    ret_rows: np.ndarray               # server output rows in the order of the received Q buffer
    self_rows: np.ndarray              # server output rows of self-served queries ...
    self_local: np.ndarray             # ... and where they live in the local buffer
    # whether any rank sends anything (the same on every rank: skip collectives that move nothing)
    q_traffic: bool = True
    kv_traffic: bool = True
    # q_rows == arange(n_local + n_recv_q): the server reads its query buffer as it is, its output rows
    # are the buffer's (local rows first), and nothing of this rank is served elsewhere
    q_identity: bool = False
    # the served tasks' documents and query ranges, in call order (for the merged call)
    task_doc: np.ndarray | None = None
    task_start: np.ndarray | None = None
    task_end: np.ndarray | None = None
    _device_cache: dict = field(default_factory=dict, repr=False)

    @property
    def n_recv_q(self) -> int:
        return int(sum(self.q_recv_splits))

    @property
    def n_recv_kv(self) -> int:
        return int(sum(self.kv_recv_splits))

    @property
    def n_tasks(self) -> int:
        return len(self.tasks)

    def shared(self):
        """The merged fused call (:class:`cadlib.kvshare.SharedKV`), built from the current fields on
        first use and cached."""
        from .kvshare import build_shared

        if "shared" not in self._device_cache:
            if self.task_doc is None:
                raise ValueError("this Dispatch has no task_doc/task_start/task_end; build it with "
                                 "build_dispatch to use the merged (kv_share='merged') server call")
            self._device_cache["shared"] = build_shared(
                self.task_doc, self.task_start, self.task_end, self.cu_q, self.cu_k, self.kv_rows,
                self.n_local + self.n_recv_kv)
        return self._device_cache["shared"]

    def to(self, device) -> "DeviceDispatch":
        """Index arrays as device tensors, copied once per device and cached. On CUDA all of them go
        in one pinned host buffer and one ``non_blocking`` copy on the current stream, so the host
        never waits for the device (the next step's plan can be built meanwhile); the pinned buffer
        is kept alive by torch's caching host allocator until the copy has run. On CPU: as_tensor."""
        import torch

        key = str(device)
        if key not in self._device_cache:
            names = ("q_send_index", "kv_send_index", "q_rows", "kv_rows", "cu_q", "cu_k", "ret_rows",
                     "self_rows", "self_local", "kv_send_uniq", "kv_send_slot")
            uniq, slot = np.unique(np.asarray(self.kv_send_index, dtype=np.int64), return_inverse=True)
            extra = {"kv_send_uniq": uniq, "kv_send_slot": slot}
            arrays = [np.asarray(extra[n] if n in extra else getattr(self, n), dtype=np.int64).reshape(-1)
                      for n in names]
            host = torch.from_numpy(np.concatenate(arrays))
            dev = torch.device(device)
            if dev.type == "cuda":
                flat = host.pin_memory().to(dev, non_blocking=True)
            else:
                flat = host.to(dev)
            parts = dict(zip(names, torch.split(flat, [a.size for a in arrays])))
            parts["cu_q"], parts["cu_k"] = parts["cu_q"].to(torch.int32), parts["cu_k"].to(torch.int32)
            self._device_cache[key] = DeviceDispatch(meta=self, **parts)
        return self._device_cache[key]


@dataclass
class DeviceDispatch:
    """The index arrays of a :class:`Dispatch` on one device; split sizes stay on the host."""

    meta: Dispatch
    q_send_index: object
    kv_send_index: object
    q_rows: object
    kv_rows: object
    cu_q: object
    cu_k: object
    ret_rows: object
    self_rows: object
    self_local: object
    kv_send_uniq: object      # distinct rows of kv_send_index and each entry's slot among them: the
    kv_send_slot: object      # owner sums several servers' dK/dV of one token (kvshare.add_rows)

    @property
    def shared(self):
        """The merged call's device metadata (:class:`cadlib.kvshare.DeviceSharedKV`)."""
        return self.meta.shared().to(self.kv_rows.device)          # copied once per device


def local_index_map(layout: Layout) -> list[np.ndarray]:
    """Per document, an int array: each token's row in its owner's local buffer (O(tokens); for tests
    and notebooks, not used by :func:`build_dispatch`)."""
    lidx = [np.empty(n, dtype=np.int64) for n in layout.doc_lens]
    for chunks, offs in zip(layout.ranks, layout.local_offsets()):
        for c, off in zip(chunks, offs):
            lidx[c.doc][c.start:c.end] = np.arange(off, off + c.length, dtype=np.int64)
    return lidx


def kv_needs(plan: Plan) -> dict[tuple[int, int], int]:
    """``{(server, doc): e}``: the server needs KV prefix ``[0, e)`` of the doc, ``e = max q_end``."""
    key, e = _needs(plan)
    n = plan.layout.n_docs
    return dict(zip(zip((key // n).tolist(), (key % n).tolist()), e.tolist()))


def _needs(plan: Plan) -> tuple[np.ndarray, np.ndarray]:
    """Sorted keys ``server * n_docs + doc`` and their prefix ends ``max q_end``."""
    key = plan.server * plan.layout.n_docs + plan.doc
    uk, inv = np.unique(key, return_inverse=True)
    e = np.zeros(uk.size, dtype=np.int64)
    np.maximum.at(e, inv, plan.q_end)
    return uk, e


def _expand(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + n) for s, n in zip(starts, lens)])`` without a Python loop."""
    lens = np.asarray(lens, dtype=np.int64)
    total = int(lens.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    head = np.cumsum(lens) - lens
    return np.repeat(np.asarray(starts, dtype=np.int64) - head, lens) + np.arange(total, dtype=np.int64)


def _cu(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64))]).astype(np.int32)


def _ragged(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For groups of ``counts`` items: each item's group and its index within the group."""
    grp = np.repeat(np.arange(counts.size), counts)
    return grp, np.arange(grp.size) - np.repeat(np.cumsum(counts) - counts, counts)


class _Chunks:
    """The layout's chunks sorted by ``(doc, start)``, with each chunk's row in its rank's local buffer:
    the pieces of any token range ``[a, b)`` of a document are found by binary search."""

    def __init__(self, plan: Plan):
        ch = plan.chunk_array()                                 # rank-major, layout order
        lens = ch[:, 2] - ch[:, 1]
        first = np.r_[True, ch[1:, 3] != ch[:-1, 3]] if len(ch) else np.zeros(0, dtype=bool)
        csum = np.cumsum(lens) - lens
        off = csum - np.maximum.accumulate(np.where(first, csum, 0)) if len(ch) else csum
        o = np.lexsort((ch[:, 1], ch[:, 0]))
        self.doc, self.start, self.end, self.rank, self.off = ch[o, 0], ch[o, 1], ch[o, 2], ch[o, 3], off[o]
        self.big = int(max(plan.layout.doc_lens)) + 1
        self.key = self.doc * self.big + self.start
        self.n_local = np.bincount(ch[:, 3], weights=lens, minlength=plan.layout.n_ranks).astype(np.int64)

    def owned(self, g, d, e) -> np.ndarray:
        """Tokens of ``[0, e)`` of documents ``d`` that ranks ``g`` hold (elementwise; -1: none)."""
        o = np.lexsort((self.start, self.doc, self.rank))            # by (rank, doc, start)
        n_docs = int(self.doc.max(initial=0)) + 1
        own_grp = self.rank[o] * n_docs + self.doc[o]
        own_a, own_b = self.start[o], self.end[o]
        cum = np.concatenate(([0], np.cumsum(own_b - own_a)))
        grp = g * n_docs + d
        lo = np.searchsorted(own_grp, grp, side="left")
        j = np.searchsorted(own_grp * self.big + own_a, grp * self.big + e, side="left") - 1  # last start < e
        ok = (j >= lo) & (g >= 0)
        j = np.maximum(j, 0)
        return np.where(ok, cum[j] - cum[lo] + np.minimum(e, own_b[j]) - own_a[j], 0)

    def pieces(self, doc, a, b) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Pieces of ranges ``[a, b)``: ``(range index, chunk, piece start, piece end)`` in range order,
        positions ascending."""
        j0 = np.searchsorted(self.key, doc * self.big + a, side="right") - 1
        j1 = np.searchsorted(self.key, doc * self.big + b, side="left") - 1
        cnt = np.maximum(j1 - j0 + 1, 0)
        grp, k = _ragged(cnt)
        j = j0[grp] + k
        return grp, j, np.maximum(a[grp], self.start[j]), np.minimum(b[grp], self.end[j])

    def local_rows(self, j, lo, hi) -> np.ndarray:
        """Local rows of pieces ``[lo, hi)`` of chunks ``j``."""
        return _expand(self.off[j] + lo - self.start[j], hi - lo)


def build_dispatch(plan: Plan, rank: int) -> Dispatch:
    """Rank ``rank``'s communication plan for ``plan`` (host metadata). O(chunks + tasks) work in
    numpy, plus the index arrays themselves (one entry per token sent, received or read); no Python
    loop over tasks or tokens, no owner map."""
    layout = plan.layout
    R = layout.n_ranks
    if plan.n_servers != R:
        raise ValueError(f"plan has {plan.n_servers} servers but its layout {R} ranks; distributed CAD "
                         "runs one attention server per rank, so they must be equal")
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < R:
        raise ValueError(f"rank {rank} is outside the plan's ranks 0..{R - 1}")
    cache = plan.__dict__.setdefault("_dispatch_cache", {})     # shared by every rank's build
    if not cache:
        C = cache["chunks"] = _Chunks(plan)
        key, e = _needs(plan)                                     # sorted by (server, doc)
        srv, dd = key // layout.n_docs, key % layout.n_docs
        by_doc = np.lexsort((srv, dd))
        cache["needs"] = (srv, dd, e, by_doc, np.searchsorted(dd[by_doc], np.arange(layout.n_docs + 1)))
        own = C.owned(np.where(srv < R, srv, -1), dd, e)          # KV tokens a server holds itself
        cache["kv_traffic"] = bool(np.any(own < e))
        cache["q_traffic"] = bool(np.any(plan.home != plan.server))
    C = cache["chunks"]
    srv, dd, need_e, need_by_doc, need_doc_ptr = cache["needs"]
    n_local = int(C.n_local[rank])
    doc, a, b, home, server = plan.doc, plan.q_start, plan.q_end, plan.home, plan.server
    n_q = b - a

    # -- Q exchange, home side: my tasks served elsewhere, grouped by server, plan order ---------
    mine = np.flatnonzero((home == rank) & (server != rank))
    mine = mine[np.argsort(server[mine], kind="stable")]
    _, j, lo, hi = C.pieces(doc[mine], a[mine], b[mine])
    q_send_index = C.local_rows(j, lo, hi)
    q_send_splits = np.bincount(server[mine], weights=n_q[mine], minlength=R).astype(np.int64)

    # -- Q exchange, server side: where each served task's query rows land ----------------------
    # Receive positions follow the homes' send order (plan order); the fused call then lists the
    # tasks longest KV prefix first (LPT): varlen kernels hand out tiles segment by segment, so the
    # longest tiles must not come last and leave SMs idle at the tail. Tasks of one document with
    # contiguous query ranges stay adjacent and ascending, so the merged call (cadlib.kvshare) takes
    # them as one segment; groups go longest prefix first. Exception: a server that computes every
    # row of its query buffer (none of its own tasks served elsewhere) lists its tasks in buffer order
    # when that merges as much, so that its call reads and writes the buffers without gather/scatter.
    served = np.flatnonzero(server == rank)
    remote = served[home[served] != rank]
    by_home = remote[np.argsort(home[remote], kind="stable")]
    q_recv_splits = np.bincount(home[remote], weights=n_q[remote], minlength=R).astype(np.int64)
    recv_start = np.zeros(len(plan.doc), dtype=np.int64)
    recv_start[by_home] = n_local + np.cumsum(n_q[by_home]) - n_q[by_home]
    n_buf = n_local + int(q_recv_splits.sum())

    def rows_of(order):
        """The query rows of tasks ``order`` in that order, and each task's first row."""
        grp, j, lo, hi = C.pieces(doc[order], a[order], b[order])
        own_piece = (home[order] == rank)[grp]                 # self-served tasks: their local rows
        starts = np.where(own_piece, C.off[j] + lo - C.start[j], recv_start[order][grp] + lo - a[order][grp])
        return _expand(starts, hi - lo), starts[np.searchsorted(grp, np.arange(order.size))]

    served = _call_order(served, doc, a, b)
    q_rows, first = rows_of(served)
    if not mine.size and q_rows.size == n_buf and n_buf:
        # This server computes every row of its query buffer: in buffer order its query rows need no
        # gather and its outputs no scatter (q_identity). Taken when it merges as many shards as LPT.
        from .kvshare import merge_groups

        def n_segments(order):
            return merge_groups(doc[order], a[order], b[order])[-1]

        buf = served[np.argsort(first, kind="stable")]
        rows = rows_of(buf)[0]
        if np.array_equal(rows, np.arange(n_buf)) and n_segments(buf) == n_segments(served):
            served, q_rows = buf, rows

    # -- KV exchange, owner side: for each of my chunks and each other server needing its document's
    # prefix [0, e), the piece [start, min(end, e)); grouped by server, documents and positions ascending
    mc = np.flatnonzero(C.rank == rank)
    lo_n, cnt = need_doc_ptr[C.doc[mc]], need_doc_ptr[C.doc[mc] + 1] - need_doc_ptr[C.doc[mc]]
    grp, k = _ragged(cnt)
    ni = need_by_doc[lo_n[grp] + k]
    c = mc[grp]
    lo, hi = C.start[c], np.minimum(C.end[c], need_e[ni])
    keep = (srv[ni] != rank) & (hi > lo)
    c, lo, hi, to = c[keep], lo[keep], hi[keep], srv[ni][keep]
    o = np.lexsort((lo, C.doc[c], to))
    kv_send_index = C.local_rows(c[o], lo[o], hi[o])
    kv_send_splits = np.bincount(to, weights=hi - lo, minlength=R).astype(np.int64)

    # -- KV exchange, server side: where each token of my documents' prefixes lands ---------------
    span = slice(*np.searchsorted(srv, [rank, rank + 1]))       # needs sorted by (server, doc)
    my_docs, my_e = dd[span], need_e[span]
    grp, j, lo, hi = C.pieces(my_docs, np.zeros(my_docs.size, dtype=np.int64), my_e)
    owner = C.rank[j]
    rem = owner != rank
    plen = hi - lo
    kv_recv_splits = np.bincount(owner[rem], weights=plen[rem], minlength=R).astype(np.int64)
    kv_base = np.cumsum(kv_recv_splits) - kv_recv_splits
    loc = C.off[j] + lo - C.start[j]                           # start row of each piece (local ones)
    r_idx = np.flatnonzero(rem)
    r_idx = r_idx[np.argsort(owner[r_idx], kind="stable")]    # per owner: documents, positions ascending
    within = np.zeros(j.size, dtype=np.int64)
    if r_idx.size:
        cum = np.cumsum(plen[r_idx]) - plen[r_idx]
        first = np.searchsorted(owner[r_idx], owner[r_idx])
        within[r_idx] = cum - cum[first]
    loc = np.where(rem, n_local + kv_base[owner] + within, loc)
    # each served task reads its document's pieces, clipped to its q_end
    doc_pos = np.searchsorted(my_docs, doc[served])           # my_docs ascending
    piece_lo = np.searchsorted(grp, np.arange(my_docs.size))
    piece_cnt = np.bincount(grp, minlength=my_docs.size)
    t_grp, k = _ragged(piece_cnt[doc_pos])
    pj = piece_lo[doc_pos][t_grp] + k
    end = np.minimum(hi[pj], b[served][t_grp])
    kv_rows = _expand(loc[pj], np.maximum(end - lo[pj], 0))

    # -- return path: received Q buffer order <- server output rows --------------------------------
    is_remote = q_rows >= n_local
    ret_rows = np.empty(int(is_remote.sum()), dtype=np.int64)
    ret_rows[q_rows[is_remote] - n_local] = np.flatnonzero(is_remote)
    self_rows = np.flatnonzero(~is_remote).astype(np.int64)
    self_local = q_rows[~is_remote]

    nq, nk = n_q[served], b[served]
    return Dispatch(
        rank=rank, world=R, n_local=n_local,
        q_send_index=q_send_index, q_send_splits=q_send_splits.tolist(), q_recv_splits=q_recv_splits.tolist(),
        kv_send_index=kv_send_index, kv_send_splits=kv_send_splits.tolist(),
        kv_recv_splits=kv_recv_splits.tolist(), tasks=served.tolist(), q_rows=q_rows, kv_rows=kv_rows,
        cu_q=_cu(nq), cu_k=_cu(nk), max_q=int(nq.max(initial=0)), max_k=int(nk.max(initial=0)),
        ret_rows=ret_rows, self_rows=self_rows, self_local=self_local,
        q_traffic=cache["q_traffic"], kv_traffic=cache["kv_traffic"],
        q_identity=bool(q_rows.size == n_buf and np.array_equal(q_rows, np.arange(n_buf))),
        task_doc=doc[served], task_start=a[served], task_end=b[served])


def _call_order(served: np.ndarray, doc, a, b) -> np.ndarray:
    """The served tasks in call order: merge groups (runs of contiguous query ranges of one document,
    :func:`cadlib.kvshare.merge_groups`) longest KV prefix first, tasks ascending inside a group."""
    from .kvshare import merge_groups

    s = served[np.lexsort((a[served], doc[served]))]
    g = merge_groups(doc[s], a[s], b[s])
    if not s.size:
        return s
    last = np.r_[np.flatnonzero(np.diff(g)), g.size - 1]
    end = b[s][last][g]
    return s[np.lexsort((a[s], g, -end))]


def build_all(plan: Plan) -> list[Dispatch]:
    """Every rank's :class:`Dispatch` (single-process use: tests, notebooks, simulated exchange)."""
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

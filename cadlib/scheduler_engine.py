"""The vectorised engine of the CAD scheduler: the algorithm of
:func:`cadlib.scheduler.reference_greedy`, with each move's candidates scored in one numpy pass.

State: the chunks of the layout are the original tasks (arrays ``a``, ``b``, ``server`` change as
tasks shrink or move); shards cut off are appended to ``shards`` (they sit on receivers, which never
give work away, so they never move again). What never changes (the chunks of each document, what each
rank holds, the colocated prefix ends) is in :class:`cadlib.scheduler_index.ChunkIndex`; per (server,
doc) the prefix end ``need`` the server fetches (``max q_end`` of its tasks of the doc) is the index's
colocated value, overridden (``over_key``, ``over_end``) once a move changes it (bytes mode only).

A donor's tasks change only when it moves, so what the candidates of its tasks need from them (a
:class:`DonorView`) is built for every donor at once when the greedy starts and again for a donor after
it has moved. ``mode="flops"`` (``equal_flops``) does not price moves: its forward bytes are those of
its final tasks less the colocated ones, on the documents it touched, counted once at the end.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cost import imbalance
from .scheduler_index import ChunkIndex, other_ends
from .scheduler_rollout import decide
from .shards import cut_near, cut_shards


@dataclass
class TaskArrays:
    """Parallel int64 arrays of a placement, ``Plan.from_arrays``' input."""

    doc: np.ndarray
    q_start: np.ndarray
    q_end: np.ndarray
    home: np.ndarray
    server: np.ndarray


@dataclass
class DonorView:
    """A donor's live tasks (plan indices ``tasks`` and their fields) and the pairs of each task's
    smallest valid move (``min_pairs``); bytes mode also: the donor's prefix end for the task's document
    without the task (``other``), the KV tokens the donor fetches for that document now (``kv_now``),
    and the chunks of the task's document (``rep``: which task, ``chunk``, its ``holder`` rank or -1
    when that rank is not a server); ``rows``: :meth:`Greedy.candidate_rows`, ``None`` until computed
    and again when a document of the view gets a new shard server."""

    tasks: np.ndarray
    doc: np.ndarray
    a: np.ndarray
    b: np.ndarray
    home: np.ndarray
    min_pairs: np.ndarray
    other: np.ndarray | None = None
    kv_now: np.ndarray | None = None
    rep: np.ndarray | None = None
    chunk: np.ndarray | None = None
    holder: np.ndarray | None = None
    rows: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None


_PER_TASK = {"flops": ("tasks", "doc", "a", "b", "home", "min_pairs"),
             "bytes": ("tasks", "doc", "a", "b", "home", "min_pairs", "other", "kv_now")}


@dataclass
class Move:
    task: int
    receiver: int
    k: int
    pairs: int
    from_end: bool
    bytes: int
    at: int = -1                  # the task's place in the donor's view


class Greedy:
    """``mode="bytes"``: ``schedule``'s priority (bytes per pair); ``mode="flops"``: ``equal_flops``."""

    def __init__(self, chunks: np.ndarray, n_docs: int, n_servers: int, tolerance: float, min_shard: int,
                 q_bytes: int, kv_bytes: int, mode: str):
        S = self.S = int(n_servers)
        self.n_docs, self.m, self.qb, self.kvb, self.mode = n_docs, int(min_shard), q_bytes, kv_bytes, mode
        self.chunks = chunks = np.asarray(chunks, dtype=np.int64)
        # few large temporaries (each is fresh memory, page faults, at 10^5 chunks): doc and home are
        # views of the chunks, server too until the first move (prepare copies it)
        self.doc, self.home = chunks[:, 0], chunks[:, 3]
        self.a, self.b = chunks[:, 1].copy(), chunks[:, 2].copy()      # change as tasks shrink
        self.server = self.home % S if self.home.size and int(self.home.max()) >= S else self.home
        self.pairs = pairs = self.b + 1
        pairs *= self.b
        aa = self.a + 1
        aa *= self.a
        pairs -= aa
        pairs //= 2
        srv = self.server
        if not srv.size or bool((srv[1:] >= srv[:-1]).all()):   # rank-major chunks: servers in order
            self.by_srv, cum = None, np.cumsum(pairs)
            self.srv_ptr = srv.searchsorted(np.arange(S + 1))
        else:
            self.by_srv = np.argsort(srv, kind="stable")
            self.srv_ptr = srv[self.by_srv].searchsorted(np.arange(S + 1))
            cum = np.cumsum(pairs[self.by_srv])
        at = np.where(self.srv_ptr > 0, cum[self.srv_ptr - 1] if cum.size else 0, 0)
        self.load = at[1:] - at[:-1]
        self.U = (1.0 + tolerance) * int(at[-1]) / S
        self.imbalance_before = self.imbalance()
        self.ix: ChunkIndex | None = None
        self.shards: list[tuple[int, int, int, int, int]] = []
        self.shard_servers: dict[int, set[int]] = {}          # doc -> servers given shards of it
        self.has_shard = np.zeros(n_docs, dtype=bool)
        self.live: dict[int, np.ndarray] = {}
        self.stuck: set[int] = set()
        self.views: dict[int, DonorView] = {}
        self.touched: set[int] = set()                         # documents the moves changed
        self.n_moves = self.n_splits = self.n_rollouts = 0
        self.moved_bytes = 0                                   # forward bytes added by the moves (exact)

    def prepare(self, index: ChunkIndex | None = None) -> None:
        """Index the chunks (only once there is a donor; ``index``: another greedy's, built on the same
        chunks and servers) and build every donor's view."""
        if self.server.base is not None:
            self.server = self.server.copy()                   # servers change from now on
        c = self.chunks                                        # (a, b as they are before any move)
        self.ix = index or ChunkIndex(self.doc, c[:, 1], c[:, 2], self.home, self.server, self.n_docs, self.S)
        self.over_key = self.over_end = np.zeros(0, dtype=np.int64)    # changed prefix ends (bytes mode)
        self.need_at: dict[tuple[int, int], int] = {}          # need1's answers
        donors = np.flatnonzero(self.load > self.U).tolist()
        p = self.srv_ptr
        self.live = {s: (np.arange(p[s], p[s + 1]) if self.by_srv is None else self.by_srv[p[s]:p[s + 1]])
                     for s in donors}
        self.build_views(donors)
        self.doc_cache: dict = {}                              # the rollouts' (scheduler_rollout._doc)

    def need(self, g: np.ndarray, d: np.ndarray) -> np.ndarray:
        """The prefix end server ``g`` fetches of document ``d`` (0 if it serves none), elementwise."""
        key = g * self.n_docs + d
        out = np.zeros_like(key)
        for k, end in ((self.ix.need_key, self.ix.need_end), (self.over_key, self.over_end)):
            if k.size:                                         # the colocated value, then the changed one
                i = np.minimum(k.searchsorted(key), k.size - 1)
                out = np.where(k[i] == key, end[i], out)
        return out

    def need1(self, g: int, d: int) -> int:
        """``need`` of one server and document (remembered until it changes)."""
        e = self.need_at.get((g, d))
        if e is not None:
            return e
        key, e = g * self.n_docs + d, 0
        for k, end in ((self.over_key, self.over_end), (self.ix.need_key, self.ix.need_end)):
            i = int(k.searchsorted(key))
            if i < k.size and k[i] == key:
                e = int(end[i])
                break
        self.need_at[(g, d)] = e
        return e

    def set_need(self, g: int, d: int, end: int) -> None:
        self.need_at[(g, d)] = end
        key = g * self.n_docs + d
        i = int(self.over_key.searchsorted(key))
        if i < self.over_key.size and self.over_key[i] == key:
            self.over_end[i] = end
        else:
            self.over_key = np.concatenate((self.over_key[:i], [key], self.over_key[i:]))
            self.over_end = np.concatenate((self.over_end[:i], [end], self.over_end[i:]))

    def imbalance(self) -> float:
        return imbalance(self.load)

    def reached(self) -> bool:
        return bool(self.load.max(initial=0) <= self.U)

    # -- donor views ------------------------------------------------------------------------------
    def build_views(self, servers: list[int]) -> None:
        """The :class:`DonorView` of each of ``servers`` (donors), from one numpy pass over their
        tasks."""
        idx = [self.live[s][self.server[self.live[s]] == s] for s in servers]
        for s, i in zip(servers, idx):
            self.live[s] = i
        cnt = np.array([i.size for i in idx], dtype=np.int64)
        idx = np.concatenate(idx) if idx else np.zeros(0, dtype=np.int64)
        d, a, b = self.doc[idx], self.a[idx], self.b[idx]
        e = np.where(b - a >= 2 * self.m, a + self.m, b)             # smallest valid move: m start tokens
        mp = (e * (e + 1) - a * (a + 1)) // 2
        cols = {"tasks": idx, "doc": d, "a": a, "b": b, "home": self.home[idx], "min_pairs": mp}
        ends = np.cumsum(cnt)
        if self.mode == "bytes":
            srv = np.repeat(np.asarray(servers, dtype=np.int64), cnt)
            other = other_ends(srv * self.n_docs + d, b)
            cols["other"] = other
            cols["kv_now"] = self.ix.kv(srv, d, np.maximum(other, b))
            lo, n_ch = self.ix.doc_ptr[d], self.ix.doc_ptr[d + 1] - self.ix.doc_ptr[d]
            rep = np.repeat(np.arange(idx.size), n_ch)
            pos = np.repeat(lo - np.cumsum(n_ch) + n_ch, n_ch) + np.arange(rep.size)
            chunk, holder = self.ix.by_doc[pos], self.ix.holder_of[pos]
            rep_at = np.r_[0, np.cumsum(n_ch)][np.r_[0, ends]].tolist()
        ends = np.r_[0, ends].tolist()
        for j, s in enumerate(servers):
            lo, hi = ends[j], ends[j + 1]
            v = DonorView(**{k: c[lo:hi] for k, c in cols.items()})
            if self.mode == "bytes":
                r0, r1 = rep_at[j], rep_at[j + 1]
                v.rep, v.chunk, v.holder = rep[r0:r1] - lo, chunk[r0:r1], holder[r0:r1]
            self.views[s] = v

    # -- one move ---------------------------------------------------------------------------------
    def best_move(self, s: int) -> Move | None:
        """Donor ``s``'s lowest-priority move (``reference_greedy``'s formula, vectorised), to one of:
        receivers serving or holding part of the task's document, and the emptiest receiver ``g``; only
        receivers below ``U`` with room for the task's smallest valid move."""
        load, U = self.load, self.U
        g = int(load.argmin())                                  # the emptiest receiver (first on ties)
        if load[g] >= U:
            return None
        if s not in self.views:
            self.build_views([s])
        v = self.views[s]
        if not v.tasks.size:
            return None
        if self.mode == "flops":
            return self.largest_move(s, g, v)
        n, nr = v.tasks.size, v.rep.size
        if v.rows is None:
            v.rows = self.candidate_rows(s, v)
        F = v.rows                                                # rows: chunk servers, the rest, g
        recv = F[2]
        recv[:nr] = self.server[v.chunk]                          # (chunks move)
        recv[-n:] = g
        srv = recv[:nr]
        room = U - load[recv]
        yf = np.floor(room)
        keep = (recv != s) & (F[1] <= yf)                         # room for the smallest valid move
        F = F[:, keep]                                            # (a pair twice scores twice: same move)
        if not F.shape[1]:
            return None
        col, _, recv, d, a, b, h, other, kv_now = F
        # pairs of each task's document that donors could shed: sum over its chunks on donors of
        # min(pairs, the donor's excess)
        avail = np.bincount(v.rep, weights=np.minimum(np.maximum(load[srv] - U, 0), self.pairs[v.chunk]),
                            minlength=n)
        need_r = self.need(recv, d)
        room, y = room[keep], yf[keep].astype(np.int64)
        excess = load[s] - U
        x = np.maximum(np.ceil(np.minimum(excess, room)), 1).astype(np.int64)
        k, p = cut_near(a, b, x, y, self.m)                       # [2, N]: end row, start row (x <= y + 1)
        valid = (k > 0) & (p <= y)
        # KV of the receiver after (its prefix end grows to the shard's, b or a + k) and before; of the
        # donor after (its prefix end is the other tasks' or what it keeps, b - k or b; 0 if whole)
        N = col.size
        e = np.concatenate((b, a + k[1])).reshape(2, N)
        left = np.concatenate((b - k[0], b)).reshape(2, N) * (k != b - a)
        kvs = self.ix.kv(np.concatenate((recv, recv, recv, np.full(2 * N, s))), np.concatenate((d,) * 5),
                         np.concatenate((np.maximum(need_r, e).ravel(), need_r,
                                         np.maximum(other, left).ravel()))).reshape(5, N)
        kv_r = kvs[:2] - kvs[2]                                   # [end, start] x N
        kv_s = kvs[3:] - kv_now
        byt = self.qb * k * ((h != recv).astype(np.int64) - (h != s)) + self.kvb * (kv_r + kv_s)
        bundle = np.maximum(np.minimum(room, avail[col]), p)
        kvb_r = self.kvb * kv_r
        cost = np.maximum(byt - kvb_r + kvb_r * p / bundle, np.minimum(byt, 0))
        prio = cost / np.maximum(p, 1)
        clears = valid & (p >= excess)
        if clears.any():                                          # a partial move: + the cheapest clearing
            prio = np.where(clears, prio, (cost + cost[clears].min()) / excess)
        prio = np.where(valid, prio, np.inf).ravel()
        best = np.flatnonzero(prio == prio.min())
        if not np.isfinite(prio[best[0]]):
            return None
        if best.size > 1:                                         # ties: larger P, task, receiver, end
            side, c = np.divmod(best, N)
            best = best[np.lexsort((side, recv[c], v.tasks[col[c]], -p.ravel()[best]))]
        sd, c = divmod(int(best[0]), N)
        self.peel = None
        ng = int(np.count_nonzero(keep[-n:]))                     # the last ng rows: to g, tasks in order
        if p[sd, c] < excess and ng:                              # partial: the peeling move too
            pe = np.where(valid[0, -ng:], p[0, -ng:], -1)
            e = int(pe.argmax())                                  # the largest; ties: the first task
            if pe[e] >= 0:
                e += N - ng
                self.peel = Move(int(v.tasks[col[e]]), g, int(k[0, e]), int(p[0, e]), True, int(byt[0, e]),
                                 int(col[e]))
        return Move(task=int(v.tasks[col[c]]), receiver=int(recv[c]), k=int(k[sd, c]),
                    pairs=int(p[sd, c]), from_end=sd == 0, bytes=int(byt[sd, c]), at=int(col[c]))

    def largest_move(self, s: int, g: int, v: DonorView) -> Move | None:
        """``equal_flops``: donor ``s``'s largest valid end shard to the emptiest receiver ``g`` (ties:
        the first task)."""
        room = self.U - self.load[g]
        y = int(np.floor(room))
        x = max(int(np.ceil(min(self.load[s] - self.U, room))), 1)
        k, p = cut_shards(v.a, v.b, x, y, self.m, sides=1)
        k, p = k[0], p[0]
        pe = np.where((k > 0) & (p <= y) & (v.min_pairs <= y), p, -1)
        i = int(pe.argmax())
        if pe[i] < 0:
            return None
        return Move(int(v.tasks[i]), g, int(k[i]), int(p[i]), True, 0, i)

    def apply(self, s: int, mv: Move) -> None:
        t, r, k, i = mv.task, mv.receiver, mv.k, mv.at
        d, a, b, h = self.doc.item(t), self.a.item(t), self.b.item(t), self.home.item(t)
        whole = k == b - a
        if whole:
            self.server[t] = r
            e = b
        else:
            lo, hi = (b - k, b) if mv.from_end else (a, a + k)
            self.shards.append((d, lo, hi, h, r))
            got = self.shard_servers.setdefault(d, set())
            if r not in got:                                   # a new candidate of d's tasks
                got.add(r)
                if self.mode == "bytes":
                    ix = self.ix
                    for g in self.server[ix.by_doc[ix.doc_ptr[d]:ix.doc_ptr[d + 1]]].tolist():
                        if g in self.views:
                            self.views[g].rows = None
            self.has_shard[d] = True
            self.pairs[t] -= mv.pairs
            if mv.from_end:
                self.b[t] = b = b - k
            else:
                self.a[t] = a = a + k
            e = hi
            self.n_splits += 1
        self.touched.add(d)
        self.load[s] -= mv.pairs
        self.load[r] += mv.pairs
        self.n_moves += 1
        v = self.views.pop(s)
        mine = None
        if self.mode == "bytes":
            self.moved_bytes += mv.bytes
            sel = np.flatnonzero(v.doc == d)                   # s's tasks of d, and their ends after the move
            ends = v.b[sel].tolist()
            sel = sel.tolist()
            j = sel.index(i)
            if whole:
                del sel[j], ends[j]
            else:
                ends[j] = b
            mine = sel, ends
            self.set_need(r, d, max(self.need1(r, d), e))
            self.set_need(s, d, max(ends, default=0))
        if self.load[s] > self.U:                              # still a donor: its view, updated
            self.views[s] = self.shrink_view(s, v, i, whole, d, a, b, mine)
        if self.load[s] < self.U:
            self.stuck.clear()                                 # a new receiver: retry stuck donors

    def shrink_view(self, s: int, v: DonorView, i: int, whole: bool, d: int, a: int, b: int,
                    mine: tuple[list[int], list[int]] | None) -> DonorView:
        """Donor ``s``'s view ``v`` after its ``i``-th task (of document ``d``) moved (``whole``) or
        shrank to ``[a, b)``; ``mine`` (bytes mode): its tasks of ``d`` (positions in ``v``) without
        the one moved whole, and their ends."""
        if whole:
            keep = np.arange(v.tasks.size) != i
            w = DonorView(**{f: getattr(v, f)[keep] for f in _PER_TASK[self.mode]})
            if self.mode == "bytes":
                kc = v.rep != i
                w.rep, w.chunk, w.holder = v.rep[kc], v.chunk[kc], v.holder[kc]
                w.rep -= w.rep > i
            v = w
        else:
            v.a[i], v.b[i] = a, b
            e = a + self.m if b - a >= 2 * self.m else b
            v.min_pairs[i] = (e * (e + 1) - a * (a + 1)) // 2
        if self.mode == "bytes":
            sel, bs = mine                                     # its tasks of d: the others' prefix ends
            if whole:
                sel = [j - (j > i) for j in sel]
            top = max(bs, default=0)
            second = max((x for x in bs if x != top), default=0) if bs.count(top) == 1 else top
            for j, bj in zip(sel, bs):
                v.other[j] = second if bj == top else top
            if sel:
                v.kv_now[sel] = top - self.ix.owned1(s, d, top)
            v.rows = None
        return v

    def candidate_rows(self, s: int, v: DonorView) -> np.ndarray:
        """Donor ``s``'s candidate (task, receiver) rows with what they need of the task, packed as one
        array ``[task, min_pairs, receiver, doc, a, b, home, other, kv_now] x rows``: first the rows of
        the tasks' documents' chunks' servers, then of the holders that are other servers and of the
        servers given shards of the document, then one per task for the emptiest receiver; the
        receivers of the first and last part are filled in per move (chunks move, and so does the
        emptiest receiver)."""
        h = (v.holder >= 0) & (v.holder != s)
        task, recv = [v.rep, v.rep[h]], [v.rep, v.holder[h]]
        if self.shard_servers:
            extra = [(i, r) for i in np.flatnonzero(self.has_shard[v.doc]).tolist()
                     for r in self.shard_servers[int(v.doc[i])]]
            if extra:
                et, er = np.array(extra, dtype=np.int64).T
                task.append(et)
                recv.append(er)
        task = np.concatenate((*task, np.arange(v.tasks.size)))
        recv = np.concatenate((*recv, np.zeros(v.tasks.size, dtype=np.int64)))
        return np.concatenate((task, v.min_pairs[task], recv, v.doc[task], v.a[task], v.b[task],
                               v.home[task], v.other[task], v.kv_now[task])).reshape(9, -1)

    def run(self) -> bool:
        """Move until no donor can: the most loaded donor first. Returns ``reached``."""
        if self.ix is None and np.any(self.load > self.U):
            self.prepare()
        load, U = self.load, self.U
        while True:
            live = load
            if self.stuck:                                     # stuck donors wait for a new receiver
                live = load.copy()
                live[list(self.stuck)] = -1
            s = int(live.argmax())                             # the most loaded donor (first on ties)
            if not live[s] > U:
                break
            mv = self.best_move(s)
            if mv is not None and self.mode == "bytes" and mv.pairs < load[s] - U:
                mv = decide(self, s, mv, self.peel)
            if mv is None:
                self.stuck.add(s)
            else:
                self.apply(s, mv)
        if self.mode == "flops" and self.touched:
            self.moved_bytes = self.touched_bytes()
        return self.reached()

    def touched_bytes(self) -> int:
        """The forward bytes the moves added (flops mode): on the documents they touched, the final
        tasks' less the colocated chunks'."""
        docs = np.fromiter(self.touched, dtype=np.int64, count=len(self.touched))
        c = self.ix.doc_chunks(docs)
        cols = [x[c] for x in (self.doc, self.a, self.b, self.home, self.server)]
        return self.ix.moved_bytes(self.chunks[c], cols, self.shards, self.S, self.qb, self.kvb)

    def task_arrays(self) -> TaskArrays:
        cols = [self.doc, self.a, self.b, self.home, self.server]
        if self.shards:
            extra = np.array(self.shards, dtype=np.int64)
            cols = [np.concatenate((c, extra[:, i])) for i, c in enumerate(cols)]
        return TaskArrays(*cols)

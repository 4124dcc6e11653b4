"""The vectorised engine of the CAD scheduler: the algorithm of
:func:`cadlib.scheduler.reference_greedy`, with each move's candidates scored in one numpy pass.

State: the chunks of the layout are the original tasks (arrays ``a``, ``b``, ``server`` change as
tasks shrink or move); shards cut off are appended to ``shards`` (they sit on receivers, which never
give work away, so they never move again). Per (server, doc) ``need`` is the end of the KV prefix the
server fetches (``max q_end`` of its tasks of the doc). ``owned(g, d, e)`` (tokens of ``[0, e)`` of
``d`` that rank ``g`` holds) is a binary search in the chunks sorted by ``(rank, doc, start)``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cost import causal_pairs, imbalance
from .shards import _rows, cut_shards


@dataclass
class TaskArrays:
    """Parallel int64 arrays of a placement, ``Plan.from_arrays``' input."""

    doc: np.ndarray
    q_start: np.ndarray
    q_end: np.ndarray
    home: np.ndarray
    server: np.ndarray


@dataclass
class Candidates:
    """One donor's candidate moves, one entry per (task, receiver): task index ``task``, its ``doc``,
    query range ``[a, b)`` and ``home``, the ``receiver`` and, for the KV accounting, the receiver's
    prefix end ``need_r`` and the donor's prefix end without this task ``other_s``."""

    task: np.ndarray
    doc: np.ndarray
    a: np.ndarray
    b: np.ndarray
    home: np.ndarray
    receiver: np.ndarray
    need_r: np.ndarray
    other_s: np.ndarray
    avail: np.ndarray | None = None


@dataclass
class DonorView:
    """A donor's live tasks (plan indices ``tasks`` and their fields), the donor's prefix end for the
    task's document without the task (``other``), the pairs of the task's smallest valid move
    (``min_pairs``), and the chunks of the task's document (``rep``: which task, ``chunk``, its
    ``holder`` rank or -1 when that rank is not a server)."""

    tasks: np.ndarray
    doc: np.ndarray
    a: np.ndarray
    b: np.ndarray
    home: np.ndarray
    other: np.ndarray | None
    min_pairs: np.ndarray
    rep: np.ndarray | None = None
    chunk: np.ndarray | None = None
    holder: np.ndarray | None = None


@dataclass
class Move:
    task: int
    receiver: int
    k: int
    pairs: int
    from_end: bool
    bytes: int


class Greedy:
    """``mode="bytes"``: ``schedule``'s priority (bytes per pair); ``mode="flops"``: ``equal_flops``."""

    def __init__(self, chunks: np.ndarray, n_docs: int, n_servers: int, tolerance: float, min_shard: int,
                 q_bytes: int, kv_bytes: int, mode: str):
        S = self.S = int(n_servers)
        self.n_docs, self.m, self.qb, self.kvb, self.mode = n_docs, int(min_shard), q_bytes, kv_bytes, mode
        self.chunks = chunks
        self.doc, self.a, self.b, self.home = (chunks[:, i].copy() for i in range(4))
        self.server = self.home % S
        self.load = np.bincount(self.server, weights=causal_pairs(self.a, self.b),
                                minlength=S).astype(np.int64)
        self.U = (1.0 + tolerance) * self.load.sum() / S
        self.imbalance_before = self.imbalance()
        self.prepared = False
        self.shards: list[tuple[int, int, int, int, int]] = []
        self.shard_servers: dict[int, set[int]] = {}          # doc -> servers given shards of it
        self.has_shard = np.zeros(n_docs, dtype=bool)
        by_srv = np.argsort(self.server, kind="stable")
        ptr = np.searchsorted(self.server[by_srv], np.arange(S + 1))
        self.live = {s: by_srv[ptr[s]:ptr[s + 1]] for s in np.flatnonzero(self.load > self.U).tolist()}
        self.stuck: set[int] = set()
        self.views: dict[int, DonorView] = {}
        self.n_moves = self.n_splits = 0
        self.moved_bytes = 0                                   # forward bytes added by the moves (exact)

    def prepare_from(self, other: "Greedy") -> None:
        """Take ``other``'s chunk index (same chunks and servers, not yet moved: its initial state)."""
        for name in ("by_doc", "doc_ptr", "holder_of", "big", "own_key", "own_grp", "own_a", "own_b",
                     "own_cum"):
            setattr(self, name, getattr(other, name))
        self.need_key, self.need_end = other.need_key, other.need_end
        self.need_over, self.doc_over = {}, np.zeros(self.n_docs, dtype=bool)
        self.prepared = True

    def prepare(self) -> None:
        """Index the chunks (only once there is a donor): per document its chunks (``by_doc`` order:
        their servers may change, their holders do not); for ``owned`` the chunks sorted by
        ``(rank, doc, start)`` with cumulative lengths; the prefix end ``need`` per (server, doc)."""
        self.prepared = True
        S, n_docs = self.S, self.n_docs
        self.by_doc = np.argsort(self.doc, kind="stable")
        self.doc_ptr = np.searchsorted(self.doc[self.by_doc], np.arange(n_docs + 1))
        holder = self.home[self.by_doc]
        self.holder_of = np.where(holder < S, holder, -1)
        # owned(g, d, e): chunks sorted by (rank, doc, start), cumulative lengths
        self.big = int(self.b.max(initial=0)) + 1
        o = np.lexsort((self.a, self.doc, self.home))
        self.own_key = (self.home[o] * n_docs + self.doc[o]) * self.big + self.a[o]
        self.own_grp = self.home[o] * n_docs + self.doc[o]
        self.own_a, self.own_b = self.a[o], self.b[o]
        self.own_cum = np.r_[0, np.cumsum(self.own_b - self.own_a)]
        # need at the start: sorted keys server * n_docs + doc and their max q_end; changes go to the
        # dict need_over (doc_over flags their documents)
        key = self.server * n_docs + self.doc
        o = np.argsort(key, kind="stable")
        k = key[o]
        first = np.flatnonzero(np.concatenate(([True], k[1:] != k[:-1]))) if k.size else k
        self.need_key = k[first]
        self.need_end = np.maximum.reduceat(self.b[o], first) if k.size else k
        self.need_over: dict[int, int] = {}
        self.doc_over = np.zeros(n_docs, dtype=bool)

    def need(self, g: np.ndarray, d: np.ndarray) -> np.ndarray:
        """The prefix end server ``g`` fetches of document ``d`` (0 if it serves none), elementwise."""
        key = g * self.n_docs + d
        if not self.need_key.size:
            return np.zeros_like(key)
        i = np.minimum(np.searchsorted(self.need_key, key), self.need_key.size - 1)
        out = np.where(self.need_key[i] == key, self.need_end[i], 0)
        if self.need_over:
            get = self.need_over.get
            for j in np.flatnonzero(self.doc_over[d]).tolist():
                out[j] = get(int(key[j]), out[j])
        return out

    # -- helpers ----------------------------------------------------------------------------------
    def imbalance(self) -> float:
        return imbalance(self.load)

    def reached(self) -> bool:
        return bool(np.all(self.load <= self.U))

    def owned(self, g: np.ndarray, d: np.ndarray, e: np.ndarray) -> np.ndarray:
        """Tokens of ``[0, e)`` of documents ``d`` held by ranks ``g`` (elementwise)."""
        grp = g * self.n_docs + d
        lo = np.searchsorted(self.own_grp, grp, side="left")
        j = np.searchsorted(self.own_key, grp * self.big + e, side="left") - 1   # last chunk starting < e
        ok = j >= lo
        j = np.maximum(j, 0)
        part = np.minimum(e, self.own_b[j]) - self.own_a[j]
        return np.where(ok, self.own_cum[j] - self.own_cum[lo] + part, 0)

    def kv(self, g, d, e):
        """KV tokens server ``g`` fetches to serve ``d`` up to ``e``: ``e - owned(g, d, e)``."""
        return e - self.owned(g, d, e)

    # -- one move ---------------------------------------------------------------------------------
    @staticmethod
    def other_ends(d: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Per task of one server (documents ``d``, ends ``b``), the server's prefix end for the document
        without this task: the largest ``b`` of its other tasks of that document (0 if none)."""
        o = np.lexsort((b, d))
        ds, bs = d[o], b[o]
        new_doc = np.concatenate(([True], ds[1:] != ds[:-1]))
        last = np.concatenate((ds[1:] != ds[:-1], [True]))
        top = np.repeat(bs[last], np.diff(np.concatenate(([0], np.flatnonzero(last) + 1))))
        second = np.where(new_doc, 0, np.concatenate(([0], bs[:-1])))
        other = np.empty_like(bs)
        other[o] = np.where(last, second, top)
        return other

    def donor_view(self, s: int) -> DonorView | None:
        """Donor ``s``'s tasks and what about them stays fixed until ``s`` itself moves (kept until
        then): per task its document, the donor's prefix end without it, the fewest pairs any valid
        move of it carries, and (bytes mode) the chunks of its document."""
        v = self.views.get(s)
        if v is not None:
            return v
        idx = self.live[s] = self.live[s][self.server[self.live[s]] == s]
        if not idx.size:
            return None
        d, a, b = self.doc[idx], self.a[idx], self.b[idx]
        other = self.other_ends(d, b) if self.mode == "bytes" else None
        e = np.where(b - a >= 2 * self.m, a + self.m, b)             # smallest valid move: m start tokens
        v = DonorView(tasks=idx, doc=d, a=a, b=b, home=self.home[idx], other=other,
                      min_pairs=(e * (e + 1) - a * (a + 1)) // 2)
        if self.mode == "bytes":
            lo, cnt = self.doc_ptr[d], self.doc_ptr[d + 1] - self.doc_ptr[d]
            v.rep = np.repeat(np.arange(idx.size), cnt)
            pos = lo[v.rep] + np.arange(v.rep.size) - np.repeat(np.cumsum(cnt) - cnt, cnt)
            v.chunk, v.holder = self.by_doc[pos], self.holder_of[pos]
        self.views[s] = v
        return v

    def candidates(self, s: int, g: int) -> Candidates | None:
        """Donor ``s``'s (task, receiver) pairs: receivers serving or holding part of the task's
        document, and the emptiest receiver ``g``; only receivers below ``U`` with room for the task's
        smallest valid move."""
        v = self.donor_view(s)
        if v is None:
            return None
        room = np.floor(self.U - self.load)
        if self.mode == "flops":
            task = np.flatnonzero(v.min_pairs <= room[g])
            recv = np.full(task.size, g)
            avail = None
        else:
            n = v.tasks.size
            extra_t, extra_r = [], []
            if self.shard_servers:
                for i in np.flatnonzero(self.has_shard[v.doc]).tolist():
                    for r in self.shard_servers[int(v.doc[i])]:
                        extra_t.append(i)
                        extra_r.append(r)
            srv = self.server[v.chunk]
            task = np.concatenate((v.rep, v.rep, np.arange(n), np.array(extra_t, dtype=np.int64)))
            recv = np.concatenate((srv, v.holder, np.full(n, g), np.array(extra_r, dtype=np.int64)))
            keep = (recv >= 0) & (recv != s)
            keep &= v.min_pairs[task] <= room[recv]                  # room for the smallest valid move
            mark = np.zeros((n, self.S), dtype=bool)                 # each (task, receiver) once, sorted
            mark[task[keep], recv[keep]] = True
            task, recv = np.nonzero(mark)
            # pairs of each task's document that donors could shed: sum over its chunks on donors of
            # min(pairs, the donor's excess)
            ca, cb = self.a[v.chunk], self.b[v.chunk]
            ex = np.maximum(self.load[srv] - self.U, 0)
            avail = np.bincount(v.rep, weights=np.minimum(ex, (cb * (cb + 1) - ca * (ca + 1)) // 2),
                                minlength=n)[task]
        if not task.size:
            return None
        dd = v.doc[task]
        need_r = self.need(recv, dd)
        return Candidates(task=v.tasks[task], doc=dd, a=v.a[task], b=v.b[task], home=v.home[task],
                          receiver=recv, need_r=need_r, other_s=v.other[task], avail=avail)

    def best_move(self, s: int) -> Move | None:
        """Donor ``s``'s lowest-priority move (``reference_greedy``'s formula, vectorised)."""
        recv = self.load < self.U
        if not recv.any():
            return None
        g = int(np.argmax(np.where(recv, self.U - self.load, -np.inf)))
        if self.mode == "flops":
            return self.largest_move(s, g)
        c = self.candidates(s, g)
        if c is None:
            return None
        room = self.U - self.load[c.receiver]
        x = np.maximum(np.ceil(np.minimum(self.load[s] - self.U, room)), 1).astype(np.int64)
        y = np.floor(room).astype(np.int64)
        k, p = cut_shards(c.a, c.b, x, y, self.m)                 # [2, N]: end row, start row
        valid = (k > 0) & (p <= y)
        whole = k == c.b - c.a
        if self.mode == "flops":
            valid[1] = False                                      # end shards only, largest first
            byt = np.zeros_like(k)
            prio = -p.astype(np.float64)
        else:
            e = _rows(c.b, c.a + k[1])                            # the shard's KV prefix end
            left = _rows(c.b - k[0], c.b)                         # end of what s keeps of the task
            left *= ~whole
            # one batched kv(): receiver after (2 sides), before; donor after (2 sides), before
            N = c.task.size
            g = np.concatenate((c.receiver, c.receiver, c.receiver, np.full(3 * N, s)))
            ends = np.concatenate((np.maximum(c.need_r, e).ravel(), c.need_r,
                                   np.maximum(c.other_s, left).ravel(), np.maximum(c.other_s, c.b)))
            kvs = self.kv(g, np.concatenate((c.doc,) * 6), ends)
            r_after, r_before = kvs[:2 * N].reshape(2, N), kvs[2 * N:3 * N]
            s_after, s_before = kvs[3 * N:5 * N].reshape(2, N), kvs[5 * N:]
            kv_r = r_after - r_before                             # [end, start] x N
            kv_s = s_after - s_before
            q = (c.home != c.receiver).astype(np.int64) - (c.home != s)
            byt = self.qb * k * q + self.kvb * (kv_r + kv_s)
            bundle = np.maximum(np.minimum(room, c.avail), p)
            cost = np.maximum(byt - self.kvb * kv_r + self.kvb * kv_r * p / bundle, np.minimum(byt, 0))
            prio = cost / np.maximum(p, 1)
            excess = self.load[s] - self.U
            clears = valid & (p >= excess)
            if clears.any():                                      # a partial move: + the cheapest clearing
                prio = np.where(clears, prio, (cost + cost[clears].min()) / excess)
        prio = np.where(valid, prio, np.inf).ravel()
        best = np.flatnonzero(prio == prio.min())
        if not np.isfinite(prio[best[0]]):
            return None
        if best.size > 1:                                         # ties: larger P, task, receiver, end
            N = c.task.size
            side, col = np.divmod(best, N)
            best = best[np.lexsort((side, c.receiver[col], c.task[col], -p.ravel()[best]))]
        sd, col = divmod(int(best[0]), c.task.size)
        return Move(task=int(c.task[col]), receiver=int(c.receiver[col]), k=int(k[sd, col]),
                    pairs=int(p[sd, col]), from_end=sd == 0, bytes=int(byt[sd, col]))

    def move_bytes(self, s: int, mv: Move) -> int:
        """The forward bytes a move adds (``reference_greedy``'s ``bytes``), for one move."""
        t, r, k = mv.task, mv.receiver, mv.k
        d, a, b, h = int(self.doc[t]), int(self.a[t]), int(self.b[t]), int(self.home[t])
        live = self.live[s]
        mine = live[(self.doc[live] == d) & (self.server[live] == s) & (live != t)]
        other = int(self.b[mine].max()) if mine.size else 0
        need_r = int(self.need(np.array([r]), np.array([d]))[0])
        e = b if mv.from_end else a + k
        left = 0 if k == b - a else (b - k if mv.from_end else b)
        kv = self.kv(np.array([r, r, s, s]), np.full(4, d),
                     np.array([max(need_r, e), need_r, max(other, left), max(other, b)])).tolist()
        return self.qb * k * (int(h != r) - int(h != s)) + self.kvb * (kv[0] - kv[1] + kv[2] - kv[3])

    def largest_move(self, s: int, g: int) -> Move | None:
        """``equal_flops``: donor ``s``'s largest valid end shard to the emptiest receiver ``g`` (ties:
        the first task)."""
        v = self.donor_view(s)
        if v is None:
            return None
        room = self.U - self.load[g]
        y = int(np.floor(room))
        ok = np.flatnonzero(v.min_pairs <= y)
        if not ok.size:
            return None
        x = max(int(np.ceil(min(self.load[s] - self.U, room))), 1)
        k, p = cut_shards(v.a[ok], v.b[ok], x, y, self.m)
        pe = np.where((k[0] > 0) & (p[0] <= y), p[0], -1)
        i = int(np.argmax(pe))
        if pe[i] < 0:
            return None
        return Move(task=int(v.tasks[ok[i]]), receiver=g, k=int(k[0, i]), pairs=int(p[0, i]), from_end=True,
                    bytes=0)

    def apply(self, s: int, mv: Move) -> None:
        t, r, k = mv.task, mv.receiver, mv.k
        d, a, b, h = int(self.doc[t]), int(self.a[t]), int(self.b[t]), int(self.home[t])
        self.moved_bytes += mv.bytes if self.mode == "bytes" else self.move_bytes(s, mv)
        if k == b - a:
            self.server[t] = r
            e = b
        else:
            lo, hi = (b - k, b) if mv.from_end else (a, a + k)
            self.shards.append((d, lo, hi, h, r))
            self.shard_servers.setdefault(d, set()).add(r)
            self.has_shard[d] = True
            if mv.from_end:
                self.b[t] = b - k
            else:
                self.a[t] = a + k
            e = hi
            self.n_splits += 1
        rk, sk = r * self.n_docs + d, s * self.n_docs + d
        self.need_over[rk] = max(int(self.need(np.array([r]), np.array([d]))[0]), e)
        self.doc_over[d] = True
        mine = self.live[s][(self.doc[self.live[s]] == d) & (self.server[self.live[s]] == s)]
        if mine.size:
            self.need_over[sk] = int(self.b[mine].max())
        else:
            self.need_over[sk] = 0
        self.views.pop(s, None)                                # its tasks changed
        self.load[s] -= mv.pairs
        self.load[r] += mv.pairs
        self.n_moves += 1
        if self.load[s] < self.U:
            self.stuck.clear()                                 # a new receiver: retry stuck donors

    def run(self) -> bool:
        """Move until no donor can: the most loaded donor first. Returns ``reached``."""
        if not self.prepared and np.any(self.load > self.U):
            self.prepare()
        while True:
            donors = np.flatnonzero(self.load > self.U)
            if self.stuck:
                donors = donors[~np.isin(donors, list(self.stuck))]
            if not donors.size:
                return self.reached()
            s = int(donors[np.argmax(self.load[donors])])
            mv = self.best_move(s)
            if mv is None:
                self.stuck.add(s)
            else:
                self.apply(s, mv)

    # -- result -----------------------------------------------------------------------------------
    def task_arrays(self) -> TaskArrays:
        cols = [self.doc, self.a, self.b, self.home, self.server]
        if self.shards:
            extra = np.array(self.shards, dtype=np.int64)
            cols = [np.r_[c, extra[:, i]] for i, c in enumerate(cols)]
        return TaskArrays(*cols)

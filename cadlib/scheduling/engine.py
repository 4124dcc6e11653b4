"""The vectorised engine of the CAD scheduler: the algorithm of
:func:`cadlib.scheduling.greedy.reference_greedy`, with each move's candidates scored in one numpy pass.

State: the chunks of the layout are the original tasks (arrays ``a``, ``b``, ``server`` change as
tasks shrink or move); shards cut off are appended to ``shards`` (they sit on receivers, which never
give work away, so they never move again). What never changes (the chunks of each document, what each
rank holds, the colocated prefix ends) is in :class:`cadlib.scheduling.index.ChunkIndex`; per (server,
doc) the prefix end ``need`` the server fetches (``max q_end`` of its tasks of the doc) is the index's
colocated value, overridden (``over_key``, ``over_end``) once a move changes it.

A donor's tasks change only when it moves, so what the candidates of its tasks need from them (a
:class:`cadlib.scheduling.views.DonorView`) is built for every donor at once when the greedy starts and
updated after it has moved (:mod:`cadlib.scheduling.views`). Each move's exact forward bytes are added
to ``moved_bytes`` as it is made. The bytes-blind ``equal_flops`` is not computed here but by
:class:`cadlib.scheduling.water_fill.WaterFill`, from a greedy's state before its moves.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..core.cost import imbalance
from .index import ChunkIndex
from .shards import cut_near, end_cut
from .views import Candidates, DonorView, Views


@dataclass
class TaskArrays:
    """Parallel int64 arrays of a placement, ``Plan.from_arrays``' input."""

    doc: np.ndarray
    q_start: np.ndarray
    q_end: np.ndarray
    home: np.ndarray
    server: np.ndarray


@dataclass
class Move:
    task: int
    receiver: int
    k: int
    pairs: int
    from_end: bool
    bytes: int
    at: int = -1                  # the task's place in the donor's view


class Greedy(Views):
    """``schedule``'s greedy: each move the most loaded donor makes its lowest-priority move (bytes per
    pair, :func:`cadlib.scheduling.greedy.reference_greedy`)."""

    def __init__(self, chunks: np.ndarray, n_docs: int, n_servers: int, tolerance: float, min_shard: int,
                 q_bytes: int, kv_bytes: int):
        S = self.S = int(n_servers)
        self.n_docs, self.m, self.qb, self.kvb = n_docs, int(min_shard), q_bytes, kv_bytes
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
        self.prepared = False
        self.shards: list[tuple[int, int, int, int, int]] = []
        self.shard_servers: dict[int, set[int]] = {}          # doc -> servers given shards of it
        self.has_shard = np.zeros(n_docs, dtype=bool)
        self.live: dict[int, np.ndarray] = {}
        self.stuck: set[int] = set()
        self.views: dict[int, DonorView] = {}
        self.n_moves = self.n_splits = 0
        self.moved_bytes = 0                                   # forward bytes added by the moves (exact)

    def chunk_index(self) -> ChunkIndex:
        """The chunks' static index, built on first use (before any move: the servers are the
        colocated ones)."""
        if self.ix is None:
            c = self.chunks                                    # (a, b as they are before any move)
            self.ix = ChunkIndex(self.doc, c[:, 1], c[:, 2], self.home, self.server, self.n_docs, self.S)
        return self.ix

    def prepare(self) -> None:
        """Index the chunks (only once there is a donor) and build every donor's view."""
        self.chunk_index()
        if self.server.base is not None:
            self.server = self.server.copy()                   # servers change from now on
        self.over_key = self.over_end = np.zeros(0, dtype=np.int64)    # changed prefix ends
        self.need_at: dict[tuple[int, int], int] = {}          # need1's answers
        donors = np.flatnonzero(self.load > self.U).tolist()
        p = self.srv_ptr
        self.live = {s: (np.arange(p[s], p[s + 1]) if self.by_srv is None else self.by_srv[p[s]:p[s + 1]])
                     for s in donors}
        self.build_views(donors)
        self.prepared = True

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
        n, nr = v.tasks.size, v.rep.size
        if v.candidates is None:
            v.candidates = self.candidate_rows(s, v)
        C = v.candidates                                          # receivers: chunk servers, the rest, g
        recv = C.receiver
        recv[:nr] = self.server[v.chunk]                          # (chunks move)
        recv[-n:] = g
        srv = recv[:nr]
        room = U - load[recv]
        yf = np.floor(room)
        keep = (recv != s) & (C.min_pairs <= yf)                  # room for the smallest valid move
        excess = load[s] - U
        if excess > yf[-1]:                                       # no move clears: a bound prunes rows
            self.prune(v, C, keep, excess, room[-1])
        C = C.where(keep)                                         # (a pair twice scores twice: same move)
        if not len(C):
            return None
        col, recv, d, a, b, h, other, kv_now = C.task, C.receiver, C.doc, C.a, C.b, C.home, C.other, C.kv_now
        # pairs of each task's document that donors could shed: sum over its chunks on donors of
        # min(pairs, the donor's excess)
        avail = np.bincount(v.rep, weights=np.minimum(np.maximum(load[srv] - U, 0), self.pairs[v.chunk]),
                            minlength=n)
        need_r = self.need(recv, d)
        room, y = room[keep], yf[keep].astype(np.int64)
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
        return Move(task=int(v.tasks[col[c]]), receiver=int(recv[c]), k=int(k[sd, c]),
                    pairs=int(p[sd, c]), from_end=sd == 0, bytes=int(byt[sd, c]), at=int(col[c]))

    def prune(self, v: DonorView, C: Candidates, keep: np.ndarray, excess: float, room: float) -> None:
        """Drop from ``keep`` the rows that cannot be the best move, when no move can clear the
        ``excess`` (a move carries at most the floor of its receiver's room, and the emptiest
        receiver's, ``room``, is the largest), so that every priority is ``cost / P``. A move of ``k``
        tokens of a task ending at ``b`` carries at most ``k b`` pairs; served off its home, it costs
        at least ``q_bytes k`` (less the bundle's promise, which only discounts the receiver's KV, and
        the donor's KV saving, 0 when the donor fetches no KV for the task), so at least ``q_bytes / b``
        per pair. The largest task's end shard to the emptiest receiver (``k0`` tokens, ``p0`` pairs,
        its end ``b0``) costs at most ``q_bytes k0 + kv_bytes b0``: rows of such tasks with
        ``q_bytes / b`` above that per pair are worse than it (that move's own row is never one: its
        ``p0 <= k0 b0``)."""
        n = v.tasks.size
        i = int(C.pairs[-n:].argmax())                            # the task with the most pairs
        x, y = max(math.ceil(min(excess, room)), 1), math.floor(room)    # as best_move's
        k0, p0 = end_cut(v.a.item(i), v.b.item(i), x, y, self.m)
        if p0 > 0:
            bmax = (self.qb * p0 - 1) // (self.qb * k0 + self.kvb * v.b.item(i))   # q_bytes / b > bound
            keep &= C.cheap > bmax

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
                ix = self.ix
                for g in self.server[ix.by_doc[ix.doc_ptr[d]:ix.doc_ptr[d + 1]]].tolist():
                    if g in self.views:
                        self.views[g].candidates = None
            self.has_shard[d] = True
            self.pairs[t] -= mv.pairs
            if mv.from_end:
                self.b[t] = b = b - k
            else:
                self.a[t] = a = a + k
            e = hi
            self.n_splits += 1
        self.load[s] -= mv.pairs
        self.load[r] += mv.pairs
        self.n_moves += 1
        self.moved_bytes += mv.bytes
        v = self.views.pop(s)
        sel = np.flatnonzero(v.doc == d)                       # s's tasks of d, and their ends after the move
        ends = v.b[sel].tolist()
        sel = sel.tolist()
        j = sel.index(i)
        if whole:
            del sel[j], ends[j]
        else:
            ends[j] = b
        self.set_need(r, d, max(self.need1(r, d), e))
        self.set_need(s, d, max(ends, default=0))
        if self.load[s] > self.U:                              # still a donor: its view, updated
            self.views[s] = self.shrink_view(s, v, i, whole, d, a, b, (sel, ends))
        if self.load[s] < self.U:
            self.stuck.clear()                                 # a new receiver: retry stuck donors

    def run(self) -> bool:
        """Move until no donor can: the most loaded donor first (a donor with no move waits for a new
        receiver). Returns ``reached``."""
        load, U = self.load, self.U
        if not self.prepared and np.any(load > U):
            self.prepare()
        while True:
            live = load
            if self.stuck:                                     # stuck donors wait for a new receiver
                live = load.copy()
                live[list(self.stuck)] = -1
            s = int(live.argmax())                             # the most loaded donor (first on ties)
            if not live[s] > U:
                break
            mv = self.best_move(s)
            if mv is None:
                self.stuck.add(s)
            else:
                self.apply(s, mv)
        return self.reached()

    def task_arrays(self) -> TaskArrays:
        cols = [self.doc, self.a, self.b, self.home, self.server]
        if self.shards:
            extra = np.array(self.shards, dtype=np.int64)
            cols = [np.concatenate((c, extra[:, i])) for i, c in enumerate(cols)]
        return TaskArrays(*cols)

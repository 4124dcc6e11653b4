"""The rollout of the CAD greedy (:mod:`cadlib.scheduler_engine`): before a donor commits a move that
leaves part of its excess, it plays out the rest.

The greedy scores a move one step ahead; a donor that needs several moves can spend its cheapest
material first (start shards, small tasks) and be left with a tail that costs more to move, or fits
no room. So when the greedy's move ``mv`` is partial and differs from the **peeling** move ``mp``
(``equal_flops``' move for this donor: its largest valid end shard to the emptiest receiver), both
are played out for this donor alone, against the receivers as they are: ``mv`` then peeling, and
peeling from ``mp``, each until the donor's excess is cleared or it has no move. The greedy commits
``mp`` if its rollout is strictly better: it clears the excess and the other does not, or it leaves
less excess, or the same and it moves fewer bytes; else ``mv``. A rollout is a handful of scalar
steps (a peeling step cuts one to three tasks in integer arithmetic, :func:`cadlib.scheduler_fill.end_cut`),
so it costs ~10 µs a step, not an engine pass.

Peeling is the base policy: a move is only replaced by peeling when peeling from here does better,
so for the donor, against the same receivers, the greedy with its rollout never does worse than
peeling alone (the rollout argument: each committed move keeps the best of the played-out totals).
"""
from __future__ import annotations

import heapq
import math
from bisect import insort

import numpy as np

from .scheduler_fill import end_cut


class Rollout:
    """Rollouts for the greedy ``g`` (a :class:`cadlib.scheduler_engine.Greedy` in bytes mode whose
    index is built). ``docs`` caches per document what the layout says and never changes: per rank the
    token ranges it holds (sorted), per server the prefix end it fetches in the colocated placement."""

    def __init__(self, g):
        self.g = g
        self.docs: dict[int, tuple[dict[int, list[tuple[int, int]]], dict[int, int]]] = {}
        self.n_rollouts = 0

    def doc(self, d: int):
        """``(held, need0)`` of document ``d``."""
        out = self.docs.get(d)
        if out is None:
            g, ix = self.g, self.g.ix
            c = ix.by_doc[ix.doc_ptr[d]:ix.doc_ptr[d + 1]]
            held: dict[int, list[tuple[int, int]]] = {}
            need0: dict[int, int] = {}
            for h, a, b in zip(g.home[c].tolist(), g.chunks[c, 1].tolist(), g.chunks[c, 2].tolist()):
                held.setdefault(h, []).append((a, b))
                srv = h % g.S
                if b > need0.get(srv, 0):
                    need0[srv] = b
            for r in held.values():
                r.sort()
            out = self.docs[d] = (held, need0)
        return out

    def kv(self, r: int, d: int, e: int) -> int:
        """KV tokens server ``r`` fetches to serve document ``d`` up to ``e``."""
        own = 0
        for lo, hi in self.doc(d)[0].get(r, ()):
            if lo >= e:
                break
            own += (hi if hi < e else e) - lo
        return e - own

    def decide(self, s: int, mv, mp):
        """The move donor ``s`` commits: its greedy move ``mv`` (partial) or its peeling move ``mp``
        (None when it has none)."""
        if mp is None or (mp.at, mp.receiver, mp.k, mp.from_end) == (mv.at, mv.receiver, mv.k, mv.from_end):
            return mv
        self.n_rollouts += 1
        base = _Donor(self, s, self.g.views[s])
        p, q = base.copy(), base
        p.apply(mp.at, mp.receiver, mp.k, mp.pairs, True)
        q.apply(mv.at, mv.receiver, mv.k, mv.pairs, mv.from_end)
        return mp if p.finish() < q.finish() else mv


class _Donor:
    """One donor's rollout state: its tasks (lists), the servers' loads (a heap of ``(load,
    server)`` with the current load per server in ``cur``), the prefix ends the moves set."""

    __slots__ = ("ro", "s", "v", "a", "b", "doc", "home", "T", "order", "alive", "cur", "heap",
                 "need", "excess", "bytes", "same")

    def __init__(self, ro: Rollout, s: int, v):
        g = ro.g
        self.ro, self.s, self.v = ro, s, v
        self.a, self.b = v.a.tolist(), v.b.tolist()
        self.doc, self.home = v.doc.tolist(), v.home.tolist()
        T = g.pairs[v.tasks]
        self.T = T.tolist()
        self.order = np.argsort(-T, kind="stable").tolist()     # most pairs first, ties: first task
        self.alive = [True] * len(self.a)
        loads = g.load.tolist()
        self.cur = dict(enumerate(loads))
        self.heap = list(zip(loads, range(len(loads))))
        heapq.heapify(self.heap)
        self.need: dict[tuple[int, int], int] = {}
        self.excess = loads[s] - g.U
        self.bytes = 0
        self.same: dict[int, list[int]] = {}                    # doc -> its tasks, where s has several
        for i in np.flatnonzero(v.other > 0).tolist():
            self.same.setdefault(self.doc[i], []).append(i)

    def copy(self) -> "_Donor":
        c = _Donor.__new__(_Donor)
        c.ro, c.s, c.v, c.doc, c.home, c.same = self.ro, self.s, self.v, self.doc, self.home, self.same
        c.a, c.b, c.T, c.order, c.alive = self.a[:], self.b[:], self.T[:], self.order[:], self.alive[:]
        c.cur, c.heap, c.need = dict(self.cur), self.heap[:], dict(self.need)
        c.excess, c.bytes = self.excess, self.bytes
        return c

    def need_of(self, r: int, d: int) -> int:
        """The prefix end of ``d`` server ``r`` fetches: set by this rollout, by the greedy's moves, or
        the colocated one."""
        e = self.need.get((r, d))
        if e is None:
            e = self.ro.g.need_at.get((r, d))
            if e is None:
                e = self.ro.doc(d)[1].get(r, 0)
            self.need[(r, d)] = e
        return e

    def apply(self, i: int, r: int, k: int, pairs: int, from_end: bool) -> int:
        """Move ``k`` tokens of task ``i`` to ``r``; returns the move's bytes (forward, exact)."""
        g, ro, s = self.ro.g, self.ro, self.s
        a, b, d, h = self.a[i], self.b[i], self.doc[i], self.home[i]
        oth = 0                                                 # the prefix end of s's other tasks of d
        for j in self.same.get(d, ()):
            if j != i and self.alive[j] and self.b[j] > oth:
                oth = self.b[j]
        whole = k == b - a
        e = b if from_end else a + k
        left = 0 if whole else (b - k if from_end else b)
        nr = self.need_of(r, d)
        ne = nr if nr > e else e
        kv_r = ro.kv(r, d, ne) - ro.kv(r, d, nr)
        kv_s = ro.kv(s, d, max(oth, left)) - ro.kv(s, d, max(oth, b))
        byt = g.qb * k * ((h != r) - (h != s)) + g.kvb * (kv_r + kv_s)
        self.need[(r, d)] = ne
        T = self.T
        self.order.remove(i)
        if whole:
            self.alive[i] = False
        else:
            if from_end:
                self.b[i] = b - k
            else:
                self.a[i] = a + k
            T[i] -= pairs
            insort(self.order, i, key=lambda j: (-T[j], j))
        self.excess -= pairs
        load = self.cur[r] + pairs
        self.cur[r] = load
        heapq.heappush(self.heap, (load, r))
        self.bytes += byt
        return byt

    def peel_step(self) -> bool:
        """Apply the peeling move (the largest valid end shard to the emptiest server, ties: the first
        task); False when there is none."""
        U, heap, cur = self.ro.g.U, self.heap, self.cur
        while heap[0][0] != cur[heap[0][1]]:                 # stale entries
            heapq.heappop(heap)
        load, r = heap[0]
        if load >= U or self.excess <= 0:
            return False
        room = U - load
        y, x, m = math.floor(room), max(math.ceil(min(self.excess, room)), 1), self.ro.g.m
        best, T = None, self.T
        for i in self.order:
            if best is not None and T[i] < best[0]:
                break
            k, p = end_cut(self.a[i], self.b[i], x, y, m)
            if p >= 0 and (best is None or p > best[0] or (p == best[0] and i < best[1])):
                best = (p, i, k)
        if best is None:
            return False
        p, i, k = best
        self.apply(i, r, k, p, True)
        return True

    def finish(self) -> tuple[bool, float, int]:
        """Peel until the excess is cleared or there is no move: ``(not cleared, excess left,
        bytes)``."""
        while self.excess > 0 and self.peel_step():
            pass
        ex = max(self.excess, 0.0)
        return ex > 0, ex, self.bytes

"""The rollout of the CAD greedy (:mod:`cadlib.scheduling.engine`): before a donor commits a move, it
plays out the rest.

The greedy scores a move one step ahead; a donor that needs several moves can spend its cheapest
material first (start shards, small tasks) and be left with a tail that costs more to move, or fits
no room. So when the greedy's move ``mv`` differs from the **peeling** move ``mp`` (``equal_flops``'
move for this donor: its largest valid end shard to the emptiest receiver), both are played out for
this donor alone, against the receivers as they are: ``mv`` then peeling, and ``mp`` then peeling,
each until the donor's excess is cleared or it has no move. The greedy commits ``mp`` if its play-out
is strictly better: it clears the excess and the other does not, or it leaves less excess, or the same
and it moves fewer bytes; else ``mv``. A play-out is a handful of scalar steps (a peeling step cuts
one to three tasks in integer arithmetic, :func:`cadlib.scheduling.shards.end_cut`), ~3 µs each, not an engine
pass; a move that clears the excess needs none.

Peeling is the rollout's base policy. Against unchanged receivers, the donor ends no worse than
peeling from where it started: each committed move's play-out is at most the peeling one from there,
and when ``mp`` is committed, peeling from the next state is the rest of that same play-out.

Other donors' moves change the receivers in between: they take the rooms the donor's play-out counted
on. So when 2 to ``MULTI_DONORS`` servers have excess, each move is also played out for **every**
donor (the move, then peeling, the most loaded donor first, one with no move waiting for a new
receiver: ``equal_flops`` from there), and that play-out's ``(not cleared, the largest excess left)``
leads the comparison, before the donor's own ``(not cleared, excess left, bytes)``. Its bytes are not
compared here: the other donors' peeling moves are not the greedy's, and comparing them made the grid's
plans worse (72 of 432 cases more bytes, 57 fewer). They are a complete, feasible continuation,
though: when the move not taken ends better in it than the committed move does, :func:`decide` returns
it, and the fortification (:mod:`cadlib.scheduling.fortify`) goes back to it if the greedy's own
continuation ends worse. ``MULTI_DONORS`` bounds the cost: such a play-out peels every donor (~30
steps at 64 servers); with 8, 64 x 128K ``prolong`` took 8.2 -> 14.6 ms, with 4 it runs 1-3 times per
plan at 64 servers. A donor's lists are kept (``Greedy.rollout_donors``) until it moves.
"""
from __future__ import annotations

import heapq
import math

import numpy as np

from .shards import end_cut

MULTI_DONORS = 4          # play out every donor when 2 to MULTI_DONORS servers have excess


def decide(g, s: int, mv, mp):
    """The move donor ``s`` of the greedy ``g`` (a :class:`cadlib.scheduling.engine.Greedy`) commits,
    its greedy move ``mv`` or its peeling move ``mp`` (None when it has none), and
    ``(the other move, its every-donor play-out)`` when every donor was played out and the other move's
    play-out, ``(not cleared, the largest excess left, the total excess left, bytes)``, is the lower
    (else None)."""
    if mp is None or (mp.at, mp.receiver, mp.k, mp.from_end) == (mv.at, mv.receiver, mv.k, mv.from_end):
        return mv, None
    g.n_rollouts += 1
    donors = [s]                                               # (every donor has a view)
    if 1 < len(g.views) <= MULTI_DONORS:
        donors = np.flatnonzero(g.load > g.U).tolist()
    every = 1 < len(donors) <= MULTI_DONORS                   # play out every donor, not s alone
    load, base, key, full = int(g.load[s]), {}, [], []
    for m in (mp, mv):
        score = ()
        for many in (True, False) if every else (False,):
            if not many and load - m.pairs <= g.U:             # clears: nothing left to play out
                score += (False, 0.0, 0.0, m.bytes)
                continue
            if many not in base:
                base[many] = _Play.start(g, s, donors if many else [s])
            p = base[many].copy()
            p.donors[s].apply(p, m.at, m.receiver, m.k, m.pairs, m.from_end)
            f = p.finish()
            if many:
                full.append(f)
            score += f[:2] if many else f
        key.append(score)
    i = 0 if key[0] < key[1] else 1                            # the committed move: mp (0) or mv (1)
    if every and full[1 - i] < full[i]:
        return (mp, mv)[i], ((mp, mv)[1 - i], full[1 - i])
    return (mp, mv)[i], None


def _doc(g, d: int):
    """What the layout says of document ``d`` and never changes, cached in ``g.doc_cache``: per rank
    the token ranges it holds (sorted), per server the prefix end it fetches when colocated."""
    out = g.doc_cache.get(d)
    if out is None:
        ix = g.ix
        c = ix.by_doc[ix.doc_ptr[d]:ix.doc_ptr[d + 1]]
        held: dict[int, list[tuple[int, int]]] = {}
        need0: dict[int, int] = {}
        for h, a, b in zip(g.home[c].tolist(), g.chunks[c, 1].tolist(), g.chunks[c, 2].tolist()):
            held.setdefault(h, []).append((a, b))
            if b > need0.get(h % g.S, 0):
                need0[h % g.S] = b
        for r in held.values():
            r.sort()
        out = g.doc_cache[d] = (held, need0)
    return out


class _Play:
    """A play-out's state: its donors (:class:`_Donor`), the servers' loads (``loads`` as the greedy
    has them, in ascending order ``by_load``, shared; the ones the play-out changed in ``cur``, also on
    a heap of ``(load, server)``: the emptiest server is the first of either that the play-out did not
    change, or the heap's top), the prefix ends the moves set, the bytes they moved."""

    __slots__ = ("g", "donors", "many", "loads", "by_load", "next", "cur", "heap", "need", "bytes")

    @classmethod
    def start(cls, g, s: int, donors: list[int]) -> "_Play":
        """Donors ``donors`` (``s`` among them) of the greedy ``g`` as they are now."""
        p = cls.__new__(cls)
        p.g, p.loads = g, g.load.tolist()
        p.by_load, p.next = np.argsort(g.load, kind="stable").tolist(), 0
        p.cur, p.heap, p.need, p.bytes = {}, [], {}, 0
        p.donors, p.many = {}, len(donors) > 1
        for i in donors:
            if i not in g.views:
                g.build_views([i])
            d = g.rollout_donors.get(i)                         # a donor's lists, until it moves
            if d is None:
                d = g.rollout_donors[i] = _Donor(i, g.views[i], p.loads[i])
            p.donors[i] = d
        return p

    def copy(self) -> "_Play":
        c = _Play.__new__(_Play)
        c.g, c.many, c.loads, c.by_load, c.next = self.g, self.many, self.loads, self.by_load, self.next
        c.cur, c.heap, c.need, c.bytes = dict(self.cur), self.heap[:], dict(self.need), self.bytes
        c.donors = {i: d.copy() for i, d in self.donors.items()}
        return c

    def emptiest(self) -> tuple[int, int]:
        """``(load, server)`` of the emptiest server (ties: the first)."""
        heap, cur, by_load = self.heap, self.cur, self.by_load
        while heap and heap[0][0] != cur[heap[0][1]]:         # stale entries
            heapq.heappop(heap)
        while self.next < len(by_load) and by_load[self.next] in cur:
            self.next += 1
        first = (self.loads[by_load[self.next]], by_load[self.next]) if self.next < len(by_load) else None
        return heap[0] if heap and (first is None or heap[0] < first) else first

    def finish(self) -> tuple[bool, float, float, int]:
        """Peel, the most loaded donor first (one with no move waits for a new receiver), until no donor
        has excess or a move: ``(not cleared, the largest excess left, the total excess left, bytes)``
        (the total summed in server order)."""
        U, donors, wait = self.g.U, self.donors, []
        if not self.many:                                       # one donor: peel it
            d, = donors.values()
            while d.load > U and d.peel_step(self):
                pass
            ex = max(d.load - U, 0.0)
            return ex > 0, ex, ex, self.bytes
        heap = [(-d.load, i) for i, d in donors.items() if d.load > U]     # the most loaded first
        heapq.heapify(heap)
        while heap:
            load, i = heapq.heappop(heap)
            d = donors[i]
            if -load != d.load:                                 # stale
                continue
            if not d.peel_step(self):
                wait.append(i)
            elif d.load > U:
                heapq.heappush(heap, (-d.load, i))
            elif d.load < U and wait:                           # a new receiver: the waiting retry
                for j in wait:
                    heapq.heappush(heap, (-donors[j].load, j))
                wait = []
        ex = max(max(d.load for d in donors.values()) - U, 0.0)
        return ex > 0, ex, sum(max(d.load - U, 0.0) for d in donors.values()), self.bytes


class _Donor:
    """One donor's tasks in a play-out (lists) and its load. (No reference to the greedy: the greedy
    keeps these, and a reference cycle would keep its arrays until a garbage collection.)"""

    __slots__ = ("s", "a", "b", "doc", "home", "T", "order", "alive", "load", "same")

    def __init__(self, s: int, v, load: int):
        self.s = s
        self.a, self.b = v.a.tolist(), v.b.tolist()
        self.doc, self.home = v.doc.tolist(), v.home.tolist()
        self.T = v.pairs.tolist()
        self.order = np.argsort(-v.pairs, kind="stable").tolist()   # most pairs first, ties: first task
        self.alive = [True] * len(self.a)
        self.load = load                                        # the donor's (an integer: exact)
        self.same: dict[int, list[int]] = {}                    # doc -> its tasks, where s has several
        for i in np.flatnonzero(v.other > 0).tolist():
            self.same.setdefault(self.doc[i], []).append(i)

    def copy(self) -> "_Donor":
        c = _Donor.__new__(_Donor)
        c.s, c.doc, c.home, c.same = self.s, self.doc, self.home, self.same
        c.a, c.b, c.T, c.order, c.alive = self.a[:], self.b[:], self.T[:], self.order[:], self.alive[:]
        c.load = self.load
        return c

    def apply(self, play: _Play, i: int, r: int, k: int, pairs: int, from_end: bool) -> int:
        """Move ``k`` tokens of task ``i`` to ``r`` (the engine's ``Greedy.apply``, in ``play``);
        returns the move's forward bytes, exact (as ``reference_greedy`` computes them)."""
        g, s, need = play.g, self.s, play.need
        a, b, d, h = self.a[i], self.b[i], self.doc[i], self.home[i]
        oth = 0                                                 # the prefix end of s's other tasks of d
        if d in self.same:
            for j in self.same[d]:
                if j != i and self.alive[j] and self.b[j] > oth:
                    oth = self.b[j]
        whole = k == b - a
        e = b if from_end else a + k
        left = 0 if whole else (b - k if from_end else b)
        held, need0 = _doc(g, d)
        nr = need.get((r, d))                                   # r's prefix end: set here, by the greedy,
        if nr is None:                                          # or colocated
            nr = g.need_at.get((r, d))
            if nr is None:
                nr = need0.get(r, 0)
        ne = nr if nr > e else e
        hr, hs = held.get(r), held.get(s)
        s0, s1 = max(oth, b), max(oth, left)                    # s's prefix end before and after
        kv = ne - nr - _owned(hr, ne) + _owned(hr, nr) + s1 - s0 - _owned(hs, s1) + _owned(hs, s0)
        byt = g.qb * k * ((h != r) - (h != s)) + g.kvb * kv
        need[(r, d)] = ne
        need[(s, d)] = s1
        order, T = self.order, self.T
        at = order.index(i)
        if whole:
            self.alive[i] = False
            del order[at]
        else:
            if from_end:
                self.b[i] = b - k
            else:
                self.a[i] = a + k
            t = T[i] = T[i] - pairs                             # fewer pairs: later in the order
            q, n = at + 1, len(order)
            while q < n and (T[order[q]] > t or (T[order[q]] == t and order[q] < i)):
                q += 1
            if q > at + 1:
                order.insert(q, i)
                del order[at]
        self.load -= pairs
        if play.many:                                           # (s may receive once below U)
            play.cur[s] = self.load
            heapq.heappush(play.heap, (self.load, s))
        load = play.cur.get(r, play.loads[r]) + pairs
        play.cur[r] = load
        heapq.heappush(play.heap, (load, r))
        play.bytes += byt
        return byt

    def peel_step(self, play: _Play) -> bool:
        """Apply the peeling move (the largest valid end shard to the emptiest server, ties: the first
        task); False when there is none."""
        load, r = play.emptiest()
        U = play.g.U
        if load >= U or self.load <= U:
            return False
        room = U - load
        y, x, m = math.floor(room), max(math.ceil(min(self.load - U, room)), 1), play.g.m
        best, T, a, b = None, self.T, self.a, self.b
        for i in self.order:                                    # a shard carries at most its task's pairs
            if best is not None and T[i] < best[0]:
                break
            k, p = end_cut(a[i], b[i], x, y, m)
            if p >= 0 and (best is None or p > best[0] or (p == best[0] and i < best[1])):
                best = (p, i, k)
        if best is None:
            return False
        p, i, k = best
        self.apply(play, i, r, k, p, True)
        return True


def _owned(ranges, e: int) -> int:
    """Tokens of ``[0, e)`` in ``ranges`` (sorted token ranges, or None)."""
    own = 0
    if ranges:
        for lo, hi in ranges:
            if lo >= e:
                break
            own += (hi if hi < e else e) - lo
    return own

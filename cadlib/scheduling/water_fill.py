"""``equal_flops``, the bytes-blind water-filling: :func:`cadlib.scheduling.scheduler.equal_flops`
and the guard of :func:`cadlib.scheduling.scheduler.place` both run it. Its plain reference is
:func:`cadlib.scheduling.greedy.reference_greedy` with ``mode="flops"`` (the same plans); this computes
them with a few scalar steps per move.

Each move the most loaded donor sends its largest valid end shard to the emptiest receiver (ties: the
donor's first task in chunk order); a donor with no move waits for a new receiver. A shard of a task
carries at most the task's pairs ``T``, so once one task's shard ``P0`` is known, only tasks with
``T >= P0`` can beat or tie it. The task with the largest ``T`` gives ``P0``; the few tasks with
``T >= P0`` (one to three on realistic batches) are then cut one at a time in exact integer arithmetic
(:func:`cadlib.scheduling.shards.end_cut`, the end row of :func:`cadlib.scheduling.shards.cut_shards`).
When ``P0`` is not valid or more than :data:`SCALAR_MAX` tasks remain, the move falls back to
``cut_shards`` over all the donor's tasks, one numpy pass.

Only the initial donors' chunks ever move (a receiver is filled to at most ``U``, so it never becomes
a donor), so the state is their tasks (per donor: chunk index, ``a``, ``b``, ``T``) and the changes
(``b`` of cut chunks, the server of moved ones, the shards). The guard needs the plan's forward bytes,
whether it reaches the tolerance and its peak; :meth:`WaterFill.task_arrays` builds the plan's arrays
(the guard calls it only when it returns this plan). The forward bytes are counted once at the end:
on the documents the moves touched, the final tasks' less the colocated chunks'.
"""
from __future__ import annotations

import math

import numpy as np

from ..core.cost import imbalance
from .engine import Greedy, TaskArrays
from .shards import cut_shards, end_cut

SCALAR_MAX = 16          # tasks cut one at a time per move; more: one numpy pass


class WaterFill:
    """``equal_flops`` on the chunks of ``g`` (a :class:`Greedy`: its arrays, ceiling and index are
    shared) from ``load0``, its servers' loads before it moved (``g.load`` when it has not). After
    :meth:`run`: ``load``, ``n_moves``, ``n_splits``, ``moved_bytes`` (exact) as the greedy's."""

    def __init__(self, g: Greedy, load0: np.ndarray):
        self.S, self.U, self.m, self.qb, self.kvb = g.S, g.U, g.m, g.qb, g.kvb
        self.chunks = g.chunks
        self.load = np.array(load0, dtype=np.int64)
        donors = np.flatnonzero(self.load > self.U).tolist()
        self.ix = g.chunk_index() if donors else None          # (for the bytes; no donor, no move)
        p = g.srv_ptr
        parts = [np.arange(p[s], p[s + 1]) if g.by_srv is None else g.by_srv[p[s]:p[s + 1]] for s in donors]
        idx = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        a, b = self.chunks[idx, 1], self.chunks[idx, 2]
        T = (b * (b + 1) - a * (a + 1)) // 2
        cut = np.cumsum([q.size for q in parts])[:-1]
        self.views = {s: list(z) for s, *z in zip(donors, *(np.split(c, cut) for c in (idx, a, b, T)))}
        self.b_mod: dict[int, int] = {}                        # chunk -> its end, once cut
        self.srv_mod: dict[int, int] = {}                      # chunk -> its server, once moved
        self.shards: list[tuple[int, int, int, int, int]] = []
        self.touched: set[int] = set()
        self.n_moves = self.n_splits = 0
        self.moved_bytes = 0

    def run(self) -> bool:
        """Move until no donor can: the most loaded donor first; returns ``reached``."""
        load, U = self.load, self.U
        stuck: set[int] = set()
        while True:
            live = load
            if stuck:
                live = load.copy()
                live[list(stuck)] = -1
            s = int(live.argmax())
            if not live[s] > U:
                break
            mv = self.best_move(s)
            if mv is None:
                stuck.add(s)
                continue
            self.apply(s, *mv)
            if load[s] < U:
                stuck.clear()
        if self.touched:
            self.moved_bytes = self.touched_bytes()
        return self.reached()

    def best_move(self, s: int) -> tuple[int, int, int, int] | None:
        """``(g, i, k, pairs)``: donor ``s``'s largest valid end shard, of its ``i``-th task, to the
        emptiest receiver ``g``."""
        load = self.load
        g = int(load.argmin())
        lg = int(load[g])
        if lg >= self.U:
            return None
        idx, a, b, T = self.views[s]
        if not idx.size:
            return None
        room = self.U - lg
        y, x, m = math.floor(room), max(math.ceil(min(int(load[s]) - self.U, room)), 1), self.m
        i0 = int(T.argmax())
        k0, p0 = end_cut(int(a[i0]), int(b[i0]), x, y, m)
        cand = np.flatnonzero(T >= p0) if p0 >= 0 else idx[:0]
        if p0 >= 0 and cand.size <= SCALAR_MAX:
            best = (p0, -i0, k0)
            for i in cand.tolist():
                if i != i0:
                    k, p = end_cut(int(a[i]), int(b[i]), x, y, m)
                    if (p, -i) > best[:2]:
                        best = (p, -i, k)
            return g, -best[1], best[2], best[0]
        k, p = cut_shards(a, b, x, y, m, sides=1)              # one pass over all the donor's tasks
        k, p = k[0], p[0]
        e = np.where(b - a >= 2 * m, a + m, b)
        pe = np.where((k > 0) & (p <= y) & ((e * (e + 1) - a * (a + 1)) // 2 <= y), p, -1)
        i = int(pe.argmax())
        return None if pe[i] < 0 else (g, i, int(k[i]), int(p[i]))

    def apply(self, s: int, g: int, i: int, k: int, pairs: int) -> None:
        v = self.views[s]
        idx, a, b, T = v
        c, ai, bi = int(idx[i]), int(a[i]), int(b[i])
        doc, home = int(self.chunks[c, 0]), int(self.chunks[c, 3])
        if k == bi - ai:
            self.srv_mod[c] = g
            keep = np.arange(idx.size) != i
            v[:] = [z[keep] for z in v]
        else:
            self.shards.append((doc, bi - k, bi, home, g))
            b[i] = self.b_mod[c] = bi - k
            T[i] -= pairs
            self.n_splits += 1
        self.touched.add(doc)
        self.load[s] -= pairs
        self.load[g] += pairs
        self.n_moves += 1

    def imbalance(self) -> float:
        return imbalance(self.load)

    def reached(self) -> bool:
        return bool(self.load.max(initial=0) <= self.U)

    def _columns(self, c: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``b`` and ``server`` of every chunk after the moves, or of chunks ``c`` (which hold every
        chunk the moves changed)."""
        ch = self.chunks if c is None else self.chunks[c]
        b, srv = ch[:, 2].copy(), ch[:, 3] % self.S
        at = None if c is None else dict(zip(c.tolist(), range(c.size)))
        for x, e in self.b_mod.items():
            b[x if at is None else at[x]] = e
        for x, r in self.srv_mod.items():
            srv[x if at is None else at[x]] = r
        return b, srv

    def touched_bytes(self) -> int:
        """The forward bytes the moves added: on the documents they touched, the final tasks' less the
        colocated chunks'."""
        docs = np.fromiter(self.touched, dtype=np.int64, count=len(self.touched))
        c = self.ix.doc_chunks(docs)
        ch = self.chunks[c]
        b, srv = self._columns(c)
        cols = [ch[:, 0], ch[:, 1], b, ch[:, 3], srv]
        return self.ix.moved_bytes(ch, cols, self.shards, self.S, self.qb, self.kvb)

    def task_arrays(self) -> TaskArrays:
        b, srv = self._columns()
        cols = [self.chunks[:, 0], self.chunks[:, 1], b, self.chunks[:, 3], srv]
        if self.shards:
            extra = np.array(self.shards, dtype=np.int64)
            cols = [np.concatenate((x, extra[:, j])) for j, x in enumerate(cols)]
        return TaskArrays(*cols)

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
from .plan import cut_shards, transfer_tokens


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
        # per doc, its chunks (by_doc order): their servers may change, their holders do not
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
        key, inv = np.unique(self.server * n_docs + self.doc, return_inverse=True)
        end = np.zeros(key.size, dtype=np.int64)
        np.maximum.at(end, inv, self.b)
        self.need: dict[int, int] = dict(zip(key.tolist(), end.tolist()))   # server * n_docs + doc -> end
        self.shards: list[tuple[int, int, int, int, int]] = []
        self.shard_servers: dict[int, set[int]] = {}          # doc -> servers given shards of it
        by_srv = np.argsort(self.server, kind="stable")
        ptr = np.searchsorted(self.server[by_srv], np.arange(S + 1))
        self.live = {s: by_srv[ptr[s]:ptr[s + 1]] for s in np.flatnonzero(self.load > self.U).tolist()}
        self.stuck: set[int] = set()
        self.n_moves = self.n_splits = 0

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

    def avail(self, d: np.ndarray) -> np.ndarray:
        """Per document of ``d``, the pairs donors could shed of it: ``sum over its chunks on donors of
        min(pairs, the donor's excess)``."""
        lo, cnt = self.doc_ptr[d], self.doc_ptr[d + 1] - self.doc_ptr[d]
        rep = np.repeat(np.arange(d.size), cnt)
        j = self.by_doc[lo[rep] + np.arange(rep.size) - np.repeat(np.cumsum(cnt) - cnt, cnt)]
        ex = np.maximum(self.load[self.server[j]] - self.U, 0)
        return np.bincount(rep, weights=np.minimum(ex, causal_pairs(self.a[j], self.b[j])), minlength=d.size)

    # -- one move ---------------------------------------------------------------------------------
    def candidates(self, s: int, g: int) -> Candidates | None:
        """Donor ``s``'s (task, receiver) pairs: receivers serving or holding part of the task's
        document, and the emptiest receiver ``g``; only receivers below ``U``."""
        idx = self.live[s] = self.live[s][self.server[self.live[s]] == s]
        if not idx.size:
            return None
        d = self.doc[idx]
        # the donor's prefix end for d without this task: the max b of its other tasks of d
        o = np.lexsort((self.b[idx], d))
        ds, bs = d[o], self.b[idx][o]
        last = np.r_[ds[1:] != ds[:-1], True]
        first = np.r_[True, ds[:-1] != ds[1:]]
        top = np.repeat(bs[last], np.diff(np.r_[0, np.flatnonzero(last) + 1]))
        second = np.where(first, 0, np.r_[0, bs[:-1]])
        other = np.empty_like(bs)
        other[o] = np.where(last, second, top)
        if self.mode == "flops":
            task, recv = np.arange(idx.size), np.full(idx.size, g)
        else:
            lo, cnt = self.doc_ptr[d], self.doc_ptr[d + 1] - self.doc_ptr[d]
            rep = np.repeat(np.arange(idx.size), cnt)
            pos = lo[rep] + np.arange(rep.size) - np.repeat(np.cumsum(cnt) - cnt, cnt)   # by_doc positions
            extra_t, extra_r = [], []
            hit = np.flatnonzero(np.isin(d, list(self.shard_servers))) if self.shard_servers else d[:0]
            for i in hit.tolist():
                for r in self.shard_servers[int(d[i])]:
                    extra_t.append(i)
                    extra_r.append(r)
            task = np.concatenate((rep, rep, np.arange(idx.size), np.array(extra_t, dtype=np.int64)))
            recv = np.concatenate((self.server[self.by_doc[pos]], self.holder_of[pos], np.full(idx.size, g),
                                   np.array(extra_r, dtype=np.int64)))
            keep = (recv >= 0) & (recv != s)
            keep[keep] = self.load[recv[keep]] < self.U
            key = np.unique(task[keep] * self.S + recv[keep])
            task, recv = key // self.S, key % self.S
        if not task.size:
            return None
        dd = d[task]
        get = self.need.get
        need_r = np.array([get(k, 0) for k in (recv * self.n_docs + dd).tolist()], dtype=np.int64)
        t = idx[task]
        return Candidates(task=t, doc=dd, a=self.a[t], b=self.b[t], home=self.home[t], receiver=recv,
                          need_r=need_r, other_s=other[task])

    def best_move(self, s: int) -> Move | None:
        """Donor ``s``'s lowest-priority move (``reference_greedy``'s formula, vectorised)."""
        recv = self.load < self.U
        if not recv.any():
            return None
        g = int(np.argmax(np.where(recv, self.U - self.load, -np.inf)))
        c = self.candidates(s, g)
        if c is None:
            return None
        room = self.U - self.load[c.receiver]
        x = np.maximum(np.ceil(np.minimum(self.load[s] - self.U, room)), 1).astype(np.int64)
        y = np.floor(room).astype(np.int64)
        k, p = cut_shards(c.a, c.b, x, y, self.m)                 # [2, N]: end row, start row
        valid = (k > 0) & (p <= y)
        n = c.b - c.a
        whole = k == n
        if self.mode == "flops":
            valid[1] = False                                      # end shards only, largest first
            byt = np.zeros_like(k)
            prio = -p.astype(np.float64)
        else:
            e = np.stack((c.b, c.a + k[1]))                       # the shard's KV prefix end
            left = np.where(whole, 0, np.stack((c.b - k[0], c.b)))  # end of what s keeps of the task
            # one batched kv(): receiver after (2 sides), before; donor after (2 sides), before
            N = c.task.size
            g = np.concatenate((np.tile(c.receiver, 3), np.full(3 * N, s)))
            ends = np.concatenate((np.maximum(c.need_r, e).ravel(), c.need_r,
                                   np.maximum(c.other_s, left).ravel(), np.maximum(c.other_s, c.b)))
            kvs = self.kv(g, np.tile(c.doc, 6), ends).reshape(6, N)
            kv_r = kvs[0:2] - kvs[2]
            kv_s = kvs[3:5] - kvs[5]
            q = (c.home != c.receiver).astype(np.int64) - (c.home != s)
            byt = self.qb * k * q + self.kvb * (kv_r + kv_s)
            bundle = np.maximum(np.minimum(room, self.avail(c.doc)), p)
            cost = np.maximum(byt - self.kvb * kv_r + self.kvb * kv_r * p / bundle, np.minimum(byt, 0))
            prio = cost / np.maximum(p, 1)
            excess = self.load[s] - self.U
            clears = valid & (p >= excess)
            if clears.any():                                      # a partial move: + the cheapest clearing
                prio = np.where(clears, prio, (cost + cost[clears].min()) / excess)
        prio = np.where(valid, prio, np.inf)
        N = c.task.size
        side = np.repeat(np.arange(2), N)
        order = np.lexsort((side, np.tile(c.receiver, 2), np.tile(c.task, 2), -p.ravel(), prio.ravel()))
        i = int(order[0])
        sd, col = divmod(i, N)
        if not np.isfinite(prio[sd, col]):
            return None
        return Move(task=int(c.task[col]), receiver=int(c.receiver[col]), k=int(k[sd, col]),
                    pairs=int(p[sd, col]), from_end=sd == 0, bytes=int(byt[sd, col]))

    def apply(self, s: int, mv: Move) -> None:
        t, r, k = mv.task, mv.receiver, mv.k
        d, a, b, h = int(self.doc[t]), int(self.a[t]), int(self.b[t]), int(self.home[t])
        if k == b - a:
            self.server[t] = r
            e = b
        else:
            lo, hi = (b - k, b) if mv.from_end else (a, a + k)
            self.shards.append((d, lo, hi, h, r))
            self.shard_servers.setdefault(d, set()).add(r)
            if mv.from_end:
                self.b[t] = b - k
            else:
                self.a[t] = a + k
            e = hi
            self.n_splits += 1
        rk, sk = r * self.n_docs + d, s * self.n_docs + d
        self.need[rk] = max(self.need.get(rk, 0), e)
        mine = self.live[s][(self.doc[self.live[s]] == d) & (self.server[self.live[s]] == s)]
        if mine.size:
            self.need[sk] = int(self.b[mine].max())
        else:
            self.need.pop(sk, None)
        self.load[s] -= mv.pairs
        self.load[r] += mv.pairs
        self.n_moves += 1
        if self.load[s] < self.U:
            self.stuck.clear()                                 # a new receiver: retry stuck donors

    def run(self) -> bool:
        """Move until no donor can: the most loaded donor first. Returns ``reached``."""
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

    @property
    def forward_bytes(self) -> int:
        """Forward dispatch bytes of the current placement (``transfer_tokens``)."""
        t = self.task_arrays()
        R = int(self.chunks[:, 3].max(initial=-1)) + 1
        q, kv = transfer_tokens(self.chunks, t.doc, t.q_start, t.q_end, t.home, t.server, max(R, 1), self.S)
        return int(q.sum()) * self.qb + int(kv.sum()) * self.kvb

"""The CAD scheduler: place CA-tasks on attention servers so that core-attention FLOPs are balanced
while as few bytes as possible cross the network (DistCA's communication-aware greedy).

Start from the colocated placement: every chunk of the linear layout is one CA-task, served by
server ``home % n_servers`` (``home`` itself when there are as many servers as ranks). With
``mean = total pairs / n_servers`` and the ceiling ``U = (1 + tolerance) * mean``, servers above ``U``
are **donors** and the other servers below ``U`` are **receivers**. A donor sheds
``x = min(load_s - U, U - load_r, pairs(task))`` pairs to a receiver, either as a whole task or as
a query shard cut out of one (at the end or at the start of its query range), until every server is
at most ``U`` or no move is possible. Each donor's move is its candidate with the fewest bytes per
FLOP (see ``schedule``); donors that need several moves go first, the most expensive first, then the
others by bytes per FLOP (``_Greedy.key``). Receivers never go above ``U`` and a donor never takes
a move while it is above ``U``, so the loop ends.

State lives in numpy arrays (one row per task, per-chunk ``(doc, server)`` prefix ends); a donor's
candidates are scored in one vectorised pass; a lazy heap keeps donors in order of their best move.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

import numpy as np

from .cost import MIN_SHARD_TOKENS, ModelSpec, as_model, causal_pairs
from .plan import Layout, Plan, transfer_tokens

METHODS = ("cad", "equal_flops", "colocated")


@dataclass
class Placement:
    """CA-tasks as arrays (``doc, q_start, q_end, home, server``): what ``Plan`` holds, without the
    O(tokens) validation, so that plans of hundreds of millions of tokens can be timed and costed."""

    doc: np.ndarray
    q_start: np.ndarray
    q_end: np.ndarray
    home: np.ndarray
    server: np.ndarray
    n_servers: int
    meta: dict = field(default_factory=dict)

    def server_pairs(self) -> np.ndarray:
        """Per server ``sum over its tasks of (b(b+1) - a(a+1)) / 2``."""
        return np.bincount(self.server, weights=causal_pairs(self.q_start, self.q_end).astype(np.float64),
                           minlength=self.n_servers)

    def imbalance(self) -> float:
        load = self.server_pairs()
        return float(load.max() / load.mean()) if load.size and load.mean() > 0 else 1.0

    def token_matrices(self, chunks: np.ndarray, n_ranks: int) -> tuple[np.ndarray, np.ndarray]:
        """``Plan.token_matrices`` without building the O(tokens) ``Plan``; ``chunks`` from
        ``Layout.chunk_array``."""
        return transfer_tokens(chunks, self.doc, self.q_start, self.q_end, self.home, self.server,
                               n_ranks, self.n_servers)

    def forward_bytes(self, chunks: np.ndarray, n_ranks: int, model: ModelSpec, dtype: str = "bf16") -> float:
        """Bytes dispatched for one layer's forward: ``q_tokens * q_bytes + kv_tokens * kv_bytes``."""
        q, kv = self.token_matrices(chunks, n_ranks)
        return float(q.sum() * model.q_bytes(dtype) + kv.sum() * model.kv_bytes(dtype))

    def to_plan(self, layout: Layout) -> Plan:
        """The validated ``Plan`` (O(tokens))."""
        tasks = list(zip(self.doc.tolist(), self.q_start.tolist(), self.q_end.tolist(),
                         self.home.tolist(), self.server.tolist()))
        return Plan(layout, tasks, self.n_servers, dict(self.meta))


def _tri_le(v: np.ndarray) -> np.ndarray:
    """Largest ``c >= 0`` with ``c(c+1) <= v`` (0 where ``v < 2``), exact for int64 ``v``:
    ``floor((sqrt(4v + 1) - 1) / 2)``. In float64 this is exact below ``2**46``: ``4v + 1`` is exact,
    at ``v = c(c+1)`` it is the square ``(2c+1)**2`` (correctly rounded sqrt is exact) and just below it
    the root is ``>= 1/(2c+1)`` under ``c``, far more than the rounding error; larger ``v`` get one
    integer correction step."""
    v = np.maximum(v, 0)
    c = (np.sqrt(v + 0.25) - 0.5).astype(np.int64)    # sqrt(4v + 1) / 2: >= 0, truncation is floor
    if not v.size or v.max() < _TRI_EXACT:
        return c
    w = c * (c + 1)                                    # float sqrt is within one of exact here
    return c - (w > v) + (w + 2 * (c + 1) <= v)


_TRI_EXACT = 2 ** 46

_SIDE = np.array([[-1], [1]])                          # end shard [b-k, b): b - f; start [a, a+k): -a + f
_CEIL = np.array([[[0], [1]], [[1], [0]]])             # [up/down, end/start]: floor or ceiling root
_SIDE2 = 2 * _SIDE
_FSGN = 1.0 - 2.0 * _CEIL                              # -1 where the ceiling root is taken


def _shard_consts(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per task the constants ``_cuts`` needs, stacked ``[7, N]``:
    ``b, -a, 2b+1, 2a+1, b(b+1), a(a+1), n``."""
    return np.stack((b, -a, 2 * b + 1, 2 * a + 1, b * (b + 1), a * (a + 1), b - a))


def _cuts(c: np.ndarray, x: np.ndarray, y: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    """``_cut`` for end (row 0) and start (row 1) shards of every task at once, ``[2, N]`` each, from
    ``c = _shard_consts(a, b)``: all four roots (fewest / most tokens, both sides) in one pass. With
    ``t(v)`` the largest and ``t'(v) = t(v-1) + [v >= 1]`` the smallest ``c >= 0`` with
    ``c(c+1) >= v``: end ``k_up = b - t(b(b+1) - 2x)``, ``k_dn = b - t'(b(b+1) - 2y)``; start
    ``k_up = t'(a(a+1) + 2x) - a``, ``k_dn = t(a(a+1) + 2y) - a``."""
    n, nm = c[6], c[6] - m
    v = np.empty((2, 2, n.size), dtype=np.int64)
    np.multiply(_SIDE2, x, out=v[0])
    np.multiply(_SIDE2, y, out=v[1])
    v += c[4:6]
    if v.size and v.max() < _TRI_EXACT:               # floor / ceiling of the float root are exact
        R = np.sqrt(np.maximum(v, 0) + 0.25) - 0.5      # (see _tri_le), ceil(R) = -floor(-R)
        R *= _FSGN
        np.floor(R, out=R)
        R *= _SIDE * _FSGN
        K = R.astype(np.int64)
        K += c[0:2]
    else:
        K = c[0:2] + _SIDE * (_tri_le(v - _CEIL) + _CEIL * (v >= 1))
    up, dn = K[0], K[1]
    np.maximum(up, m, out=up)                          # fewest valid tokens >= up
    np.copyto(up, n, where=up > nm)
    z = np.minimum(dn, nm)                             # most valid tokens <= dn
    z *= z >= m
    np.copyto(z, n, where=dn >= n)
    K[1] = z
    P = (K * (c[2:4] + _SIDE * K)) >> 1                # end k(2b + 1 - k) / 2, start k(2a + 1 + k) / 2
    ok = P[0] <= y
    return np.where(ok, up, z), np.where(ok, P[0], P[1])


def _cut(a, b, x, y, m, from_end: bool):
    """Query tokens ``k`` to move from task ``[a, b)``: the fewest with ``pairs >= x``, rounded to a
    valid shard (``m <= k <= n - m`` or ``k = n``); if that exceeds the receiver's room ``y``, the most
    with ``pairs <= y`` instead (0 if none is valid). Moved pairs of ``k`` tokens, solving the causal
    pair-count quadratic ``c(c+1) = b(b+1) - 2x`` (end shard ``[c, b)``) or ``e(e+1) = a(a+1) + 2x``
    (start shard ``[a, e)``). Returns ``(k, pairs)``."""
    a, b, x, y = (np.asarray(v, dtype=np.int64) for v in (a, b, x, y))
    k, p = _cuts(_shard_consts(a, b), x, y, m)
    side = 0 if from_end else 1
    return k[side], p[side]


# rows of a donor's candidate block (int64 [len, N]); _C.. _C + 7 hold _shard_consts
_T, _R, _CUR, _DROW, _HOME, _NOTS, _W1, _SOLE, _SRC, _C = range(10)


class _Greedy:
    """The move loop shared by ``schedule`` (``mode="bytes"``) and ``equal_flops`` (``mode="flops"``).

    Speed (same moves as scoring every candidate afresh): a donor's candidate rows are built once
    and updated in place when that donor moves or a receiver gets a first shard of one of its
    documents (rows no receiver can ever take are left out: ``_fits``); a donor's best move is kept
    until a server its rows point at changes load or the emptiest receiver ``g`` changes; both shard
    sides are cut in one ``_cuts`` pass."""

    def __init__(self, chunks, n_docs, n_servers, tolerance, min_shard, q_bytes, kv_bytes, mode):
        S = self.S = n_servers
        self.doc, self.a, self.b, self.home = (chunks[:, i].copy() for i in range(4))
        self.a0 = self.a.copy()
        self.srv = self.home % S
        self.m, self.qb, self.kvb, self.mode = int(min_shard), q_bytes, kv_bytes, mode
        self.load = np.bincount(self.srv, weights=causal_pairs(self.a, self.b).astype(np.float64),
                                minlength=S)
        self.mean = self.load.sum() / S
        self.U = (1.0 + tolerance) * self.mean
        self.donor = self.load > self.U
        # per (server, doc): its chunks' count (sole: the only task of its doc on its server) and the
        # end of the prefix it already holds
        key = self.srv * n_docs + self.doc
        by = np.argsort(key, kind="stable")
        starts = np.flatnonzero(np.r_[True, np.diff(key[by]) != 0]) if by.size else by
        own_end, self.sole = np.empty_like(self.b), np.empty(by.size, dtype=bool)
        if by.size:
            cnt = np.diff(np.r_[starts, by.size])
            own_end[by] = np.repeat(np.maximum.reduceat(self.b[by], starts), cnt)
            self.sole[by] = np.repeat(cnt == 1, cnt)
        order = self.by_doc = np.argsort(self.doc, kind="stable")
        self.ch_srv, self.ch_end = self.srv[order], own_end[order]
        self.doc_ptr = np.searchsorted(self.doc[order], np.arange(n_docs + 1))
        by_srv = np.argsort(self.srv, kind="stable")
        ptr = np.searchsorted(self.srv[by_srv], np.arange(S + 1))
        self.live = {s: by_srv[ptr[s]:ptr[s + 1]] for s in np.flatnonzero(self.donor).tolist()}
        self.recv_end: dict[int, dict[int, int]] = {}   # doc -> {server: max q_end received}
        self.doc_row = np.zeros(n_docs, dtype=np.intp)  # row of recv_end in re_arr (0: nothing yet)
        self.re_arr = np.zeros((16, S), dtype=np.int64)
        self.new: list[tuple[int, int, int, int, int]] = []
        self.n_moves = self.n_splits = self.n_evals = 0
        self.touched = np.zeros(S, dtype=np.int64)      # move number that last changed each load
        self.rows: dict[int, tuple] = {}                # donor -> (block, pm, receivers)
        self.res: dict[int, tuple] = {}                 # donor -> (rows, g, n_moves, best move)
        self._receivers()

    def _receivers(self) -> None:
        recv = self.load < self.U                      # not a donor now (ex-donors may receive)
        self.any_recv = bool(recv.any())
        self.g = int(np.argmax(np.where(recv, self.U - self.load, -np.inf)))

    def _own_end(self, d: int, r: int) -> int:
        lo, hi = self.doc_ptr[d], self.doc_ptr[d + 1]
        mine = self.ch_srv[lo:hi] == r
        return int(self.ch_end[lo:hi][mine].max()) if mine.any() else 0

    def _rows(self, s: int) -> tuple:
        """Donor ``s``'s candidates: each live task to ``g`` (receiver ``-1`` here, filled in when
        scored), to every receiver holding a chunk of its document and to every receiver already sent
        a shard of it (unless it holds a chunk: same row); per row the prefix the receiver holds from its
        own chunks."""
        c = self.rows.get(s)
        if c is not None:
            return c
        idx = self.live[s]
        idx = self.live[s] = idx[self.srv[idx] == s]
        t, r, cur = idx, np.full(idx.size, -1), np.zeros(idx.size, dtype=np.int64)
        extra = []
        if self.mode == "bytes":                       # receivers holding part of the document
            d = self.doc[idx]
            lo, cnt = self.doc_ptr[d], self.doc_ptr[d + 1] - self.doc_ptr[d]
            rows = np.repeat(np.arange(idx.size), cnt)
            j = lo[rows] + np.arange(rows.size) - np.repeat(np.cumsum(cnt) - cnt, cnt)
            keep = self.ch_srv[j] != s
            rows, j = rows[keep], j[keep]
            t, r = np.concatenate((t, idx[rows])), np.concatenate((r, self.ch_srv[j]))
            cur = np.concatenate((cur, self.ch_end[j]))
            if self.recv_end:                          # receivers already sent part of the prefix
                hit = np.flatnonzero(self.doc_row[d])
                extra = [(ti, rr, 0) for ti, dd in zip(idx[hit].tolist(), d[hit].tolist())
                         for rr in self.recv_end[dd] if self._fits(ti, rr) and not self._own_end(dd, rr)]
                if extra:
                    ex = np.array(extra, dtype=np.int64)
                    t, r, cur = (np.concatenate((v, ex[:, i])) for i, v in enumerate((t, r, cur)))
        block, pairs = self._block(s, t, r, cur)
        c = self.rows[s] = (block, np.minimum(self.load[s] - self.U, pairs), np.unique(r[idx.size:]),
                            idx.size, pairs, t.size - len(extra))
        return c

    def _block(self, s: int, t, r, cur) -> tuple[np.ndarray, np.ndarray]:
        a, b, home = self.a[t], self.b[t], self.home[t]
        hs = home == s
        block = np.empty((_C + 7, t.size), dtype=np.int64)
        block[_T], block[_R], block[_CUR], block[_HOME], block[_SRC] = t, r, cur, home, s
        block[_DROW], block[_NOTS], block[_SOLE] = self.doc_row[self.doc[t]], hs - 1, self.sole[t]
        block[_W1] = np.where(hs, self.a0[t], b)
        c = block[_C:]
        c[0], c[1], c[2], c[3] = b, -a, 2 * b + 1, 2 * a + 1
        c[4], c[5], c[6] = b * (b + 1), a * (a + 1), b - a
        return block, ((c[4] - c[5]) // 2).astype(np.float64)

    def _fits(self, t, r):
        """Whether receiver ``r`` has room for the smallest valid move of task ``t``: ``m`` start
        tokens ``[a, a+m)`` if ``n >= 2m``, else the whole task (only ``k = n`` is valid). A move
        leaves ``>= m`` tokens and rooms only shrink, so a row that fails never becomes valid."""
        a, b = self.a[t], self.b[t]
        e = np.where(b - a >= 2 * self.m, a + self.m, b)
        return (e * (e + 1) - a * (a + 1)) // 2 <= self.U - self.load[r]

    def _new_receiver(self, s: int, tasks: np.ndarray, d: int, r: int, first: bool) -> None:
        """Receiver ``r`` got its first shard of document ``d``: give donor ``s``'s tasks of ``d`` a
        row to ``r`` each, after their other such rows (the order a rebuild would give)."""
        block, _, recvs, n1, pairs, n12 = self.rows[s]
        if first:
            block[_DROW, self.doc[block[_T]] == d] = self.doc_row[d]
        tasks = tasks[self._fits(tasks, r)]
        if not tasks.size or self._own_end(d, r):     # r holds a chunk of d: its rows exist already
            return
        cols, new_pairs = self._block(s, tasks, np.full(tasks.size, r), np.zeros(tasks.size, dtype=np.int64))
        pos = n12 + np.searchsorted(block[_T, n12:], tasks, side="right")
        block, pairs = np.insert(block, pos, cols, axis=1), np.insert(pairs, pos, new_pairs)
        self.rows[s] = (block, np.minimum(self.load[s] - self.U, pairs), np.append(recvs, r), n1, pairs, n12)

    def _moved(self, s: int, ti: int, whole: bool) -> None:
        """Update donor ``s``'s rows in place after it moved (part of) task ``ti``: drop the task's
        rows or recompute its shard constants; every row's ``pm = min(load_s - U, pairs)``."""
        c = self.rows.pop(s, None)
        if c is None:
            return
        block, _, recvs, n1, pairs, n12 = c
        at = block[_T] == ti
        if whole:
            keep = ~at
            block, pairs, n1, n12 = block[:, keep], pairs[keep], n1 - 1, n12 - int(at[:n12].sum())
        else:
            a, b = int(self.a[ti]), int(self.b[ti])
            block[_C:, at] = np.array([b, -a, 2 * b + 1, 2 * a + 1, b * (b + 1), a * (a + 1), b - a])[:, None]
            block[_W1, at] = self.a0[ti] if self.home[ti] == s else b
            pairs[at] = (b * (b + 1) - a * (a + 1)) // 2
        self.rows[s] = (block, np.minimum(self.load[s] - self.U, pairs), recvs, n1, pairs, n12)

    def _score(self, blocks: list[tuple]) -> tuple:
        """Priorities ``[2, N]`` (row 0 end shards, row 1 start shards; ``inf`` if invalid) of the
        candidate rows of ``blocks``, with their shard sizes, pairs and bytes."""
        self.n_evals += 1
        for blk, _, _, n1, _, _ in blocks:
            blk[_R, :n1] = self.g
        M = blocks[0][0] if len(blocks) == 1 else np.concatenate([c[0] for c in blocks], axis=1)
        pm = blocks[0][1] if len(blocks) == 1 else np.concatenate([c[1] for c in blocks])
        r = M[_R]
        room = self.U - self.load[r]
        y = np.floor(room).astype(np.int64)            # non-receivers: y <= 0, so no valid move
        x = np.maximum(np.ceil(np.minimum(pm, room)).astype(np.int64), 1)
        k, p = _cuts(M[_C:], x, y, self.m)
        valid = (k > 0) & (p <= y)                     # k > 0: p > 0
        if self.mode == "flops":
            byt = np.zeros(p.shape, dtype=np.int64)
            valid[1] = False                           # end shards only
            prio = -p.astype(np.float64)
        else:
            cur = np.maximum(M[_CUR], self.re_arr[M[_DROW], r])
            e = np.empty_like(k)                       # end: b; start: a + k (b if whole)
            e[0] = M[_C]
            np.subtract(k[1], M[_C + 1], out=e[1])
            save = k * M[_NOTS]                        # -k if h != s (end shards only), W1 if whole
            save[1] = 0
            save = np.where(k == M[_C + 6], M[_W1], -save)
            save *= M[_SOLE]
            byt = self.qb * (k * ((M[_HOME] != r) + M[_NOTS])) + self.kvb * (np.maximum(e - cur, 0) - save)
            prio = byt / np.maximum(p, 1)
        return M, np.where(valid, prio, np.inf), k, p, byt

    def best(self, donors: list[int]) -> dict:
        """Per donor, its lowest-priority move as ``{s: (priority, move)}`` (donors with no valid
        move are left out). The donors whose kept best move is stale are scored in one pass."""
        if not donors or not self.any_recv:
            return {}
        out, todo = {}, []
        for s in donors:
            c = self._rows(s)
            kept = self.res.get(s)
            if (kept is not None and kept[0] is c and kept[1] == self.g and self.touched[self.g] <= kept[2]
                    and (not c[2].size or self.touched[c[2]].max() <= kept[2])):
                if kept[3] is not None:
                    out[s] = kept[3]
            elif c[0].shape[1]:
                todo.append(s)
            else:
                self.res[s] = (c, self.g, self.n_moves, None)
        if not todo:
            return out
        blocks = [self.rows[s] for s in todo]
        M, prio, k, p, byt = self._score(blocks)
        N = M.shape[1]
        flat = prio.ravel()
        if len(todo) == 1:
            first = [int(np.argmin(flat))]
        else:
            owner = np.tile(M[_SRC], 2)
            order = np.lexsort((flat, owner))
            first = order[np.r_[True, owner[order][1:] != owner[order][:-1]]].tolist()
        for s in todo:
            self.res[s] = (self.rows[s], self.g, self.n_moves, None)
        for i in first:
            side, row = divmod(i, N)
            s = int(M[_SRC, row])
            if np.isfinite(flat[i]):
                cand = (float(flat[i]), (int(M[_T, row]), int(M[_R, row]), side == 0, int(k[side, row]),
                                         int(p[side, row]), float(byt[side, row])))
                out[s] = cand
                self.res[s] = (self.rows[s], self.g, self.n_moves, cand)
        return out

    def apply(self, s: int, move) -> None:
        ti, r, from_end, k, p, _ = move
        a, b = int(self.a[ti]), int(self.b[ti])
        d, home = int(self.doc[ti]), int(self.home[ti])
        if k == b - a:
            self.srv[ti], e = r, b
        elif from_end:
            self.new.append((d, b - k, b, home, r))
            self.b[ti], e = b - k, b
            self.n_splits += 1
        else:
            self.new.append((d, a, a + k, home, r))
            self.a[ti], e = a + k, a + k
            self.n_splits += 1
        self.n_moves += 1
        self.load[s] -= p
        self.load[r] += p
        self.touched[s] = self.touched[r] = self.n_moves
        self._moved(s, ti, k == b - a)
        got = self.recv_end.setdefault(d, {})
        if r not in got:                               # new candidate rows for this document's donors
            first = not self.doc_row[d]
            if first:
                self.doc_row[d] = len(self.recv_end)
                if self.doc_row[d] >= self.re_arr.shape[0]:
                    self.re_arr = np.r_[self.re_arr, np.zeros_like(self.re_arr)]
            tasks = self.by_doc[self.doc_ptr[d]:self.doc_ptr[d + 1]]
            owner = self.srv[tasks]
            for s2 in set(owner.tolist()).intersection(self.rows):
                self._new_receiver(s2, tasks[owner == s2], d, r, first)
        got[r] = max(got.get(r, 0), e)
        self.re_arr[self.doc_row[d], r] = got[r]
        self._receivers()

    def key(self, s: int, cand: tuple) -> tuple:
        """Order of donors: those needing more than one move (excess above the emptiest receiver's
        room) first, the most bytes first: each receiver takes about one piece, and such a donor's
        pieces cost about the same whatever their size (the KV prefix dominates), so it should get
        the largest rooms. Then the others by bytes per FLOP (``equal_flops``: all by ``-P``)."""
        if self.mode == "bytes" and self.load[s] - self.U > self.U - self.load[self.g]:
            return (0, -cand[1][5])
        return (1, cand[0])

    def run(self) -> bool:
        """Lazy heap over donors keyed by ``key`` of their best move; a popped donor is re-scored
        and moves only if its key is still no worse than the next donor's (stale) key."""
        first = self.best(list(self.live))
        heap = [(self.key(s, c), s) for s, c in first.items()]
        heapq.heapify(heap)
        reached = len(first) == len(self.live)
        while heap:
            _, s = heapq.heappop(heap)
            if self.load[s] <= self.U:
                continue
            cand = self.best([s]).get(s)
            if cand is None:
                reached = False
                continue
            key = self.key(s, cand)
            if heap and key > heap[0][0]:
                heapq.heappush(heap, (key, s))
                continue
            self.apply(s, cand[1])
            if self.load[s] > self.U:
                heapq.heappush(heap, (key, s))
        return reached and bool(np.all(self.load <= self.U))

    def placement(self) -> Placement:
        cols = [self.doc, self.a, self.b, self.home, self.srv]
        if self.new:
            extra = np.array(self.new, dtype=np.int64)
            cols = [np.r_[c, extra[:, i]] for i, c in enumerate(cols)]
        return Placement(*cols, n_servers=self.S)


def _check(layout: Layout, n_servers, tolerance: float, min_shard: int) -> int:
    if not isinstance(layout, Layout):
        raise ValueError(f"expected a Layout, got {type(layout).__name__}")
    S = layout.n_ranks if n_servers is None else int(n_servers)
    if S < 1:
        raise ValueError(f"n_servers must be >= 1 (or None for one server per rank), got {n_servers}")
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be >= 0 (max load <= (1 + tolerance) * mean), got {tolerance}")
    if min_shard < 1:
        raise ValueError(f"min_shard must be >= 1 token, got {min_shard}")
    return S


def place(layout: Layout, method: str = "cad", n_servers: int | None = None, model=None,
          tolerance: float = 0.1, min_shard: int = MIN_SHARD_TOKENS, dtype: str = "bf16",
          chunks: np.ndarray | None = None) -> Placement:
    """Run ``method`` (``cad``, ``equal_flops`` or ``colocated``) and return the tasks as arrays.
    ``chunks`` (from ``Layout.chunk_array``) may be passed to skip the O(chunks) layout conversion.
    ``meta['seconds']`` is the planning time including that conversion; ``meta['loop_seconds']`` the
    greedy alone."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
    S = _check(layout, n_servers, tolerance, min_shard)
    spec = as_model(model)
    qb, kvb = spec.q_bytes(dtype), spec.kv_bytes(dtype)
    t0 = time.perf_counter()
    ch = layout.chunk_array() if chunks is None else chunks
    g = _Greedy(ch, layout.n_docs, S, float(tolerance), min_shard, qb, kvb,
                "flops" if method == "equal_flops" else "bytes")
    before = float(g.load.max() / g.mean) if g.mean > 0 else 1.0
    t1 = time.perf_counter()
    reached = g.run() if method != "colocated" else bool(np.all(g.load <= g.U))
    t2 = time.perf_counter()
    out = g.placement()
    out.meta = {"method": method, "n_moves": g.n_moves, "n_splits": g.n_splits, "n_evaluations": g.n_evals,
                "seconds": time.perf_counter() - t0, "loop_seconds": t2 - t1, "tolerance": float(tolerance),
                "reached": reached, "min_shard": int(min_shard), "n_servers": S, "model": spec.name,
                "dtype": dtype, "imbalance_before": before,
                "imbalance_after": float(g.load.max() / g.mean) if g.mean > 0 else 1.0}
    return out


def schedule(layout: Layout, n_servers: int | None = None, model=None, tolerance: float = 0.1,
             min_shard: int = MIN_SHARD_TOKENS, dtype: str = "bf16") -> Plan:
    """DistCA's communication-aware greedy. Returns a validated ``Plan``; ``plan.meta`` records
    ``n_moves, n_splits, seconds, tolerance, reached`` (all servers ``<= (1 + tolerance) * mean``).

    A candidate moves ``k`` query tokens of task ``t`` (doc ``d``, ``[a, b)``, home ``h``) from donor
    ``s`` to receiver ``r``; the shard is ``[b-k, b)`` (end) or ``[a, a+k)`` (start) and needs the KV
    prefix ``[0, e)``. Its **priority** (lower first) is bytes per FLOP moved::

        priority = (q_bytes * k * ([h != r] - [h != s])
                    + kv_bytes * (max(0, e - cur_r(d)) - save_s(d))) / (4 * n_heads * head_dim * P)

    where ``P = pairs(shard)``, ``cur_r(d)`` is the prefix of ``d`` already on ``r`` (its own chunks'
    ends or an earlier shard: KV counted once per (server, doc)), and ``save_s(d)`` the prefix tokens
    ``s`` no longer fetches when ``t`` is its only task of ``d`` (whole move: ``a0`` if ``h == s`` else
    ``b``; end shard: ``k`` if ``h != s``). End vs start: an end shard has the most pairs per query
    token (token ``i`` carries ``i+1``), so it sends the fewest queries but needs the full prefix ``[0,
    b)``; a start shard sends more queries but only ``[0, a+k)``. For a receiver holding nothing of
    ``d`` and a small amount the start shard wins (at ``a = 0`` it costs ``(q+kv) sqrt(2P)`` bytes, the
    end shard ``kv b``); for a receiver that already holds the prefix (a neighbouring rank under
    sequential packing) the end shard wins. Both are scored, per candidate.

    Each donor's move is its lowest-priority candidate. Donors whose excess is above the emptiest
    receiver's room move first, the most bytes first: they need several pieces, each filling about
    one receiver and costing about its KV prefix whatever its size, so they should get the largest
    rooms (on ProLong at 64 servers this cuts bytes 2-6% below ``equal_flops``). Then the others, by
    priority.
    """
    p = place(layout, "cad", n_servers, model, tolerance, min_shard, dtype)
    return p.to_plan(layout)


def equal_flops(layout: Layout, n_servers: int | None = None, tolerance: float = 0.1,
                min_shard: int = MIN_SHARD_TOKENS) -> Plan:
    """Baseline water-filling that ignores bytes: the largest piece first (priority ``-P``), always to
    the least-loaded receiver, end shards only; same donor/receiver rules and shard sizes."""
    return place(layout, "equal_flops", n_servers, None, tolerance, min_shard).to_plan(layout)


def colocated(layout: Layout, n_servers: int | None = None) -> Plan:
    """Every task on server ``home % n_servers`` (on its own rank when ``n_servers == n_ranks``)."""
    return place(layout, "colocated", n_servers, None, 0.0, 1).to_plan(layout)

"""The CAD scheduler: place CA-tasks on attention servers so that core-attention FLOPs are balanced
while as few bytes as possible cross the network (DistCA's communication-aware greedy).

Start from the colocated placement: every chunk of the linear layout is one CA-task, served by
server ``home % n_servers`` (``home`` itself when there are as many servers as ranks). With
``mean = total pairs / n_servers`` and the ceiling ``U = (1 + tolerance) * mean``, servers above ``U``
are **donors** and servers below ``mean`` are **receivers**. A donor sheds
``x = min(load_s - U, mean - load_r, pairs(task))`` pairs to a receiver, either as a whole task or as
a query shard cut out of one (at the end or at the start of its query range), until every server is
at most ``U`` or no move is possible. Among all candidate moves the greedy takes the one with the
fewest bytes per FLOP first (see ``schedule``). Receivers never go above ``U`` and donors never
receive, so a donor never becomes a receiver again and the loop ends.

State lives in numpy arrays (one row per task, per-chunk ``(doc, server)`` prefix ends); a donor's
candidates are scored in one vectorised pass; a lazy heap keeps donors in order of their best move.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

import numpy as np

from .cost import MIN_SHARD_TOKENS, ModelSpec, causal_pairs
from .shard import Layout, Plan

METHODS = ("cad", "equal_flops", "colocated")


def _layout_arrays(layout: Layout) -> np.ndarray:
    """``[n_chunks, 4]`` int64 rows ``(doc, start, end, rank)`` in rank-major order."""
    rows = [(c.doc, c.start, c.end, r) for r, chunks in enumerate(layout.ranks) for c in chunks]
    return np.array(rows, dtype=np.int64).reshape(-1, 4)


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
        """Same ``[G, G]`` matrices as ``Plan.token_matrices``, from the layout's chunk rows
        (``_layout_arrays``), in O(chunks touched) instead of O(tokens): a server needs
        ``[0, max q_end)`` of each document it serves and receives the tokens of that prefix held by
        every rank but itself."""
        R, S = n_ranks, self.n_servers
        G = max(R, S)
        q = np.zeros((G, G), dtype=np.int64)
        remote = self.home != self.server
        np.add.at(q, (self.home[remote], self.server[remote]), (self.q_end - self.q_start)[remote])
        key = self.server * (int(self.doc.max(initial=0)) + 1) + self.doc
        uk, inv = np.unique(key, return_inverse=True)
        need = np.zeros(uk.size, dtype=np.int64)
        np.maximum.at(need, inv, self.q_end)
        n_docs = int(self.doc.max(initial=0)) + 1
        srv, doc = uk // n_docs, uk % n_docs
        order = np.argsort(chunks[:, 0], kind="stable")
        ch = chunks[order]
        ptr = np.searchsorted(ch[:, 0], np.arange(n_docs + 1))
        lo, cnt = ptr[doc], ptr[doc + 1] - ptr[doc]
        rows = np.repeat(np.arange(uk.size), cnt)
        j = lo[rows] + np.arange(cnt.sum()) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        held = np.clip(np.minimum(ch[j, 2], need[rows]) - ch[j, 1], 0, None)
        rank = ch[j, 3]
        keep = rank != srv[rows]
        kv = np.bincount(rank[keep] * G + srv[rows][keep], weights=held[keep], minlength=G * G)
        return q, kv.reshape(G, G).astype(np.int64)

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
    """Largest ``c >= 0`` with ``c(c+1) <= v`` (0 where ``v < 2``), exact for int64 ``v``."""
    v = np.maximum(v, 0)
    c = np.floor((np.sqrt(1.0 + 4.0 * v.astype(np.float64)) - 1.0) / 2.0).astype(np.int64)
    c -= c * (c + 1) > v                               # float sqrt is within one of exact here
    c += (c + 1) * (c + 2) <= v
    return c


def _cut(a, b, x, y, m, from_end: bool):
    """Query tokens ``k`` to move from task ``[a, b)``: the fewest with ``pairs >= x``, rounded to a
    valid shard (``m <= k <= n - m`` or ``k = n``); if that exceeds the receiver's room ``y``, the most
    with ``pairs <= y`` instead (0 if none is valid). Moved pairs of ``k`` tokens, solving the causal
    pair-count quadratic ``c(c+1) = b(b+1) - 2x`` (end shard ``[c, b)``) or ``e(e+1) = a(a+1) + 2x``
    (start shard ``[a, e)``). Returns ``(k, pairs)``."""
    n = b - a
    if from_end:
        k_up = b - _tri_le(b * (b + 1) - 2 * x)
        v = b * (b + 1) - 2 * y
        k_dn = b - np.where(v <= 0, 0, _tri_le(v - 1) + 1)
    else:
        k_up = _tri_le(a * (a + 1) + 2 * x - 1) + 1 - a
        k_dn = _tri_le(a * (a + 1) + 2 * y) - a
    k_up = np.maximum(k_up, m)
    k_up = np.where(k_up > n - m, n, k_up)
    k_dn = np.minimum(np.maximum(k_dn, 0), n)
    k_dn = np.where((k_dn < n) & (k_dn > n - m), n - m, k_dn)
    k_dn = np.where((k_dn < n) & (k_dn < m), 0, k_dn)

    def moved(k):
        lo, hi = (b - k, b) if from_end else (a, a + k)
        return (hi * (hi + 1) - lo * (lo + 1)) // 2

    p_up = moved(k_up)
    ok = p_up <= y
    k = np.where(ok, k_up, k_dn)
    return k, np.where(ok, p_up, moved(k_dn))


class _Greedy:
    """The move loop shared by ``schedule`` (``mode="bytes"``) and ``equal_flops`` (``mode="flops"``)."""

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
        key = self.srv * n_docs + self.doc
        _, inv, cnt = np.unique(key, return_inverse=True, return_counts=True)
        self.sole = cnt[inv] == 1                      # only task of its doc on its server
        # chunks by doc, each with the end of the prefix its (doc, server) already holds
        by = np.argsort(key, kind="stable")
        starts = np.flatnonzero(np.r_[True, np.diff(key[by]) != 0]) if by.size else by
        own_end = np.empty_like(self.b)
        if by.size:
            own_end[by] = np.repeat(np.maximum.reduceat(self.b[by], starts), np.diff(np.r_[starts, by.size]))
        order = np.argsort(self.doc, kind="stable")
        self.ch_srv, self.ch_end = self.srv[order], own_end[order]
        self.doc_ptr = np.searchsorted(self.doc[order], np.arange(n_docs + 1))
        by_srv = np.argsort(self.srv, kind="stable")
        ptr = np.searchsorted(self.srv[by_srv], np.arange(S + 1))
        self.live = {s: by_srv[ptr[s]:ptr[s + 1]] for s in np.flatnonzero(self.donor).tolist()}
        self.has_recv = np.zeros(n_docs, dtype=bool)
        self.recv_end: dict[int, dict[int, int]] = {}   # doc -> {server: max q_end received}
        self.new: list[tuple[int, int, int, int, int]] = []
        self.n_moves = self.n_splits = self.n_evals = 0

    def _own_end(self, d: int, r: int) -> int:
        lo, hi = self.doc_ptr[d], self.doc_ptr[d + 1]
        mine = self.ch_srv[lo:hi] == r
        return int(self.ch_end[lo:hi][mine].max()) if mine.any() else 0

    def best(self, donors: list[int]) -> dict:
        """Per donor, its lowest-priority move as ``{s: (priority, move)}`` (donors with no valid
        move are left out). All donors' candidates are scored in one vectorised pass."""
        self.n_evals += 1
        if not donors:
            return {}
        parts = []
        for s in donors:
            idx = self.live[s]
            parts.append(idx[self.srv[idx] == s])
            self.live[s] = parts[-1]
        idx = np.concatenate(parts)
        recv = self.load < self.U                      # not a donor now (ex-donors may receive)
        if not idx.size or not recv.any():
            return {}
        sv = np.repeat(np.asarray(donors, dtype=np.int64), [len(p) for p in parts])
        room = np.where(recv, self.U - self.load, -np.inf)
        g = int(np.argmax(room))
        t, r, cur, src = idx, np.full(idx.size, g), np.zeros(idx.size, dtype=np.int64), sv
        if self.mode == "bytes":                       # receivers holding part of the document
            d = self.doc[idx]
            lo, cnt = self.doc_ptr[d], self.doc_ptr[d + 1] - self.doc_ptr[d]
            rows = np.repeat(np.arange(idx.size), cnt)
            j = lo[rows] + np.arange(rows.size) - np.repeat(np.cumsum(cnt) - cnt, cnt)
            keep = recv[self.ch_srv[j]]
            rows, j = rows[keep], j[keep]
            t, r = np.concatenate((t, idx[rows])), np.concatenate((r, self.ch_srv[j]))
            cur, src = np.concatenate((cur, self.ch_end[j])), np.concatenate((src, sv[rows]))
            if self.recv_end:                          # receivers already sent part of the prefix
                hit = np.flatnonzero(self.has_recv[self.doc[t]])
                for i, dd, rr in zip(hit.tolist(), self.doc[t[hit]].tolist(), r[hit].tolist()):
                    cur[i] = max(cur[i], self.recv_end[dd].get(rr, 0))
                hit = np.flatnonzero(self.has_recv[self.doc[idx]])
                ti_, dd_ = idx[hit].tolist(), self.doc[idx[hit]].tolist()
                extra = [(ti, rr, max(e, self._own_end(dd, rr)), s)
                         for ti, dd, s in zip(ti_, dd_, sv[hit].tolist())
                         for rr, e in self.recv_end[dd].items() if recv[rr]]
                if extra:
                    ex = np.array(extra, dtype=np.int64)
                    t, r, cur, src = (np.concatenate((v, ex[:, i])) for i, v in enumerate((t, r, cur, src)))
        a, b, home = self.a[t], self.b[t], self.home[t]
        n, pairs = b - a, (b * (b + 1) - a * (a + 1)) // 2
        x = np.ceil(np.minimum(np.minimum(self.load[src] - self.U, room[r]), pairs)).astype(np.int64)
        x = np.maximum(x, 1)
        y = np.floor(self.U - self.load[r]).astype(np.int64)
        prios, moves = [], []
        for from_end in ((True, False) if self.mode == "bytes" else (True,)):
            k, p = _cut(a, b, x, y, self.m, from_end)
            valid = (k > 0) & (p > 0) & (p <= y)
            if self.mode == "flops":
                byt = np.zeros(p.size)
                prio = -p.astype(np.float64)
            else:
                whole = k == n
                e = np.where(from_end | whole, b, a + k)
                save = np.where(whole, np.where(home == src, self.a0[t], b), np.where(home == src, 0, k))
                save = np.where(self.sole[t] & (from_end | whole), save, 0)
                q = k * ((home != r).astype(np.int64) - (home != src))
                byt = self.qb * q + self.kvb * (np.maximum(e - cur, 0) - save)
                prio = byt / np.maximum(p, 1)
            prios.append(np.where(valid, prio, np.inf))
            moves.append((k, p, byt, from_end))
        prio = np.concatenate(prios)
        owner = np.tile(src, len(prios))
        order = np.lexsort((prio, owner))
        first = order[np.r_[True, owner[order][1:] != owner[order][:-1]]]
        out = {}
        for i in first.tolist():
            if np.isfinite(prio[i]):
                side, row = divmod(i, t.size)
                k, p, byt, from_end = moves[side]
                out[int(owner[i])] = (float(prio[i]), (int(t[row]), int(r[row]), from_end, int(k[row]),
                                                       int(p[row]), float(byt[row])))
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
        got = self.recv_end.setdefault(d, {})
        got[r] = max(got.get(r, 0), e)
        self.has_recv[d] = True

    def run(self) -> bool:
        """Lazy heap over donors keyed by their best move's priority; a popped donor is re-scored
        and moves only if it is still no worse than the next donor's (stale, optimistic) score."""
        first = self.best(list(self.live))
        heap = [(c[0], s) for s, c in first.items()]
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
            if heap and cand[0] > heap[0][0]:
                heapq.heappush(heap, (cand[0], s))
                continue
            self.apply(s, cand[1])
            if self.load[s] > self.U:
                heapq.heappush(heap, (cand[0], s))
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


def _model(model) -> ModelSpec:
    if model is None:
        return ModelSpec.from_name("llama3-8b")
    return ModelSpec.from_name(model) if isinstance(model, str) else model


def place(layout: Layout, method: str = "cad", n_servers: int | None = None, model=None,
          tolerance: float = 0.1, min_shard: int = MIN_SHARD_TOKENS, dtype: str = "bf16",
          chunks: np.ndarray | None = None) -> Placement:
    """Run ``method`` (``cad``, ``equal_flops`` or ``colocated``) and return the tasks as arrays.
    ``chunks`` (from ``_layout_arrays``) may be passed to skip the O(chunks) layout conversion.
    ``meta['seconds']`` is the planning time including that conversion; ``meta['loop_seconds']`` the
    greedy alone."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
    S = _check(layout, n_servers, tolerance, min_shard)
    spec = _model(model)
    qb, kvb = spec.q_bytes(dtype), spec.kv_bytes(dtype)
    t0 = time.perf_counter()
    ch = _layout_arrays(layout) if chunks is None else chunks
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
    ``s`` no longer fetches when ``t`` is its only task of ``d`` (whole move: ``a0`` if ``h == s``
    else ``b``). End vs start: an end shard has the most pairs per query token (token ``i`` carries
    ``i+1``), so it sends the fewest queries but needs the full prefix ``[0, b)``; a start shard sends
    more queries but only ``[0, a+k)``. For a receiver holding nothing of ``d`` and a small amount the
    start shard wins (at ``a = 0`` it costs ``(q+kv) sqrt(2P)`` bytes, the end shard ``kv b``); for a
    receiver that already holds the prefix (a neighbouring rank under sequential packing) the end shard
    wins. Both are scored, per candidate.
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

"""CA-tasks and layouts: the contract between packing, scheduling, dispatch and the servers.

* A **layout** is, per rank, a list of :class:`Chunk` ``(doc, start, end)`` token ranges. A rank may
  hold several non-contiguous ranges of one document (DistCA's head/tail chunks). Every token of
  every document lies in exactly one chunk. The linear layers run where the layout puts tokens.
* A **CA-task** ``(doc, q_start, q_end)`` is causal: query token ``i`` attends to KV tokens
  ``[0, i]`` of its document, so the task needs the KV prefix ``[0, q_end)``. Its query tokens all
  live on one ``home`` rank; ``server`` is the attention server that computes it.
* A **plan** is the list of tasks, each with its server, plus the layout it was made for.
  Communication follows from it: query tokens not already on their server, and the KV prefix tokens
  not already on their server, counted once per (server, doc).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import Iterable, NamedTuple, Sequence

import numpy as np

from .cost import MIN_SHARD_TOKENS, ModelSpec, causal_pairs, imbalance


class Chunk(NamedTuple):
    """Tokens ``[start, end)`` of document ``doc``, held by one rank."""

    doc: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass
class Layout:
    """Per rank, the token ranges it holds for the linear layers. ``validate()`` checks coverage."""

    ranks: list[list[Chunk]]
    doc_lens: list[int]

    def __post_init__(self):
        self.ranks = [[Chunk(*c) for c in r] for r in self.ranks]
        self.doc_lens = [int(n) for n in self.doc_lens]
        self.validate()

    @property
    def n_ranks(self) -> int:
        return len(self.ranks)

    @property
    def n_docs(self) -> int:
        return len(self.doc_lens)

    @property
    def total_tokens(self) -> int:
        return int(sum(self.doc_lens))

    def tokens_per_rank(self) -> np.ndarray:
        return np.array([sum(c.length for c in r) for r in self.ranks], dtype=np.int64)

    def validate(self) -> "Layout":
        """Raise ValueError unless every token of every document lies in exactly one chunk."""
        if self.n_ranks < 1:
            raise ValueError("a layout needs at least one rank")
        for i, n in enumerate(self.doc_lens):
            if n < 1:
                raise ValueError(f"document {i} has length {n}; document lengths must be >= 1")
        pieces: list[list[tuple[int, int, int]]] = [[] for _ in self.doc_lens]
        for rank, chunks in enumerate(self.ranks):
            for c in chunks:
                if not 0 <= c.doc < self.n_docs:
                    raise ValueError(f"rank {rank} holds chunk {tuple(c)} of unknown document "
                                     f"{c.doc}; valid documents are 0..{self.n_docs - 1}")
                if not 0 <= c.start < c.end <= self.doc_lens[c.doc]:
                    raise ValueError(f"rank {rank} holds chunk {tuple(c)}: need 0 <= start < end <= "
                                     f"{self.doc_lens[c.doc]} (length of document {c.doc})")
                pieces[c.doc].append((c.start, c.end, rank))
        for d, ps in enumerate(pieces):
            ps.sort()
            pos = 0
            for s, e, rank in ps:
                if s < pos:
                    raise ValueError(f"document {d}: tokens [{s}, {min(pos, e)}) are held twice "
                                     f"(again by rank {rank}); every token must be in exactly one chunk")
                if s > pos:
                    raise ValueError(f"document {d}: tokens [{pos}, {s}) are held by no rank; every "
                                     "token must be in exactly one chunk")
                pos = e
            if pos != self.doc_lens[d]:
                raise ValueError(f"document {d}: tokens [{pos}, {self.doc_lens[d]}) are held by no rank; "
                                 "every token must be in exactly one chunk")
        return self

    def owner_map(self) -> list[np.ndarray]:
        """Per document, an int array: the rank holding each token."""
        own = [np.empty(n, dtype=np.int64) for n in self.doc_lens]
        for rank, chunks in enumerate(self.ranks):
            for c in chunks:
                own[c.doc][c.start:c.end] = rank
        return own

    def chunk_array(self) -> np.ndarray:
        """``[n_chunks, 4]`` int64 rows ``(doc, start, end, rank)`` in rank-major order."""
        lens = [len(r) for r in self.ranks]
        n = sum(lens)
        out = np.empty((n, 4), dtype=np.int64)
        out[:, :3] = np.fromiter(chain.from_iterable(chain.from_iterable(self.ranks)), dtype=np.int64,
                                 count=3 * n).reshape(n, 3)
        out[:, 3] = np.repeat(np.arange(len(lens)), lens)
        return out

    def local_offsets(self) -> list[list[int]]:
        """Per rank, the offset of each chunk in that rank's packed local token buffer."""
        out = []
        for chunks in self.ranks:
            offs, pos = [], 0
            for c in chunks:
                offs.append(pos)
                pos += c.length
            out.append(offs)
        return out


class CATask(NamedTuple):
    """A core-attention task: query tokens ``[q_start, q_end)`` of ``doc`` with KV prefix
    ``[0, q_end)``, whose query tokens live on rank ``home`` and which runs on ``server``."""

    doc: int
    q_start: int
    q_end: int
    home: int
    server: int

    @property
    def n_q(self) -> int:
        return self.q_end - self.q_start

    @property
    def kv_len(self) -> int:
        return self.q_end

    @property
    def pairs(self) -> int:
        """``sum_{i=q_start}^{q_end-1} (i + 1)``."""
        return causal_pairs(self.q_start, self.q_end)


def layout_to_tasks(layout: Layout) -> list[CATask]:
    """One task per chunk, served where its tokens live (the colocated placement)."""
    return [CATask(c.doc, c.start, c.end, rank, rank)
            for rank, chunks in enumerate(layout.ranks) for c in chunks]


def split_task(task: CATask, cuts: Iterable[int], min_shard: int = MIN_SHARD_TOKENS) -> list[CATask]:
    """Cut a task's query range at absolute token positions ``cuts`` into consecutive shards.

    Every shard but a task that is already shorter than ``min_shard`` must keep at least
    ``min_shard`` query tokens; a cut that would leave a shorter piece raises ValueError."""
    if min_shard < 1:
        raise ValueError(f"min_shard must be >= 1, got {min_shard}")
    points = sorted(set(int(c) for c in cuts))
    for c in points:
        if not task.q_start < c < task.q_end:
            raise ValueError(f"cut {c} is outside the open query range ({task.q_start}, {task.q_end})")
    bounds = [task.q_start, *points, task.q_end]
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b - a < min_shard:
            raise ValueError(f"cut would leave a {b - a}-token shard [{a}, {b}) of document {task.doc}; "
                             f"shards must have >= min_shard={min_shard} tokens")
        out.append(task._replace(q_start=a, q_end=b))
    return out


def split_even(task: CATask, n: int, min_shard: int = MIN_SHARD_TOKENS) -> list[CATask]:
    """Cut a task into at most ``n`` shards of near-equal query length, none below ``min_shard``."""
    n = max(1, min(int(n), task.n_q // max(min_shard, 1)))
    if n == 1:
        return [task]
    cuts = [task.q_start + (task.n_q * k) // n for k in range(1, n)]
    return split_task(task, cuts, min_shard)


@dataclass
class Plan:
    """Tasks with their servers, plus the layout they were made for.

    ``n_servers`` defaults to the layout's rank count (every GPU is an attention server, in place)."""

    layout: Layout
    tasks: list[CATask]
    n_servers: int = 0
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        self.tasks = [CATask(*t) for t in self.tasks]
        if self.n_servers <= 0:
            self.n_servers = self.layout.n_ranks
        self.validate()

    def validate(self) -> "Plan":
        """Every query token of every document is in exactly one task, on the rank that holds it."""
        own = self.layout.owner_map()
        seen = [np.zeros(n, dtype=np.int64) for n in self.layout.doc_lens]
        for t in self.tasks:
            n = self.layout.doc_lens[t.doc] if 0 <= t.doc < self.layout.n_docs else -1
            if not 0 <= t.q_start < t.q_end <= n:
                raise ValueError(f"task {tuple(t)} lies outside its document")
            if not 0 <= t.server < self.n_servers:
                raise ValueError(f"task {tuple(t)} has server {t.server}; valid: 0..{self.n_servers - 1}")
            if np.any(own[t.doc][t.q_start:t.q_end] != t.home):
                raise ValueError(f"task {tuple(t)}: its query tokens are not all on home rank {t.home}")
            seen[t.doc][t.q_start:t.q_end] += 1
        for d, s in enumerate(seen):
            if np.any(s != 1):
                bad = int(np.flatnonzero(s != 1)[0])
                raise ValueError(f"document {d}, token {bad} is in {int(s[bad])} tasks; must be exactly 1")
        return self

    # -- loads ---------------------------------------------------------------------------------
    def server_pairs(self) -> np.ndarray:
        load = np.zeros(self.n_servers, dtype=np.float64)
        for t in self.tasks:
            load[t.server] += t.pairs
        return load

    def server_flops(self, model: ModelSpec, backward: bool = False, layers: int | None = 1) -> np.ndarray:
        """Core-attention FLOPs per server (one layer by default)."""
        return model.attention_flops(self.server_pairs(), backward=backward, layers=layers)

    def imbalance(self) -> float:
        """max / mean of the per-server attention load (1.0 = perfectly balanced)."""
        return imbalance(self.server_pairs())

    # -- communication ---------------------------------------------------------------------------
    def token_matrices(self) -> tuple[np.ndarray, np.ndarray]:
        """``(q_tokens, kv_tokens)``, each ``[src, dst]`` over ``max(n_ranks, n_servers)`` GPUs; see
        :func:`transfer_tokens`."""
        t = np.array(self.tasks, dtype=np.int64).reshape(-1, 5)
        return transfer_tokens(self.layout.chunk_array(), t[:, 0], t[:, 1], t[:, 2], t[:, 3], t[:, 4],
                               self.layout.n_ranks, self.n_servers)

    def bytes_matrix(self, model: ModelSpec, dtype: str = "bf16", backward: bool = False) -> np.ndarray:
        """Bytes ``[src, dst]`` between GPUs for one layer: Q and KV from homes/owners to servers, O
        and LSE from servers back to homes. With ``backward`` also the backward resend (q, k, v, o,
        dO, lse out; dq back, and dk, dv summed per (server, doc) back to the KV owners)."""
        q, kv = self.token_matrices()
        qb, kvb, ob, lb = model.q_bytes(dtype), model.kv_bytes(dtype), model.o_bytes(dtype), model.lse_bytes()
        out = q * qb + kv * kvb
        back = (q * (ob + lb)).T
        if backward:
            out = out + q * (qb + 2 * ob + lb) + kv * kvb      # q, o, dO, lse and k, v again
            back = back + (q * qb + kv * kvb).T                # dq, and dk, dv summed per (server, doc)
        return (out + back).astype(np.float64)

    def total_bytes(self, model: ModelSpec, dtype: str = "bf16", backward: bool = False) -> float:
        return float(self.bytes_matrix(model, dtype, backward).sum())


def layout_from_lists(ranks: Sequence[Sequence[Sequence[int]]], doc_lens: Sequence[int]) -> Layout:
    """Build a layout from plain nested lists ``[[(doc, start, end), ...], ...]``."""
    return Layout([[Chunk(*c) for c in r] for r in ranks], list(doc_lens))


def transfer_tokens(chunks: np.ndarray, doc, q_start, q_end, home, server, n_ranks: int,
                    n_servers: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens each GPU sends each GPU for one layer's dispatch, ``[src, dst]`` over
    ``G = max(n_ranks, n_servers)`` (rank ``g`` and server ``g`` are one GPU), in O(chunks):

    * ``q[h, s]``: query tokens of tasks homed on ``h`` and served on ``s != h``;
    * ``kv[o, s]``: KV tokens owned by ``o != s`` in ``[0, e_{s,d})`` of each document ``d`` that ``s``
      serves, ``e_{s,d} = max q_end`` over its tasks of ``d`` (counted once per (server, doc)).

    ``chunks`` are :meth:`Layout.chunk_array` rows; the task fields are parallel int arrays."""
    doc, q_start, q_end, home, server = (np.asarray(a, dtype=np.int64) for a in (doc, q_start, q_end,
                                                                                  home, server))
    G = max(n_ranks, n_servers)
    q = np.zeros((G, G), dtype=np.int64)
    remote = home != server
    np.add.at(q, (home[remote], server[remote]), (q_end - q_start)[remote])
    n_docs = int(max(doc.max(initial=0), chunks[:, 0].max(initial=0))) + 1
    uk, inv = np.unique(server * n_docs + doc, return_inverse=True)
    need = np.zeros(uk.size, dtype=np.int64)
    np.maximum.at(need, inv, q_end)
    srv, dd = uk // n_docs, uk % n_docs
    ch = chunks[np.argsort(chunks[:, 0], kind="stable")]
    ptr = np.searchsorted(ch[:, 0], np.arange(n_docs + 1))
    lo, cnt = ptr[dd], ptr[dd + 1] - ptr[dd]
    rows = np.repeat(np.arange(uk.size), cnt)
    j = lo[rows] + np.arange(cnt.sum()) - np.repeat(np.cumsum(cnt) - cnt, cnt)
    held = np.clip(np.minimum(ch[j, 2], need[rows]) - ch[j, 1], 0, None)
    owner = ch[j, 3]
    keep = owner != srv[rows]
    kv = np.bincount(owner[keep] * G + srv[rows][keep], weights=held[keep], minlength=G * G)
    return q, kv.reshape(G, G).astype(np.int64)

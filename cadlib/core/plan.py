"""CA-tasks and layouts: the contract between packing, scheduling, dispatch and the servers.

* A **layout** (:mod:`cadlib.core.layout`) is, per rank, a list of :class:`Chunk`
  ``(doc, start, end)`` token ranges. A rank may hold several non-contiguous ranges of one document
  (DistCA's head/tail chunks). Every token of every document lies in exactly one chunk. The linear
  layers run where the layout puts tokens.
* A **CA-task** ``(doc, q_start, q_end)`` is causal: query token ``i`` attends to KV tokens
  ``[0, i]`` of its document, so the task needs the KV prefix ``[0, q_end)``. Its query tokens all
  live on one ``home`` rank; ``server`` is the attention server that computes it.
* A **plan** is the list of tasks, each with its server, plus the layout it was made for.
  Communication follows from it: query tokens not already on their server, and the KV prefix tokens
  not already on their server, counted once per (server, doc).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from .cost import CAD_A2A, CAD_A2A_TO_SERVERS, ModelSpec, causal_pairs, imbalance
from .layout import Layout


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


# ---------------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------------

FIELDS = ("doc", "q_start", "q_end", "home", "server")


def check_n_servers(n_servers, n_ranks: int) -> int:
    if n_servers is None:
        return n_ranks
    if isinstance(n_servers, bool) or not isinstance(n_servers, (int, np.integer)) or n_servers < 1:
        raise ValueError(f"n_servers must be an integer >= 1 (or None for one server per rank), "
                         f"got {n_servers!r}")
    return int(n_servers)


class Plan:
    """CA-tasks with their servers, plus the layout they were made for.

    The tasks are held as parallel int64 arrays ``doc, q_start, q_end, home, server`` (``plan.tasks``
    gives them as :class:`CATask` records). ``Plan(layout, tasks, n_servers, meta)`` takes a list of
    tasks and validates it; :meth:`from_arrays` (the scheduler's per-step path) checks only ranges,
    in O(tasks); :meth:`validate` checks coverage and homes on demand. ``n_servers`` defaults to the
    layout's rank count (every GPU is an attention server, in place)."""

    def __init__(self, layout: Layout, tasks: Sequence, n_servers: int | None = None,
                 meta: dict | None = None, validate: bool = True):
        arr = np.array([tuple(t) for t in tasks], dtype=np.int64).reshape(-1, 5)
        self._init(layout, arr.T, n_servers, meta, None)
        if validate:
            self.validate()

    @classmethod
    def from_arrays(cls, layout: Layout, doc, q_start, q_end, home, server, n_servers: int | None = None,
                    meta: dict | None = None, chunks: np.ndarray | None = None, check: bool = True) -> "Plan":
        """A plan from parallel task arrays, without the coverage check (call :meth:`validate`).
        ``chunks`` (``layout.chunk_array()``) may be passed when already at hand. ``check=False`` skips
        the range checks too (for arrays the scheduler built from the layout's own chunks)."""
        self = cls.__new__(cls)
        self._init(layout, [doc, q_start, q_end, home, server], n_servers, meta, chunks, check)
        return self

    def _init(self, layout, cols, n_servers, meta, chunks, check: bool = True) -> None:
        if not isinstance(layout, Layout):
            raise ValueError(f"layout must be a cadlib.core.layout.Layout, got {type(layout).__name__}")
        self.layout = layout
        self.n_servers = check_n_servers(n_servers, layout.n_ranks)
        self.meta = dict(meta or {})
        self.doc, self.q_start, self.q_end, self.home, self.server = (
            np.ascontiguousarray(c, dtype=np.int64).reshape(-1) for c in cols)
        self._chunks = chunks
        self._tasks = None
        n = {c.size for c in (self.doc, self.q_start, self.q_end, self.home, self.server)}
        if len(n) != 1:
            raise ValueError(f"task arrays must have one length, got lengths {sorted(n)}")
        if not check:
            return
        lens = np.asarray(layout.doc_lens, dtype=np.int64)
        bad = ~((self.doc >= 0) & (self.doc < layout.n_docs))
        bad |= ~((0 <= self.q_start) & (self.q_start < self.q_end))
        bad[~bad] |= self.q_end[~bad] > lens[self.doc[~bad]]
        bad |= ~((0 <= self.home) & (self.home < layout.n_ranks))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"task {self._row(i)} lies outside its document or its home is not a rank "
                             f"(documents 0..{layout.n_docs - 1}, ranks 0..{layout.n_ranks - 1})")
        bad = ~((0 <= self.server) & (self.server < self.n_servers))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"task {self._row(i)} has server {int(self.server[i])}; "
                             f"valid: 0..{self.n_servers - 1}")

    def _row(self, i: int) -> tuple:
        return tuple(int(getattr(self, f)[i]) for f in FIELDS)

    @property
    def tasks(self) -> list[CATask]:
        """The tasks as :class:`CATask` records, in plan order (built once, on first use)."""
        if self._tasks is None:
            self._tasks = [CATask(*t) for t in zip(*(getattr(self, f).tolist() for f in FIELDS))]
        return self._tasks

    @property
    def n_tasks(self) -> int:
        return int(self.doc.size)

    def chunk_array(self) -> np.ndarray:
        """``layout.chunk_array()``, computed once per plan."""
        if self._chunks is None:
            self._chunks = self.layout.chunk_array()
        return self._chunks

    def __repr__(self) -> str:
        return (f"Plan({self.n_tasks} tasks, {self.layout.n_ranks} ranks, {self.n_servers} servers, "
                f"meta={self.meta})")

    def validate(self) -> "Plan":
        """Raise ValueError unless every query token of every document is in exactly one task, on the
        rank that holds it. Vectorised over tasks and chunks (sorting, no per-token work)."""
        lay = self.layout
        lens = np.asarray(lay.doc_lens, dtype=np.int64)
        big = int(lens.max()) + 1
        order = np.argsort(self.doc * big + self.q_start, kind="stable")   # by (doc, q_start)
        d, a, b = self.doc[order], self.q_start[order], self.q_end[order]
        first = np.r_[True, d[1:] != d[:-1]] if d.size else np.zeros(0, dtype=bool)
        last = np.r_[d[1:] != d[:-1], True] if d.size else first
        prev_end = np.where(first, 0, np.r_[0, b[:-1]])
        gap = a != prev_end                                 # a task starts where the previous ended
        short = last & (b != lens[d])                       # the last one ends at the document's end
        missing = np.setdiff1d(np.arange(lay.n_docs), d)
        if missing.size:
            raise ValueError(f"document {int(missing[0])}, token 0 is in 0 tasks; every query token must "
                             "be in exactly 1 task")
        if gap.any() or short.any():
            i = int(np.flatnonzero(gap | short)[0])
            if gap[i]:
                pos, count = int(min(a[i], prev_end[i])), (0 if a[i] > prev_end[i] else 2)
            else:
                pos, count = int(b[i]), 0
            raise ValueError(f"document {int(d[i])}, token {pos} is in {count} tasks; every query token "
                             "must be in exactly 1 task")
        # home: the range of one rank holding q_start must hold the whole task, on the task's home
        sc = lay.sorted_chunks()
        cs = np.stack([sc.doc, sc.start, sc.end, sc.rank], axis=1)
        join = (cs[1:, 0] == cs[:-1, 0]) & (cs[1:, 3] == cs[:-1, 3]) & (cs[1:, 1] == cs[:-1, 2])
        if join.any():                                      # one rank's neighbouring chunks: one range
            run = np.flatnonzero(np.r_[True, ~join])
            ends = cs[np.r_[run[1:], len(cs)] - 1, 2]
            cs = cs[run].copy()
            cs[:, 2] = ends
        j = np.searchsorted(cs[:, 0] * big + cs[:, 1], self.doc * big + self.q_start, side="right") - 1
        ok = (cs[j, 0] == self.doc) & (self.q_end <= cs[j, 2]) & (cs[j, 3] == self.home)
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            raise ValueError(f"task {self._row(i)}: its query tokens are not all on home rank "
                             f"{int(self.home[i])}")
        return self

    # -- loads ---------------------------------------------------------------------------------
    def server_pairs(self) -> np.ndarray:
        """Per server ``sum over its tasks of (b(b+1) - a(a+1)) / 2``."""
        return np.bincount(self.server, weights=causal_pairs(self.q_start, self.q_end).astype(np.float64),
                           minlength=self.n_servers)

    def server_flops(self, model: ModelSpec, backward: bool = False, layers: int | None = 1) -> np.ndarray:
        """Core-attention FLOPs per server (one layer by default)."""
        return model.attention_flops(self.server_pairs(), backward=backward, layers=layers)

    def imbalance(self) -> float:
        """max / mean of the per-server attention load (1.0 = perfectly balanced)."""
        return imbalance(self.server_pairs())

    # -- communication ---------------------------------------------------------------------------
    def token_matrices(self, local: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """``(q_tokens, kv_tokens)``, each ``[src, dst]`` over ``max(n_ranks, n_servers)`` GPUs; see
        :func:`transfer_tokens` (``local``: with the tokens a GPU serves itself on the diagonal)."""
        return transfer_tokens(self.chunk_array(), self.doc, self.q_start, self.q_end, self.home,
                               self.server, self.layout.n_ranks, self.n_servers, local=local)

    def forward_bytes(self, model: ModelSpec, dtype: str = "bf16") -> float:
        """Bytes dispatched for one layer's forward: ``q_tokens * q_bytes + kv_tokens * kv_bytes``."""
        q, kv = self.token_matrices()
        return float(q.sum() * model.q_bytes(dtype) + kv.sum() * model.kv_bytes(dtype))

    def bytes_matrix(self, model: ModelSpec, dtype: str = "bf16", backward: bool = False,
                     resend: bool = False) -> np.ndarray:
        """Bytes ``[src, dst]`` between GPUs for one layer, as the CAD stages move them
        (:mod:`cadlib.runtime.stages`): Q and KV from homes and owners to servers, O from the servers back
        to the homes; with ``backward`` also dO out to the servers, and dQ and dK, dV (summed per
        (server, doc)) back, the servers having kept what they received. ``resend``: DistCA's stateless
        servers instead (the LSE returns with O; the backward sends dO, O, LSE, Q and K, V again;
        :meth:`ModelSpec.cad_a2a_bytes`)."""
        q, kv = self.token_matrices()
        per = model.cad_a2a_bytes(resend, dtype)
        out = 0
        for name in CAD_A2A if backward else CAD_A2A[:2]:
            bq, bkv = per[name]
            m = q * bq + kv * bkv
            out = out + (m if name in CAD_A2A_TO_SERVERS else m.T)
        return out.astype(np.float64)

    def total_bytes(self, model: ModelSpec, dtype: str = "bf16", backward: bool = False) -> float:
        return float(self.bytes_matrix(model, dtype, backward).sum())


def transfer_tokens(chunks: np.ndarray, doc, q_start, q_end, home, server, n_ranks: int,
                    n_servers: int, local: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Tokens each GPU sends each GPU for one layer's dispatch, ``[src, dst]`` over
    ``G = max(n_ranks, n_servers)`` (rank ``g`` and server ``g`` are one GPU), in O(chunks):

    * ``q[h, s]``: query tokens of tasks homed on ``h`` and served on ``s != h``;
    * ``kv[o, s]``: KV tokens owned by ``o != s`` in ``[0, e_{s,d})`` of each document ``d`` that ``s``
      serves, ``e_{s,d} = max q_end`` over its tasks of ``d`` (counted once per (server, doc)).

    ``local``: also ``s == h`` and ``o == s`` on the diagonal, the tokens a GPU serves itself (DistCA's
    all-to-all copies those through its buffer too). ``chunks`` are :meth:`Layout.chunk_array` rows;
    the task fields are parallel int arrays."""
    doc, q_start, q_end, home, server = (np.asarray(a, dtype=np.int64) for a in (doc, q_start, q_end,
                                                                                  home, server))
    G = max(n_ranks, n_servers)
    q = np.zeros((G, G), dtype=np.int64)
    remote = np.ones(home.shape, dtype=bool) if local else home != server
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
    keep = np.ones(owner.shape, dtype=bool) if local else owner != srv[rows]
    kv = np.bincount(owner[keep] * G + srv[rows][keep], weights=held[keep], minlength=G * G)
    return q, kv.reshape(G, G).astype(np.int64)


def merge_groups(doc, a, b) -> np.ndarray:
    """Per task (in call order), its merged segment: a new one unless the task continues the previous
    task's query range in the same document (``doc`` equal and ``a == previous b``)."""
    doc, a, b = (np.asarray(x, dtype=np.int64) for x in (doc, a, b))
    if not doc.size:
        return np.zeros(0, dtype=np.int64)
    cont = np.r_[False, (doc[1:] == doc[:-1]) & (a[1:] == b[:-1])]
    return np.cumsum(~cont) - 1

"""Nano-batches as per-document cuts: whole documents (the default) or documents cut between A and B,
or DistCA's: two batches of sequences, each laid over all ranks (:func:`sequence_layout`).

A cut ``c_d`` in ``[0, L_d]`` per document puts positions ``< c_d`` in nano-batch A and ``>= c_d`` in
B (``c_d = L_d``: all in A, ``0``: all in B). A stays self-contained: every query of A attends to a
prefix that is in A. B's queries ``[c_d, L_d)`` of a cut document also attend to ``[0, c_d)``, which
are A's tokens (on whatever ranks hold them), so B's layout carries them as **KV-only context
chunks**: each rank's list is its query chunks, then the chunks of A it holds of B's cut documents.
B's layout is thus an ordinary :class:`~cadlib.core.layout.Layout` (every token of every B document in one
chunk) and :func:`cadlib.dispatch.build.build_dispatch` needs no change: a rank's local buffer is its B
query rows followed by its context rows, the KV exchange sends context rows like any other KV row and
no task has a query there. Only B's **plan** covers less than its layout (queries ``[c_d, L_d)``), so
``Plan.validate()`` does not apply to it; :func:`schedule_nano` schedules the query chunks alone.

At run time (:func:`cadlib.runtime.pingpong.pingpong_layers`) B's send stage takes
``cat([q_B, zeros])``, ``cat([k_B, k_A[context]])``, ``cat([v_B, v_A[context]])`` (``context``: this
rank's rows of A's local buffer, :attr:`NanoBatch.context`), and keeps only the first ``n_B`` rows of
what its return stage gives back. Gradients of the gathered rows flow back into A's k, v.

The cuts (:func:`refine_cuts`) start from the whole-document assignment and improve it by coordinate
descent: documents largest first, each gets the cut that minimises ``sum_r (w_A[r] - w_B[r])^2`` with
the others fixed, among 0, ``L_d``, its chunk boundaries and, inside each chunk long enough to give two
pieces of at least ``min_piece`` tokens, the best point of ``[start + min_piece, end - min_piece]``;
a cut changes only when it lowers the sum, so the result is never worse than whole documents.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import numpy as np

from ..core.cost import MIN_SHARD_TOKENS, causal_pairs
from ..core.layout import Chunk, Layout
from ..core.plan import Plan
from ..data.packing import pack
from . import scheduler


@dataclass
class NanoBatch:
    """One nano-batch: its layout over the same ranks (documents renumbered 0..), the global document
    of each of its documents, and per rank the rows of that rank's full local buffer it takes.

    ``context[r]`` (B of a cutting split only): rows of nano-batch A's local buffer on rank ``r`` whose
    K, V this nano-batch's attention reads; they are the last ``len(context[r])`` rows of its local
    buffer, ``n_context_chunks[r]`` chunks at the end of ``layout.ranks[r]``."""

    layout: Layout
    docs: np.ndarray
    rows: list[np.ndarray]
    context: list[np.ndarray] = field(default_factory=list)
    n_context_chunks: list[int] = field(default_factory=list)

    @property
    def has_context(self) -> bool:
        return any(len(c) for c in self.context)

    def query_chunks(self) -> np.ndarray:
        """``layout.chunk_array()`` without the KV-only context chunks (rank-major)."""
        ch = self.layout.chunk_array()
        if not self.has_context:
            return ch
        keep = np.concatenate([np.arange(len(r)) < len(r) - n
                               for r, n in zip(self.layout.ranks, self.n_context_chunks)])
        return ch[keep]


def build_nano_batches(layout: Layout, cuts) -> tuple[NanoBatch, NanoBatch]:
    """Nano-batches A (positions ``< cuts[d]``) and B (the rest, plus A's tokens of the documents it
    shares as context). Each rank keeps its chunks' order in both halves."""
    lens = np.asarray(layout.doc_lens, dtype=np.int64)
    cuts = np.asarray(cuts, dtype=np.int64)
    if cuts.shape != lens.shape or np.any(cuts < 0) or np.any(cuts > lens):
        raise ValueError(f"cuts must hold one integer in [0, L_d] per document ({lens.size} documents)")
    docs_a, docs_b = np.flatnonzero(cuts > 0), np.flatnonzero(cuts < lens)
    ren_a = np.full(lens.size, -1, dtype=np.int64)
    ren_a[docs_a] = np.arange(docs_a.size)
    ren_b = np.full(lens.size, -1, dtype=np.int64)
    ren_b[docs_b] = np.arange(docs_b.size)
    ra, rb, rows_a, rows_b, context, n_ctx = [], [], [], [], [], []
    for chunks, offs in zip(layout.ranks, layout.local_offsets()):
        ca, cb, cc, ia, ib, ic, pos_a = [], [], [], [], [], [], 0
        for c, o in zip(chunks, offs):
            cut = int(cuts[c.doc])
            if c.start < cut:                                  # A's piece [start, min(end, cut))
                e = min(c.end, cut)
                ca.append(Chunk(int(ren_a[c.doc]), c.start, e))
                ia.append(np.arange(o, o + e - c.start))
                if cut < lens[c.doc]:                          # a cut document: B reads it as context
                    cc.append(Chunk(int(ren_b[c.doc]), c.start, e))
                    ic.append(np.arange(pos_a, pos_a + e - c.start))
                pos_a += e - c.start
            if c.end > cut:                                    # B's piece [max(start, cut), end)
                s = max(c.start, cut)
                cb.append(Chunk(int(ren_b[c.doc]), s, c.end))
                ib.append(np.arange(o + s - c.start, o + c.length))
        cat = [np.concatenate(x).astype(np.int64) if x else np.zeros(0, dtype=np.int64) for x in (ia, ib, ic)]
        ra.append(ca)
        rb.append(cb + cc)
        rows_a.append(cat[0])
        rows_b.append(cat[1])
        context.append(cat[2])
        n_ctx.append(len(cc))
    a = NanoBatch(Layout(ra, cuts[docs_a].tolist()), docs_a, rows_a)
    b = NanoBatch(Layout(rb, lens[docs_b].tolist()), docs_b, rows_b,
                  context if any(n_ctx) else [], n_ctx if any(n_ctx) else [])
    return a, b


def check_min_piece(min_piece) -> int:
    if isinstance(min_piece, bool) or not isinstance(min_piece, numbers.Integral) or min_piece < 1:
        raise ValueError(f"min_piece must be an integer >= 1 token, got {min_piece!r}")
    return int(min_piece)


def _weight(balance: str):
    return (lambda a, b: b - a) if balance == "tokens" else causal_pairs


def refine_cuts(layout: Layout, cuts, balance: str = "tokens", min_piece: int = 512,
                max_passes: int = 4) -> np.ndarray:
    """Improve per-document cuts (see the module docstring) so that every rank's two nano-batches
    carry about the same weight (``balance``: ``"tokens"`` or causal ``"attention"`` pairs). A cut
    inside a chunk leaves both of its pieces at least ``min_piece`` tokens long. Returns new cuts."""
    check_min_piece(min_piece)
    W = _weight(balance)
    R, m = layout.n_ranks, int(min_piece)
    lens = np.asarray(layout.doc_lens, dtype=np.int64)
    cuts = np.array(cuts, dtype=np.int64)
    ch = layout.chunk_array()
    ch = ch[np.lexsort((ch[:, 1], ch[:, 0]))]
    ptr = np.searchsorted(ch[:, 0], np.arange(layout.n_docs + 1))

    def contrib(j, c):
        """Per rank ``w_A - w_B`` of document chunks ``j`` cut at ``c``."""
        s, e = ch[j, 1], ch[j, 2]
        x = np.clip(c, s, e)
        return np.bincount(ch[j, 3], weights=(W(s, x) - W(x, e)).astype(np.float64), minlength=R)

    diff = np.zeros(R)
    for d in range(layout.n_docs):
        diff += contrib(np.arange(ptr[d], ptr[d + 1]), cuts[d])
    order = sorted(range(layout.n_docs), key=lambda d: (-float(W(0, lens[d])), d))
    for _ in range(max_passes):
        changed = False
        for d in order:
            j = np.arange(ptr[d], ptr[d + 1])
            rest = diff - contrib(j, cuts[d])

            def cost(c):
                return float(((rest + contrib(j, c)) ** 2).sum())

            cands = [int(cuts[d]), 0, int(lens[d]), *ch[j[1:], 1].tolist()]
            for i in j:
                lo, hi, r = int(ch[i, 1]) + m, int(ch[i, 2]) - m, int(ch[i, 3])
                if lo > hi:
                    continue
                while lo < hi:                 # first c with rank r's balance >= 0 (monotone in c)
                    mid = (lo + hi) // 2
                    if rest[r] + contrib(j, mid)[r] >= 0:
                        hi = mid
                    else:
                        lo = mid + 1
                cands += [lo, max(lo - 1, int(ch[i, 1]) + m)]
            best, best_cost = cands[0], cost(cands[0])
            for c in cands[1:]:
                cc = cost(c)
                if cc < best_cost:
                    best, best_cost = c, cc
            if best != cuts[d]:
                cuts[d], changed = best, True
            diff = rest + contrib(j, cuts[d])
        if not changed:
            break
    return cuts


BALANCE = ("tokens", "attention")


def split_nano_batches(layout: Layout, balance: str = "tokens", split_docs: bool = False,
                       min_piece: int = MIN_SHARD_TOKENS) -> tuple[NanoBatch, NanoBatch]:
    """Assign whole documents to nano-batch A or B, largest first, each to the side that keeps
    ``sum_r (w_A[r] - w_B[r])^2`` smallest, ``w`` = tokens per rank (``balance="tokens"``) or causal
    attention pairs per rank (``"attention"``). Each rank keeps its chunks' order in both halves.

    ``split_docs=True``: then cut documents between A and B where that lowers the same sum (a prefix
    in A, the rest in B, whose layout carries A's part as KV-only context; no cut leaves a piece of a
    chunk shorter than ``min_piece`` tokens): :mod:`cadlib.scheduling.nanosplit`."""
    if balance not in BALANCE:
        raise ValueError(f"unknown balance {balance!r}; choose one of: {', '.join(BALANCE)}")
    if not isinstance(split_docs, (bool, np.bool_)):
        raise ValueError(f"split_docs must be True or False, got {split_docs!r}")
    check_min_piece(min_piece)
    R = layout.n_ranks
    per_doc: list[list[tuple[int, float]]] = [[] for _ in range(layout.n_docs)]
    for r, chunks in enumerate(layout.ranks):
        for c in chunks:
            w = c.length if balance == "tokens" else causal_pairs(c.start, c.end)
            per_doc[c.doc].append((r, float(w)))
    side = np.zeros(layout.n_docs, dtype=np.int64)
    diff = np.zeros(R)                      # w_A - w_B per rank
    order = sorted(range(layout.n_docs), key=lambda d: -sum(w for _, w in per_doc[d]))
    for d in order:
        ranks = np.array([r for r, _ in per_doc[d]], dtype=np.int64)
        w = np.zeros(R)
        np.add.at(w, ranks, [x for _, x in per_doc[d]])
        to_a = float(((diff + w) ** 2).sum())
        to_b = float(((diff - w) ** 2).sum())
        side[d] = 0 if to_a <= to_b else 1
        diff += w if side[d] == 0 else -w
    cuts = np.where(side == 0, np.asarray(layout.doc_lens, dtype=np.int64), 0)
    if split_docs:
        cuts = refine_cuts(layout, cuts, balance, min_piece)
    return build_nano_batches(layout, cuts)


def schedule_nano(nb: NanoBatch, method: str = "cad", **kw) -> Plan:
    """:func:`cadlib.scheduling.scheduler.schedule` of a nano-batch (``kw``: its arguments), or another
    :func:`~cadlib.scheduling.scheduler.place` ``method`` (``distca``). With context chunks,
    the scheduler sees the query chunks alone (pairs from their true positions, a task ``[a, b)``
    over its whole prefix ``[0, b)``); its byte estimate then counts A's context rows as fetched even
    where a server's rank holds them. The plan is made for the full layout, so the dispatch is exact."""
    if not nb.has_context:
        if method == "cad":
            return scheduler.schedule(nb.layout, **kw)
        return scheduler.place(nb.layout, method, **kw)
    p = scheduler.place(nb.layout, method, chunks=nb.query_chunks(), **kw)
    return Plan.from_arrays(nb.layout, p.doc, p.q_start, p.q_end, p.home, p.server, n_servers=p.n_servers,
                            meta=p.meta)


def imbalance_per_rank(a: NanoBatch, b: NanoBatch) -> np.ndarray:
    """Per rank ``|tokens of A - query tokens of B|``."""
    return np.abs(np.array([len(r) for r in a.rows]) - np.array([len(r) for r in b.rows]))


def sequence_layout(seqs_a, seqs_b, n_ranks: int) -> Layout:
    """DistCA's nano-batches as one layout: nano-batch A's documents (the sequences ``seqs_a``, ping)
    laid over all ``n_ranks`` ranks as DistCA places them (:func:`cadlib.data.packing.pack`'s
    ``distca``: in order, a document crossing ranks dealt out head and tail), then B's (``seqs_b``,
    pong) the same way; rank ``r`` holds its A chunks, then its B chunks. Documents are numbered A's
    first. Each half must split evenly over the ranks. No document is shared by A and B, so the
    split is :func:`halves` of this layout (whole documents, no context)."""
    docs_a = [int(n) for s in seqs_a for n in s]
    docs_b = [int(n) for s in seqs_b for n in s]
    for name, docs in (("seqs_a", docs_a), ("seqs_b", docs_b)):
        if not docs or sum(docs) % n_ranks:
            raise ValueError(f"{name} must hold tokens that split evenly over {n_ranks} ranks, got "
                             f"{sum(docs)} tokens")
    if sum(docs_a) != sum(docs_b):
        raise ValueError(f"ping and pong must hold as many tokens: {sum(docs_a)} != {sum(docs_b)}")
    la = pack(docs_a, n_ranks, sum(docs_a) // n_ranks, method="distca")
    lb = pack(docs_b, n_ranks, sum(docs_b) // n_ranks, method="distca")
    off = len(docs_a)
    ranks = [list(a) + [Chunk(c.doc + off, c.start, c.end) for c in b] for a, b in zip(la.ranks, lb.ranks)]
    return Layout(ranks, docs_a + docs_b)


def distca_layout(doc_lens, n_ranks: int) -> Layout:
    """:func:`sequence_layout` of a batch whose documents, in order, make up ping (the first half of the
    tokens) and pong (the rest): a batch of sequences (:func:`cadlib.data.sequences.step_sequences`)."""
    lens = [int(n) for n in doc_lens]
    ends = np.cumsum(lens)
    half = int(ends[-1]) // 2 if lens else 0
    i = int(np.searchsorted(ends, half)) + 1 if lens else 0
    if not lens or ends[-1] % 2 or ends[i - 1] != half:
        raise ValueError("nano_split='distca' needs a batch of two halves of whole documents (sequences "
                         "of ping, then of pong: a Recipe with a sequence_len)")
    return sequence_layout([lens[:i]], [lens[i:]], n_ranks)


def halves(layout: Layout) -> tuple[NanoBatch, NanoBatch]:
    """DistCA's nano-batches of a :func:`sequence_layout`: A the documents that make up the first half
    of the tokens (in document order), B the rest; whole documents, each with its own layout."""
    lens = np.asarray(layout.doc_lens, dtype=np.int64)
    ends = np.cumsum(lens)
    n_a = int(np.searchsorted(ends, ends[-1] // 2)) + 1 if lens.size else 0
    if not lens.size or ends[-1] % 2 or ends[n_a - 1] != ends[-1] // 2:
        raise ValueError("nano_split='distca' needs a batch of two halves of whole documents (sequences "
                         "of ping, then of pong: cadlib.scheduling.recipes.batch_docs with a sequence_len)")
    return build_nano_batches(layout, np.where(np.arange(lens.size) < n_a, lens, 0))

"""The linear layout: which rank holds which token ranges of which document for the linear layers.

A :class:`Layout` is, per rank, a list of :class:`Chunk` ``(doc, start, end)`` token ranges; a rank
may hold several non-contiguous ranges of one document (DistCA's head/tail chunks), and every token of
every document lies in exactly one chunk. A rank's **local buffer** is its chunks' tokens one after
another, in list order.

The per-step path (layout -> plan -> dispatch metadata) reads a layout as arrays, never as Python
objects: one ``[n_chunks, 4]`` int64 array ``(doc, start, end, rank)``, rank-major. Converting 270K
:class:`Chunk` objects into that array alone costs ~50 ms on a 2-core host (DistCA's head/tail layout
at 64 ranks x 512K tokens), the whole budget of a step's host work. So the array is the layout's
primary form: it is built and validated once, at construction (:meth:`Layout.from_chunks` takes it
directly, as the packers produce it), together with the chunks sorted by ``(doc, start)``
(:meth:`Layout.sorted_chunks`, what the dispatch looks token ranges up in), and the per-rank lists
``layout.ranks`` are materialised only when something asks for them. A layout is immutable after
construction: edit a copy of ``ranks`` and build a new one.
"""
from __future__ import annotations

from itertools import chain
from typing import NamedTuple, Sequence

import numpy as np

from .ranges import excl


class Chunk(NamedTuple):
    """Tokens ``[start, end)`` of document ``doc``, held by one rank."""

    doc: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


class SortedChunks:
    """A layout's chunks sorted by ``(doc, start)``: the pieces of any token range ``[a, b)`` of a
    document are found by binary search on ``key = doc * big + start``. ``ptr[d]:ptr[d + 1]``:
    document ``d``'s chunks; ``order``: their rows in :meth:`Layout.chunk_array` (where a rank's
    chunks, in local order, give their local rows: :meth:`Layout.offsets`); ``doc`` (``key // big``)
    is computed on first use."""

    __slots__ = ("key", "start", "end", "rank", "ptr", "order", "big", "_doc")

    def __init__(self, key, start, end, rank, ptr, order, big: int):
        self.key, self.start, self.end, self.rank = key, start, end, rank
        self.ptr, self.order, self.big, self._doc = ptr, order, big, None

    @property
    def doc(self) -> np.ndarray:
        if self._doc is None:
            self._doc = _frozen(self.key // self.big)
        return self._doc


def _immutable(a: np.ndarray) -> bool:
    """An int64 C-contiguous array no one can write through (it and its base read-only): shared."""
    base = a.base if isinstance(a.base, np.ndarray) else None
    return (a.dtype == np.int64 and a.flags.c_contiguous and not a.flags.writeable
            and (base is None or not base.flags.writeable) and (a.base is None or base is not None))


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


class Layout:
    """Per rank, the token ranges it holds for the linear layers (validated at construction).

    ``Layout(ranks, doc_lens)`` takes per-rank lists of chunks (:class:`Chunk` or ``(doc, start,
    end)`` tuples); :meth:`from_chunks` takes the ``[n_chunks, 4]`` array form. Both raise ValueError
    unless every token of every document lies in exactly one chunk."""

    def __init__(self, ranks: Sequence[Sequence], doc_lens: Sequence[int]):
        ranks = [list(r) for r in ranks]
        flat = list(chain.from_iterable(ranks))
        if not set(map(type, flat)) <= {Chunk}:        # tuples: checked and converted one by one
            ranks = [[c if type(c) is Chunk else Chunk(*c) for c in r] for r in ranks]
            flat = list(chain.from_iterable(ranks))
        n = len(flat)
        ch = np.empty((n, 4), dtype=np.int64)
        ch[:, :3] = np.fromiter(chain.from_iterable(flat), dtype=np.int64, count=3 * n).reshape(n, 3)
        ch[:, 3] = np.repeat(np.arange(len(ranks)), [len(r) for r in ranks])
        self._init(ch, doc_lens, len(ranks), ranks)

    @classmethod
    def from_chunks(cls, chunks, doc_lens: Sequence[int], n_ranks: int) -> "Layout":
        """A layout from its array form: rows ``(doc, start, end, rank)``, each rank's chunks in its
        local buffer order (rows of different ranks may interleave; they are grouped stably), and
        ``n_ranks`` (ranks may hold nothing). O(chunks), no Python object per chunk."""
        if isinstance(n_ranks, bool) or not isinstance(n_ranks, (int, np.integer)):
            raise ValueError(f"n_ranks must be an integer >= 1, got {n_ranks!r}")
        arr = np.asarray(chunks)
        if arr.size == 0:
            arr = arr.reshape(0, 4)
        if arr.ndim != 2 or arr.shape[1] != 4 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"chunks must be an integer array [n_chunks, 4] of (doc, start, end, rank) "
                             f"rows; got {arr.dtype} {arr.shape}")
        ch = arr if _immutable(arr) else np.array(arr, dtype=np.int64)     # else a copy: ours
        bad = (ch[:, 3] < 0) | (ch[:, 3] >= n_ranks)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"chunks row {i} {tuple(ch[i].tolist())} names rank {ch[i, 3]}; valid ranks "
                             f"are 0..{int(n_ranks) - 1} (n_ranks={n_ranks})")
        if ch.shape[0] and (np.diff(ch[:, 3]) < 0).any():
            ch = ch[np.argsort(ch[:, 3], kind="stable")]
        self = cls.__new__(cls)
        self._init(ch, doc_lens, int(n_ranks), None)
        return self

    def _init(self, ch: np.ndarray, doc_lens, n_ranks: int, ranks) -> None:
        self.doc_lens = [int(n) for n in doc_lens]
        self._n_ranks = n_ranks
        self._ranks = ranks
        self._ch = _frozen(ch)
        self._sorted = None
        self.validate()

    # -- the per-rank lists, materialised on demand -------------------------------------------------
    @property
    def ranks(self) -> list[list[Chunk]]:
        """Per rank, its chunks in local buffer order (built from the array on first use)."""
        if self._ranks is None:
            rows = map(Chunk._make, self._ch[:, :3].tolist())
            self._ranks = [[next(rows) for _ in range(k)] for k in np.diff(self.rank_ptr()).tolist()]
        return self._ranks

    def __eq__(self, other) -> bool:
        if not isinstance(other, Layout):
            return NotImplemented
        return (self.n_ranks == other.n_ranks and self.doc_lens == other.doc_lens
                and np.array_equal(self._ch, other._ch))

    __hash__ = None

    def __repr__(self) -> str:
        return f"Layout(ranks={self.ranks!r}, doc_lens={self.doc_lens!r})"

    def __getstate__(self):
        return {"_ch": np.array(self._ch), "doc_lens": self.doc_lens, "_n_ranks": self._n_ranks}

    def __setstate__(self, state):
        self._init(state["_ch"], state["doc_lens"], state["_n_ranks"], None)

    @property
    def n_ranks(self) -> int:
        return self._n_ranks

    @property
    def n_docs(self) -> int:
        return len(self.doc_lens)

    @property
    def total_tokens(self) -> int:
        return int(sum(self.doc_lens))

    def tokens_per_rank(self) -> np.ndarray:
        d, a, b, rank = self._ch.T
        return np.bincount(rank, weights=b - a, minlength=self.n_ranks).astype(np.int64)

    def chunk_array(self) -> np.ndarray:
        """``[n_chunks, 4]`` int64 rows ``(doc, start, end, rank)`` in rank-major order (read-only)."""
        return self._ch

    def rank_ptr(self) -> np.ndarray:
        """Rank ``r``'s chunks are rows ``rank_ptr[r]:rank_ptr[r + 1]`` of :meth:`chunk_array`."""
        return np.searchsorted(self._ch[:, 3], np.arange(self.n_ranks + 1))

    def sorted_chunks(self) -> SortedChunks:
        """The chunks sorted by ``(doc, start)`` with their local rows (computed once)."""
        if self._sorted is None:
            self._sort()
        return self._sorted

    def validate(self) -> "Layout":
        """Raise ValueError unless every token of every document lies in exactly one chunk (vectorised:
        chunks sorted by ``(doc, start)`` must tile each document)."""
        if self.n_ranks < 1:
            raise ValueError("a layout needs at least one rank")
        lens = np.asarray(self.doc_lens, dtype=np.int64)
        if (lens < 1).any():
            i = int(np.flatnonzero(lens < 1)[0])
            raise ValueError(f"document {i} has length {lens[i]}; document lengths must be >= 1")
        ch = self._ch
        d, a, b, rank = ch.T
        bad = (d < 0) | (d >= self.n_docs)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"rank {rank[i]} holds chunk {tuple(ch[i, :3].tolist())} of unknown document "
                             f"{d[i]}; valid documents are 0..{self.n_docs - 1}")
        bad = (a < 0) | (a >= b) | (b > lens[d])
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"rank {rank[i]} holds chunk {tuple(ch[i, :3].tolist())}: need 0 <= start < end "
                             f"<= {lens[d[i]]} (length of document {d[i]})")
        s = self.sorted_chunks()
        missing = np.flatnonzero(s.ptr[1:] == s.ptr[:-1])
        if missing.size:
            m = int(missing[0])
            raise ValueError(f"document {m}: tokens [0, {lens[m]}) are held by no rank; every token must be "
                             "in exactly one chunk")
        a, b = s.start, s.end
        prev = np.empty_like(b)                                 # where the previous chunk ended
        prev[1:] = b[:-1]
        prev[s.ptr[:-1]] = 0                                    # a document's first chunk: at 0
        gap = a != prev
        short = np.zeros(a.size, dtype=bool)
        short[s.ptr[1:] - 1] = b[s.ptr[1:] - 1] != lens        # its last chunk ends at its end
        if gap.any() or short.any():
            i = int(np.flatnonzero(gap | short)[0])
            di = int(s.doc[i])
            if gap[i] and a[i] < prev[i]:
                raise ValueError(f"document {di}: tokens [{a[i]}, {min(prev[i], b[i])}) are held twice "
                                 f"(again by rank {s.rank[i]}); every token must be in exactly one chunk")
            lo, hi = (prev[i], a[i]) if gap[i] else (b[i], lens[di])
            raise ValueError(f"document {di}: tokens [{lo}, {hi}) are held by no rank; every token must be "
                             "in exactly one chunk")
        return self

    def _sort(self) -> SortedChunks:
        """Sort by ``(doc, start)`` with one stable argsort of a combined key (ranges already checked):
        ``np.lexsort`` of the two columns takes ~120 ms on 270K chunks, this ~1 ms (the rank-major
        rows are a few long sorted runs, which the stable sort merges). Few full-length temporaries:
        on a 2-core VM a step's host time is as much page faults as arithmetic."""
        d, a, b, rank = self._ch.T
        big = int(max(self.doc_lens, default=0)) + 1
        key = d * big
        key += a
        o = np.argsort(key, kind="stable")
        key = key[o]
        self._sorted = SortedChunks(
            key=_frozen(key), start=_frozen(np.take(a, o)), end=_frozen(np.take(b, o)),
            rank=_frozen(np.take(rank, o)), order=_frozen(o), big=big,
            ptr=_frozen(np.searchsorted(key, np.arange(self.n_docs + 1) * big)))
        return self._sorted

    def owner_map(self) -> list[np.ndarray]:
        """Per document, an int array: the rank holding each token."""
        own = [np.empty(n, dtype=np.int64) for n in self.doc_lens]
        for d, a, b, rank in self._ch.tolist():
            own[d][a:b] = rank
        return own

    def offsets(self, rank: int) -> np.ndarray:
        """The first local row of each of ``rank``'s chunks (rows ``rank_ptr[rank]:rank_ptr[rank + 1]``
        of :meth:`chunk_array`): O(its chunks), so that no rank pays for the others'."""
        lo, hi = self.rank_ptr()[rank:rank + 2]
        n = self._ch[lo:hi, 2] - self._ch[lo:hi, 1]
        return excl(n)

    def local_offsets(self) -> list[list[int]]:
        """Per rank, the offset of each chunk in that rank's packed local token buffer."""
        return [self.offsets(r).tolist() for r in range(self.n_ranks)]


def layout_from_lists(ranks: Sequence[Sequence[Sequence[int]]], doc_lens: Sequence[int]) -> Layout:
    """Build a layout from plain nested lists ``[[(doc, start, end), ...], ...]``."""
    return Layout([[Chunk(*c) for c in r] for r in ranks], list(doc_lens))


def global_rows(layout: Layout, rank: int) -> np.ndarray:
    """Global (doc-major) token positions of ``rank``'s local rows, in layout order."""
    base = np.concatenate([[0], np.cumsum(layout.doc_lens)]).astype(np.int64)
    parts = [np.arange(base[c.doc] + c.start, base[c.doc] + c.end) for c in layout.ranks[rank]]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def stack_layouts(parts: Sequence["Layout | None"], n_ranks_each: int) -> Layout:
    """One layout over ``len(parts) * n_ranks_each`` ranks: part ``i``'s ranks become ranks
    ``[i * n_ranks_each, (i + 1) * n_ranks_each)`` and its documents follow the earlier parts'
    (renumbered by the documents before them); a None part holds nothing (its ranks still count).
    A lock-step tick's layout: every pipeline stage's microbatch over that stage's data-parallel
    ranks (:mod:`cadlib.core.pipeline`)."""
    if isinstance(n_ranks_each, bool) or not isinstance(n_ranks_each, (int, np.integer)) or n_ranks_each < 1:
        raise ValueError(f"n_ranks_each must be an integer >= 1, got {n_ranks_each!r}")
    rows, lens, n_docs = [], [], 0
    for i, part in enumerate(parts):
        if part is None:
            continue
        if part.n_ranks != n_ranks_each:
            raise ValueError(f"parts[{i}] has {part.n_ranks} ranks; every part must have n_ranks_each="
                             f"{n_ranks_each}")
        ch = part.chunk_array().copy()
        ch[:, 0] += n_docs
        ch[:, 3] += i * n_ranks_each
        rows.append(ch)
        lens += part.doc_lens
        n_docs += part.n_docs
    chunks = np.concatenate(rows) if rows else np.zeros((0, 4), dtype=np.int64)
    return Layout.from_chunks(chunks, lens, len(parts) * int(n_ranks_each))


def split_layout(layout: Layout, n_parts: int, cut: bool = False) -> list[Layout]:
    """The inverse of :func:`stack_layouts`: ``n_parts`` layouts of ``n_ranks / n_parts`` consecutive
    ranks each, documents renumbered per part. A document held in two parts raises ValueError unless
    ``cut``: then each part's tokens of it become a document of their own (its chunks in token order,
    closed up), what a data loader does at the boundary of two packed sequences."""
    if isinstance(n_parts, bool) or not isinstance(n_parts, (int, np.integer)) or n_parts < 1 \
            or layout.n_ranks % n_parts:
        raise ValueError(f"n_parts must be an integer >= 1 dividing n_ranks={layout.n_ranks}, got {n_parts!r}")
    per = layout.n_ranks // int(n_parts)
    ch = layout.chunk_array()
    lens_all = np.asarray(layout.doc_lens, dtype=np.int64)
    out = []
    for i in range(int(n_parts)):
        sel = ch[ch[:, 3] // per == i]
        o = np.lexsort((sel[:, 1], sel[:, 0]))                 # by (doc, start)
        doc, n = sel[o, 0], sel[o, 2] - sel[o, 1]
        docs, first = np.unique(doc, return_index=True)
        held = np.add.reduceat(n, first) if docs.size else np.zeros(0, np.int64)
        if not cut and not np.array_equal(held, lens_all[docs]):
            d = int(docs[held != lens_all[docs]][0])
            raise ValueError(f"document {d} is held in more than one part; pass cut=True to cut it")
        new = np.searchsorted(docs, doc)
        start = np.empty_like(n)
        start[o] = np.cumsum(n) - n - np.repeat(np.cumsum(held) - held, np.diff(np.r_[first, doc.size]))
        new_doc = np.empty_like(n)
        new_doc[o] = new
        rows = np.stack([new_doc, start, start + sel[:, 2] - sel[:, 1], sel[:, 3] - i * per], axis=1)
        out.append(Layout.from_chunks(rows, held.tolist(), per))
    return out

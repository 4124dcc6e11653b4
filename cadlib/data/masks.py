"""Attention masks as lists of range slices, with exact areas: the 12 mask types of LongCA-bench.

A mask over ``T`` query and ``T`` key tokens is a list of **slices** ``(q_range, k_range, kind)``
that never overlap (no (query, key) pair lies in two slices). Inside a slice with ``Lq`` query rows
(row ``j``) and ``Lk`` key columns (column ``t``), the kinds are::

    FULL       every pair                                 area = Lq * Lk
    CAUSAL     t <= j + (Lk - Lq)   (bottom-right aligned) area = m (Lk - m) + m (m + 1) / 2, m = min(Lq, Lk)
    INVCAUSAL  t >= j               (top-left aligned)     area = the same as CAUSAL
    BICAUSAL   j <= t <= j + (Lk - Lq)  (both)             area = Lq (Lk - Lq + 1) if Lk >= Lq else 0

The **area** (attended pairs) is summed in closed form, never materialised, and gives the FLOPs:
``forward = 4 * area * query_heads * head_dim`` and ``backward = 2.5 * forward``
(:data:`cadlib.core.cost.ATTN_BWD_MULT`). Converters: :meth:`Mask.to_dense` (boolean ``[T, T]``, small
sizes), FlexAttention's form (:mod:`cadlib.runtime.kernels.flex`), :meth:`Mask.to_varlen`
(``cu_seqlens`` for the varlen kernels, when the mask is a set of all-FULL or all-CAUSAL segments).

The generators (:func:`make_mask`, ``MASK_TYPES``) follow the benchmark's definitions; documents come
from :func:`cadlib.data.workload.sample_docs` (``pile`` up to 12K tokens, ``prolong64k`` above, and
``prolong512k`` for the distributed runs when asked).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..core.cost import ATTN_BWD_MULT
from .workload import sample_docs

FULL, CAUSAL, INVCAUSAL, BICAUSAL = 0, 1, 2, 3
KIND_NAMES = ("full", "causal", "invcausal", "bicausal")

MASK_TYPES = ("full", "causal", "full_document", "causal_document", "share_question", "causal_blockwise",
              "prefix_lm_causal", "prefix_lm_document", "sliding_window_causal", "sliding_window",
              "global_sliding_window", "block_causal_document")
"""The 12 mask types of the benchmark."""
LONG_TYPES = ("full_document_long", "causal_document_long")
"""Document masks with 60% of the tokens in documents of 8K-30K tokens."""
ALL_TYPES = MASK_TYPES + LONG_TYPES

DEFAULT_WINDOW = 1024
"""Sliding-window width (tokens back, and forward for ``sliding_window``)."""
DEFAULT_BLOCK = 1024
"""Block size of ``block_causal_document``."""
SHORT_DIST_MAX_TOKENS = 12 * 1024
"""Up to this total length documents come from ``pile``, above it from ``prolong64k``."""
LONG_DOC_RANGE = (8 * 1024, 30 * 1024)
"""Length range (uniform, end excluded) of the long documents of the ``_long`` variants."""
LONG_FRACTION = 0.6
"""Fraction of the tokens in long documents in the ``_long`` variants."""
DENSE_MAX_ELEMS = 1 << 28
"""``to_dense`` refuses masks larger than this many elements."""


def slice_area(lq, lk, kind):
    """Attended pairs of slices (vectorised; see the module docstring for the formulas)."""
    lq, lk, kind = (np.asarray(a, dtype=np.int64) for a in (lq, lk, kind))
    m = np.minimum(lq, lk)
    tri = m * (lk - m) + m * (m + 1) // 2
    bi = np.where(lk >= lq, lq * (lk - lq + 1), 0)
    return np.select([kind == FULL, kind == BICAUSAL], [lq * lk, bi], tri)


def _slice_dense(lq: int, lk: int, kind: int) -> np.ndarray:
    j = np.arange(lq)[:, None]
    t = np.arange(lk)[None, :]
    if kind == FULL:
        return np.ones((lq, lk), dtype=bool)
    causal = t <= j + (lk - lq)
    inv = t >= j
    return {CAUSAL: causal, INVCAUSAL: inv, BICAUSAL: causal & inv}[kind]


@dataclass
class VarlenForm:
    """A mask as varlen segments for the fused kernels: segment ``i`` takes query rows
    ``[cu_q[i], cu_q[i+1])`` (the queries in order) and key rows ``k_index[cu_k[i]:cu_k[i+1]]``
    (``k_index`` None: the keys in order, ``cu_k == cu_q``); one ``causal`` flag for all (bottom-right)."""

    cu_q: np.ndarray
    cu_k: np.ndarray
    max_q: int
    max_k: int
    causal: bool
    k_index: np.ndarray | None


@dataclass
class Mask:
    """A ``T x T`` mask as non-overlapping slices (int64 arrays ``q0, q1, k0, k1, kind``)."""

    name: str
    total: int
    q0: np.ndarray
    q1: np.ndarray
    k0: np.ndarray
    k1: np.ndarray
    kind: np.ndarray
    params: dict = field(default_factory=dict)

    def __post_init__(self):
        for f in ("q0", "q1", "k0", "k1", "kind"):
            setattr(self, f, np.asarray(getattr(self, f), dtype=np.int64).reshape(-1))
        keep = (self.q1 > self.q0) & (self.k1 > self.k0)
        for f in ("q0", "q1", "k0", "k1", "kind"):
            setattr(self, f, getattr(self, f)[keep])
        if ((self.q0 < 0) | (self.k0 < 0) | (self.q1 > self.total) | (self.k1 > self.total)).any():
            raise ValueError(f"mask {self.name!r}: slices must lie inside [0, {self.total})")
        if not np.isin(self.kind, (FULL, CAUSAL, INVCAUSAL, BICAUSAL)).all():
            raise ValueError("slice kinds must be FULL=0, CAUSAL=1, INVCAUSAL=2 or BICAUSAL=3")

    @property
    def n_slices(self) -> int:
        return int(self.q0.size)

    def slices(self) -> list[tuple[tuple[int, int], tuple[int, int], str]]:
        return [((int(a), int(b)), (int(c), int(d)), KIND_NAMES[int(k)])
                for a, b, c, d, k in zip(self.q0, self.q1, self.k0, self.k1, self.kind)]

    # -- work --------------------------------------------------------------------------------------
    def area(self) -> int:
        """Attended (query, key) pairs, exact, in closed form."""
        return int(slice_area(self.q1 - self.q0, self.k1 - self.k0, self.kind).sum())

    def sparsity(self) -> float:
        """Fraction of the ``T x T`` square that is attended."""
        return self.area() / float(self.total) ** 2

    def flops(self, heads: int, head_dim: int, direction: str = "fwd") -> float:
        """``fwd = 4 * area * heads * head_dim``; ``bwd = 2.5 * fwd``; ``fwd_bwd = 3.5 * fwd``."""
        f = 4.0 * self.area() * heads * head_dim
        mult = {"fwd": 1.0, "bwd": ATTN_BWD_MULT, "fwd_bwd": 1.0 + ATTN_BWD_MULT}
        if direction not in mult:
            raise ValueError(f"direction must be one of {', '.join(mult)}, got {direction!r}")
        return f * mult[direction]

    # -- converters --------------------------------------------------------------------------------
    def to_dense(self) -> np.ndarray:
        """Boolean ``[T, T]`` (row = query). Refuses masks above ``DENSE_MAX_ELEMS`` elements."""
        if self.total ** 2 > DENSE_MAX_ELEMS:
            raise ValueError(f"to_dense of a {self.total}-token mask needs {self.total ** 2} elements; "
                             f"the limit is {DENSE_MAX_ELEMS} (use area(), to_varlen() or cadlib.runtime.kernels.flex.mask_mod())")
        out = np.zeros((self.total, self.total), dtype=bool)
        for a, b, c, d, k in zip(self.q0, self.q1, self.k0, self.k1, self.kind):
            out[a:b, c:d] |= _slice_dense(int(b - a), int(d - c), int(k))
        return out

    def row_table(self) -> np.ndarray:
        """``[T, K]``: the slices covering each query row (-1 pads), K the most slices on one row."""
        order = np.argsort(self.q0, kind="stable")
        cnt = np.zeros(self.total, dtype=np.int64)
        cols = np.zeros(self.n_slices, dtype=np.int64)
        for s in order:
            a, b = self.q0[s], self.q1[s]
            cols[s] = cnt[a:b].max()
            cnt[a:b] = cols[s] + 1
        table = np.full((self.total, int(cols.max(initial=0)) + 1), -1, dtype=np.int64)
        for s in range(self.n_slices):
            table[self.q0[s]:self.q1[s], cols[s]] = s
        return table

    def to_varlen(self) -> VarlenForm:
        """Varlen segments (see :class:`VarlenForm`). Needs every slice FULL, or every slice CAUSAL,
        and query ranges that tile ``[0, T)`` in order; otherwise ValueError."""
        kinds = set(self.kind.tolist())
        if not kinds <= {FULL} and not kinds <= {CAUSAL}:
            raise ValueError(f"mask {self.name!r} mixes slice kinds {sorted(KIND_NAMES[k] for k in kinds)}; "
                             "a varlen call takes all-full or all-causal segments")
        order = np.argsort(self.q0, kind="stable")
        q0, q1, k0, k1 = self.q0[order], self.q1[order], self.k0[order], self.k1[order]
        if q0.size == 0 or q0[0] != 0 or q1[-1] != self.total or (q0[1:] != q1[:-1]).any():
            raise ValueError(f"mask {self.name!r}: query ranges must tile [0, {self.total}) without "
                             "overlap for a varlen call")
        lq, lk = q1 - q0, k1 - k0
        cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
        cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
        same = bool((k0 == q0).all() and (k1 == q1).all())
        k_index = None if same else np.concatenate([np.arange(a, b) for a, b in zip(k0, k1)])
        return VarlenForm(cu_q, cu_k, int(lq.max()), int(lk.max()), kinds == {CAUSAL}, k_index)

    def is_varlen(self) -> bool:
        try:
            self.to_varlen()
        except ValueError:
            return False
        return True

    def document_lengths(self) -> list[int] | None:
        """The document lengths of a plain document mask (``full``/``causal`` = one document)."""
        return self.params.get("doc_lens")


# ---------------------------------------------------------------------------------------------------
# Slice builders
# ---------------------------------------------------------------------------------------------------

def _mask(name, total, rows, **params) -> Mask:
    arr = np.array(rows, dtype=np.int64).reshape(-1, 5)
    return Mask(name, int(total), arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3], arr[:, 4], params)


def band_slices(start: int, length: int, left: int, right: int) -> list[tuple[int, int, int, int, int]]:
    """Slices of the band ``i - left <= j <= i + right`` over ``[start, start + length)`` squared.

    Query ``i`` sees keys ``[lo_i, hi_i)``, ``lo_i = max(0, i - left)``, ``hi_i = min(L, i + right + 1)``
    (``i`` relative). Both are piecewise linear with slope 0 or 1, breaking at ``left`` and
    ``L - right``; on each run the pair of slopes picks the kind: (0, 0) FULL, (0, 1) CAUSAL,
    (1, 0) INVCAUSAL, (1, 1) BICAUSAL."""
    L = int(length)
    if L <= 0:
        return []
    left, right = max(0, int(left)), max(0, int(right))
    cuts = sorted({0, L, min(L, left), max(0, min(L, L - right))})
    out = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        if b <= a:
            continue
        lo_a, hi_last = max(0, a - left), min(L, (b - 1) + right + 1)
        lo_slope, hi_slope = a >= left, (b - 1) + right + 1 <= L
        kind = {(False, False): FULL, (False, True): CAUSAL, (True, False): INVCAUSAL,
                (True, True): BICAUSAL}[(lo_slope, hi_slope)]
        out.append((start + a, start + b, start + lo_a, start + hi_last, kind))
    return out


def _doc_bounds(doc_lens: Sequence[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(doc_lens)]).astype(np.int64)


def _docs(total: int, seed: int, dist: str | None, doc_lens) -> list[int]:
    if doc_lens is not None:
        lens = [int(n) for n in doc_lens]
        if sum(lens) != total or min(lens) < 1:
            raise ValueError(f"doc_lens must be lengths >= 1 summing to total_len={total}; got sum "
                             f"{sum(lens)}, min {min(lens) if lens else None}")
        return lens

    dist = dist or ("pile" if total <= SHORT_DIST_MAX_TOKENS else "prolong64k")
    return sample_docs(dist, total, seed)


def _long_docs(total: int, seed: int, dist: str | None) -> list[int]:
    """40% of the tokens from the distribution, 60% in documents uniform in [8K, 30K), shuffled."""
    n_short = int(round(total * (1 - LONG_FRACTION)))
    rng = np.random.default_rng(seed)
    short = _docs(n_short, seed, dist, None) if n_short > 0 else []
    longs, left = [], total - n_short
    while left > 0:
        n = min(left, int(rng.integers(*LONG_DOC_RANGE)))
        longs.append(n)
        left -= n
    lens = short + longs
    rng.shuffle(lens)
    return [int(n) for n in lens]


def make_mask(name: str, total_len: int, seed: int = 0, dist: str | None = None,
              doc_lens: Sequence[int] | None = None, window: int = DEFAULT_WINDOW,
              block: int = DEFAULT_BLOCK) -> Mask:
    """The mask ``name`` (one of ``ALL_TYPES``) over ``total_len`` tokens. Documents: ``doc_lens``
    if given, else sampled from ``dist`` (default: ``pile`` up to 12K tokens, else ``prolong64k``)
    with ``seed``; random parameters (prefix lengths, global width, blocks per document) also come
    from ``seed``. ``window`` is the sliding-window width, ``block`` the block size."""
    T = int(total_len)
    if T < 1:
        raise ValueError(f"total_len must be >= 1, got {total_len}")
    if name not in ALL_TYPES:
        raise ValueError(f"unknown mask type {name!r}; choose one of: {', '.join(ALL_TYPES)}")
    rng = np.random.default_rng([seed, ALL_TYPES.index(name)])
    if name in ("full", "causal"):
        return _mask(name, T, [(0, T, 0, T, FULL if name == "full" else CAUSAL)], doc_lens=[T])
    if name in LONG_TYPES:
        lens = _long_docs(T, seed, dist) if doc_lens is None else _docs(T, seed, dist, doc_lens)
        b = _doc_bounds(lens)
        kind = FULL if name.startswith("full") else CAUSAL
        return _mask(name, T, [(s, e, s, e, kind) for s, e in zip(b[:-1], b[1:])], doc_lens=lens)
    if name in ("sliding_window_causal", "sliding_window"):
        right = 0 if name == "sliding_window_causal" else window
        return _mask(name, T, band_slices(0, T, window, right), window=int(window))
    if name == "global_sliding_window":
        w = int(rng.integers(1, max(2, T // 3)))
        rows = [(0, T, 0, w, FULL), (0, w, w, T, FULL)] + band_slices(w, T - w, w, w)
        return _mask(name, T, rows, global_width=w)
    if name == "prefix_lm_causal":
        p = int(rng.integers(1, T + 1))
        return _mask(name, T, [(0, p, 0, p, FULL), (p, T, 0, T, CAUSAL)], prefix=p)
    lens = _docs(T, seed, dist, doc_lens)
    b = _doc_bounds(lens)
    docs = list(zip(b[:-1].tolist(), b[1:].tolist()))
    if name in ("full_document", "causal_document"):
        kind = FULL if name == "full_document" else CAUSAL
        return _mask(name, T, [(s, e, s, e, kind) for s, e in docs], doc_lens=lens)
    if name == "share_question":
        if len(docs) < 2:
            return _mask(name, T, [(0, T, 0, T, CAUSAL)], doc_lens=lens)
        e1, first = docs[1][1], docs[0][1]
        rows = [(0, e1, 0, e1, CAUSAL)] + [(s, e, s, e, CAUSAL) for s, e in docs[2:]]
        if len(docs) > 2:
            rows.append((e1, T, 0, first, FULL))
        return _mask(name, T, rows, doc_lens=lens)
    if name == "causal_blockwise":
        rows = [(s, e, s, e, CAUSAL) for s, e in docs[:-1]] + [(docs[-1][0], T, 0, T, CAUSAL)]
        return _mask(name, T, rows, doc_lens=lens)
    if name == "prefix_lm_document":
        f = int(rng.integers(1, lens[0])) if lens[0] > 1 else 1
        rows = []
        for s, e in docs:
            if f < e - s:
                rows += [(s, s + f, s, s + f, FULL), (s + f, e, s, e, CAUSAL)]
            else:
                rows.append((s, e, s, e, FULL))
        return _mask(name, T, rows, doc_lens=lens, prefix=f)
    # block_causal_document: documents of 1-8 blocks; each block sees its document up to its own end
    if doc_lens is None:
        lens, left = [], T
        while left > 0:
            n = min(left, int(rng.integers(1, 9)) * int(block))
            lens.append(n)
            left -= n
        b = _doc_bounds(lens)
        docs = list(zip(b[:-1].tolist(), b[1:].tolist()))
    rows = [(q, min(q + block, e), s, min(q + block, e), FULL) for s, e in docs for q in range(s, e, block)]
    return _mask(name, T, rows, doc_lens=lens, block=int(block))


def dense_reference(mask: Mask) -> np.ndarray:
    """Each type's definition written directly as a predicate on (query i, key j), for testing the
    slices: independent of the slice machinery."""
    T, p = mask.total, mask.params
    i = np.arange(T)[:, None]
    j = np.arange(T)[None, :]
    name = mask.name
    if name in ("full", "causal"):
        return np.broadcast_to(j <= i if name == "causal" else np.ones((1, 1), bool), (T, T)).copy()
    if name == "sliding_window_causal":
        return (j <= i) & (j >= i - p["window"])
    if name == "sliding_window":
        return np.abs(i - j) <= p["window"]
    if name == "global_sliding_window":
        w = p["global_width"]
        return (j < w) | (i < w) | (np.abs(i - j) <= w)
    if name == "prefix_lm_causal":
        return (j <= i) | ((i < p["prefix"]) & (j < p["prefix"]))
    b = _doc_bounds(p["doc_lens"])
    doc = np.searchsorted(b, np.arange(T), side="right") - 1
    di, dj = doc[:, None], doc[None, :]
    same = di == dj
    if name in ("full_document", "full_document_long"):
        return same
    if name in ("causal_document", "causal_document_long"):
        return same & (j <= i)
    if name == "share_question":
        n_docs = len(p["doc_lens"])
        block01 = (di <= 1) & (dj <= 1) if n_docs >= 2 else same
        return ((same | block01) & (j <= i)) | ((di >= 2) & (dj == 0))
    if name == "causal_blockwise":
        last = len(p["doc_lens"]) - 1
        return (same & (j <= i)) | ((di == last) & (j <= i))
    if name == "prefix_lm_document":
        f = p["prefix"]
        pos_i, pos_j = (np.arange(T) - b[doc])[:, None], (np.arange(T) - b[doc])[None, :]
        return same & ((j <= i) | ((pos_i < f) & (pos_j < f)))
    if name == "block_causal_document":
        blk = p["block"]
        pos_i = (np.arange(T) - b[doc])[:, None]
        block_end = np.minimum(b[doc][:, None] + (pos_i // blk + 1) * blk, b[doc + 1][:, None])
        return same & (j < block_end)
    raise ValueError(f"no reference for mask {name!r}")

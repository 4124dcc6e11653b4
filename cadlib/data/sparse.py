"""Block-sparse attention masks, LongCA-bench's dynamic masks: uniform and variable block sparsity.

A block-sparse mask cuts the ``T`` query tokens into ``Nq`` row blocks and the ``T`` key tokens into
``Nk`` column blocks, per **mask head** ``h``, and keeps a set of (row block, column block) pairs; a kept
pair is attended in full. Each row block keeps the same number of column blocks, the top ``k`` of
random scores (uniform on ``[0, 1)``), so a row keeps a uniformly random ``k``-subset::

    k = min(Nk, max(1, floor(sparsity * Nk)))          (the benchmark's top-k)
    area_h = sum_i rows_h[i] * sum_{j kept in row i} cols_h[j]          (exact, integers)

``sparsity`` is the benchmark's "sparsity ratio": the fraction of column blocks a row block KEEPS
(its FLOPs are ``4 * S^2 * H * D * sparsity``), so 0.9 is the densest. Two families:

* **uniform** (:func:`uniform_block_sparse`): every block ``block`` tokens (64 or 128); ``T`` a multiple.
* **variable** (:func:`variable_block_sparse`): ``Nq = Nk = T // avg_block`` blocks of random sizes,
  each at least ``min_block`` (128): the ``T - N * min_block`` spare tokens are cut at ``N - 1`` sorted
  uniform points, a size per head for the rows and another for the columns.

Heads: the benchmark draws one pattern per KV head (``per_kv_head``) shared by the query heads of its
group; ``heads`` here is that count (8 for GQA 64:8, 64 for MHA 64:64). Query head ``g`` reads mask
head ``g * heads // q_heads``. FLOPs count the exact area, never ``sparsity * T^2``::

    forward = 4 * D * (q_heads / heads) * sum_h area_h,    backward = 2.5 * forward

Seeds: the benchmark seeds once (``seed_everything(42)``) and draws every configuration in its loop
order, so a cell's pattern depends on the cells before it. Here every draw has its own generator,
keyed by ``(seed, family, T, block, sparsity, heads)``: one cell reproduces alone, with the same
distribution. Each head is one mask in :mod:`cadlib.data.masks`' form (:meth:`BlockSparseMask.head_mask`:
FULL slices, one per run of kept column blocks of a row block).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..core.cost import ATTN_BWD_MULT
from ..core.paper import LONGCA_SPARSITIES, LONGCA_UNIFORM_BLOCKS, LONGCA_VARIABLE_MIN_BLOCK
from .masks import FULL, Mask

UNIFORM, VARIABLE = "uniform_block_sparse", "variable_block_sparse"
SPARSE_TYPES = (UNIFORM, VARIABLE)
DEFAULT_SEED = 42
"""The benchmark's ``seed_everything(42)``."""
SPARSITIES = tuple(round(float(s), 1) for s in np.arange(LONGCA_SPARSITIES[0], LONGCA_SPARSITIES[1] + 0.05, 0.1))
"""The sparsity ratios (kept fraction) of the study, 0.1-0.9 in steps of 0.1."""
UNIFORM_BLOCKS = LONGCA_UNIFORM_BLOCKS
"""Block sizes of the uniform masks."""
VARIABLE_AVG_BLOCKS = (128, 256, 512, 1024)
"""Average block sizes of the variable masks."""
MIN_VARIABLE_BLOCK = LONGCA_VARIABLE_MIN_BLOCK
"""Smallest block of a variable mask (the benchmark's ``min_q_block_size = min_kv_block_size``)."""


@dataclass
class BlockSparseMask:
    """``heads`` block-sparse ``T x T`` masks: ``blocks[h, i, j]`` keeps row block ``i`` x column block
    ``j`` of head ``h``; ``rows[h]`` and ``cols[h]`` are the block sizes (each summing to ``total``)."""

    name: str
    total: int
    blocks: np.ndarray          # bool [heads, Nq, Nk]
    rows: np.ndarray            # int64 [heads, Nq]
    cols: np.ndarray            # int64 [heads, Nk]
    params: dict = field(default_factory=dict)

    def __post_init__(self):
        self.blocks = np.asarray(self.blocks, dtype=bool)
        self.rows = np.asarray(self.rows, dtype=np.int64)
        self.cols = np.asarray(self.cols, dtype=np.int64)
        h, nq, nk = self.blocks.shape
        if self.rows.shape != (h, nq) or self.cols.shape != (h, nk):
            raise ValueError(f"rows must be [heads, Nq] = {(h, nq)} and cols [heads, Nk] = {(h, nk)}; got "
                             f"{self.rows.shape} and {self.cols.shape}")
        if (self.rows < 1).any() or (self.cols < 1).any() or (self.rows.sum(1) != self.total).any() \
                or (self.cols.sum(1) != self.total).any():
            raise ValueError(f"block sizes must be >= 1 and sum to total={self.total} in every head")

    @property
    def heads(self) -> int:
        return int(self.blocks.shape[0])

    def bounds(self, h: int) -> tuple[np.ndarray, np.ndarray]:
        """Token boundaries ``[Nq + 1]`` of head ``h``'s row blocks and ``[Nk + 1]`` of its column blocks."""
        return (np.concatenate([[0], np.cumsum(self.rows[h])]), np.concatenate([[0], np.cumsum(self.cols[h])]))

    def head_areas(self) -> np.ndarray:
        """Exact attended pairs per mask head: ``area_h = rows_h . blocks_h . cols_h`` (int64)."""
        return np.array([int(self.rows[h] @ (self.blocks[h].astype(np.int64) @ self.cols[h]))
                         for h in range(self.heads)], dtype=np.int64)

    def area(self) -> int:
        """Attended pairs summed over the mask heads."""
        return int(self.head_areas().sum())

    def sparsity(self) -> float:
        """Attended fraction of the ``heads x T x T`` pairs (the measured counterpart of ``sparsity``)."""
        return self.area() / (self.heads * float(self.total) ** 2)

    def flops(self, q_heads: int, head_dim: int, direction: str = "fwd") -> float:
        """``4 * D * (q_heads / heads) * area`` forward; ``bwd`` 2.5x, ``fwd_bwd`` 3.5x."""
        if q_heads % self.heads:
            raise ValueError(f"q_heads={q_heads} must be a multiple of the mask's {self.heads} heads")
        mult = {"fwd": 1.0, "bwd": ATTN_BWD_MULT, "fwd_bwd": 1.0 + ATTN_BWD_MULT}
        if direction not in mult:
            raise ValueError(f"direction must be one of {', '.join(mult)}, got {direction!r}")
        return 4.0 * head_dim * (q_heads // self.heads) * self.area() * mult[direction]

    def head_mask(self, h: int) -> Mask:
        """Head ``h`` as a :class:`cadlib.data.masks.Mask`: one FULL slice per run of consecutive kept
        column blocks of a row block (its area equals ``head_areas()[h]``)."""
        if not 0 <= h < self.heads:
            raise ValueError(f"head {h} is outside 0..{self.heads - 1}")
        rb, cb = self.bounds(h)
        keep = np.pad(self.blocks[h], ((0, 0), (1, 1)))
        edges = np.diff(keep.astype(np.int8), axis=1)         # +1: a run starts, -1: it ends
        i, start = np.nonzero(edges == 1)
        _, end = np.nonzero(edges == -1)                       # same row order, runs left to right
        rows = np.stack([rb[i], rb[i + 1], cb[start], cb[end], np.full(i.size, FULL)], 1)
        return Mask(self.name, self.total, rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3], rows[:, 4],
                    {**self.params, "head": int(h)})

    def to_dense(self, h: int) -> np.ndarray:
        """Boolean ``[T, T]`` of head ``h`` (row = query), small sizes only."""
        return self.head_mask(h).to_dense()


def _top_k(rng: np.random.Generator, nq: int, nk: int, k: int) -> np.ndarray:
    """``[nq, nk]`` bool: each row keeps the ``k`` columns with the largest uniform scores."""
    scores = rng.random((nq, nk))
    keep = np.zeros((nq, nk), dtype=bool)
    top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    np.put_along_axis(keep, top, True, axis=1)
    return keep


def _check(total: int, sparsity: float, heads: int) -> None:
    if total < 1:
        raise ValueError(f"total must be >= 1, got {total}")
    if not 0.0 < sparsity <= 1.0:
        raise ValueError(f"sparsity (the kept fraction of column blocks) must be in (0, 1], got {sparsity}")
    if heads < 1:
        raise ValueError(f"heads must be >= 1, got {heads}")


def kept_blocks(n_cols: int, sparsity: float) -> int:
    """``k = min(Nk, max(1, floor(sparsity * Nk)))``, the benchmark's top-k count."""
    return min(n_cols, max(1, int(sparsity * n_cols)))


def _rng(seed: int, family: str, total: int, block: int, sparsity: float, heads: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), SPARSE_TYPES.index(family), int(total), int(block),
                                  int(round(sparsity * 1e6)), int(heads)])


def uniform_block_sparse(total: int, block: int, sparsity: float, heads: int = 1,
                         seed: int = DEFAULT_SEED) -> BlockSparseMask:
    """Blocks of ``block`` tokens; every row block keeps ``k`` random column blocks (module docstring).
    ``total`` must be a multiple of ``block``."""
    _check(total, sparsity, heads)
    if block < 1 or total % block:
        raise ValueError(f"total={total} must be a positive multiple of block={block}")
    n = total // block
    k = kept_blocks(n, sparsity)
    rng = _rng(seed, UNIFORM, total, block, sparsity, heads)
    blocks = np.stack([_top_k(rng, n, n, k) for _ in range(heads)])
    sizes = np.full((heads, n), block, dtype=np.int64)
    return BlockSparseMask(UNIFORM, total, blocks, sizes, sizes.copy(),
                           {"block": int(block), "sparsity": float(sparsity), "k": k, "seed": int(seed)})


def random_partition(rng: np.random.Generator, total: int, n: int, min_size: int) -> np.ndarray:
    """``n`` sizes, each >= ``min_size``, summing to ``total``: the spare tokens cut at ``n - 1``
    sorted uniform integer points in ``[0, spare]``."""
    spare = total - n * min_size
    if n < 1 or spare < 0:
        raise ValueError(f"cannot cut {total} tokens into {n} blocks of at least {min_size}")
    cuts = np.sort(rng.integers(0, spare + 1, n - 1))
    return np.diff(np.concatenate([[0], cuts, [spare]])).astype(np.int64) + min_size


def variable_block_sparse(total: int, avg_block: int, sparsity: float, heads: int = 1,
                          min_block: int = MIN_VARIABLE_BLOCK, seed: int = DEFAULT_SEED) -> BlockSparseMask:
    """``N = total // avg_block`` row and column blocks of random sizes >= ``min_block`` per head;
    every row block keeps ``k`` random column blocks (module docstring)."""
    _check(total, sparsity, heads)
    n = total // int(avg_block) if avg_block >= 1 else 0
    if n < 1 or n * min_block > total:
        raise ValueError(f"variable blocks: total={total} needs avg_block={avg_block} >= min_block={min_block} "
                         "and at least one block")
    k = kept_blocks(n, sparsity)
    rng = _rng(seed, VARIABLE, total, avg_block, sparsity, heads)
    rows = np.stack([random_partition(rng, total, n, min_block) for _ in range(heads)])
    cols = np.stack([random_partition(rng, total, n, min_block) for _ in range(heads)])
    blocks = np.stack([_top_k(rng, n, n, k) for _ in range(heads)])
    return BlockSparseMask(VARIABLE, total, blocks, rows, cols,
                           {"avg_block": int(avg_block), "min_block": int(min_block),
                            "sparsity": float(sparsity), "k": k, "seed": int(seed)})


def make_sparse_mask(name: str, total: int, block: int, sparsity: float, heads: int = 1,
                     seed: int = DEFAULT_SEED) -> BlockSparseMask:
    """``name`` one of ``SPARSE_TYPES``; ``block`` the block size (uniform) or average block (variable)."""
    if name == UNIFORM:
        return uniform_block_sparse(total, block, sparsity, heads, seed)
    if name == VARIABLE:
        return variable_block_sparse(total, block, sparsity, heads, seed=seed)
    raise ValueError(f"unknown block-sparse mask {name!r}; choose one of: {', '.join(SPARSE_TYPES)}")


def dense_reference(m: BlockSparseMask, h: int) -> np.ndarray:
    """Head ``h`` written token by token (each token's block by ``searchsorted``), independent of
    :meth:`BlockSparseMask.head_mask`: for testing it."""
    rb, cb = m.bounds(h)
    t = np.arange(m.total)
    qb = np.searchsorted(rb, t, side="right") - 1
    kb = np.searchsorted(cb, t, side="right") - 1
    return m.blocks[h][qb[:, None], kb[None, :]]

"""The protocol every CP mechanism follows (see :mod:`cadlib.cp`): which global rows each rank holds
(the zigzag and contiguous layouts), dispatching rows by index, and an all-gather undispatch."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from ..core.layout import Chunk, Layout, global_rows


def group_rank_world(group) -> tuple[int, int]:
    """``(rank, world)`` of ``group``, or ``(0, 1)`` when no process group exists."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def split_points(total: int, parts: int) -> np.ndarray:
    """``parts + 1`` boundaries cutting ``[0, total)`` into near-equal pieces (sizes differ by <= 1)."""
    return (np.arange(parts + 1, dtype=np.int64) * int(total)) // int(parts)


def _chunks_of(doc_lens: Sequence[int], start: int, end: int) -> list[Chunk]:
    """The document chunks covering global token positions ``[start, end)``."""
    base = np.concatenate([[0], np.cumsum(doc_lens)]).astype(np.int64)
    out = []
    d = int(np.searchsorted(base, start, side="right") - 1)
    pos = start
    while pos < end:
        e = min(end, int(base[d + 1]))
        if e > pos:
            out.append(Chunk(d, pos - int(base[d]), e - int(base[d])))
        pos, d = e, d + 1
    return out


def zigzag_layout(doc_lens: Sequence[int], world: int) -> Layout:
    """The global sequence cut into ``2 * world`` near-equal pieces; rank ``r`` holds pieces ``r`` and
    ``2 * world - 1 - r`` (a head and a tail: equal causal work on every rank). Pieces are cut at
    token positions, not document boundaries, so a rank holds pieces of documents; when
    ``T < 2 * world`` some pieces are empty."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    b = split_points(int(sum(doc_lens)), 2 * world)
    ranks = [_chunks_of(doc_lens, b[r], b[r + 1]) + _chunks_of(doc_lens, b[2 * world - 1 - r],
                                                                 b[2 * world - r]) for r in range(world)]
    return Layout(ranks, list(doc_lens))


def contiguous_layout(doc_lens: Sequence[int], world: int) -> Layout:
    """The global sequence cut into ``world`` near-equal contiguous pieces, one per rank."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    b = split_points(int(sum(doc_lens)), world)
    return Layout([_chunks_of(doc_lens, b[r], b[r + 1]) for r in range(world)], list(doc_lens))


def global_rank(group, group_rank: int) -> int:
    """The default-group rank of ``group_rank`` in ``group`` (for point-to-point peers)."""
    if group is None or group is dist.group.WORLD or not dist.is_initialized():
        return int(group_rank)
    return dist.get_global_rank(group, group_rank)


class CPMechanism:
    """Base class: which global rows each rank holds, row dispatch by index, an all-gather undispatch.

    Subclasses call :meth:`set_rows` (or :meth:`set_layout`) and implement :meth:`apply_attn`."""

    name = "base"
    pads = False
    """Whether the mechanism pads the sequence internally (see its docstring)."""

    def __init__(self, group, doc_lens: Sequence[int], causal: bool = True, attn_backend: str | None = None):
        doc_lens = [int(n) for n in doc_lens]
        if not doc_lens or min(doc_lens) < 1:
            raise ValueError(f"doc_lens must be a non-empty list of lengths >= 1, got {doc_lens[:8]}")
        self.group = group
        self.rank, self.world = group_rank_world(group)
        self.doc_lens, self.causal, self.attn_backend = doc_lens, bool(causal), attn_backend
        self.total = int(sum(doc_lens))
        self.layout: Layout | None = None
        self.rows_per_rank: list[np.ndarray] = []
        self._rows: dict[str, torch.Tensor] = {}

    # -- rows ------------------------------------------------------------------------------------
    def set_layout(self, layout: Layout) -> None:
        self.layout = layout
        self.set_rows([global_rows(layout, r) for r in range(self.world)])

    def set_rows(self, rows: list[np.ndarray]) -> None:
        if len(rows) != self.world or sorted(np.concatenate(rows).tolist()) != list(range(self.total)):
            raise ValueError("every token must be on exactly one rank")
        self.rows_per_rank = [np.asarray(r, dtype=np.int64) for r in rows]

    def local_rows(self, rank: int | None = None) -> np.ndarray:
        """Global token positions of ``rank``'s local rows (default: this rank), in local order."""
        return self.rows_per_rank[self.rank if rank is None else rank]

    def _rows_on(self, device) -> torch.Tensor:
        key = str(device)
        if key not in self._rows:
            self._rows[key] = torch.as_tensor(self.local_rows()).to(device)
        return self._rows[key]

    @property
    def n_local(self) -> int:
        return int(self.local_rows().size)

    def tokens_per_rank(self) -> np.ndarray:
        return np.array([r.size for r in self.rows_per_rank], dtype=np.int64)

    def dispatch(self, x_global: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a ``[T, ...]`` tensor (every rank passes the same global tensor)."""
        if x_global.shape[0] != self.total:
            raise ValueError(f"x_global must have T={self.total} rows, got {tuple(x_global.shape)}")
        return x_global.index_select(0, self._rows_on(x_global.device))

    def undispatch(self, x_local: torch.Tensor) -> torch.Tensor:
        """The global ``[T, ...]`` tensor from every rank's local rows (an all-gather, padded)."""
        counts = self.tokens_per_rank()
        if x_local.shape[0] != counts[self.rank]:
            raise ValueError(f"x_local must have n_local={counts[self.rank]} rows, got {x_local.shape[0]}")
        pad = int(counts.max())
        send = x_local.new_zeros((pad, *x_local.shape[1:]))
        send[:x_local.shape[0]] = x_local
        if self.world > 1:
            buf = x_local.new_empty((self.world * pad, *x_local.shape[1:]))
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            gather(buf, send, group=self.group)
        else:
            buf = send
        out = x_local.new_empty((self.total, *x_local.shape[1:]))
        src = np.concatenate([np.arange(r * pad, r * pad + counts[r]) for r in range(self.world)])
        dst = np.concatenate(self.rows_per_rank)
        out[torch.as_tensor(dst, device=out.device)] = buf.index_select(0, torch.as_tensor(src,
                                                                                          device=buf.device))
        return out

    def apply_attn(self, q, k, v):
        raise NotImplementedError

    def check_qkv(self, q, k, v) -> None:
        """ValueError unless q, k, v are this rank's ``[n_local, H, D]`` rows (before any collective)."""
        n = self.n_local
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or not q.shape[0] == k.shape[0] == v.shape[0] == n:
            raise ValueError(f"q, k, v must be [n_local={n}, heads, head_dim]; got {tuple(q.shape)}, "
                             f"{tuple(k.shape)}, {tuple(v.shape)}")
        if k.shape != v.shape or q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
            raise ValueError(f"need k, v of one shape, equal head_dim and Hq a multiple of Hkv; got "
                             f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
        if not (q.dtype == k.dtype == v.dtype):
            raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")

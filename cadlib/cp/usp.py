"""USP (unified sequence parallelism): Ulysses inside groups of ``u`` ranks, ring attention across.

The ``W = u * R`` ranks form a grid: rank ``r = g * u + i`` is Ulysses rank ``i`` of ring position
``g``. The global sequence is cut zigzag over the ``R`` ring positions (balanced causal work); ring
position ``g``'s tokens (in its layout order) are cut into ``u`` contiguous near-equal parts, one per
Ulysses rank. Ulysses' all-to-all gives each rank all of ring position ``g``'s tokens for ``Hq / u``
heads; the ring of the ``R`` ranks with the same ``i`` then computes their attention against the
whole sequence; a second all-to-all returns the output. ``u = W`` is Ulysses, ``u = 1`` the ring.

Sub-groups are made with ``dist.new_group`` by every rank of the default group (cached per parent
group and ``u``); the parent group must therefore span the default group or all ranks must build
the mechanism together.
"""
from __future__ import annotations

import numpy as np
import torch.distributed as dist

from ..core.layout import global_rows
from .protocol import CPMechanism, contiguous_layout, global_rank, split_points, zigzag_layout
from .ring import build_ring_meta, ring_attention
from .ulysses import kv_head_map, ulysses_attention

_SUBGROUPS: dict = {}


def _subgroups(group, world: int, u: int):
    """``(ulysses_groups, ring_groups)``: per ring position ``g`` the group of ranks ``g*u .. g*u+u-1``,
    per Ulysses index ``i`` the group of ranks ``i, u + i, ...`` (group ranks of ``group``)."""
    if not dist.is_initialized() or world == 1:
        return [None], [None]

    ranks = tuple(global_rank(group, r) for r in range(world))
    key = (ranks, u)
    if key not in _SUBGROUPS:
        R = world // u
        uly = [group if u == world else dist.new_group([ranks[g * u + i] for i in range(u)])
               for g in range(R)]
        ring = [group if R == world else dist.new_group([ranks[g * u + i] for g in range(R)])
                for i in range(u)]
        _SUBGROUPS[key] = (uly, ring)
    return _SUBGROUPS[key]


def default_ulysses_size(world: int) -> int:
    """2 when the group has at least 4 ranks and an even count (so both levels are exercised), else
    the whole group (pure Ulysses)."""
    return 2 if world >= 4 and world % 2 == 0 else world


class USPCP(CPMechanism):
    name = "usp"
    default_ulysses = staticmethod(default_ulysses_size)
    """The Ulysses size when none is given (a subclass may choose another)."""

    def __init__(self, group, doc_lens, causal: bool = True, attn_backend: str | None = None,
                 ulysses_size: int | None = None):
        super().__init__(group, doc_lens, causal, attn_backend)
        u = self.default_ulysses(self.world) if ulysses_size is None else int(ulysses_size)
        if u < 1 or self.world % u:
            raise ValueError(f"ulysses_size must divide the group size {self.world}, got {u}")
        self.u, self.R = u, self.world // u
        self.g, self.i = divmod(self.rank, u)
        ring_layout = (zigzag_layout(self.doc_lens, self.R) if self.R > 1
                       else contiguous_layout(self.doc_lens, 1))
        rows, self.parts_of = [], []
        for g in range(self.R):
            grp = global_rows(ring_layout, g)
            b = split_points(grp.size, u)
            self.parts_of.append([int(x) for x in np.diff(b)])
            rows += [grp[b[i]:b[i + 1]] for i in range(u)]
        self.set_rows(rows)
        self.ring_layout = ring_layout
        self.uly_groups, self.ring_groups = _subgroups(group, self.world, u)
        ring_group = self.ring_groups[self.i] if self.R > 1 else None
        self.ring_group = ring_group
        self.uly_group = self.uly_groups[self.g] if u > 1 else None
        self.build_ring()

    def build_ring(self) -> None:
        """The across-groups ring's metadata (a subclass may build another ring)."""
        self.ring_meta = build_ring_meta(self.ring_layout, self.g if self.R > 1 else 0, self.causal,
                                         self.ring_group)

    def ring_attention(self, q, k, v):
        """Attention of the gathered sequence's heads against the whole sequence, around the ring."""
        return ring_attention(q, k, v, self.ring_meta, self.ring_group, self.attn_backend)

    def apply_attn(self, q, k, v):
        self.check_qkv(q, k, v)
        kv_head_map(q.shape[1], k.shape[1], self.u)               # ValueError before any collective
        return ulysses_attention(q, k, v, self.parts_of[self.g], self.i, self.uly_group, self.ring_attention)

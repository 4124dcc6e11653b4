"""A :class:`cadlib.data.masks.Mask` in FlexAttention's form: its ``mask_mod`` and ``BlockMask``."""
from __future__ import annotations

import numpy as np
import torch
from torch.nn.attention.flex_attention import create_block_mask

from ...data.masks import BICAUSAL, CAUSAL, FULL, INVCAUSAL, Mask

MASK_MOD_COLS = 3
"""``mask_mod`` looks up at least this many covering slices per query row (padded), so masks of
one length share tensor shapes and a compiled FlexAttention can be reused across them."""
MASK_MOD_SLICES = 4096
"""``mask_mod``'s slice tables are padded to at least this many entries (same reason)."""


def mask_mod(mask: Mask, device="cpu"):
    """A FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool`` equal to :meth:`cadlib.data.masks.Mask.to_dense`: it
    looks up the (few) slices covering ``q_idx`` (1-D tables, one per column, ``-1`` = none) and
    applies each one's kind condition."""
    table = mask.row_table()
    n_cols = max(MASK_MOD_COLS, table.shape[1])
    table = np.pad(table, ((0, 0), (0, n_cols - table.shape[1])), constant_values=-1)
    per_col = [torch.as_tensor(np.ascontiguousarray(table[:, c]), device=device) for c in range(n_cols)]
    n = max(MASK_MOD_SLICES, 1 << max(0, mask.n_slices - 1).bit_length())   # padded: shared shapes
    cols = [np.pad(a, (0, n - a.size)) for a in (mask.q0, mask.q1, mask.k0, mask.k1, mask.kind)]
    q0s, q1s, k0s, k1s, kinds = (torch.as_tensor(a, device=device) for a in cols)

    def mod(b, h, q_idx, kv_idx):
        ok = q_idx < 0                                   # False, shaped like the indices
        for col in per_col:                              # 1-D lookups only (vmap/compile friendly)
            s = col[q_idx]
            si = s.clamp(min=0)
            q0, q1, k0, k1, kind = q0s[si], q1s[si], k0s[si], k1s[si], kinds[si]
            j, t = q_idx - q0, kv_idx - k0
            causal = t <= j + (k1 - k0) - (q1 - q0)
            inv = t >= j
            cond = (kind == FULL) | ((kind == CAUSAL) & causal) | ((kind == INVCAUSAL) & inv) \
                | ((kind == BICAUSAL) & causal & inv)
            ok = ok | ((s >= 0) & (kv_idx >= k0) & (kv_idx < k1) & cond)
        return ok
    return mod

def block_mask(mask: Mask, device="cpu", block_size: int = 128, compile: bool = False):
    """FlexAttention's ``BlockMask`` of :func:`mask_mod` (batch and heads broadcast)."""
    return create_block_mask(mask_mod(mask, device), None, None, mask.total, mask.total, device=device,
                             BLOCK_SIZE=block_size, _compile=compile)

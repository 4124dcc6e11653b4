"""Block-sparse attention kernels over a :class:`cadlib.data.sparse.BlockSparseMask`, forward and backward.

For query head ``g`` (mask head ``h = g * H // Hq``) and query token ``i`` in row block ``I``::

    o_i = sum_{t : blocks[h, I, J(t)]} softmax_t(q_i . k_t * scale) v_t,   lse_i = log sum_t exp(q_i . k_t * scale)

Kernels (``SPARSE_KERNELS``), each given q, k, v token-major ``[T, H, D]``:

* ``flex``: FlexAttention with a ``BlockMask`` built straight from the block grid (``BlockMask.from_kv_blocks``),
  never by evaluating a mask function over the ``T x T`` square (the benchmark's ``create_block_mask`` over
  every head runs out of memory there). A kernel tile (``tile`` tokens, the mask's block when it is 64 or
  128, else 128) is *full* when every (row block, column block) pair it touches is kept, *partial* when some
  are (then ``mask_mod`` looks each token's block up), empty otherwise. Runs on the CPU (forward only:
  FlexAttention has no CPU backward) and, compiled, on CUDA.
* ``fa4``: FlashAttention-4's block-sparse path (``flash_attn.cute``, ``block_sparse_tensors`` forward and
  ``block_sparse_tensors_bwd``, the query-direction lists, backward): uniform blocks only, each tile full;
  variable blocks would need partial tiles and a CuTe ``mask_mod``, so they are unsupported.
  Its own checks decide which block sizes a GPU takes (its tile must divide the block).
* ``sdpa``: torch SDPA with the dense boolean ``[Hq, T, T]`` mask (the benchmark's baseline; memory-bound).

:func:`reference_attention` is the dense masked attention in fp32 (plain torch, autograd), the one every
kernel is checked against. An unsupported (kernel, mask, device) raises :class:`SparseUnsupported`.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from ...data.sparse import BlockSparseMask
from .flash import fa4_module

SPARSE_KERNELS = ("flex", "fa4", "sdpa")
FLEX_TILES = (64, 128)
"""Tile sizes the FlexAttention block mask is built on (the mask's uniform block if one of these, else 128)."""


class SparseUnsupported(ValueError):
    """A (kernel, mask, device) combination the kernel cannot run; the message says why."""


# ---------------------------------------------------------------------------------------------------
# The block grid on kernel tiles
# ---------------------------------------------------------------------------------------------------

def _block_ids(sizes: torch.Tensor, total: int) -> torch.Tensor:
    """``[H, T]`` int32: each token's block (``sizes [H, N]``)."""
    bounds = torch.cumsum(sizes, dim=1)
    tok = torch.arange(total, device=sizes.device).expand(sizes.shape[0], total).contiguous()
    return torch.searchsorted(bounds, tok, right=True).to(torch.int32)


def tile_status(m: BlockSparseMask, tile: int, device="cpu") -> torch.Tensor:
    """``[H, nT, nT]`` uint8 per mask head and (query tile, key tile): 2 full, 1 partial, 0 empty
    (``nT = ceil(T / tile)``). A tile's tokens span blocks ``lo..hi`` of each side; it is full when all
    ``blocks[lo..hi, lo'..hi']`` are kept, empty when none is (2-D prefix sums, exact)."""
    blocks = torch.as_tensor(m.blocks, device=device)
    if (m.rows == tile).all() and (m.cols == tile).all():
        return blocks.to(torch.uint8) * 2                                   # tiles are the blocks
    T = m.total
    starts = torch.arange(0, T, tile, device=device)
    ends = torch.clamp(starts + tile, max=T) - 1
    out = []
    for h in range(m.heads):
        rb = _block_ids(torch.as_tensor(m.rows[h:h + 1], device=device), T)[0].long()
        cb = _block_ids(torch.as_tensor(m.cols[h:h + 1], device=device), T)[0].long()
        pre = F.pad(blocks[h].to(torch.int32).cumsum(0).cumsum(1), (1, 0, 1, 0))
        r0, r1 = rb[starts][:, None], rb[ends][:, None] + 1
        c0, c1 = cb[starts][None, :], cb[ends][None, :] + 1
        kept = pre[r1, c1] - pre[r0, c1] - pre[r1, c0] + pre[r0, c0]
        out.append(torch.where(kept == (r1 - r0) * (c1 - c0), 2, (kept > 0).to(torch.int64)).to(torch.uint8))
    return torch.stack(out)


def _ordered(flag: torch.Tensor, compact: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(counts [.., R], indices [.., R, W])`` int32: per row the columns where ``flag`` is set, first.
    ``W`` is every column (FlexAttention's form), or with ``compact`` the most set in a row (FA4 reads
    only the first ``count`` of a row, so its index lists need be no wider)."""
    counts = flag.sum(-1, dtype=torch.int32)
    width = max(1, int(counts.max()) if counts.numel() else 1) if compact else flag.shape[-1]
    order = torch.argsort((~flag).to(torch.uint8), dim=-1, stable=True)[..., :width]
    return counts, order.to(torch.int32).contiguous()


def _head_map(m: BlockSparseMask, q_heads: int) -> int:
    if q_heads % m.heads:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of the mask's heads ({m.heads})")
    return q_heads // m.heads


def flex_tile(m: BlockSparseMask) -> int:
    """The tile the FlexAttention block mask is built on: the uniform block if in ``FLEX_TILES``, else 128."""
    block = m.params.get("block")
    return int(block) if block in FLEX_TILES and (m.rows == block).all() else 128


def flex_kernel_options(tile: int) -> dict | None:
    """The compiled FlexAttention's tile options for a block mask of ``tile`` rows and columns: its
    default forward tile on Hopper is 128 x 64, which a 64-row block mask does not divide (Inductor
    refuses it), so masks on a tile under 128 ask for ``tile x tile`` (None: the defaults)."""
    return None if tile >= 128 else {"BLOCK_M": tile, "BLOCK_N": tile}


def flex_block_mask(m: BlockSparseMask, q_heads: int, device="cpu") -> BlockMask:
    """FlexAttention's ``BlockMask`` of ``m`` for ``q_heads`` query heads (module docstring)."""
    group = _head_map(m, q_heads)
    tile = flex_tile(m)
    status = tile_status(m, tile, device)
    if group > 1:
        status = status.repeat_interleave(group, dim=0)
    part_n, part_i = _ordered(status == 1)
    full_n, full_i = _ordered(status == 2)
    qblk = _block_ids(torch.as_tensor(m.rows, device=device), m.total)
    kblk = _block_ids(torch.as_tensor(m.cols, device=device), m.total)
    blocks = torch.as_tensor(m.blocks, device=device)

    def mask_mod(b, h, q_idx, kv_idx):
        mh = h // group
        return blocks[mh, qblk[mh, q_idx], kblk[mh, kv_idx]]

    return BlockMask.from_kv_blocks(part_n[None], part_i[None], full_n[None], full_i[None], BLOCK_SIZE=tile,
                                    mask_mod=mask_mod, seq_lengths=(m.total, m.total))


def fa4_block_sparse_tensors(m: BlockSparseMask, q_heads: int, device):
    """FA4's ``(block_sparse_tensors, block_sparse_tensors_bwd)``: every kept block a full tile, listed per
    query tile (forward) and per key tile (backward). Uniform blocks only (else :class:`SparseUnsupported`)."""
    block = m.params.get("block")
    if block is None or not ((m.rows == block).all() and (m.cols == block).all()):
        raise SparseUnsupported("FA4 block sparsity lists whole tiles; variable blocks cut tiles and would "
                                "need a CuTe mask_mod for the partial ones (not written)")
    mod = fa4_module()
    if mod is None:
        raise SparseUnsupported("flash-attn-4 (flash_attn.cute) is not importable here")
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    group = _head_map(m, q_heads)
    kept = torch.as_tensor(m.blocks, device=device)
    if group > 1:
        kept = kept.repeat_interleave(group, dim=0)
    n = kept.shape[-1]
    fwd_n, fwd_i = _ordered(kept, compact=True)
    bwd_n, bwd_i = _ordered(kept.transpose(1, 2), compact=True)
    zero_n = torch.zeros(1, 1, n, dtype=torch.int32, device=device)
    zero_i = torch.zeros(1, 1, n, 1, dtype=torch.int32, device=device)
    size = (int(block), int(block))
    fwd = BlockSparseTensorsTorch(zero_n, zero_i, fwd_n[None], fwd_i[None], block_size=size)
    bwd = BlockSparseTensorsTorch(zero_n, zero_i, bwd_n[None], bwd_i[None], block_size=size)
    return fwd, bwd


# ---------------------------------------------------------------------------------------------------
# The kernels and the reference
# ---------------------------------------------------------------------------------------------------

def dense_mask(m: BlockSparseMask, q_heads: int, device="cpu") -> torch.Tensor:
    """Boolean ``[Hq, T, T]`` (small sizes): query head ``g`` gets mask head ``g // (Hq / H)``."""
    group = _head_map(m, q_heads)
    qblk = _block_ids(torch.as_tensor(m.rows, device=device), m.total).long()
    kblk = _block_ids(torch.as_tensor(m.cols, device=device), m.total).long()
    blocks = torch.as_tensor(m.blocks, device=device)
    dense = torch.stack([blocks[h][qblk[h]][:, kblk[h]] for h in range(m.heads)])
    return dense.repeat_interleave(group, dim=0)


def reference_attention(q, k, v, m: BlockSparseMask, scale: float | None = None):
    """Dense masked attention in fp32 (autograd): ``(out [T, Hq, D] in q's dtype, lse [T, Hq] fp32)``."""
    T, hq, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    rep = hq // k.shape[1]
    kk, vv = (x.float().repeat_interleave(rep, dim=1) for x in (k, v))
    s = torch.einsum("qhd,khd->hqk", q.float(), kk) * scale
    s = s.masked_fill(~dense_mask(m, hq, q.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("hqk,khd->qhd", torch.exp(s - lse[..., None]), vv)
    return out.to(q.dtype), lse.transpose(0, 1)


def _check(q, k, v, m: BlockSparseMask) -> None:
    if q.dim() != 3 or k.shape != v.shape or q.shape[0] != m.total or k.shape[0] != m.total:
        raise ValueError(f"q, k, v must be [T={m.total}, heads, head_dim] (k, v alike); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k.shape[1]})")
    _head_map(m, q.shape[1])


def setup(kernel: str, m: BlockSparseMask, q, k, v, flex_fn: Callable | None = None) -> Callable:
    """``fwd() -> out [T, Hq, D]`` of ``kernel`` on ``m`` (differentiable where the kernel has a backward),
    with every mask structure built here, outside the timed call. q, k, v token-major ``[T, H, D]``."""
    _check(q, k, v, m)
    hq, gqa = q.shape[1], q.shape[1] != k.shape[1]
    if kernel == "flex":
        bm = flex_block_mask(m, hq, q.device)
        fn = flex_fn or flex_attention
        qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        opts = flex_kernel_options(flex_tile(m))
        return lambda: fn(qh, kh, vh, block_mask=bm, enable_gqa=gqa, kernel_options=opts)[0].transpose(0, 1)
    if kernel == "fa4":
        if q.device.type != "cuda":
            raise SparseUnsupported("FA4 needs CUDA")
        fwd_t, bwd_t = fa4_block_sparse_tensors(m, hq, q.device)
        from flash_attn.cute import flash_attn_func

        qb, kb, vb = (x.unsqueeze(0) for x in (q, k, v))                     # [1, T, H, D]

        def run():
            res = flash_attn_func(qb, kb, vb, block_sparse_tensors=fwd_t, block_sparse_tensors_bwd=bwd_t)
            return (res[0] if isinstance(res, tuple) else res)[0]
        return run
    if kernel == "sdpa":
        mask = dense_mask(m, hq, q.device).unsqueeze(0)
        qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        return lambda: F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask,
                                                      enable_gqa=gqa)[0].transpose(0, 1)
    raise ValueError(f"unknown sparse kernel {kernel!r}; choose one of: {', '.join(SPARSE_KERNELS)}")

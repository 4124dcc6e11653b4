"""The linear blocks at the speed of their matmuls: RMSNorm, RoPE and SwiGLU as Triton kernels beside
cuBLAS GEMMs, each equal to its plain torch reference in :mod:`cadlib.runtime.blocks` up to bf16 rounding.

A block's time is its GEMMs plus every pass its element-wise work makes over ``[tokens, width]``
tensors. The references make several such passes, some in fp32; here each element-wise step is one
kernel that reads its inputs once and writes its outputs once in the model's dtype, computing in fp32:

* **RMSNorm** (:class:`RMSNormFn`): ``y = bf16(bf16(x r) w)``, ``r = 1 / sqrt(mean(x^2) + eps)`` per row;
  saves ``x`` and the fp32 ``r``. Backward, ``xh = x r``, ``gw = dy w``::

      dx = r (gw - xh mean(gw xh)),    dw = sum_rows dy bf16(xh)      (per-program partial sums in fp32)

* **QKV with RoPE** (:class:`QKVRopeFn`): one GEMM ``[q | k | v] = h [Wq; Wk; Wv]^T`` and one kernel
  that rotates every pair ``(x_i, x_{i + D/2})`` of each q and k head by its token's angle into
  contiguous ``q, k`` (``v`` copied out)::

      y_1 = x_1 cos_1 - x_2 sin_1,   y_2 = x_2 cos_2 + x_1 sin_2       backward (the transpose):
      dx_1 = dy_1 cos_1 + dy_2 sin_2,   dx_2 = dy_2 cos_2 - dy_1 sin_1

  It saves the norm's output ``h`` (shared by the three projections) and the RoPE tables; the backward
  writes ``[dq | dk | dv]`` rotated back into one buffer and runs one GEMM for ``dh`` and one for the
  three weights' gradients.

* **SwiGLU MLP** (:class:`SwiGLUMLPFn`): ``y = W2 (silu(a) * b)``, ``a = W1 h``, ``b = W3 h``; saves
  ``h, a, b`` and ``g = silu(a) b``. With ``s = sigmoid(a)`` the backward kernel writes
  ``da = dg b s (1 + a (1 - s))`` over ``dg`` in place and ``db = dg a s`` beside it, so its working
  set is ``2 ffn`` per token and no fp32 ``[tokens, ffn]`` temporary exists.

Kernels run on CUDA, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1`` set before
triton is imported: the tests). Hand-written rather than ``torch.compile``: each kernel is a few
lines a reader can check against its equation, no compile runs per token count, and the CPU keeps
the plain references. Only long-standing Triton features are used (``tl.load``/``tl.store``, loops
with runtime bounds), which every Triton from 3.0 has.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:                                  # the CPU reference path needs no triton
    triton = tl = None

HAVE_TRITON = triton is not None
INTERPRET = HAVE_TRITON and os.environ.get("TRITON_INTERPRET", "0") == "1"
"""Triton's interpreter was chosen before triton was imported: its kernels then run on CPU tensors."""
BLOCKS = ("auto", "fused", "reference")
"""How a block computes: ``fused`` (the kernels here), ``reference`` (plain torch,
:mod:`cadlib.runtime.blocks`) or ``auto`` (fused on a CUDA tensor when triton is importable, else the
reference)."""
FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ELEMENTWISE_BLOCK = 1024
"""Elements per program of the SwiGLU kernels."""
NORM_BWD_PROGRAMS = 512
"""Programs of the RMSNorm backward (at most): each runs a contiguous block of rows and sums ``dw`` over
them in fp32; torch sums the programs' partial sums."""


def can_fuse(x: torch.Tensor) -> bool:
    """Whether the kernels can run on ``x``: triton importable, a dtype of :data:`FUSED_DTYPES`, and
    ``x`` on CUDA (or on the CPU under the interpreter)."""
    return HAVE_TRITON and x.dtype in FUSED_DTYPES and (x.is_cuda or (INTERPRET and x.device.type == "cpu"))


def use_fused(blocks: str, x: torch.Tensor) -> bool:
    """Whether a block given ``blocks`` (one of :data:`BLOCKS`) runs the kernels on ``x``."""
    if blocks not in BLOCKS:
        raise ValueError(f"unknown blocks {blocks!r}; choose one of: {', '.join(BLOCKS)}")
    if blocks == "reference":
        return False
    if blocks == "auto":
        return x.is_cuda and can_fuse(x)
    if not can_fuse(x):
        why = "" if HAVE_TRITON else " (not importable here)"
        raise ValueError(f"blocks='fused' needs triton{why} and a "
                         f"{'/'.join(str(d)[6:] for d in FUSED_DTYPES)} tensor on CUDA, or on the CPU with "
                         f"TRITON_INTERPRET=1 set before triton is imported; got {x.dtype} on {x.device}")
    return True


# ---------------------------------------------------------------------------------------------------
# GEMMs with an fp32 result
# ---------------------------------------------------------------------------------------------------

_OUT_DTYPE = {"mm": True, "addmm": True}   # whether torch's out_dtype= works here; cleared on first failure


def mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` as fp32: low-precision inputs multiplied with fp32 accumulation and fp32 output where
    torch supports it (``mm(out_dtype=)`` on CUDA), else the low-precision product upcast."""
    if a.dtype == torch.float32:
        return a @ b
    if _OUT_DTYPE["mm"] and a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError, NotImplementedError):
            _OUT_DTYPE["mm"] = False
    return (a @ b).float()


def addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` into the fp32 ``acc``: inside the GEMM where torch can (``addmm(out_dtype=)``), else
    through an fp32 product."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
        return
    if _OUT_DTYPE["addmm"] and a.is_cuda:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        except (TypeError, ValueError, RuntimeError, NotImplementedError):
            _OUT_DTYPE["addmm"] = False
    acc += mm_f32(a, b)


# ---------------------------------------------------------------------------------------------------
# Kernels (offsets in int64: [tokens, ffn] passes 2^31 elements at 256K tokens)
# ---------------------------------------------------------------------------------------------------

if HAVE_TRITON:
    @triton.jit
    def _rms_fwd(X, W, Y, R, stride, N, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(X + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
        xh = (x * r).to(Y.dtype.element_ty).to(tl.float32)            # the reference rounds x r first
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + row * stride + cols, (xh * w).to(Y.dtype.element_ty), mask=mask)
        tl.store(R + row, r)

    @triton.jit
    def _rms_bwd(DY, X, W, R, DX, DWP, stride, n_rows, rows_per, N, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        first = pid * rows_per                                      # this program's rows, in a run
        off = first.to(tl.int64) * stride                           # row offsets in int64, carried
        for row in range(first, tl.minimum(first + rows_per, n_rows)):
            x = tl.load(X + off + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + off + cols, mask=mask, other=0.0).to(tl.float32)
            r = tl.load(R + row)
            xh = x * r
            gw = dy * w
            dx = r * (gw - xh * (tl.sum(gw * xh, axis=0) / N))
            tl.store(DX + off + cols, dx.to(DX.dtype.element_ty), mask=mask)
            dw += dy * xh.to(X.dtype.element_ty).to(tl.float32)
            off += stride
        tl.store(DWP + pid.to(tl.int64) * N + cols, dw, mask=mask)

    @triton.jit
    def _rope(SRC, src_stride, DST, dst_stride, COS, SIN, cs_stride, H, D: tl.constexpr,
              HALF: tl.constexpr, BH: tl.constexpr, BACKWARD: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, HALF)[None, :]
        h = tl.arange(0, BH)[:, None]
        mask = (h < H) & (d < HALF)
        c1 = tl.load(COS + row * cs_stride + d).to(tl.float32)
        c2 = tl.load(COS + row * cs_stride + HALF + d).to(tl.float32)
        s1 = tl.load(SIN + row * cs_stride + d).to(tl.float32)
        s2 = tl.load(SIN + row * cs_stride + HALF + d).to(tl.float32)
        src = SRC + row * src_stride + h * D + d
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:
            y1, y2 = x1 * c1 + x2 * s2, x2 * c2 - x1 * s1
        else:
            y1, y2 = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
        dst = DST + row * dst_stride + h * D + d
        tl.store(dst, y1.to(DST.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, y2.to(DST.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_fwd(A, B, G, n, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        a = tl.load(A + i, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(B + i, mask=mask, other=0.0).to(tl.float32)
        silu = (a * tl.sigmoid(a)).to(G.dtype.element_ty).to(tl.float32)   # the reference rounds silu(a)
        tl.store(G + i, (silu * b).to(G.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd(A, B, DG, DB, n, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        a = tl.load(A + i, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(B + i, mask=mask, other=0.0).to(tl.float32)
        dg = tl.load(DG + i, mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(a)
        tl.store(DB + i, (dg * a * s).to(DB.dtype.element_ty), mask=mask)
        tl.store(DG + i, (dg * b * s * (1.0 + a * (1.0 - s))).to(DG.dtype.element_ty), mask=mask)


def _warps(block: int) -> int:
    return max(1, min(16, block // 256))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as contiguous rows ``[n, width]``."""
    return x.reshape(-1, x.shape[-1]).contiguous()


# ---------------------------------------------------------------------------------------------------
# The blocks
# ---------------------------------------------------------------------------------------------------

class RMSNormFn(torch.autograd.Function):
    """RMSNorm over the last dimension in one kernel each way (module docstring); saves ``x, w, r``."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        x2 = _rows(x)
        n, width = x2.shape
        y, r = torch.empty_like(x2), torch.empty(n, dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(width)
        if n:
            _rms_fwd[(n,)](x2, weight, y, r, width, width, eps, BLOCK=block, num_warps=_warps(block))
        ctx.save_for_backward(x2, weight, r)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x, weight, r = ctx.saved_tensors
        n, width = x.shape
        dy = _rows(dy)
        dx = torch.empty_like(x)
        rows_per = triton.cdiv(max(n, 1), NORM_BWD_PROGRAMS)
        programs = triton.cdiv(max(n, 1), rows_per)
        part = torch.empty(programs, width, dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(width)
        if n:
            _rms_bwd[(programs,)](dy, x, weight, r, dx, part, width, n, rows_per, width, BLOCK=block,
                                  num_warps=_warps(block))
        else:
            part.zero_()
        return dx.view(ctx.shape), part.sum(0).to(weight.dtype), None


def _rotate(src: torch.Tensor, dst: torch.Tensor, cos, sin, heads: int, head_dim: int,
            backward: bool) -> None:
    """RoPE (or its transpose) of ``heads`` heads per row of ``src`` into ``dst``: both ``[n, >= heads
    head_dim]`` with unit stride over a row's heads, any row stride."""
    n = src.shape[0]
    if n:
        half = head_dim // 2
        _rope[(n,)](src, src.stride(0), dst, dst.stride(0), cos, sin, cos.stride(0), heads, D=head_dim,
                    HALF=half, BH=triton.next_power_of_2(heads), BACKWARD=backward,
                    num_warps=_warps(triton.next_power_of_2(heads) * half))


class QKVRopeFn(torch.autograd.Function):
    """``q, k, v = rope(Wq h), rope(Wk h), Wv h`` as ``[n, heads, D]`` (module docstring): one GEMM and
    one RoPE kernel per direction; saves ``h`` (the norm's output) and the RoPE tables."""

    @staticmethod
    def forward(ctx, h, wq, wk, wv, cos, sin, n_heads: int, n_kv_heads: int):
        n, d = h.shape[0], wq.shape[0] // n_heads
        qd, kd = wq.shape[0], wk.shape[0]
        qkv = h @ torch.cat([wq, wk, wv]).t()                   # [n, qd + 2 kd]
        cos, sin = cos.contiguous(), sin.contiguous()
        q = torch.empty(n, n_heads, d, dtype=h.dtype, device=h.device)
        k = torch.empty(n, n_kv_heads, d, dtype=h.dtype, device=h.device)
        _rotate(qkv, q, cos, sin, n_heads, d, backward=False)
        _rotate(qkv[:, qd:], k, cos, sin, n_kv_heads, d, backward=False)
        v = qkv[:, qd + kd:].contiguous().view(n, n_kv_heads, d)
        ctx.save_for_backward(h, wq, wk, wv, cos, sin)
        ctx.heads = (n_heads, n_kv_heads, d)
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        h, wq, wk, wv, cos, sin = ctx.saved_tensors
        n_heads, n_kv_heads, d = ctx.heads
        qd, kd = wq.shape[0], wk.shape[0]
        dqkv = torch.empty(h.shape[0], qd + 2 * kd, dtype=h.dtype, device=h.device)
        _rotate(dq.reshape(-1, qd).contiguous(), dqkv, cos, sin, n_heads, d, backward=True)
        _rotate(dk.reshape(-1, kd).contiguous(), dqkv[:, qd:], cos, sin, n_kv_heads, d, backward=True)
        dqkv[:, qd + kd:] = dv.reshape(-1, kd)
        dh = dqkv @ torch.cat([wq, wk, wv])
        dw = dqkv.t() @ h
        return dh, dw[:qd], dw[qd:qd + kd], dw[qd + kd:], None, None, None, None


def _swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    g = torch.empty_like(a)
    if a.numel():
        _swiglu_fwd[(triton.cdiv(a.numel(), ELEMENTWISE_BLOCK),)](a, b, g, a.numel(), BLOCK=ELEMENTWISE_BLOCK,
                                                                 num_warps=4)
    return g


class SwiGLUFn(torch.autograd.Function):
    """``silu(a) * b`` alone (the kernels of :class:`SwiGLUMLPFn`); saves ``a, b``."""

    @staticmethod
    def forward(ctx, a, b):
        a, b = a.contiguous(), b.contiguous()
        ctx.save_for_backward(a, b)
        return _swiglu(a, b)

    @staticmethod
    def backward(ctx, dg):
        a, b = ctx.saved_tensors
        dg = dg.contiguous().clone()
        db = torch.empty_like(b)
        if a.numel():
            _swiglu_bwd[(triton.cdiv(a.numel(), ELEMENTWISE_BLOCK),)](a, b, dg, db, a.numel(),
                                                                     BLOCK=ELEMENTWISE_BLOCK, num_warps=4)
        return dg, db


class SwiGLUMLPFn(torch.autograd.Function):
    """``W2 (silu(W1 h) * W3 h)`` (module docstring): four GEMMs and one kernel forward, six GEMMs and
    one kernel backward; saves ``h, a, b, g``."""

    @staticmethod
    def forward(ctx, h, w1, w3, w2):
        a, b = h @ w1.t(), h @ w3.t()
        g = _swiglu(a, b)
        ctx.save_for_backward(h, a, b, g, w1, w3, w2)
        return g @ w2.t()

    @staticmethod
    def backward(ctx, dy):
        h, a, b, g, w1, w3, w2 = ctx.saved_tensors
        dy = dy.contiguous()
        dw2 = dy.t() @ g
        dg = dy @ w2                                               # becomes da in place
        db = torch.empty_like(b)
        if a.numel():
            _swiglu_bwd[(triton.cdiv(a.numel(), ELEMENTWISE_BLOCK),)](a, b, dg, db, a.numel(),
                                                                     BLOCK=ELEMENTWISE_BLOCK, num_warps=4)
        dh = dg @ w1
        dh.addmm_(db, w3)
        return dh, dg.t() @ h, db.t() @ h, dw2

"""The decoder's linear blocks: each a plain torch reference, and the call that runs the fused kernels
of :mod:`cadlib.runtime.fused` instead where they can (``blocks``: ``auto``, ``fused``, ``reference``).

* ``rms_norm``: ``y = x / sqrt(mean(x^2) + eps) * w`` over the last dimension (:class:`RMSNormFn`).
* ``qkv_rope``: ``q, k, v = rope(Wq h), rope(Wk h), Wv h`` (:func:`apply_rope`).
* ``swiglu_mlp``: ``W2 (silu(W1 h) * W3 h)`` (:class:`SwiGLUFn`).
* :class:`ChunkedCrossEntropy`: the LM head's summed cross-entropy in chunks of tokens
  (:mod:`cadlib.runtime.fused_head` on a GPU).

The references are what the CPU runs (the tests, in fp32) and what every fused kernel is tested
against (within bf16 rounding). ``auto`` fuses on CUDA tensors when triton is importable.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .fused import QKVRopeFn, SwiGLUMLPFn, mm_f32, use_fused
from .fused import RMSNormFn as FusedRMSNormFn
from .fused_head import LinearCrossEntropyFn

IGNORE_INDEX = -100
"""Target id that contributes nothing to the loss (each document's last token)."""

SWIGLU_BWD_ELEMS = 1 << 27
"""The reference SwiGLU backward works in fp32 on row blocks of at most this many elements (512 MiB
each), not on the whole ``[n, ffn]`` at once (at 128K tokens x 14336 that would be 7 GiB per temporary)."""


def _up(x: torch.Tensor) -> torch.Tensor:
    """``x`` in at least fp32 (fp64 stays fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class RMSNormFn(torch.autograd.Function):
    """``y = (x * r).to(dtype) * w`` with ``r = 1 / sqrt(mean(x^2) + eps)`` in fp32; saves only ``x``
    and ``r`` (autograd of the plain expression would also keep fp32 copies of ``x``). Backward, with
    ``xh = x r`` and ``gw = dy * w`` (fp32): ``dx = r (gw - xh mean(gw * xh))``, ``dw = sum_i dy_i xh_i``."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        xf = _up(x)
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, r)
        return (xf * r).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, dy):
        x, weight, r = ctx.saved_tensors
        xh = _up(x) * r
        gw = _up(dy) * _up(weight)
        dx = r * (gw - xh * (gw * xh).mean(-1, keepdim=True))
        dw = (_up(dy) * _up(xh.to(x.dtype))).reshape(-1, x.shape[-1]).sum(0)
        return dx.to(x.dtype), dw.to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, blocks: str = "auto") -> torch.Tensor:
    """RMSNorm of ``x`` (:class:`RMSNormFn`, or the fused kernel)."""
    fn = FusedRMSNormFn if use_fused(blocks, x) else RMSNormFn
    return fn.apply(x, weight, eps)


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * w`` over the last dimension, computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-5, *, blocks: str = "auto", dtype=None, device=None):
        super().__init__()
        self.eps, self.blocks = eps, blocks
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.blocks)


class SwiGLUFn(torch.autograd.Function):
    """``silu(a) * b`` with ``silu(a) = a sigmoid(a)``, keeping only ``a`` and ``b`` for backward
    (autograd of the plain expression also keeps ``silu(a)``). With ``s = sigmoid(a)``:
    ``da = dy b s (1 + a (1 - s))``, ``db = dy silu(a)`` (fp32)."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx, dy):
        a, b = ctx.saved_tensors
        da, db = torch.empty_like(a), torch.empty_like(b)
        rows = max(1, SWIGLU_BWD_ELEMS // max(1, a.shape[-1]))
        for i in range(0, a.shape[0], rows):                 # fp32 temporaries of bounded size
            af, g = _up(a[i:i + rows]), _up(dy[i:i + rows])
            s = torch.sigmoid(af)
            da[i:i + rows] = g * _up(b[i:i + rows]) * s * (1 + af * (1 - s))
            db[i:i + rows] = g * af * s
        return da, db


def swiglu_mlp(h: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
               blocks: str = "auto") -> torch.Tensor:
    """``W2 (silu(W1 h) * W3 h)`` (weights as ``nn.Linear`` keeps them: ``[out, in]``)."""
    if use_fused(blocks, h):
        return SwiGLUMLPFn.apply(h, w1, w3, w2)
    return F.linear(SwiGLUFn.apply(F.linear(h, w1), F.linear(h, w3)), w2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding, rotate-half convention, on ``x [n, H, D]`` with ``cos, sin [n, D]``::

        rope(x)_m = x_m * cos(m theta) + rotate_half(x_m) * sin(m theta)

    i.e. each pair ``(x_i, x_{i + D/2})`` is rotated by the angle ``m * theta_i`` of its token's
    position ``m``, so ``rope(q)_m . rope(k)_n`` depends on positions only through ``m - n``.
    ``rotate_half([x1, x2]) = [-x2, x1]`` (halves of the last dimension)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None, :] + torch.cat((-x2, x1), dim=-1) * sin[:, None, :]


def qkv_rope(h: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor, n_heads: int, n_kv_heads: int, blocks: str = "auto"):
    """``q = rope(Wq h)``, ``k = rope(Wk h)``, ``v = Wv h`` as ``[n, heads, D]`` from ``h [n, hidden]``."""
    if use_fused(blocks, h):
        return QKVRopeFn.apply(h, wq, wk, wv, cos, sin, n_heads, n_kv_heads)
    n, d = h.shape[0], wq.shape[0] // n_heads
    q = F.linear(h, wq).view(n, n_heads, d)
    k = F.linear(h, wk).view(n, n_kv_heads, d)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), F.linear(h, wv).view(n, n_kv_heads, d)


class ChunkedCrossEntropy(torch.autograd.Function):
    """``sum_i [lse_i - z_{i, t_i}]`` over tokens with ``t_i != -100``, ``z_i = W h_i`` (fp32),
    ``lse_i = log sum_v exp(z_{i, v})``; chunk by chunk of ``chunk`` tokens.

    Forward keeps only ``hidden``, ``targets`` and the per-token ``lse`` (fp32 ``[n]``) for backward;
    backward recomputes each chunk's logits and uses ``dL/dz_i = g (softmax(z_i) - onehot(t_i))``::

        dh_i = (dL/dz_i) W,    dW = sum_i (dL/dz_i)^T h_i

    Peak extra memory is about two ``[chunk, vocab]`` fp32 buffers (logits and their exp), never
    ``[n, vocab]``; backward also holds dW as fp32 ``[vocab, hidden]`` (and, for a low-precision W,
    one more such buffer for each chunk's product): ~2 GiB each at llama3-8b's vocabulary.

    ``ChunkedCrossEntropy.apply(hidden, weight, targets, chunk, blocks="auto")``: where the fused
    kernels run (``blocks``, :func:`cadlib.runtime.fused.use_fused`), the fused head of
    :mod:`cadlib.runtime.fused_head` computes the same loss and gradients instead."""

    @classmethod
    def apply(cls, hidden, weight, targets, chunk: int, blocks: str = "auto"):
        if use_fused(blocks, hidden):
            on = torch.is_grad_enabled()
            return LinearCrossEntropyFn.apply(hidden, weight, targets, chunk, IGNORE_INDEX,
                                              (on and hidden.requires_grad, on and weight.requires_grad))
        return super().apply(hidden, weight, targets, chunk)

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int):
        n = hidden.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        valid = targets != IGNORE_INDEX
        safe = torch.where(valid, targets, torch.zeros_like(targets))
        wt = weight.t()
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            z = mm_f32(hidden[s:e], wt)                                   # [c, V] fp32
            lse[s:e] = torch.logsumexp(z, dim=-1)
            zt = z.gather(1, safe[s:e, None]).squeeze(1)
            total += ((lse[s:e] - zt) * valid[s:e]).sum()
            del z
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, targets, lse = ctx.saved_tensors
        chunk, n = ctx.chunk, hidden.shape[0]
        valid = targets != IGNORE_INDEX
        safe = torch.where(valid, targets, torch.zeros_like(targets))
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh = torch.empty_like(hidden) if need_h else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        wt = weight.t()
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            h = hidden[s:e]
            p = mm_f32(h, wt).sub_(lse[s:e, None]).exp_()                 # softmax, [c, V] fp32
            p.scatter_add_(1, safe[s:e, None], -torch.ones(e - s, 1, dtype=p.dtype, device=p.device))
            p.mul_((valid[s:e].to(p.dtype) * grad)[:, None])              # dL/dz, zero on ignored rows
            g = p.to(hidden.dtype)
            del p
            if need_h:
                dh[s:e] = g @ weight
            if need_w and g.dtype == torch.float32:
                dw.addmm_(g.t(), h)                                       # in place, no [V, hidden] temp
            elif need_w:
                dw += mm_f32(g.t(), h)
        return dh, (dw.to(weight.dtype) if need_w else None), None, None

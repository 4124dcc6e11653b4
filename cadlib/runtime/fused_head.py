"""The LM head and its cross-entropy with the gradient made in the forward: three GEMMs per chunk of
tokens instead of the reference's four (:class:`cadlib.runtime.blocks.ChunkedCrossEntropy` computes
each chunk's logits again in the backward).

The loss is a scalar, so its gradient is a scalar ``g`` times the gradient of the loss itself. Per
chunk of ``c`` tokens, ``z = h W^T`` (``[c, V]``, fp32 output), then one kernel per row streams ``z``
twice: an online max and sum give ``lse = log sum_v exp(z_v)`` and the row's loss ``lse - z_t``, then
it writes ``p = softmax(z) - onehot(t)`` (zero on ignored rows) in the model's dtype. Two GEMMs follow::

    dh_chunk = p W,     dW += p^T h_chunk        (dW in fp32, accumulated inside the GEMM where torch can)

The forward keeps ``dh`` (``[n, hidden]``) and ``dW`` (in the weight's dtype) instead of ``hidden`` and
the per-token ``lse``; the backward multiplies them by ``g``. Peak extra memory in the forward: ``dW`` in
fp32 and one chunk's fp32 logits and ``p``; nothing of ``[n, vocab]``. Under ``torch.no_grad`` only the
loss is computed (one GEMM per chunk).
"""
from __future__ import annotations

import torch

from .fused import HAVE_TRITON, addmm_f32_, mm_f32, tl, triton

CE_BLOCK = 2048
"""Vocabulary entries per step of the cross-entropy kernel's loops."""

if HAVE_TRITON:
    @triton.jit
    def _ce_rows(Z, stride_z, P, stride_p, T, LOSS, V, ignore, BLOCK: tl.constexpr, WRITE_P: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        z_row = Z + row * stride_z
        cols = tl.arange(0, BLOCK)
        z = tl.load(z_row + cols, mask=cols < V, other=float("-inf"))
        m = tl.max(z, axis=0)
        s = tl.sum(tl.exp(z - m), axis=0)
        for start in range(BLOCK, V, BLOCK):                        # online max and sum
            z = tl.load(z_row + start + cols, mask=start + cols < V, other=float("-inf"))
            m_new = tl.maximum(m, tl.max(z, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
            m = m_new
        lse = m + tl.log(s)
        t = tl.load(T + row)
        valid = t != ignore
        zt = tl.load(z_row + tl.where(valid, t, 0))
        tl.store(LOSS + row, tl.where(valid, lse - zt, 0.0))
        if WRITE_P:
            scale = tl.where(valid, 1.0, 0.0)
            for start in range(0, V, BLOCK):
                c = start + cols
                z = tl.load(z_row + c, mask=c < V, other=0.0)
                p = tl.exp(z - lse) - tl.where(c == t, 1.0, 0.0)
                tl.store(P + row * stride_p + c, (p * scale).to(P.dtype.element_ty), mask=c < V)


class LinearCrossEntropyFn(torch.autograd.Function):
    """``sum_i [lse_i - z_{i, t_i}]`` over targets ``!= ignore``, ``z_i = W h_i`` (fp32), in chunks of
    ``chunk`` tokens (module docstring); ``grads``: which of ``hidden``, ``weight`` need a gradient
    (computed in the forward; ``(False, False)`` under ``torch.no_grad``)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, ignore: int, grads: tuple[bool, bool]):
        n, vocab = hidden.shape[0], weight.shape[0]
        need_h, need_w = grads
        loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
        dh = torch.empty_like(hidden) if need_h else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        targets = targets.contiguous()
        wt = weight.t()
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            z = mm_f32(hidden[s:e], wt)                                   # [c, V] fp32
            p = z if not (need_h or need_w) else \
                torch.empty(e - s, vocab, dtype=hidden.dtype, device=hidden.device)
            _ce_rows[(e - s,)](z, z.stride(0), p, p.stride(0), targets[s:e], loss[s:e], vocab, ignore,
                               BLOCK=CE_BLOCK, WRITE_P=need_h or need_w, num_warps=8)
            del z
            if need_h:
                torch.mm(p, weight, out=dh[s:e])
            if need_w:
                addmm_f32_(dw, p.t(), hidden[s:e])
            del p
        ctx.save_for_backward(dh, dw.to(weight.dtype) if need_w else None)
        return loss.sum()

    @staticmethod
    def backward(ctx, grad):
        dh, dw = ctx.saved_tensors
        return (None if dh is None else dh * grad, None if dw is None else dw * grad, None, None, None, None)

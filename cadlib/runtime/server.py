"""The attention server: ONE fused varlen kernel call over every CA-task it received.

Forward takes Q rows and KV rows and returns O and LSE; backward takes what the forward had (the
server keeps its buffers, O and LSE: :mod:`cadlib.runtime.stages`) and dO, and returns dQ, dK, dV.
The scatter of dK, dV into the KV buffer is here too. It reads its inputs from two buffers laid out by
:mod:`cadlib.dispatch.build`: the per-query buffer ``cat([local, received Q])`` and the KV buffer
``cat([local, received KV])``. For task ``t`` (``[a, b)`` of document ``d``) the call sees the query
rows ``q_rows[cu_q[t]:cu_q[t+1]]`` and the KV prefix ``[0, b)`` of ``d``; the kernel's segment
semantics (queries are the suffix of the KV block) give exactly causal attention
``o_i = sum_{j<=i} softmax_j(q_i . k_j / sqrt(D)) v_j``.

Two ways to lay out the call (``kv_share``):

* ``"merged"`` (default, :mod:`cadlib.dispatch.kvshare`): tasks of one document with contiguous query ranges
  are one segment over one copy of their prefix; the KV rows of the call are gathered once (not at
  all when they are the buffer itself). Backward: dK/dV of rows read once are written in the KV dtype;
  rows that several segments read (non-contiguous shards of one document) are summed in fp32.
* ``"copy"`` (the reference): one segment per task, each gathering its own prefix copy
  ``kv_rows[cu_k[t]:cu_k[t+1]]``; backward sums every copy's dK/dV with ``index_add_`` in fp32.

Either way the output rows are in task-row order (``q_rows``), and the dK/dV buffers are aligned with
the KV buffer, every task's contribution summed, in the KV buffer's dtype. When ``q_rows`` is the
identity (``Dispatch.q_identity``: the server computes its whole query buffer
``cat([local[:q_keep], received])`` in buffer order) the query-side buffers are read as they are, with
no gather.
"""
from __future__ import annotations

import torch

from ..dispatch.kvshare import check_mode
from .device import DeviceDispatch, DeviceSharedKV
from .kernels import attend, attend_backward


def _gather(buf: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return buf.index_select(0, rows)


def _q_rows(buf: torch.Tensor, dd: DeviceDispatch) -> torch.Tensor:
    """A per-query buffer's rows in task-row order: the buffer itself when ``q_identity``."""
    return buf if dd.meta.q_identity else buf.index_select(0, dd.q_rows)


def _call(dd: DeviceDispatch, k_buf, v_buf, mode: str):
    """The call's KV tensors and segment metadata: ``(k, v, cu_q, cu_k, max_q, max_k)``."""
    if mode == "copy":
        m = dd.meta
        return (_gather(k_buf, dd.kv_rows), _gather(v_buf, dd.kv_rows), dd.cu_q, dd.cu_k, m.max_q, m.max_k)
    sh = dd.shared
    s = sh.meta
    if s.kv_identity:                                   # the buffer's first n_kv rows, in place
        k, v = k_buf[:s.n_kv], v_buf[:s.n_kv]
    else:
        k, v = _gather(k_buf, sh.kv_rows), _gather(v_buf, sh.kv_rows)
    return k, v, sh.cu_q, sh.cu_k, s.max_q, s.max_k


def serve_forward(q_buf: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, dd: DeviceDispatch,
                  attn_backend: str | None = None, kv_share: str | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Run this server's tasks in one ``attend`` call; returns ``(out, lse)`` in task-row order
    (``[n_rows, Hq, D]`` and float32 ``[n_rows, Hq]``)."""
    mode = check_mode(kv_share)
    m = dd.meta
    if m.n_tasks == 0:
        return (q_buf.new_empty((0, *q_buf.shape[1:])),
                torch.empty((0, q_buf.shape[1]), dtype=torch.float32, device=q_buf.device))
    k, v, cu_q, cu_k, mq, mk = _call(dd, k_buf, v_buf, mode)
    return attend(_q_rows(q_buf, dd), k, v, cu_q, cu_k, mq, mk, causal=True, backend=attn_backend)


def serve_backward(q_buf, k_buf, v_buf, o_t, do_t, lse_t, dd: DeviceDispatch,
                         attn_backend: str | None = None, kv_share: str | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One ``attend_backward`` call over this server's tasks: ``o_t``, ``do_t`` and ``lse_t`` are in
    task-row order (what :func:`serve_forward` returned and the server kept). Returns ``dq`` in
    task-row order (``[n_rows, Hq, D]``) and ``dk``, ``dv`` aligned with the KV buffer
    (``[len(k_buf), Hkv, D]``, its dtype), every task's contribution summed."""
    mode = check_mode(kv_share)
    m = dd.meta
    if m.n_tasks == 0:
        return (q_buf.new_empty((0, *q_buf.shape[1:])), torch.zeros_like(k_buf), torch.zeros_like(v_buf))
    k, v, cu_q, cu_k, mq, mk = _call(dd, k_buf, v_buf, mode)
    dq, dk_seg, dv_seg = attend_backward(do_t, _q_rows(q_buf, dd), k, v, o_t, lse_t, cu_q, cu_k,
                                         mq, mk, causal=True, backend=attn_backend)
    if mode == "merged":
        n = k_buf.shape[0]
        return (dq, scatter_kv_grad(dk_seg, dd.shared, n, k_buf.dtype),
                scatter_kv_grad(dv_seg, dd.shared, n, v_buf.dtype))
    dk = torch.zeros(k_buf.shape, dtype=torch.float32, device=k_buf.device)
    dv = torch.zeros(v_buf.shape, dtype=torch.float32, device=v_buf.device)
    dk.index_add_(0, dd.kv_rows, dk_seg.float())
    dv.index_add_(0, dd.kv_rows, dv_seg.float())
    return dq, dk.to(k_buf.dtype), dv.to(v_buf.dtype)


def scatter_kv_grad(seg_grad, sh: DeviceSharedKV, n_rows: int, dtype):
    """dK (or dV) of the merged call's KV rows into a ``[n_rows, ...]`` buffer of ``dtype``: rows read
    once are written as they are; rows read by several segments are summed in fp32, rounded once."""
    m = sh.meta
    if m.kv_identity:                                       # the buffer's first rows, in order
        g = seg_grad.to(dtype)
        rest = n_rows - g.shape[0]
        return torch.cat([g, g.new_zeros((rest, *g.shape[1:]))]) if rest else g
    out = seg_grad.new_zeros((n_rows, *seg_grad.shape[1:]), dtype=dtype)
    if m.all_once:
        return out.index_copy_(0, sh.kv_rows, seg_grad.to(dtype))
    out.index_copy_(0, sh.once_rows, seg_grad.index_select(0, sh.once_pos).to(dtype))
    acc = seg_grad.new_zeros((sh.rep_rows.shape[0], *seg_grad.shape[1:]), dtype=torch.float32)
    acc.index_add_(0, sh.rep_slot, seg_grad.index_select(0, sh.rep_pos).float())
    return out.index_copy_(0, sh.rep_rows, acc.to(dtype))


def add_rows(dst, index, uniq, slot, src):
    """``dst[index] += src`` with repeated ``index`` entries summed (``uniq``/``slot``: ``index``'s
    distinct rows and each entry's position among them, from the host): only the touched rows are
    accumulated in fp32, then rounded once into ``dst`` (in place; returned)."""
    if not index.numel():
        return dst
    acc = dst.index_select(0, uniq).float()
    acc.index_add_(0, slot, src.to(torch.float32))
    return dst.index_copy_(0, uniq, acc.to(dst.dtype))

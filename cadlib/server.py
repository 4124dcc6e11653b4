"""The attention server: ONE fused varlen kernel call over every CA-task it received.

A server is stateless (DistCA): forward takes Q rows and KV rows, returns O and LSE; backward takes
Q, K, V, O, dO, LSE again and returns dQ, dK, dV. It reads its inputs from two buffers laid out by
:mod:`cadlib.dispatch`: the per-query buffer ``cat([local, received Q])`` and the KV buffer
``cat([local, received KV])``. For task ``t`` (``[a, b)`` of document ``d``) the call sees the query
rows ``q_rows[cu_q[t]:cu_q[t+1]]`` and the contiguous KV segment ``kv_rows[cu_k[t]:cu_k[t+1]]`` =
tokens ``[0, b)`` of ``d``, so the kernel's segment semantics (queries are the suffix of the KV block)
give exactly causal attention ``o_i = sum_{j<=i} softmax_j(q_i . k_j / sqrt(D)) v_j``.

Because several tasks may read one KV token (a shared prefix, received once), backward sums their
contributions: ``dK_buf[r] = sum_{t, j : kv_rows[j] = r} dK_seg[j]`` (``index_add_`` in fp32).
"""
from __future__ import annotations

import torch

from .dispatch import DeviceDispatch
from .kernels import attend, attend_backward


def _gather(buf: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return buf.index_select(0, rows)


def serve_forward(q_buf: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, dd: DeviceDispatch,
                  attn_backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run this server's tasks in one ``attend`` call; returns ``(out, lse)`` in task-row order
    (``[n_rows, Hq, D]`` and float32 ``[n_rows, Hq]``)."""
    m = dd.meta
    if m.n_tasks == 0:
        return (q_buf.new_empty((0, *q_buf.shape[1:])),
                torch.empty((0, q_buf.shape[1]), dtype=torch.float32, device=q_buf.device))
    return attend(_gather(q_buf, dd.q_rows), _gather(k_buf, dd.kv_rows), _gather(v_buf, dd.kv_rows),
                  dd.cu_q, dd.cu_k, m.max_q, m.max_k, causal=True, backend=attn_backend)


def serve_backward(q_buf: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, o_buf: torch.Tensor,
                   do_buf: torch.Tensor, lse_buf: torch.Tensor, dd: DeviceDispatch,
                   attn_backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One ``attend_backward`` call over this server's tasks; ``o_buf``, ``do_buf``, ``lse_buf`` are
    per-query buffers laid out like ``q_buf``.

    Returns ``dq`` in task-row order (``[n_rows, Hq, D]``) and ``dk``, ``dv`` as float32 buffers
    aligned with the KV buffer (``[len(k_buf), Hkv, D]``), every task's contribution summed."""
    rows = dd.q_rows
    return serve_backward_tasks(q_buf, k_buf, v_buf, _gather(o_buf, rows), _gather(do_buf, rows),
                                _gather(lse_buf, rows), dd, attn_backend)


def serve_backward_tasks(q_buf, k_buf, v_buf, o_t, do_t, lse_t, dd: DeviceDispatch,
                         attn_backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`serve_backward` with ``o``, ``dO`` and ``lse`` already in task-row order (what
    :func:`serve_forward` returned): the form a server that kept its forward outputs uses."""
    m = dd.meta
    dk = torch.zeros(k_buf.shape, dtype=torch.float32, device=k_buf.device)
    dv = torch.zeros(v_buf.shape, dtype=torch.float32, device=v_buf.device)
    if m.n_tasks == 0:
        return q_buf.new_empty((0, *q_buf.shape[1:])), dk, dv
    dq, dk_seg, dv_seg = attend_backward(
        do_t, _gather(q_buf, dd.q_rows), _gather(k_buf, dd.kv_rows), _gather(v_buf, dd.kv_rows), o_t, lse_t,
        dd.cu_q, dd.cu_k, m.max_q, m.max_k, causal=True, backend=attn_backend)
    dk.index_add_(0, dd.kv_rows, dk_seg.float())
    dv.index_add_(0, dd.kv_rows, dv_seg.float())
    return dq, dk, dv

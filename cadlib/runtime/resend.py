"""Stateless attention servers, for pipeline parallelism's lock-step ticks: the backward resends.

Under PP a tick's CA-tasks are those of every stage's current microbatch, scheduled together over all
GPUs (:mod:`cadlib.core.pipeline`). A microbatch's forward and backward run in different ticks, next
to different microbatches of the other stages, so they have different plans: the server that
attended a query in the forward is in general not the one that attends it in the backward. So here
no server keeps anything between the two (as DistCA's servers do not): the home keeps its own
``q, k, v`` and gets ``o`` and the LSE back, and the backward sends what the backward kernel needs to
the backward tick's servers::

    forward  (tick plan F)  home q | owner k, v   --all_to_all-->  server      out, lse = attend(...)
                            server out, lse       --all_to_all-->  home        keeps q, k, v, o, lse
    backward (tick plan B)  home q, o, dO, lse | owner k, v   --all_to_all-->  server
                            server dq, dk, dv = attend_backward(...)            ONE call
                            server dq | dk, dv    --all_to_all-->  home dq | owner dk, dv (summed)

Twice the bytes of the staged engine's backward (:mod:`cadlib.runtime.stages`, whose servers keep
their buffers), none of its server memory. Each step is one plain function call (no autograd; the
pipeline's layer loop, :mod:`cadlib.runtime.pipeline`, calls the linear layers' backward around it),
so the two nano-batches of ping-pong can interleave their steps in both directions. Communication
runs on the communication stream, attention on the compute stream; the caller puts barriers between
ticks. Nothing here reads a device value on the host.
"""
from __future__ import annotations

import torch

from .device import DeviceDispatch
from .server import serve_backward, serve_forward
from .stages import grads_home, query_buffer, rows_home, to_servers
from .streams import OFF, Streams, Timeline


class TickAttention:
    """One nano-batch's core attention of one layer: ``send``, ``serve``, ``ret`` forward (on the
    forward tick's dispatch), then ``send_grad``, ``serve_grad``, ``ret_grad`` backward (on the
    backward tick's). ``q, k, v`` are this rank's rows (detached: gradients come back from
    :meth:`ret_grad`)."""

    def __init__(self, comm, streams: Streams, attn_backend: str, tl: Timeline = OFF, name: str = "",
                 kv_share: str | None = None):
        self.comm, self.streams, self.backend, self.tl, self.name = comm, streams, attn_backend, tl, name
        self.kv_share = kv_share
        self._bufs = self._out = None
        self.saved = None          # (q, k, v, o, lse) at the home, for the backward

    def _comm(self, label: str, fn, *tensors):
        st = self.streams
        st.keep(tensors, st.comm)
        with st.on_comm(), self.tl.span("comm", f"{label} {self.name}"):
            out = fn()
        st.keep([t for part in out for t in (part if isinstance(part, (list, tuple)) else [part])],
                st.compute)
        return out

    # -- forward ------------------------------------------------------------------------------------
    def send(self, q, k, v, dd: DeviceDispatch) -> None:
        """q, k, v to the forward tick's servers."""
        self._dd, self._q, self._k, self._v = dd, q, k, v
        self._bufs = self._comm("send", lambda: to_servers(self.comm, [q], [k, v], dd), q, k, v)

    def serve(self) -> None:
        """The server's tasks, one call: out and lse in task-row order."""
        (q_buf,), (k_buf, v_buf) = self._bufs
        self._bufs = None
        with self.tl.span("compute", f"attn {self.name}"):
            self._out = serve_forward(q_buf, k_buf, v_buf, self._dd, self.backend, self.kv_share)

    def ret(self) -> torch.Tensor:
        """o (and lse) back to the home; returns ``o [n_local, Hq, D]`` and keeps what the backward needs."""
        out, lse = self._out
        self._out = None
        o, lse_h = self._comm("return", lambda: rows_home(self.comm, [out, lse], self._dd), out, lse)
        self.saved = (self._q, self._k, self._v, o, lse_h)
        del self._q, self._k, self._v, self._dd
        return o

    # -- backward -----------------------------------------------------------------------------------
    def send_grad(self, do, dd: DeviceDispatch) -> None:
        """q, o, dO, lse and k, v to the backward tick's servers."""
        q, k, v, o, lse = self.saved
        self.saved, self._dd = None, dd
        do = do.contiguous()
        self._bufs = self._comm("send'", lambda: to_servers(self.comm, [q, o, do, lse], [k, v], dd),
                                q, k, v, o, do, lse)

    def serve_grad(self) -> None:
        """dq (in the query buffer's layout), dk, dv (the KV buffer's) of the server's tasks, one call."""
        (q_buf, o_buf, do_buf, lse_buf), (k_buf, v_buf) = self._bufs
        self._bufs = None
        dd = self._dd
        rows = (lambda b: b) if dd.meta.q_identity else (lambda b: b.index_select(0, dd.q_rows))
        with self.tl.span("compute", f"attn' {self.name}"):
            dq_t, dk, dv = serve_backward(q_buf, k_buf, v_buf, rows(o_buf), rows(do_buf), rows(lse_buf),
                                          dd, self.backend, self.kv_share)
            self._out = (query_buffer(dq_t.to(q_buf.dtype), q_buf, dd), dk.to(k_buf.dtype),
                         dv.to(v_buf.dtype))

    def ret_grad(self):
        """dq back to the homes, dk, dv to the owners; returns ``(dq, dk, dv)`` of this rank's rows."""
        dq_buf, dk_buf, dv_buf = self._out
        self._out = None
        grads = self._comm("return'", lambda: grads_home(self.comm, dq_buf, dk_buf, dv_buf, self._dd),
                           dq_buf, dk_buf, dv_buf)
        del self._dd
        return grads


def resend_attention(q, k, v, dd_fwd: DeviceDispatch, dd_bwd: DeviceDispatch, do, comm, streams,
                     attn_backend: str):
    """Forward on ``dd_fwd`` and backward on ``dd_bwd`` in one go: ``(o, dq, dk, dv)`` (for tests; the
    pipeline runs the six steps in its ticks)."""
    att = TickAttention(comm, streams, attn_backend)
    att.send(q, k, v, dd_fwd)
    att.serve()
    o = att.ret()
    att.send_grad(do, dd_bwd)
    att.serve_grad()
    return (o, *att.ret_grad())

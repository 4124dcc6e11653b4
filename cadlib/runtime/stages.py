"""CAD attention in three autograd stages, so that two nano-batches can overlap (ping-pong).

:func:`cadlib.runtime.cad.cad_attention` is one autograd node: dispatch, serve and return happen inside one
call, and its servers are stateless (the backward resends q, k, v, o, dO, LSE from the homes, as
DistCA does). Overlapping one nano-batch's communication with the other's compute needs the pieces
as separate nodes, each on its own stream, so that the forward can interleave them and autograd can
replay the backward in mirror order:

* :func:`send` (comm stream): q, k, v of the homes -> all-to-all -> the servers' buffers; its backward
  returns dQ, dK, dV of the received rows to their homes;
* :func:`serve` (compute stream): one fused varlen call over the server's tasks; backward: one fused
  backward call;
* :func:`ret` (comm stream): O rows of the servers -> all-to-all -> the homes' ``o``; its backward
  sends dO rows to the servers.

Here the servers keep what they received (and their outputs) until the backward, so the backward
moves only dO out and dQ, dK, dV back: half the bytes of the stateless backward, for server memory
equal to the rows it received. ``staged_attention`` chains the three on one stream (CAD without
ping-pong); :mod:`cadlib.runtime.pingpong` interleaves two nano-batches.

Streams: a stage's backward runs on the stream that was current when the stage was applied
(autograd's rule for CUDA), so :func:`send` and :func:`ret` are applied on the comm stream; autograd
makes a node's stream wait for the streams that produced its gradients when that node runs. Tensors that cross
streams are kept alive for the stream that uses them (``record_stream``). Nothing here reads a device
value on the host. On CPU there are no streams: the same code runs in program order.
"""
from __future__ import annotations

import contextlib
import time

import torch

from .cad import (
    AllToAll,
    _exchange,
    check_inputs,
    kv_rows_cat,
    local_part,
    prepare,
    recv_part,
    send_rows,
    server_rows,
    to_home,
)
from .device import DeviceDispatch
from .server import add_rows, serve_backward_tasks, serve_forward


class Streams:
    """A compute stream (the current one) and a communication stream on CUDA; no-ops on CPU."""

    def __init__(self, device):
        device = torch.device(device)
        self.cuda = device.type == "cuda"
        self.compute = torch.cuda.current_stream(device) if self.cuda else None
        self.comm = torch.cuda.Stream(device) if self.cuda else None

    def on_comm(self):
        return torch.cuda.stream(self.comm) if self.cuda else contextlib.nullcontext()

    def barrier(self) -> None:
        """Two-way stream barrier: each stream waits for everything queued on the other (no host sync)."""
        if self.cuda:
            self.comm.wait_stream(self.compute)
            self.compute.wait_stream(self.comm)

    def keep(self, tensors, stream) -> None:
        """Keep ``tensors``' memory alive until ``stream``'s queued work is done."""
        if self.cuda:
            for t in tensors:
                if t is not None and t.is_cuda:
                    t.record_stream(stream)


class Timeline:
    """Spans ``(lane, phase)`` recorded with CUDA events on the current stream (wall clock on CPU).

    ``span`` is a context manager; :meth:`rows` resolves the times (one device synchronisation, after
    the step) in milliseconds from :meth:`origin`. A disabled timeline records nothing."""

    def __init__(self, device, enabled: bool = True):
        self.cuda = torch.device(device).type == "cuda"
        self.enabled = enabled
        self._spans: list = []
        self._origin = None

    def mark(self):
        """A point in time on the current stream (a recorded CUDA event; the wall clock on CPU)."""
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def origin(self) -> None:
        self._spans.clear()
        self._origin = self.mark()

    def add(self, lane: str, phase: str, start, end) -> None:
        """Record a span between two :meth:`mark` points."""
        self._spans.append((lane, phase, start, end))

    @contextlib.contextmanager
    def span(self, lane: str, phase: str):
        if not self.enabled:
            yield
            return
        start = self.mark()
        try:
            yield
        finally:
            self.add(lane, phase, start, self.mark())

    def _ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def rows(self) -> list[dict]:
        if self.cuda:
            torch.cuda.synchronize()
        return [{"lane": lane, "phase": phase, "start_ms": self._ms(self._origin, a),
                 "end_ms": self._ms(self._origin, b)} for lane, phase, a, b in self._spans]


_OFF = Timeline("cpu", enabled=False)


class SignalOnly(AllToAll):
    """The control of DistCA's ablation: every all-to-all moves one element per peer. What remains of a
    step's communication cost is then latency and synchronisation, not bytes.

    The receiver gets rows of the size it expected filled with real values: copies of its own local
    rows (``fill``, :func:`cadlib.runtime.cad.cycled_rows`), repeated as needed. Not zeros: on an H200 FA4's
    forward+backward runs 16% faster on all-zero inputs and a bf16 GEMM 16% faster (lower power, higher
    clock; ``scripts/probes/probe_input_values.py``), so a control that received zeros would time the
    servers' work on received rows too fast and credit that to exposed communication. The copy costs
    one gather of the received size, less than the bytes NCCL would have written."""

    def start(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], fill=None):
        world = len(send_splits)
        token = send.new_zeros((world,))
        pending = super().start(token, [1] * world, [1] * world)
        return _Ready(received_like(send, int(sum(recv_splits)), fill), pending)


def received_like(send: torch.Tensor, n: int, fill=None) -> torch.Tensor:
    """``n`` rows shaped and packed like ``send``'s: ``fill(n)`` (real values), or zeros when there is
    nothing to fill them from."""
    out = fill(n) if fill is not None and n else None
    if out is None:
        return send.new_zeros((n, *send.shape[1:]))
    if out.shape[1:] != send.shape[1:] or out.dtype != send.dtype:
        raise ValueError(f"fill must pack rows like send {tuple(send.shape[1:])} {send.dtype}, got "
                         f"{tuple(out.shape[1:])} {out.dtype}")
    return out


class _Ready:
    def __init__(self, recv, pending):
        self.recv, self.pending = recv, pending

    def wait(self):
        self.pending.wait()
        return self.recv


class _Send(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, dd: DeviceDispatch, comm, streams: Streams, tl: Timeline, name: str):
        m = dd.meta
        streams.keep((q, k, v), streams.comm)
        with streams.on_comm(), tl.span("comm", f"send {name}"):
            wait_q = send_rows(comm, [q], dd)
            wait_kv = _exchange(comm, [k, v], dd.kv_send_index, m.kv_send_splits, m.kv_recv_splits,
                                m.kv_traffic)
            (q_recv,) = wait_q()
            k_recv, v_recv = wait_kv()
            bufs = (server_rows(q, q_recv, m), kv_rows_cat(k, k_recv, m), kv_rows_cat(v, v_recv, m))
        streams.keep(bufs, streams.compute)
        ctx.dd, ctx.comm, ctx.streams, ctx.tl, ctx.name = dd, comm, streams, tl, name
        return bufs

    @staticmethod
    def backward(ctx, dq_buf, dk_buf, dv_buf):
        dd, m, comm, streams = ctx.dd, ctx.dd.meta, ctx.comm, ctx.streams
        n = m.n_local
        streams.keep((dq_buf, dk_buf, dv_buf), streams.comm)
        with ctx.tl.span("comm", f"send' {ctx.name}"):
            wait_q = _exchange(comm, [recv_part(dq_buf, m)], None, m.q_recv_splits, m.q_send_splits,
                               m.q_traffic, source=[dq_buf])
            wait_kv = _exchange(comm, [recv_part(dk_buf, m, True), recv_part(dv_buf, m, True)], None,
                                m.kv_recv_splits, m.kv_send_splits, m.kv_traffic, source=[dk_buf, dv_buf])
            (rq,) = wait_q()
            rk, rv = wait_kv()
            # rows of this rank served elsewhere get their gradients added (on a copy: the buffer's
            # gradient is autograd's); a sent-last rank's are its tail (to_home); with nothing sent
            # and every row served here, the local part is the gradient as it is
            if m.q_identity and m.q_keep < n:
                dq = to_home(dq_buf, rq, dd)
            else:
                dq_l = local_part(dq_buf, m)
                dq = dq_l.clone().index_add_(0, dd.q_send_index, rq) if m.n_send_q else dq_l
            dk_l, dv_l = local_part(dk_buf, m, True), local_part(dv_buf, m, True)
            if m.n_send_kv:
                dk = add_rows(dk_l.clone(), dd.kv_send_index, dd.kv_send_uniq, dd.kv_send_slot, rk)
                dv = add_rows(dv_l.clone(), dd.kv_send_index, dd.kv_send_uniq, dd.kv_send_slot, rv)
            else:
                dk, dv = dk_l, dv_l
            grads = (dq, dk, dv)
        streams.keep(grads, streams.compute)
        return (*grads, None, None, None, None, None)


class _Serve(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_buf, k_buf, v_buf, dd: DeviceDispatch, attn_backend, tl: Timeline, name: str):
        with tl.span("compute", f"attn {name}"):
            out, lse = serve_forward(q_buf, k_buf, v_buf, dd, attn_backend)
        ctx.save_for_backward(q_buf, k_buf, v_buf, out, lse)
        ctx.dd, ctx.attn_backend, ctx.tl, ctx.name = dd, attn_backend, tl, name
        return out

    @staticmethod
    def backward(ctx, dout):
        q_buf, k_buf, v_buf, out, lse = ctx.saved_tensors
        dd = ctx.dd
        with ctx.tl.span("compute", f"attn' {ctx.name}"):
            dq_t, dk, dv = serve_backward_tasks(q_buf, k_buf, v_buf, out, dout.contiguous(), lse, dd,
                                                ctx.attn_backend)
            if dd.meta.q_identity:
                dq = dq_t.to(q_buf.dtype)
            else:
                dq = torch.zeros_like(q_buf).index_copy_(0, dd.q_rows, dq_t.to(q_buf.dtype))
        return dq, dk.to(k_buf.dtype), dv.to(v_buf.dtype), None, None, None, None


class _Return(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, dd: DeviceDispatch, comm, streams: Streams, tl: Timeline, name: str):
        m = dd.meta
        streams.keep((out,), streams.comm)
        with streams.on_comm(), tl.span("comm", f"return {name}"):
            if m.q_identity:       # kept rows first, in order; received ones go back unpermuted
                (back,) = _exchange(comm, [recv_part(out, m)], None, m.q_recv_splits, m.q_send_splits,
                                    m.q_traffic, source=[out])()
            else:
                (back,) = _exchange(comm, [out], dd.ret_rows, m.q_recv_splits, m.q_send_splits, m.q_traffic)()
            o = to_home(out, back, dd)
        streams.keep((o,), streams.compute)
        ctx.dd, ctx.comm, ctx.streams, ctx.tl, ctx.name = dd, comm, streams, tl, name
        ctx.n_rows = out.shape[0]
        return o

    @staticmethod
    def backward(ctx, do):
        dd, m, streams = ctx.dd, ctx.dd.meta, ctx.streams
        streams.keep((do,), streams.comm)
        with ctx.tl.span("comm", f"return' {ctx.name}"):
            do = do.contiguous()
            (recv,) = send_rows(ctx.comm, [do], dd)()
            if m.q_identity:
                dout = server_rows(do, recv, m)
            else:
                dout = do.new_empty((ctx.n_rows, *do.shape[1:]))
                dout.index_copy_(0, dd.self_rows, do.index_select(0, dd.self_local))
                dout.index_copy_(0, dd.ret_rows, recv)
        streams.keep((dout,), streams.compute)
        return dout, None, None, None, None, None


def send(q, k, v, dd, comm, streams, tl=_OFF, name=""):
    """Stage 1 (comm stream): q, k, v of this rank's tokens to their servers; returns the server
    buffers ``(q_buf, k_buf, v_buf)`` = ``cat([local, received])``.

    Applied with the comm stream current, so that autograd runs its backward there too (a node's
    backward runs on the stream that was current when it was applied) and makes the consumers of its
    gradients wait for that stream only when they run."""
    with streams.on_comm():
        return _Send.apply(q, k, v, dd, comm, streams, tl, name)


def serve(q_buf, k_buf, v_buf, dd, attn_backend=None, tl=_OFF, name=""):
    """Stage 2 (compute stream): this server's tasks in one fused call; returns O in task-row order."""
    return _Serve.apply(q_buf, k_buf, v_buf, dd, attn_backend, tl, name)


def ret(out, dd, comm, streams, tl=_OFF, name=""):
    """Stage 3 (comm stream): O rows back to their homes; returns ``o [n_local, Hq, D]`` (applied on
    the comm stream, like :func:`send`)."""
    with streams.on_comm():
        return _Return.apply(out, dd, comm, streams, tl, name)


def prepare_staged(q, k, v, plan, group, attn_backend=None):
    """Validate inputs (every rank, before any collective) and return ``(dd, attn_backend)``."""
    dd = prepare(plan, group, q.device)
    return dd, check_inputs(q, k, v, dd.meta.n_local, attn_backend, group)


def staged_attention(q, k, v, plan, group, attn_backend=None, comm=None, streams=None, tl=_OFF, name=""):
    """CAD attention as send -> serve -> return, one nano-batch, no overlap: the same result as
    :func:`cadlib.runtime.cad.cad_attention` (tested), with the stateful servers described above."""
    dd, attn_backend = prepare_staged(q, k, v, plan, group, attn_backend)
    comm = comm if comm is not None else AllToAll(group)
    streams = streams if streams is not None else Streams(q.device)
    streams.barrier()
    bufs = send(q, k, v, dd, comm, streams, tl, name)
    streams.barrier()
    out = serve(*bufs, dd, attn_backend, tl, name)
    streams.barrier()
    o = ret(out, dd, comm, streams, tl, name)
    streams.barrier()
    return o

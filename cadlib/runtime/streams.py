"""Streams and timelines: a compute and a communication stream (no-ops on CPU), spans of a step
recorded with CUDA events, and spans around autograd blocks, forward and backward."""
from __future__ import annotations

import contextlib
import time

import torch


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


OFF = Timeline("cpu", enabled=False)


def as_tuple(out) -> tuple:
    """A custom Function returns a bare tensor for one output: make it a tuple again."""
    return (out,) if isinstance(out, torch.Tensor) else tuple(out)


class _SpanEnd(torch.autograd.Function):
    """Identity; its backward opens the backward span of the block it closes (see :func:`spanned`)."""

    @staticmethod
    def forward(ctx, tl, box, *tensors):
        ctx.tl, ctx.box = tl, box
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.box["start"] = ctx.tl.mark()
        return (None, None, *grads)


class _SpanStart(torch.autograd.Function):
    """Identity; its backward closes the backward span opened by the matching :class:`_SpanEnd`."""

    @staticmethod
    def forward(ctx, tl, box, lane, phase, *tensors):
        ctx.tl, ctx.box, ctx.lane, ctx.phase = tl, box, lane, phase
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        if "start" in ctx.box:
            ctx.tl.add(ctx.lane, ctx.phase, ctx.box.pop("start"), ctx.tl.mark())
        return (None, None, None, None, *grads)


def spanned(tl: Timeline, phase: str, fn, *inputs):
    """``fn(*inputs)`` recorded as ``("compute", phase)`` forward and ``("compute", phase + "'")``
    backward (the backward span runs from the first gradient reaching the block's outputs to the
    last one leaving through its inputs)."""
    if not tl.enabled:
        return fn(*inputs)
    box: dict = {}
    grad_in = [t for t in inputs if t.requires_grad]
    if grad_in:
        moved = iter(as_tuple(_SpanStart.apply(tl, box, "compute", phase + "'", *grad_in)))
        inputs = tuple(next(moved) if t.requires_grad else t for t in inputs)
    with tl.span("compute", phase):
        out = fn(*inputs)
    single = isinstance(out, torch.Tensor)
    outs = (out,) if single else tuple(out)
    if grad_in and any(t.requires_grad for t in outs):
        outs = as_tuple(_SpanEnd.apply(tl, box, *outs))
    return outs[0] if single else outs

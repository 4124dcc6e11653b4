"""One GPU's share of a tensor-parallel layer under sequence parallelism, timed alone: the collectives
stood in for, so that the compute around them runs on the right number of tokens.

Megatron's sequence parallelism (SP) keeps the hidden-sized activations of a TP group of ``tp`` GPUs
split over its ``n`` tokens: each GPU runs the norms, residual adds and element-wise work on its
``n / tp`` tokens, all-gathers the norm's output before the column-parallel GEMMs (QKV, the MLP's
gate and up) and reduce-scatters the row-parallel GEMMs' partial sums (O, the MLP's down projection)
back to its tokens (:class:`cadlib.runtime.model.SequenceParallel`). The replay adds the collectives'
time from the link model (:func:`cadlib.analysis.replay.phases.tp_seconds`); what is timed on one GPU
is the compute. :class:`LocalSP` is that GPU's view: ``gather`` returns an ``[n, hidden]`` buffer
holding random rows with this GPU's rows copied in (the bytes an all-gather leaves there: real values,
not zeros, as a GEMM's speed depends on its inputs), ``scatter`` returns this GPU's rows of its input;
their backwards do the mirror, so the backward runs on the same token counts.
"""
from __future__ import annotations

import torch


def _fill(full: torch.Tensor, x: torch.Tensor, lo: int) -> torch.Tensor:
    full[lo:lo + x.shape[0]].copy_(x)
    return full


class _Gather(torch.autograd.Function):
    """``full`` (a pool buffer) with rows ``[lo, lo + len(x))`` replaced by ``x``; backward: those rows."""

    @staticmethod
    def forward(ctx, x, full, lo: int):
        ctx.mark_dirty(full)
        ctx.rows = (lo, lo + x.shape[0])
        return _fill(full, x, lo)

    @staticmethod
    def backward(ctx, dy):
        lo, hi = ctx.rows
        return dy[lo:hi], None, None


class _Scatter(torch.autograd.Function):
    """This GPU's rows of ``y``; backward: a pool buffer with the gradient's rows copied in."""

    @staticmethod
    def forward(ctx, y, sp: "LocalSP"):
        ctx.sp = sp
        return y[sp.lo:sp.hi].clone()

    @staticmethod
    def backward(ctx, dy):
        sp = ctx.sp
        return _fill(sp.buffer(), dy, sp.lo), None


class LocalSP:
    """Rank ``rank``'s share of ``n`` tokens in a group of ``tp`` (``n / tp`` rows, ``tp`` dividing ``n``),
    ``hidden`` wide: :meth:`gather` and :meth:`scatter` as the model calls them. Gathered tensors come
    from ``slots`` pre-drawn random buffers in turn: a layer keeps two for its backward (the norms'
    gathered outputs) and its backward gathers two more (three under MLP recompute), so the default
    leaves every tensor alive until the next step overwrites it."""

    def __init__(self, tp: int, n: int, hidden: int, device, dtype, rank: int = 0, slots: int = 6,
                 seed: int = 0):
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or n % tp:
            raise ValueError(f"tp must be an integer >= 1 dividing the tokens n={n}; got {tp!r}")
        if not 0 <= rank < tp:
            raise ValueError(f"rank must be in [0, tp={tp}); got {rank}")
        if slots < 1:
            raise ValueError(f"slots must be >= 1; got {slots}")
        self.tp, self.n, self.lo, self.hi = tp, n, rank * (n // tp), (rank + 1) * (n // tp)
        gen = torch.Generator(device=device).manual_seed(seed)
        self._pool = [torch.randn(n, hidden, generator=gen, device=device).to(dtype) for _ in range(slots)]
        self._next = 0

    @property
    def local(self) -> int:
        """Tokens of this GPU (``n / tp``)."""
        return self.hi - self.lo

    def buffer(self) -> torch.Tensor:
        """The next pre-drawn ``[n, hidden]`` buffer (a fresh alias of it)."""
        buf = self._pool[self._next]
        self._next = (self._next + 1) % len(self._pool)
        return buf.detach()

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[n / tp, hidden] -> [n, hidden]``, this GPU's rows in place."""
        if x.shape[0] != self.local:
            raise ValueError(f"gather expects this GPU's {self.local} rows; got {x.shape[0]}")
        return _Gather.apply(x, self.buffer(), self.lo)

    def scatter(self, y: torch.Tensor) -> torch.Tensor:
        """``[n, hidden] -> [n / tp, hidden]``: this GPU's rows (a reduce-scatter would also sum the
        other GPUs' partial products into them; the link model prices that)."""
        if y.shape[0] != self.n:
            raise ValueError(f"scatter expects the group's {self.n} rows; got {y.shape[0]}")
        return _Scatter.apply(y, self)

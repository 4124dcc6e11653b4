"""The all-to-all of CAD: byte-packed exchanges of per-row tensors over an explicit process group, and
the signal-only control of DistCA's ablation.

Several tensors with one row per token travel as one byte-packed all-to-all (:func:`pack_rows`), so a
stage sends one collective per exchange; an exchange that moves nothing on any rank (known from the
global plan) is skipped on every rank. Split sizes are host lists; nothing here reads a device value on
the host, and ``wait()`` only orders streams."""
from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist


class AllToAll:
    """``torch.distributed.all_to_all_single`` over an explicit process group, started async so two
    exchanges can be in flight at once; ``wait()`` only orders streams (NCCL) and never syncs the host
    with the device."""

    def __init__(self, group):
        self.group = group

    def start(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], fill=None):
        """``fill(n)``: ``n`` rows packed like ``send``'s made from local rows (unused here; the
        signal-only control, :class:`SignalOnly`, receives them instead)."""
        recv = send.new_empty((int(sum(recv_splits)), *send.shape[1:]))
        work = dist.all_to_all_single(recv, send.contiguous(), list(recv_splits), list(send_splits),
                                      group=self.group, async_op=True)
        return _Pending(recv, work)


class _Pending:
    def __init__(self, recv, work):
        self.recv, self.work = recv, work

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.recv


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``[n, ...]`` as ``[n, bytes]`` uint8 (a view when contiguous)."""
    t = t.contiguous()
    return t.view(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8)


def pack_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate per-row tensors of any dtypes into one uint8 ``[n, sum bytes]`` buffer."""
    return tensors[0].contiguous() if len(tensors) == 1 else torch.cat([_as_bytes(t) for t in tensors], 1)


def unpack_rows(buf: torch.Tensor, likes: list[torch.Tensor]) -> list[torch.Tensor]:
    """Inverse of :func:`pack_rows`; ``likes`` give each part's trailing shape and dtype."""
    if len(likes) == 1:
        return [buf]
    out, off, n = [], 0, buf.shape[0]
    for like in likes:
        width = math.prod(like.shape[1:]) * like.element_size()
        # Always a fresh, aligned copy: ``.contiguous()`` of a 0- or 1-row slice is the slice itself,
        # whose byte offset need not be a multiple of the part's element size.
        part = buf.new_empty((n, width)).copy_(buf[:, off:off + width]).view(like.dtype)
        out.append(part.view(n, *like.shape[1:]))
        off += width
    return out


def exchange(comm, parts, index, send_splits, recv_splits, active, source=None):
    """Start sending ``[p[index] for p in parts]`` (packed; ``index=None``: the parts as they are);
    returns a waiter giving the unpacked received parts. When no rank moves anything, returns empty
    parts without a collective. ``source``: whole local tensors the parts come from (default the parts),
    whose rows the signal-only control receives instead (:func:`cycled_rows`)."""
    likes = [p[:0] for p in parts]
    if not active:
        return lambda: [p.new_empty((0, *p.shape[1:])) for p in parts]
    send = parts if index is None else [p.index_select(0, index) for p in parts]
    pending = comm.start(pack_rows(send), send_splits, recv_splits,
                         fill=functools.partial(cycled_rows, source or parts, likes))
    return lambda: unpack_rows(pending.wait(), likes)


def cycled_rows(source: list[torch.Tensor], likes: list[torch.Tensor], n: int) -> torch.Tensor | None:
    """``n`` rows packed as :func:`pack_rows` packs ``likes``-shaped parts: rows of ``source`` (whole
    local tensors, one per part) taken cyclically, each cast to its part's dtype; None when ``source``
    has no row."""
    rows = source[0].shape[0] if source else 0
    if not rows:
        return None
    idx = torch.arange(n, device=source[0].device) % rows
    return pack_rows([s.index_select(0, idx).to(like.dtype) for s, like in zip(source, likes)])


class SignalOnly(AllToAll):
    """The control of DistCA's ablation: every all-to-all moves one element per peer. What remains of a
    step's communication cost is then latency and synchronisation, not bytes.

    The receiver gets rows of the size it expected filled with real values: copies of its own local
    rows (``fill``, :func:`cycled_rows`), repeated as needed. Not zeros: on an H200 FA4's
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

"""Count the bytes a rank hands to ``torch.distributed`` for other ranks: what a CP mechanism really sends.

Inside ``with count_sent() as sent:`` every collective the CP mechanisms use is counted as it is
issued, by the bytes this rank sends to *other* ranks (its own slice of an all-to-all, or a self
send, is not traffic)::

    batch_isend_irecv(ops)                    sum of the isend tensors' bytes
    all_to_all_single(out, inp, osz, isz)     inp's rows to the other ranks (isz, or equal splits) x row bytes
    all_gather_into_tensor(out, inp)          (group size - 1) x inp's bytes

For measuring on the side of a run (a check, a benchmark): the functions are wrapped for the block and
restored after it. Control traffic outside these calls (``all_gather_object`` of input signatures) is not
counted.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import allgather

_WRAPPED = ("batch_isend_irecv", "all_to_all_single", "all_gather_into_tensor", "all_gather_single")


@dataclass
class Sent:
    """Bytes sent to other ranks, per kind of call."""

    by_kind: dict = field(default_factory=dict)

    def add(self, kind: str, n: int) -> None:
        self.by_kind[kind] = self.by_kind.get(kind, 0) + int(n)

    @property
    def total(self) -> int:
        return int(sum(self.by_kind.values()))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _me(group) -> int:
    return dist.get_rank(group) if group is not None else dist.get_rank()


@contextlib.contextmanager
def count_sent():
    """Yield a :class:`Sent` that counts this rank's outgoing bytes until the block ends."""
    sent = Sent()
    orig = {name: getattr(dist, name) for name in _WRAPPED if hasattr(dist, name)}
    orig_alias = allgather._all_gather

    def batch_isend_irecv(ops, *a, **kw):
        me = dist.get_rank()
        sent.add("p2p", sum(_nbytes(op.tensor) for op in ops if op.op is dist.isend and op.peer != me))
        return orig["batch_isend_irecv"](ops, *a, **kw)

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, *a, **kw):
        world = dist.get_world_size(group)
        rows = input.shape[0] if input.dim() else 0
        splits = list(input_split_sizes) if input_split_sizes else [rows // world] * world
        row_bytes = _nbytes(input) // rows if rows else 0
        sent.add("all_to_all", (sum(splits) - splits[_me(group)]) * row_bytes)
        return orig["all_to_all_single"](output, input, output_split_sizes, input_split_sizes, group, *a, **kw)

    def gather(fn):
        def wrapped(output, input, group=None, *a, **kw):
            sent.add("all_gather", (dist.get_world_size(group) - 1) * _nbytes(input))
            return fn(output, input, group, *a, **kw)
        return wrapped

    try:
        dist.batch_isend_irecv = batch_isend_irecv
        dist.all_to_all_single = all_to_all_single
        for name in ("all_gather_into_tensor", "all_gather_single"):
            if name in orig:
                setattr(dist, name, gather(orig[name]))
        allgather._all_gather = gather(orig_alias)
        yield sent
    finally:
        for name, fn in orig.items():
            setattr(dist, name, fn)
        allgather._all_gather = orig_alias

"""Context-parallel (CP) attention mechanisms under one protocol.

A CP mechanism spreads ONE global token sequence (documents concatenated, ``T`` tokens) over the ranks
of an explicit process group and computes its core attention. Every mechanism offers::

    mech = make(name, group, doc_lens, causal, attn_backend=None)
    x_local = mech.dispatch(x_global)        # [T, ...] -> this rank's rows [n_local, ...]
    x_global = mech.undispatch(x_local)      # inverse (an all-gather; for checking and plotting)
    out, lse = mech.apply_attn(q, k, v)      # local q [n_local, Hq, D], k, v [n_local, Hkv, D];
                                             # differentiable in q, k, v; lse float32 [n_local, Hq]

The mask is given by ``doc_lens`` and ``causal``: ``full`` / ``causal`` are one document of length
``T``; ``full_document`` / ``causal_document`` are several (see :mod:`cadlib.data.masks`). Token ``i`` of a
document attends to tokens ``[0, i]`` (causal) or all tokens (full) of its own document. No
mechanism requires document lengths, or ``T``, to divide by the group size; those that need equal
shards pad internally and say so in their docstring.

Mechanisms (``MECHANISMS``):

* ``allgather``: zigzag layout, K, V of documents held by several ranks all-gathered (Llama-3 style);
  :func:`cadlib.cp.allgather.layout_attention`, the same function the end-to-end training uses.
* ``ring``: zigzag layout, K, V passed around the ring point-to-point, overlapped with compute,
  partial results merged by log-sum-exp in fp32 (:mod:`cadlib.cp.ring`).
* ``ulysses``: contiguous layout, all-to-all from sequence- to head-sharding (:mod:`cadlib.cp.ulysses`).
* ``usp``: Ulysses inside groups of ``ulysses_size`` ranks, ring across them (:mod:`cadlib.cp.usp`).
* ``loongtrain``: USP's grid with LoongTrain's double ring across the groups: windows of ``window_size``
  ring positions, an inner ring inside each window and an outer ring between them
  (:mod:`cadlib.cp.loongtrain`).
* ``cad``: contiguous layout, the CAD scheduler's plan run on cadlib's attention servers
  (:mod:`cadlib.cp.cad`).
"""
from __future__ import annotations

from typing import Sequence

from .allgather import AllGatherCP
from .cad import CADCP
from .loongtrain import LoongTrainCP
from .protocol import CPMechanism
from .ring import RingCP
from .ulysses import UlyssesCP
from .usp import USPCP

MECHANISMS = ("allgather", "ring", "ulysses", "usp", "loongtrain", "cad")
CLASSES: dict[str, type[CPMechanism]] = {"allgather": AllGatherCP, "ring": RingCP, "ulysses": UlyssesCP,
                                         "usp": USPCP, "loongtrain": LoongTrainCP, "cad": CADCP}


def make(name: str, group, doc_lens: Sequence[int], causal: bool = True, attn_backend: str | None = None,
         **kwargs) -> CPMechanism:
    """The CP mechanism ``name`` (one of ``MECHANISMS``) for this group and mask."""
    if name not in CLASSES:
        raise ValueError(f"unknown CP mechanism {name!r}; choose one of: {', '.join(MECHANISMS)}")
    return CLASSES[name](group, doc_lens, causal=causal, attn_backend=attn_backend, **kwargs)

"""DistCA's all-to-all buffer, and the tolerance rule that makes a step's plans fit it.

DistCA moves every all-to-all through one buffer per GPU allocated once (NVSHMEM), the rows a GPU
sends to itself included (``get_fa2a_metadata``: "remove the local communication, which is the major
part" is a TODO, ``distca/runtime/compute_metadata.py:78-90``, DistCA commit 2afd219). A plan whose
transfers do not fit cannot run, so its 3D driver (``tests/test_e2e_combined.py:1063-1261``) plans
each step's ping and pong with the smallest tolerance that fits, and raises it until one does::

    for tol in DISTCA_TOLERANCE_FACTORS if tol >= MIN:            # L1072-1086; MIN = 0.05
        plans = ping and pong planned at tol                      # L1090-1093
        need = max over the plans, the ranks and the four all-to-alls (qkv forward, qkv backward,
               out forward, out backward) of max(bytes sent, bytes received)      # L1193-1234
        if need <= buffer: break                                  # L1239-1243
    else:                                                         # nothing fits, even tol = 1.0:
        buffer = (ceil(need / GiB) + 0.5) GiB                     # L1247-1259, and the tol = 1.0
                                                                  # plans run
(the check also takes the last offsets written in a peer's buffer, which never exceed those totals).
The bytes per token follow the backward in use (:meth:`cadlib.core.cost.ModelSpec.cad_a2a_bytes`):
DistCA's stateless servers resend Q, O, LSE and K, V with dO, so their backward's dispatch is the
largest of the four. A plan's transfers here are :meth:`cadlib.core.plan.Plan.token_matrices` with the
local rows (``local=True``), K and V counted once per (server, document) as the dispatch moves them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from ..core.paper import (DISTCA_BUFFER_GIB, DISTCA_BUFFER_GROW_GIB, DISTCA_MIN_TOLERANCE,
                          DISTCA_TOLERANCE_FACTORS)
from ..core.plan import Plan

GIB = 1024 ** 3
RECORD_KEYS = ("tolerance", "buffer_need_gib", "buffer_gib", "buffer_grown", "tolerances_tried")
"""What :meth:`BufferFit.meta` records of a step's fit."""


def a2a_need(plans: Sequence[Plan], spec, resend: bool = False, dtype: str = "bf16") -> float:
    """Bytes of buffer ``plans`` need per GPU: over the plans, the GPUs and CAD's four all-to-alls of a
    layer, the most any GPU sends or receives, its own rows included (``test_e2e_combined.py:1193-1234``).
    ``resend``: with DistCA's stateless servers' bytes per token."""
    per = spec.cad_a2a_bytes(resend, dtype)
    need = 0
    for p in plans:
        q, kv = p.token_matrices(local=True)
        for bq, bkv in per.values():
            m = q * bq + kv * bkv
            need = max(need, int(m.sum(1).max(initial=0)), int(m.sum(0).max(initial=0)))
    return float(need)


@dataclass(frozen=True)
class BufferFit:
    """The outcome of :func:`fit_buffer`: the ``tolerance`` chosen, what ``plan_at`` returned for it
    (``made``), the buffer its plans ``need`` (bytes) and the ``buffer`` they ran with (bytes; grown
    when ``grown``), and the tolerances ``tried`` in order."""

    tolerance: float
    made: object
    need: float
    buffer: float
    grown: bool
    tried: tuple[float, ...]

    def meta(self) -> dict:
        """The record a batch keeps of it (:data:`RECORD_KEYS`; sizes in GiB)."""
        return dict(zip(RECORD_KEYS, (self.tolerance, self.need / GIB, self.buffer / GIB, self.grown,
                                      len(self.tried))))


def fit_buffer(plan_at: Callable[[float], object], spec, buffer_gib: float = DISTCA_BUFFER_GIB,
               resend: bool = False, min_tolerance: float = DISTCA_MIN_TOLERANCE,
               plans: Callable[[object], Sequence[Plan]] = lambda made: made,
               tolerances: Sequence[float] = DISTCA_TOLERANCE_FACTORS, dtype: str = "bf16") -> BufferFit:
    """DistCA's tolerance rule (see the module docstring): ``plan_at(tol)`` makes a step's plans at
    tolerance ``tol`` (``plans(made)`` gives its :class:`Plan` s, ping and pong, or the one plan of a
    step without ping-pong); the first of ``tolerances`` at least ``min_tolerance`` whose plans need at
    most ``buffer_gib`` GiB per GPU (:func:`a2a_need`) is chosen; if none does, the last one's plans
    and a buffer grown to ``ceil(need) + 0.5`` GiB."""
    if isinstance(buffer_gib, bool) or not (isinstance(buffer_gib, (int, float))
                                            and 0 < buffer_gib < math.inf):
        raise ValueError(f"buffer_gib must be a finite number > 0, got {buffer_gib!r}")
    if not (isinstance(min_tolerance, (int, float)) and 0 <= min_tolerance < math.inf):
        raise ValueError(f"min_tolerance must be a finite number >= 0, got {min_tolerance!r}")
    todo = [float(t) for t in tolerances if t >= min_tolerance]
    if not todo:
        raise ValueError(f"min_tolerance={min_tolerance} is above every tolerance tried "
                         f"(the largest is {max(tolerances)})")
    buffer = float(buffer_gib) * GIB
    tried = []
    for tol in todo:
        made = plan_at(tol)
        need = a2a_need(plans(made), spec, resend, dtype)
        tried.append(tol)
        if need <= buffer:
            return BufferFit(tol, made, need, buffer, False, tuple(tried))
    grown = (math.ceil(need / GIB) + DISTCA_BUFFER_GROW_GIB) * GIB
    return BufferFit(tried[-1], made, need, float(grown), True, tuple(tried))

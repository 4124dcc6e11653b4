"""The methods a training step runs, defined once: how each packs the documents, whether its core
attention runs on attention servers (CAD), whether it overlaps two nano-batches (ping-pong), whether
it is the signal-only control, and the label figures give it.

``python -m cadlib.train``, the scale replay, the composition of a step, the error bands, the what-if
and the benchmarks take their method names from here, each the subset it runs (:func:`names`):

============  ==========  ===  =========  ===========  =========  ========
method        packing     CAD  ping-pong  signal-only  trainable  headline
============  ==========  ===  =========  ===========  =========  ========
colocated     sequential  no   no         no           yes        yes
wlb           balanced    no   no         no           yes        yes
varlen        varlen      no   no         no           no         no
cad           sequential  yes  no         no           yes        no
cad-pingpong  sequential  yes  yes        no           yes        yes
signal-only   sequential  yes  yes        yes          yes        no
============  ==========  ===  =========  ===========  =========  ========

The scheduler's placements (``cad``, ``equal_flops``, ``colocated``, ``distca``:
:data:`cadlib.scheduling.scheduler.PLANNERS`) are another vocabulary: how one plan places its
CA-tasks, not how a step runs. So are the simulator's parallelisms
(:data:`cadlib.analysis.model.sim.METHODS`: ``dp``, ``pp``, ``cp``, ``cad``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Method:
    """One method of a training step.

    ``packing``: how the batch's documents are laid over the ranks: ``sequential`` (DistCA's),
    ``balanced`` (WLB-LLM's variable-length packing; ``wlb`` is "WLB-ideal") or ``varlen`` (the
    motivation's variable-length chunking of whole documents, :func:`cadlib.analysis.model.idle.varlen_chunking`).
    ``cad``: core attention on the scheduler's attention servers; otherwise each rank attends its
    own chunks, a document split across ranks through per-document context parallelism (a
    baseline). ``pingpong``: two nano-batches per rank in DistCA's tick order. ``signal_only``: the
    control that cuts every all-to-all to one element per peer. ``trainable``: ``python -m
    cadlib.train`` runs it (``varlen`` is modelled only). ``headline``: what the paper's headline
    compares (its two baselines and CAD with ping-pong, DistCA itself)."""

    name: str
    label: str
    packing: str
    cad: bool
    pingpong: bool = False
    signal_only: bool = False
    trainable: bool = True
    headline: bool = False

    @property
    def baseline(self) -> bool:
        """Not CAD: each rank attends its own tokens."""
        return not self.cad


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("colocated", "colocated", "sequential", cad=False, headline=True),
    Method("wlb", "WLB-ideal", "balanced", cad=False, headline=True),
    Method("varlen", "variable-length chunking", "varlen", cad=False, trainable=False),
    Method("cad", "CAD", "sequential", cad=True),
    Method("cad-pingpong", "CAD (ping-pong)", "sequential", cad=True, pingpong=True, headline=True),
    Method("signal-only", "signal-only", "sequential", cad=True, pingpong=True, signal_only=True),
)}
"""Every method by name, in the order tables list them."""


def names(where: Callable[[Method], bool] | None = None, **props) -> tuple[str, ...]:
    """The names of the methods with every property of ``props`` (``names(trainable=True)``) and,
    given, ``where(method)`` true; in :data:`METHODS`' order."""
    bad = [k for k in props if k not in Method.__dataclass_fields__ and k != "baseline"]
    if bad:
        raise ValueError(f"unknown method properties {bad}; choose from: "
                         f"{', '.join([*Method.__dataclass_fields__, 'baseline'])}")
    return tuple(n for n, m in METHODS.items()
                 if all(getattr(m, k) == v for k, v in props.items()) and (where is None or where(m)))


def method(name: str) -> Method:
    """The :class:`Method` called ``name``; ValueError naming the valid ones."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of: {', '.join(METHODS)}")
    return METHODS[name]

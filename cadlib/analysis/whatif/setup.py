"""What a what-if plans (:mod:`cadlib.analysis.whatif.planner`): the cluster and its links, the training setup, the
documents, and the scale replay's :class:`~cadlib.analysis.replay.settings.Setting` of one pipeline stage.

The cluster: ``gpus`` GPUs, ``gpus_per_node`` to a node; a data-parallel (DP) group is ``tp x pp``
GPUs, so ``dp = gpus / (tp pp)``; a group holds ``tokens_per_group`` tokens per micro-batch. Links
(:class:`cadlib.analysis.model.compose.Link`, bandwidth per GPU): tensor parallelism's collectives run at the
in-node bandwidth (inter-node where ``tp > gpus_per_node``). The collectives between DP groups (CAD's
all-to-alls, CP's all-gathers, the gradient all-reduce) have ``k = min(dp, max(1, gpus_per_node //
(tp pp)))`` groups to a node; a GPU's traffic spread evenly over its ``dp - 1`` peers takes::

    t = B max(f_in / bw_in, f_out / bw_out),   f_in = (k - 1) / (dp - 1),   f_out = (dp - k) / (dp - 1)

i.e. one link of ``1 / max(f_in / bw_in, f_out / bw_out)`` GB/s.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...core.cost import H200_NVLINK_ALL_TO_ALL_GBPS, IB_GBPS_PER_GPU, ModelSpec, as_model
from ...core.defaults import DEFAULT_TOLERANCE
from ...core.methods import names
from ...core.paper import DISTCA_GPUS_PER_NODE
from ...data.workload import sample_kwargs
from ..model.compose import Link
from ..replay import phases as replay_phases
from ..replay import settings as replay
from .fit import DEFAULT_GPU_MEM_GIB

METHODS = names(headline=True)
"""What the what-if compares: colocated, WLB-ideal and CAD with ping-pong (:mod:`cadlib.core.methods`)."""


@dataclass(frozen=True)
class Cluster:
    """``gpus`` GPUs, ``gpus_per_node`` to a node, DP groups of ``tp x pp`` (``tp`` defaults to a node, as
    DistCA's); bandwidths per GPU in GB/s; ``gpu_mem_gib``, one GPU's memory in GiB (the activation
    column and the search of what fits measure against it); ``kernels``: a kernel latency table
    (``scripts/bench/profile_kernels.py``'s JSON) to price attention with, None for the simulator's H200 rates."""

    gpus: int
    gpus_per_node: int = DISTCA_GPUS_PER_NODE
    tp: int | None = None
    pp: int = 1
    intra_node_gbps: float = H200_NVLINK_ALL_TO_ALL_GBPS
    inter_node_gbps: float = IB_GBPS_PER_GPU
    gpu_mem_gib: float = DEFAULT_GPU_MEM_GIB
    kernels: str | None = None

    def __post_init__(self):
        if self.tp is None:
            object.__setattr__(self, "tp", min(self.gpus_per_node, self.gpus) if self.gpus >= 1 else 1)
        for f in ("gpus", "gpus_per_node", "tp", "pp"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"Cluster.{f} must be an integer >= 1, got {v!r}")
        if self.gpus % (self.tp * self.pp):
            raise ValueError(f"Cluster.gpus ({self.gpus}) must be a multiple of tp x pp = "
                             f"{self.tp} x {self.pp}")
        for f in ("intra_node_gbps", "inter_node_gbps", "gpu_mem_gib"):
            if not getattr(self, f) > 0:
                raise ValueError(f"Cluster.{f} must be > 0, got {getattr(self, f)!r}")

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def groups_per_node(self) -> int:
        return min(self.dp, max(1, self.gpus_per_node // (self.tp * self.pp)))

    def dp_gbps(self) -> float:
        """The DP groups' collectives as one link (the module docstring's ``f_in``, ``f_out``)."""
        if self.dp == 1:
            return self.intra_node_gbps
        k = self.groups_per_node
        f_in, f_out = (k - 1) / (self.dp - 1), (self.dp - k) / (self.dp - 1)
        return 1.0 / max(f_in / self.intra_node_gbps, f_out / self.inter_node_gbps)

    def links(self) -> replay_phases.Links:
        tp = self.intra_node_gbps if self.tp <= self.gpus_per_node else self.inter_node_gbps
        dp = Link(self.dp_gbps(), replay_phases.NCCL_LATENCY_S, "dp")
        return replay_phases.Links(dp=dp, tp=Link(tp, replay_phases.NCCL_LATENCY_S, "tp"), cad=dp)


@dataclass(frozen=True)
class Training:
    """``context`` (MaxDocLen: longer documents are clipped to it), ``tokens_per_group`` per micro-batch,
    ``micro_batches`` per step, ``steps`` sampled steps, ``seed``; ``elongate`` stretches every length;
    the CAD scheduler's ``tolerance`` and ``min_shard``."""

    context: int
    tokens_per_group: int = replay.TOKENS_PER_GROUP
    micro_batches: int = 1
    steps: int = 20
    seed: int = 0
    elongate: float = 1.0
    tolerance: float = DEFAULT_TOLERANCE
    min_shard: int = 512

    def __post_init__(self):
        for f in ("context", "tokens_per_group", "micro_batches", "steps", "min_shard"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"Training.{f} must be an integer >= 1, got {v!r}")
        if not self.elongate > 0:
            raise ValueError(f"Training.elongate must be > 0, got {self.elongate!r}")
        if not self.tolerance >= 0:
            raise ValueError(f"Training.tolerance must be >= 0, got {self.tolerance!r}")


@dataclass(frozen=True)
class Documents:
    """Where the documents come from: ``lengths`` (an array) or ``dist`` (a named distribution or
    preset); ``label`` names the source in the output."""

    dist: str | None = None
    lengths: np.ndarray | None = field(default=None, repr=False)
    label: str = ""

    def __post_init__(self):
        if (self.dist is None) == (self.lengths is None):
            raise ValueError("Documents needs exactly one of dist (a named distribution) and lengths "
                             "(an array)")
        if self.dist is not None:
            sample_kwargs(self.dist)          # ValueError naming the valid names
        else:
            a = np.asarray(self.lengths)
            if a.ndim != 1 or a.size == 0 or a.dtype.kind not in "iu" or a.min() < 1:
                raise ValueError("Documents.lengths must be a non-empty 1-D array of integers >= 1")
        if not self.label:
            object.__setattr__(self, "label", self.dist or f"{np.asarray(self.lengths).size} lengths")


def setting(model: ModelSpec, cluster: Cluster, training: Training, docs: Documents) -> replay.Setting:
    """The scale replay's :class:`~cadlib.analysis.replay.settings.Setting` of one stage: ``L / pp`` layers,
    ``steps x micro_batches`` sampled batches, the three methods."""
    model = as_model(model)
    if model.n_layers % cluster.pp:
        raise ValueError(f"pp={cluster.pp} must divide the model's {model.n_layers} layers")
    model.shard(cluster.tp)                   # ValueError naming what tp must divide
    return replay.Setting(
        "whatif", docs.dist or "lengths", cluster.dp, tokens=training.tokens_per_group,
        max_doc_len=training.context, elongate=training.elongate, tp=cluster.tp, model=model,
        n_layers=model.n_layers // cluster.pp, batches=training.steps * training.micro_batches,
        seed=training.seed, methods=METHODS, link="ib",
        tolerance=training.tolerance, min_shard=training.min_shard, lengths=docs.lengths)

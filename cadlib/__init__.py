"""cadlib: core attention disaggregation (CAD) for long-context LLM training, as a workbook.

The names a user starts from:

>>> from cadlib import sample_docs, pack, schedule, ModelSpec
>>> docs = sample_docs("pretrain", 8 * 65536, seed=0)        # document lengths
>>> layout = pack(docs, n_ranks=8, tokens_per_rank=65536)   # the linear layout
>>> plan = schedule(layout, model=ModelSpec.from_name("llama3-8b"), tolerance=0.05)
>>> plan.imbalance() < 1.1                                  # max / mean attention per server
True

The package is cut into layers, each importing only the layers below it (``docs/design.md``):
``core`` (numpy: layout, plans, cost model) <- ``data`` (workloads, packing, masks) <-
``scheduling`` and ``dispatch`` (numpy) <- ``runtime`` (torch: kernels, comm, servers, ping-pong,
model) <- ``cp`` and ``analysis`` (pandas, plotly; no torch), with ``infra`` (results, process groups,
launch) beside ``core``, and ``train`` and ``verify`` as entry points on top. Importing ``cadlib``
needs numpy only: ``cad_attention`` and ``run_torchrun`` load torch when first used.
"""
import importlib

from .core.cost import ModelSpec
from .core.layout import Chunk, Layout
from .core.plan import CATask, Plan
from .data.packing import pack
from .data.workload import sample_docs
from .scheduling.scheduler import colocated, equal_flops, place, schedule

_LAZY = {"cad_attention": "cadlib.runtime.stages", "run_torchrun": "cadlib.infra.launch"}
"""Public names whose modules need torch (or start processes): loaded on first use, so that the host
layers, the analysis and the what-if import on a machine without torch."""


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'cadlib' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["ModelSpec", "Chunk", "Layout", "CATask", "Plan", "pack", "sample_docs", "run_torchrun",
           "cad_attention", "colocated", "equal_flops", "place", "schedule"]

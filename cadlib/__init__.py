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
launch) beside ``core``, and ``train`` and ``verify`` as entry points on top.
"""
from .core.cost import ModelSpec
from .core.layout import Chunk, Layout
from .core.plan import CATask, Plan
from .data.packing import pack
from .data.workload import sample_docs
from .infra.launch import run_torchrun
from .runtime.stages import cad_attention
from .scheduling.scheduler import colocated, equal_flops, place, schedule

__all__ = ["ModelSpec", "Chunk", "Layout", "CATask", "Plan", "pack", "sample_docs", "run_torchrun",
           "cad_attention", "colocated", "equal_flops", "place", "schedule"]

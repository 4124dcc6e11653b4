"""The plans of a pipeline step under CAD: per lock-step tick, the CA-tasks of every stage's current
microbatch scheduled together over all GPUs ("for PP, the scheduler is called for each logical tick",
DistCA section 4.2).

A microbatch is a layout over one stage's ``dp`` data-parallel ranks (the same for every stage it
passes). Global rank ``s * dp + d`` is data-parallel rank ``d`` of stage ``s`` (:mod:`cadlib.infra.groups`),
so a tick's layout stacks, stage by stage, the layout of the microbatch that stage runs, and the
ranks of a stage with nothing to run (a dummy) hold nothing but still serve
(:func:`cadlib.core.layout.stack_layouts`). Under ping-pong each microbatch is split into its two
nano-batches once, and a tick stacks those, so a microbatch keeps the same nano-batches in its
forward and backward ticks (whose plans differ).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..core.layout import Layout, stack_layouts
from ..core.pipeline import Tick
from .buffer import fit_buffer
from .nanosplit import NanoBatch
from .recipes import Recipe, cad_plan, nano_batches, plan_nano


def tick_micro(tick: Tick, parts: list) -> list:
    """Per stage, its part of ``parts`` (indexed by microbatch) in this tick, None for a dummy."""
    return [None if m is None else parts[m] for m in tick.micro]


def stack_nanos(parts: list[NanoBatch | None], n_ranks_each: int) -> NanoBatch:
    """Nano-batches of the stages' microbatches stacked like :func:`stack_layouts` stacks layouts
    (the rows and context each rank takes are its own stage's)."""
    layout = stack_layouts([None if p is None else p.layout for p in parts], n_ranks_each)
    empty = np.zeros(0, dtype=np.int64)
    rows, context, n_ctx = [], [], []
    for p in parts:
        for d in range(n_ranks_each):
            rows.append(empty if p is None else p.rows[d])
            context.append(p.context[d] if p is not None and p.has_context else empty)
            n_ctx.append(p.n_context_chunks[d] if p is not None and p.has_context else 0)
    has = any(n_ctx)
    return NanoBatch(layout, np.arange(layout.n_docs), rows, context if has else [], n_ctx if has else [])


def micro_nanos(micro_layouts: list[Layout], recipe: Recipe) -> list[tuple[NanoBatch, NanoBatch]]:
    """Each microbatch's two nano-batches (:func:`cadlib.scheduling.recipes.nano_batches`)."""
    return [nano_batches(lay, recipe) for lay in micro_layouts]


def tick_plans(ticks: list[Tick], micro_layouts: list[Layout], recipe: Recipe, spec,
               nanos=None) -> list[list]:
    """Per tick, its plans over every GPU: one (``cad``) or, given the microbatches' ``nanos``
    (:func:`micro_nanos`), one per nano-batch (``cad-pingpong``)."""
    dp = micro_layouts[0].n_ranks
    if nanos is None:
        return [[cad_plan(stack_layouts(tick_micro(t, micro_layouts), dp), recipe, spec)] for t in ticks]
    return [[plan_nano(stack_nanos(tick_micro(t, [n[j] for n in nanos]), dp), recipe, spec) for j in range(2)]
            for t in ticks]


def fitted_tick_plans(ticks: list[Tick], micro_layouts: list[Layout], recipe: Recipe, spec, nanos,
                      buffer_gib: float, tolerances, resend: bool = True, dtype: str = "bf16"):
    """DistCA's 4D tolerance rule (``distca/utils/test_util.py:619-795``): per tick, its two nano-batch
    plans at the first of ``tolerances`` from ``recipe.tolerance`` up whose all-to-alls fit ``buffer_gib``
    GiB per GPU (:func:`cadlib.scheduling.buffer.fit_buffer`). Returns ``(plans per tick, fits per
    tick)``; a tick that fits at no tolerance (DistCA's driver raises: the run fails) keeps the last
    plans tried and its fit says ``grown``."""
    dp = micro_layouts[0].n_ranks
    plans, fits = [], []
    for t in ticks:
        stacked = [stack_nanos(tick_micro(t, [n[j] for n in nanos]), dp) for j in range(2)]
        fit = fit_buffer(lambda tol: [plan_nano(nb, replace(recipe, tolerance=tol), spec) for nb in stacked],
                         spec, buffer_gib, resend=resend, min_tolerance=recipe.tolerance,
                         tolerances=tolerances, dtype=dtype)
        plans.append(fit.made)
        fits.append(fit)
    return plans, fits

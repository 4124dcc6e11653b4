"""The CAD scheduler: place CA-tasks on attention servers so that core-attention FLOPs are balanced
while as few bytes as possible cross the network (DistCA's communication-aware greedy).

Start from the colocated placement: every chunk of the linear layout is one CA-task, served by
server ``home % n_servers`` (``home`` itself when there are as many servers as ranks). With
``mean = total pairs / n_servers`` and the ceiling ``U = (1 + tolerance) * mean``, servers above ``U``
are **donors**, servers below ``U`` **receivers**. Repeatedly, the most loaded donor ``s`` makes its
best move: it sheds ``x = min(load_s - U, U - load_r)`` pairs (at least) to a receiver ``r``, as a
whole task or as a query shard cut from its end or its start (``shards.cut_shards``), never filling
``r`` above ``U``. A donor with no valid move is skipped until a new receiver appears; the loop ends
when no donor can move. Every move lowers ``sum(max(0, load - U))``, so it ends.

``schedule`` picks the move with the fewest bytes per pair moved (the priority in
:func:`cadlib.scheduling.greedy.reference_greedy`: bytes per pair, with the receiver's KV prefix
shared over the pairs of the document it could take, and a move that leaves part of the donor's excess
priced, over the whole excess, with the cheapest move that clears it), on the vectorised engine of
:mod:`cadlib.scheduling.engine`.
``equal_flops`` is the bytes-blind baseline (the largest end shard to the emptiest receiver),
computed by :class:`cadlib.scheduling.water_fill.WaterFill`. ``reference_greedy`` is both written
plainly, one candidate at a time (``mode="bytes"`` and ``"flops"``); the engine and ``WaterFill`` make
its plans. The guard of :func:`place` runs ``equal_flops`` after the greedy and returns its plan when
it is better.
"""
from __future__ import annotations

import time

import numpy as np

from ..core.cost import MIN_SHARD_TOKENS, as_model, imbalance
from ..core.layout import Layout
from ..core.plan import Plan
from .distca import distca_plan
from .engine import Greedy
from .greedy import check_args
from .water_fill import WaterFill

PLANNERS = ("cad", "equal_flops", "colocated", "distca")
"""How :func:`place` places a plan's CA-tasks (its ``method``): not the methods a training step runs
(:mod:`cadlib.core.methods`), though ``cad`` and ``colocated`` name both."""


# ---------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------

def place(layout: Layout, method: str = "cad", n_servers: int | None = None, model=None,
          tolerance: float = 0.1, min_shard: int | None = None, dtype: str = "bf16",
          chunks: np.ndarray | None = None, guard: bool = True, cost_model=None) -> Plan:
    """Run ``method`` (``cad``, ``equal_flops``, ``colocated`` or ``distca``: DistCA's released planner,
    :func:`cadlib.scheduling.distca.distca_plan`) and return its :class:`Plan`, built
    from arrays in O(chunks + tasks) (call ``plan.validate()`` to check coverage). ``chunks`` (from
    ``Layout.chunk_array``) may be passed to skip the layout conversion. ``meta['seconds']`` is the
    planning time including that conversion; ``meta['loop_seconds']`` the greedy alone.

    ``guard`` (``cad`` only): if the bytes-blind ``equal_flops`` plan reaches the tolerance while this
    one does not, or both reach it and it moves fewer bytes (neither: a lower peak load), return it
    instead (``meta['guard']`` records it); so ``cad`` is never worse than ``equal_flops``. The
    benchmark reports how often the guard is used. ``equal_flops``' plan is computed by
    :class:`cadlib.scheduling.water_fill.WaterFill` (for the guard, its arrays only when it is returned).
    ``meta['moved_bytes']``: the forward bytes the moves added to the colocated placement's, exact
    (``plan.forward_bytes(model)`` gives the total).

    ``min_shard`` None: ``MIN_SHARD_TOKENS``, or with ``cost_model`` (a
    :class:`cadlib.core.measured.MeasuredCost`) its :meth:`~cadlib.core.measured.MeasuredCost.min_shard`; the
    plan then records ``meta['measured_imbalance']``, the max/mean of its servers' modelled times (the
    greedy itself still balances pairs)."""
    if method not in PLANNERS:
        raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(PLANNERS)}")
    if cost_model is not None and not hasattr(cost_model, "min_shard"):
        raise ValueError(f"cost_model must be a cadlib.core.measured.MeasuredCost (or None), got "
                         f"{type(cost_model).__name__}")
    if min_shard is None:
        min_shard = cost_model.min_shard() if cost_model is not None else MIN_SHARD_TOKENS
    S, tol, m = check_args(layout, n_servers, tolerance, min_shard)
    if method == "distca":
        return distca_plan(layout, S, model, tol, m, dtype, chunks)
    spec = as_model(model)
    qb, kvb = spec.q_bytes(dtype), spec.kv_bytes(dtype)
    t0 = time.perf_counter()
    ch = layout.chunk_array() if chunks is None else chunks
    g = Greedy(ch, layout.n_docs, S, tol, m, qb, kvb)
    imbalance_before = g.imbalance_before
    load0 = g.load.copy() if method == "cad" and guard else None
    t1 = time.perf_counter()
    if method == "equal_flops":
        g = WaterFill(g, g.load)
        reached = g.run()
    else:
        reached = g.run() if method == "cad" else g.reached()
    t2 = time.perf_counter()
    meta = {"method": method, "n_moves": g.n_moves, "n_splits": g.n_splits, "tolerance": tol,
            "reached": reached, "min_shard": m, "n_servers": S, "model": spec.name, "dtype": dtype,
            "imbalance_before": imbalance_before, "imbalance_after": g.imbalance(),
            "moved_bytes": g.moved_bytes, "guard": False}
    if method == "cad" and guard and g.n_moves:                # no move: equal_flops makes none either
        e = WaterFill(g, load0)                                 # equal_flops' moves, cheaply
        e_reached = e.run()
        if reached != e_reached:
            better = e_reached
        elif reached:                                           # both balanced: fewer bytes
            better = e.moved_bytes < g.moved_bytes
        else:                                                   # neither: lower peak, then fewer bytes
            better = (e.load.max(), e.moved_bytes) < (g.load.max(), g.moved_bytes)
        if better:
            g, meta["guard"], meta["reached"] = e, True, e_reached
            meta.update(n_moves=e.n_moves, n_splits=e.n_splits, imbalance_after=e.imbalance(),
                        moved_bytes=e.moved_bytes)
    cols = g.task_arrays()
    meta["loop_seconds"] = t2 - t1
    meta["seconds"] = time.perf_counter() - t0
    plan = Plan.from_arrays(layout, cols.doc, cols.q_start, cols.q_end, cols.home, cols.server,
                            n_servers=S, meta=meta, chunks=ch, check=False)
    if cost_model is not None:
        plan.meta["measured_imbalance"] = imbalance(cost_model.server_seconds(plan, model=spec))
    return plan


def schedule(layout: Layout, n_servers: int | None = None, model=None, tolerance: float = 0.1,
             min_shard: int | None = None, dtype: str = "bf16", cost_model=None) -> Plan:
    """DistCA's communication-aware greedy (see :func:`cadlib.scheduling.greedy.reference_greedy` for
    the priority of a move), with :func:`place`'s guard. ``plan.meta`` records ``n_moves, n_splits,
    seconds, tolerance, reached`` (all servers ``<= (1 + tolerance) * mean``). End vs start shard: an
    end shard has the most pairs per query token (token ``i`` carries ``i+1``), so it sends the fewest
    queries but needs the full prefix ``[0, b)``; a start shard sends more queries but only
    ``[0, a+k)``. For a receiver holding nothing of ``d`` and a small amount the start shard wins; for
    one that already holds the prefix (a neighbouring rank under sequential packing) the end shard
    wins. Both are scored, per candidate. ``cost_model``: see :func:`place`."""
    return place(layout, "cad", n_servers, model, tolerance, min_shard, dtype, cost_model=cost_model)


def equal_flops(layout: Layout, n_servers: int | None = None, tolerance: float = 0.1,
                min_shard: int = MIN_SHARD_TOKENS) -> Plan:
    """Baseline water-filling that ignores bytes (:class:`cadlib.scheduling.water_fill.WaterFill`):
    the most loaded donor sends its largest end shard (priority ``-P``) to the emptiest receiver; same
    donor/receiver rules and shard sizes."""
    return place(layout, "equal_flops", n_servers, None, tolerance, min_shard)


def colocated(layout: Layout, n_servers: int | None = None) -> Plan:
    """Every task on server ``home % n_servers`` (on its own rank when ``n_servers == n_ranks``)."""
    return place(layout, "colocated", n_servers, None, 0.0, 1)

"""LongCA-bench's balance metrics of a CP dispatch: how evenly each mechanism spreads attention work.

Per rank ``r`` of ``W``, ``area_r`` is the attention pairs it computes and ``range_r`` the query tokens,
both in whole-head units: a rank that computes ``m`` query tokens for ``1/u`` of the heads (Ulysses,
USP, LoongTrain, whose ``u`` ranks of a group share its ring position's tokens by heads) counts
``m / u``, so every mechanism's areas sum to the mask's area and its ranges to ``T``. With ``p_r = x_r / sum x``::

    entropy(x)   = -sum_r p_r ln p_r / ln W      1 when even, 0 when one rank does everything
    gini(x)      = 1 - sum_r p_r^2               1 - 1/W when even, 0 when one rank does everything
    max_total    = max_r area_r / sum_r area_r   1/W when even
    max_mean     = max_r area_r / mean_r area_r  1 when even (cadlib.core.cost.imbalance's measure)

``area_entropy``, ``area_gini``, ``range_gini`` (and ``range_entropy``), ``max_total``, ``max_mean``: the
benchmark's dispatch metrics (its enum names them; its text was not available here, so the entropy is
normalised by ``ln W`` and the Gini impurity is the plain one). :func:`rank_work` lays each mechanism out
as it does itself (:mod:`cadlib.cp.protocol`'s layouts, :func:`cadlib.cp.cad.cad_plan`); the bytes each rank
sends come from :func:`cadlib.cp.volume.per_rank`.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..core.cost import causal_pairs
from ..core.layout import Layout
from .cad import cad_plan
from .protocol import contiguous_layout, zigzag_layout
from .volume import grid

METRICS = ("area_entropy", "area_gini", "range_entropy", "range_gini", "max_total", "max_mean")


def _layout_work(layout: Layout, causal: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per rank: attention pairs of its chunks (causal: ``(e(e+1) - s(s+1)) / 2``; full: ``(e - s) L``)
    and its query tokens."""
    arr = layout.chunk_array()                          # doc, start, end, rank
    lens = np.asarray(layout.doc_lens, dtype=np.int64)
    area = np.zeros(layout.n_ranks, dtype=np.float64)
    tok = np.zeros(layout.n_ranks, dtype=np.float64)
    if len(arr):
        d, s, e, r = (arr[:, i].astype(np.int64) for i in range(4))
        pairs = causal_pairs(s, e) if causal else (e - s) * lens[d]
        np.add.at(area, r, pairs.astype(np.float64))
        np.add.at(tok, r, (e - s).astype(np.float64))
    return area, tok


def rank_work(name: str, doc_lens: Sequence[int], world: int, causal: bool = True,
              ulysses_size: int | None = None, window_size: int | None = None, plan=None,
              min_shard: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(area [W], range [W])`` of mechanism ``name`` (module docstring). ``cad``: its plan (given, or
    :func:`cadlib.cp.cad.cad_plan`, causal masks only)."""
    if name in ("ring", "allgather"):
        return _layout_work(zigzag_layout(doc_lens, world), causal)
    if name in ("ulysses", "usp", "loongtrain"):
        u, R, _ = grid(name, world, ulysses_size, window_size)
        ring = zigzag_layout(doc_lens, R) if R > 1 else contiguous_layout(doc_lens, 1)
        area, tok = _layout_work(ring, causal)
        return np.repeat(area / u, u), np.repeat(tok / u, u)
    if name == "cad":
        if not causal:
            raise ValueError("CAD serves causal masks only (CA-tasks are causal)")
        if plan is None:
            plan = cad_plan(doc_lens, world, **({"min_shard": min_shard} if min_shard else {}))
        area = np.bincount(plan.server, weights=causal_pairs(plan.q_start, plan.q_end).astype(np.float64),
                           minlength=world)[:world]
        tok = np.bincount(plan.server, weights=(plan.q_end - plan.q_start).astype(np.float64),
                          minlength=world)[:world]
        return area, tok
    raise ValueError(f"unknown CP mechanism {name!r}")


def entropy(x) -> float:
    """``-sum p ln p / ln W`` (module docstring); 1.0 for one rank or nothing at all."""
    x = np.asarray(x, dtype=np.float64)
    if x.size < 2 or x.sum() <= 0:
        return 1.0
    p = x[x > 0] / x.sum()
    return float(-(p * np.log(p)).sum() / np.log(x.size))


def gini(x) -> float:
    """``1 - sum p^2`` (module docstring)."""
    x = np.asarray(x, dtype=np.float64)
    if x.sum() <= 0:
        return 0.0
    p = x / x.sum()
    return float(1.0 - (p * p).sum())


def balance_metrics(area, tokens) -> dict:
    """The module docstring's metrics of per-rank ``area`` and ``tokens``."""
    area = np.asarray(area, dtype=np.float64)
    total = area.sum()
    return {"area_entropy": entropy(area), "area_gini": gini(area), "range_entropy": entropy(tokens),
            "range_gini": gini(tokens), "max_total": float(area.max() / total) if total else 0.0,
            "max_mean": float(area.max() / area.mean()) if total else 1.0}

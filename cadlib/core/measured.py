"""A cost model measured on the server kernel: latency tables from ``scripts/bench/profile_kernels.py``.

The pair-count model (:mod:`cadlib.core.cost`) prices a CA-task by its causal pairs at an assumed rate per
shard size. :class:`MeasuredCost` prices it from measurements instead. The table (JSON written with
:func:`cadlib.infra.results.save_result`) has ``config`` = ``{"n_heads", "n_kv_heads", "head_dim", "dtype",
...}`` and ``results`` = rows::

    {"backend": "fa4", "kind": "task",  "q_len": 512, "kv_len": 8192, "n_seg": 16,
     "fwd_ms": ..., "fwd_bwd_ms": ...}        # a fused call of n_seg identical segments
    {"backend": "fa4", "kind": "fused", "q_len": 512, "kv_len": 8192, "n_seg": 4, ...}

A segment of ``q`` queries that are the suffix of ``k`` KV tokens has ``pairs(q, k) = q k - q (q-1)/2``
causal pairs. From the ``task`` rows, the rate ``R(q, k) = pairs * n_seg / seconds`` is interpolated
bilinearly in ``(log2 q, log2 k)`` (cells with ``k < q`` take the ``k = q`` value; outside the grid the
rate is held at the edge), and a task costs ``pairs / R``. A fused call of segments costs
``overhead + sum of its segments``; ``overhead`` is fitted on the ``fused`` rows (latency against
``n_seg`` at one shape: ``t(n) = overhead + n t_1``), 0 without them. Other head counts scale the
time by ``n_heads * head_dim`` relative to the table's. Phases: ``fwd``, ``fwd_bwd``, ``bwd``
(= ``fwd_bwd - fwd``).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

from .cost import ModelSpec, as_model
from .plan import merge_groups

PHASES = ("fwd", "bwd", "fwd_bwd")


def segment_pairs(q_len, kv_len):
    """Causal pairs of segments of ``q_len`` queries, the suffix of ``kv_len`` KV tokens (elementwise)."""
    q = np.asarray(q_len, dtype=np.float64)
    k = np.asarray(kv_len, dtype=np.float64)
    if np.any(q < 0) or np.any(k < q):
        raise ValueError("segments need 0 <= q_len <= kv_len (queries are the suffix of the KV block)")
    return q * k - q * (q - 1) / 2


@dataclass
class MeasuredCost:
    """Interpolated kernel latencies of one backend (see the module docstring)."""

    backend: str
    q_grid: np.ndarray                  # ascending query lengths of the task grid
    k_grid: np.ndarray                  # ascending KV lengths
    rate: dict                          # phase -> [len(q_grid), len(k_grid)] pairs per second
    overhead: dict                      # phase -> seconds per fused call
    n_heads: int
    head_dim: int
    meta: dict = field(default_factory=dict)

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def from_table(cls, table: dict, backend: str | None = None) -> "MeasuredCost":
        """From a loaded table (``{"config", "results"}``); ``backend`` defaults to the first one."""
        if not isinstance(table, dict) or "results" not in table or "config" not in table:
            raise ValueError("table must be a dict with 'config' and 'results' (profile_kernels.py's JSON)")
        rows = [r for r in table["results"] if isinstance(r, dict)]
        names = sorted({r.get("backend") for r in rows if r.get("kind") == "task"})
        if not names:
            raise ValueError("table has no 'task' rows")
        backend = names[0] if backend is None else backend
        if backend not in names:
            raise ValueError(f"backend {backend!r} is not in the table; it has: {', '.join(names)}")
        task = [r for r in rows if r.get("backend") == backend and r.get("kind") == "task"]
        qs = np.array(sorted({int(r["q_len"]) for r in task}), dtype=np.int64)
        ks = np.array(sorted({int(r["kv_len"]) for r in task}), dtype=np.int64)
        rate = {}
        for ph in ("fwd", "fwd_bwd"):
            grid = np.full((qs.size, ks.size), np.nan)
            for r in task:
                ms = r.get(f"{ph}_ms")
                if ms is not None and ms > 0:
                    p = float(segment_pairs(r["q_len"], r["kv_len"])) * int(r.get("n_seg", 1))
                    grid[np.searchsorted(qs, r["q_len"]), np.searchsorted(ks, r["kv_len"])] = p / (ms * 1e-3)
            rate[ph] = _fill(grid, qs, ks, ph)
        fused = [r for r in rows if r.get("backend") == backend and r.get("kind") == "fused"]
        overhead = {ph: _fit_overhead(fused, ph) for ph in ("fwd", "fwd_bwd")}
        cfg = table["config"]
        return cls(backend, qs, ks, rate, overhead, int(cfg["n_heads"]), int(cfg["head_dim"]),
                   meta={"source": table.get("meta", {}), "config": cfg})

    @classmethod
    def load(cls, path: str | os.PathLike, backend: str | None = None) -> "MeasuredCost":
        with open(path) as f:
            return cls.from_table(json.load(f), backend)

    # -- latencies ---------------------------------------------------------------------------------
    def _rate(self, q, k, phase: str) -> np.ndarray:
        lq = np.clip(np.log2(np.maximum(q, 1)), np.log2(self.q_grid[0]), np.log2(self.q_grid[-1]))
        lk = np.clip(np.log2(np.maximum(k, 1)), np.log2(self.k_grid[0]), np.log2(self.k_grid[-1]))
        gq, gk = np.log2(self.q_grid), np.log2(self.k_grid)
        i = np.clip(np.searchsorted(gq, lq, side="right") - 1, 0, max(gq.size - 2, 0))
        j = np.clip(np.searchsorted(gk, lk, side="right") - 1, 0, max(gk.size - 2, 0))
        i1, j1 = np.minimum(i + 1, gq.size - 1), np.minimum(j + 1, gk.size - 1)
        tq = np.where(i1 > i, (lq - gq[i]) / np.where(i1 > i, gq[i1] - gq[i], 1), 0.0)
        tk = np.where(j1 > j, (lk - gk[j]) / np.where(j1 > j, gk[j1] - gk[j], 1), 0.0)
        r = self.rate[phase]
        return ((1 - tq) * (1 - tk) * r[i, j] + tq * (1 - tk) * r[i1, j] + (1 - tq) * tk * r[i, j1]
                + tq * tk * r[i1, j1])

    def _scale(self, model) -> float:
        if model is None:
            return 1.0
        m = as_model(model)
        return (m.n_heads * m.head_dim) / (self.n_heads * self.head_dim)

    def task_seconds(self, q_len, kv_len, phase: str = "fwd_bwd", model: ModelSpec | str | None = None):
        """Seconds of segments of ``q_len`` queries over ``kv_len`` KV tokens inside a fused call (one
        layer; elementwise). ``model`` rescales to its heads x head_dim."""
        _check_phase(phase)
        q = np.asarray(q_len, dtype=np.float64)
        k = np.asarray(kv_len, dtype=np.float64)
        pairs = segment_pairs(q, k)
        if phase == "bwd":
            t = pairs / self._rate(q, k, "fwd_bwd") - pairs / self._rate(q, k, "fwd")
            t = np.maximum(t, 0.0)
        else:
            t = pairs / self._rate(q, k, phase)
        t = t * self._scale(model)
        return float(t) if t.ndim == 0 else t

    def fused_seconds(self, q_lens, kv_lens, phase: str = "fwd_bwd", model=None) -> float:
        """One fused call over segments ``(q_lens[i], kv_lens[i])``: overhead + the segments' sum."""
        q = np.atleast_1d(np.asarray(q_lens, dtype=np.float64))
        if not q.size:
            return 0.0
        return float(self.call_overhead(phase) + np.sum(self.task_seconds(q, kv_lens, phase, model)))

    def call_overhead(self, phase: str = "fwd_bwd") -> float:
        """Seconds a fused call costs beyond its segments (launch, tail)."""
        _check_phase(phase)
        over = self.overhead["fwd_bwd"] - self.overhead["fwd"] if phase == "bwd" else self.overhead[phase]
        return max(over, 0.0)

    def efficiency(self, q_len, kv_len=None, phase: str = "fwd_bwd") -> float:
        """Rate of ``q_len``-query segments over the best rate in the table (``kv_len``: at that KV
        length; None: the mean over the grid's KV lengths >= q_len)."""
        _check_phase(phase)
        ph = "fwd_bwd" if phase == "bwd" else phase
        ks = self.k_grid[self.k_grid >= q_len] if kv_len is None else np.array([kv_len])
        if not ks.size:
            ks = self.k_grid[-1:]
        r = self._rate(np.full(ks.size, float(q_len)), ks.astype(np.float64), ph)
        return float(np.mean(r) / np.nanmax(self.rate[ph]))

    def min_shard(self, within: float = 0.1, phase: str = "fwd_bwd", kv_len=None) -> int:
        """The smallest query length of the grid whose :meth:`efficiency` is within ``within`` of the
        best query length's (``>= (1 - within) * max``): the scheduler's minimum shard."""
        if not 0 <= within < 1:
            raise ValueError(f"within must be in [0, 1), got {within}")
        eff = np.array([self.efficiency(q, kv_len, phase) for q in self.q_grid])
        return int(self.q_grid[np.flatnonzero(eff >= (1 - within) * eff.max())[0]])

    # -- plans ---------------------------------------------------------------------------------------
    def server_seconds(self, plan, phase: str = "fwd_bwd", model=None, merge: bool = True) -> np.ndarray:
        """Per server of ``plan``, one layer of its fused call. ``merge``: contiguous tasks of one
        document are one segment, as the server runs them (:mod:`cadlib.dispatch.kvshare`)."""
        out = np.zeros(plan.n_servers)
        o = np.lexsort((plan.q_start, plan.doc, plan.server))
        srv, d, a, b = plan.server[o], plan.doc[o], plan.q_start[o], plan.q_end[o]
        g = merge_groups(srv * (plan.layout.n_docs + 1) + d, a, b) if merge else np.arange(srv.size)
        if not g.size:
            return out
        first = np.r_[0, np.flatnonzero(np.diff(g)) + 1]
        last = np.r_[first[1:], g.size] - 1
        t = self.task_seconds(b[last] - a[first], b[last], phase, model)
        np.add.at(out, srv[first], np.atleast_1d(t))
        busy = np.bincount(srv, minlength=plan.n_servers) > 0
        return out + np.where(busy, self.call_overhead(phase), 0.0)


def _check_phase(phase: str) -> None:
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {', '.join(PHASES)}; got {phase!r}")


def _fill(grid: np.ndarray, qs, ks, phase: str) -> np.ndarray:
    """Cells without a measurement: ``k < q`` cells take their row's value at the smallest measured
    ``k >= q`` (or the nearest measured cell); missing valid cells the nearest measured cell in the
    same row, then the same column. A table with no measurement at all is a ValueError."""
    if not np.isfinite(grid).any():
        raise ValueError(f"table has no {phase}_ms measurement")
    out = grid.copy()
    for i in range(out.shape[0]):
        ok = np.flatnonzero(np.isfinite(grid[i]))
        if ok.size:
            miss = np.flatnonzero(~np.isfinite(grid[i]))
            out[i, miss] = grid[i, ok[np.abs(ok[None, :] - miss[:, None]).argmin(1)]]
    for j in range(out.shape[1]):
        ok = np.flatnonzero(np.isfinite(out[:, j]))
        if ok.size:
            miss = np.flatnonzero(~np.isfinite(out[:, j]))
            out[miss, j] = out[ok[np.abs(ok[None, :] - miss[:, None]).argmin(1)], j]
    if not np.isfinite(out).all():                       # whole rows and columns missing
        out[~np.isfinite(out)] = np.nanmean(grid)
    return out


def _fit_overhead(rows, phase: str) -> float:
    """Least-squares intercept of ``ms`` against ``n_seg`` over the fused rows of one shape (>= 2
    distinct n_seg), clipped at 0; 0 without such rows."""
    pts = [(int(r.get("n_seg", 1)), r[f"{phase}_ms"]) for r in rows if r.get(f"{phase}_ms")]
    if len({n for n, _ in pts}) < 2:
        return 0.0
    n, ms = np.array(pts, dtype=np.float64).T
    slope, icept = np.polyfit(n, ms, 1)
    return float(max(icept, 0.0) * 1e-3)

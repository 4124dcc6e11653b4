"""DistCA's 4D sweep (section 6.2: "we sweep both DistCA and WLB across all possible configurations";
section 6.1: "we grid search best configurations that avoid out-of-memory"), replayed.

A step is Table 4's ``batch`` sequences of MaxDocLen tokens (:func:`cadlib.data.sequences.step_sequences`,
the same for every configuration and method, as DistCA's runs all consume one stream from its start). A
configuration (:class:`Config4D`, the grid of DistCA's ``zconfig_gen.py``, :func:`zconfig_grid`) cuts it
into ``n_micro`` micro-batches of ``2 bs`` sequences each, in order, over ``pp`` stages of ``nodes / pp``
nodes:

* CAD (``cad-pingpong``): micro-batch ``m`` is sequences ``[2 bs m, 2 bs (m + 1))``, ping the first ``bs``
  and pong the rest, each laid over the stage's nodes (``nano_split="distca"``); DistCA's lock-step
  ticks over all GPUs (:func:`cadlib.analysis.replay.pipelined.pipeline_lockstep`);
* WLB-ideal: all of the step's documents, whole, over ``n_micro x nodes / (pp cp)`` buckets by WLB-LLM's
  packer (:func:`cadlib.analysis.replay.settings4d.wlb_micro_layouts`), per-document CP of degree ``cp``,
  1F1B (per DP replica with ``schedule="replica"``).

Each configuration carries whether it fits a GPU's memory (:func:`cadlib.core.memory.configs`, DistCA's
Megatron profile, selective MLP recompute as every paper script runs; the paper excluded what ran out of
memory on its cluster). Per view (:data:`VIEWS`) and method the configuration of least mean step over the
batches is the method's (:func:`summarise`); the speedup is the ratio of the two means (the figures'
captions: "the average duration of the runs of WLB-LLM over DistCA"), its standard error by the delta
method over the paired batches::

    r = mean(W) / mean(C),   se(r)^2 = r^2 (var W / W^2 + var C / C^2 - 2 cov(W, C) / (W C)) / n
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ...core import memory
from ...core.cost import as_model
from ...core.methods import METHODS
from ...core.paper import DISTCA_ZCONFIG
from ...data.sequences import step_sequences
from ...scheduling.recipes import method_layout
from .phases import Links
from .pipelined import pipeline_1f1b, pipeline_lockstep
from .settings4d import Setting4D, wlb_micro_layouts

SWEEP_METHODS = ("wlb", "cad-pingpong")
"""What Figure 10 compares: WLB-ideal and DistCA (CAD with ping-pong)."""
VIEWS = ("paper", "any", "oracle")
"""``paper``: the configurations that fit in memory (CAD's also with every tick's plans in its buffer),
each method's best by mean step; ``any``: no memory limit; ``oracle``: as ``paper`` but WLB-ideal takes
its best fitting configuration batch by batch (our earlier per-batch choice, an oracle)."""


@dataclass(frozen=True)
class Config4D:
    """One run of the sweep: ``method`` (``"wlb"`` or ``"cad"``), ``pp`` stages, ``n_micro``
    micro-batches of ``2 bs`` sequences (``bs`` per ping and per pong), WLB's CP degree ``cp`` in nodes."""

    method: str
    pp: int
    n_micro: int
    bs: float
    cp: int = 1

    def dp(self, nodes: int) -> int:
        """Nodes per pipeline stage."""
        return nodes // self.pp

    def replicas(self, nodes: int) -> int:
        """Data-parallel replicas: CAD's nodes per stage (each its own attention server), WLB's CP groups."""
        return nodes // (self.pp * self.cp)


def zconfig_grid(nodes: int, batch: int, n_layers: int, grid: dict = DISTCA_ZCONFIG) -> list[Config4D]:
    """DistCA's 4D grid (:data:`cadlib.core.paper.DISTCA_ZCONFIG`) for ``nodes`` nodes and a step of
    ``batch`` sequences: ``bs x n_micro = batch / 2``; ``pp`` dividing the layers and the nodes, one
    micro-batch without PP, at least ``2 pp`` with it; CAD with ``bs >= 1``; WLB with ``pp cp <= nodes``
    and ``nodes // cp <= 2 bs``."""
    if batch % 2 or batch < 2:
        raise ValueError(f"batch must be an even number of sequences (ping and pong), got {batch!r}")
    out = []
    for bs in grid["batch_size"]:
        for m in grid["n_micro"]:
            if bs * m != batch // 2:
                continue
            for pp in grid["pp"]:
                if n_layers % pp or nodes % pp or (pp == 1 and m != 1) or (pp > 1 and m < 2 * pp):
                    continue
                if bs >= 1:
                    out.append(Config4D("cad", pp, m, bs))
                out += [Config4D("wlb", pp, m, bs, c) for c in grid["wlb_cp"]
                        if pp * c <= nodes and nodes % (pp * c) == 0 and nodes // c <= 2 * bs]
    return out


def memory_fits(s: Setting4D, cfgs: list[Config4D]) -> dict[Config4D, dict]:
    """Per configuration its peak per GPU (GiB) and whether it fits, from :func:`cadlib.core.memory.configs`
    (the step's tokens; WLB's micro-batch tokens per CP rank, CAD's per node; selective MLP recompute)."""
    rows = memory.configs(s.model, s.gpus, s.total_tokens, tps=(s.tp,), recomputes=("mlp",),
                          max_micro=max(c.n_micro for c in cfgs), max_doc_len=s.max_doc_len)
    by = {(r["method"], r["pp"], r["cp"], r["n_micro"]): r for r in rows}
    out = {}
    for c in cfgs:
        r = by.get((c.method, c.pp, c.cp, c.n_micro))
        if r is None:
            raise ValueError(f"the memory model has no row for {c} on {s.gpus} GPUs")
        out[c] = {"peak_gib": r["peak"] / memory.GIB, "fits": bool(r["fits"]), "moment": r["moment"]}
    return out


def micro_groups(s: Setting4D, seqs: list[list[int]], c: Config4D) -> list[list[int]]:
    """The micro-batches' documents: ``2 bs`` consecutive sequences each, in order."""
    k = int(2 * c.bs)
    return [[n for q in seqs[k * m:k * (m + 1)] for n in q] for m in range(c.n_micro)]


def run_config(s: Setting4D, seqs, c: Config4D, times, links: Links, price, backend: str) -> dict:
    """One configuration's step on a step's sequences."""
    dp = c.dp(s.nodes)
    sc = replace(s, micro_tokens=int(2 * c.bs * s.max_doc_len) // dp)
    groups = micro_groups(s, seqs, c)
    if c.method == "wlb":
        lays = wlb_micro_layouts(sc, groups, dp, c.cp)
        out = pipeline_1f1b(sc, lays, c.pp, dp, times, links, price, backend, "wlb",
                            c.cp if s.wlb_gather == "replica" else None, replica=c.cp)
        return {**out, "max_tokens_per_rank": int(max(lay.tokens_per_rank().max() for lay in lays))}
    recipe = sc.base(dp).recipe()
    lays = [method_layout(g, dp, recipe, METHODS["cad-pingpong"]) for g in groups]
    return {**pipeline_lockstep(sc, lays, c.pp, dp, times, links, price, backend),
            "max_tokens_per_rank": sc.micro_tokens}


def replay_sweep(s: Setting4D, times: dict, rates: dict, backend: str, price, progress=None,
                 only_fitting: bool = False) -> dict:
    """Every configuration of the grid (``only_fitting``: those that fit in memory) for every batch, and
    :func:`summarise`'s views; ``price`` gives the server calls' durations (and counts them)."""
    if s.sequence_len is None:
        raise ValueError("the 4D sweep forms micro-batches from DistCA's sequences: "
                         "give Setting4D.sequence_len")
    cfgs = zconfig_grid(s.nodes, s.batch, as_model(s.model).n_layers)
    mem = memory_fits(s, cfgs)
    if only_fitting:
        cfgs = [c for c in cfgs if mem[c]["fits"]]
    links = Links.of(s.base(1), rates)
    rows = []
    for b in range(s.batches):
        seqs = step_sequences(s.dist, s.sequence_len, s.batch, b, s.seed)
        for c in cfgs:
            r = run_config(s, seqs, c, times, links, price, backend)
            rows.append({"batch": b, "method": "wlb" if c.method == "wlb" else "cad-pingpong", "pp": c.pp,
                         "dp": c.dp(s.nodes), "cp": c.cp, "n_micro": c.n_micro, "bs": c.bs, **mem[c], **r})
        if progress is not None:
            progress(f"{s.name} batch {b}")
    return {"configs": [{**c.__dict__, **mem[c]} for c in cfgs], "per_config": rows,
            "summary": [r for r in summarise(s, rows) if not (only_fitting and r["view"] == "any")],
            "attention_calls": {"timed": price.timed, "modelled": price.modelled}}


def _ok(r: dict) -> bool:
    return r["fits"] and not r.get("buffer_failed_ticks", 0)


def ratio_se(w, c) -> float:
    """Standard error of ``mean(w) / mean(c)`` over paired samples (delta method; 0 for one sample)."""
    w, c = np.asarray(w, dtype=np.float64), np.asarray(c, dtype=np.float64)
    n = w.size
    if n < 2:
        return 0.0
    mw, mc = w.mean(), c.mean()
    cov = np.cov(w, c, ddof=1)
    var = (cov[0, 0] / mw ** 2 + cov[1, 1] / mc ** 2 - 2 * cov[0, 1] / (mw * mc)) / n
    return float(mw / mc * np.sqrt(max(var, 0.0)))


def summarise(s: Setting4D, rows: list[dict]) -> list[dict]:
    """Per view (:data:`VIEWS`) and method its configuration of least mean step, with the step's mean and
    standard error over the batches, and CAD's speedup over WLB-ideal (ratio of the means) with its
    standard error."""
    key = ("pp", "dp", "cp", "n_micro", "bs")
    out = []
    for view in VIEWS:
        keep = (lambda r: True) if view == "any" else _ok
        best = {}
        for m in SWEEP_METHODS:
            runs: dict[tuple, list[dict]] = {}
            for r in rows:
                if r["method"] == m and keep(r):
                    runs.setdefault(tuple(r[k] for k in key), []).append(r)
            runs = {k: sorted(v, key=lambda r: r["batch"]) for k, v in runs.items() if len(v) == s.batches}
            if not runs:
                continue
            k = min(runs, key=lambda k: np.mean([r["step_s"] for r in runs[k]]))
            steps = np.array([r["step_s"] for r in runs[k]])
            if view == "oracle" and m == "wlb":        # each batch its own best configuration
                steps = np.array([min(v[b]["step_s"] for v in runs.values()) for b in range(s.batches)])
            best[m] = {"setting": s.name, "dist": s.dist, "max_doc_len": s.max_doc_len, "gpus": s.gpus,
                       "batch": s.batch, "view": view, "method": m, **dict(zip(key, k)),
                       "batches": int(steps.size), "configs": len(runs), "step_s_mean": float(steps.mean()),
                       "step_s_se": float(steps.std(ddof=1) / np.sqrt(steps.size)) if steps.size > 1 else 0.0,
                       "peak_gib": runs[k][0]["peak_gib"], "steps": steps}
        if "wlb" in best and "cad-pingpong" in best:
            w, c = best["wlb"]["steps"], best["cad-pingpong"]["steps"]
            best["cad-pingpong"]["speedup_over_wlb"] = float(w.mean() / c.mean())
            best["cad-pingpong"]["speedup_se"] = ratio_se(w, c)
        for r in best.values():
            r.pop("steps")
        out += list(best.values())
    return out

"""Straggler idle studies on top of :mod:`cadlib.analysis.model.sim`: how much of a step data- and pipeline-parallel
ranks spend waiting, as the paper's motivation measures it.

* :func:`idle_fraction_sweep`: the simulated idle fraction of DP (and CAD) over DP sizes and context
  lengths, sequential packing;
* :func:`varlen_chunking` and :func:`straggler_idle`: variable-length chunking (WLB-LLM) as DistCA's
  baseline planner does it, and the idle time it leaves, beside fixed-length packing;
* :func:`pp_timeline`: the 1F1B schedule as a table for a Gantt chart;
* :func:`pipeline_run_timeline`: the same picture from a real run (``python -m cadlib.train --pp``).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ...core.cost import as_model
from ...core.layout import Chunk, Layout
from ...data.packing import pack
from ...data.workload import sample_docs
from ...data.workload import sample_kwargs as resolve
from .compose import one_f_one_b
from .sim import Hardware, attention_seconds, linear_seconds, simulate, simulate_dp


def idle_fraction_sweep(distribution: str, dp_sizes: Sequence[int], context_lengths: Sequence[int],
                        model="llama3-8b", methods: Sequence[str] = ("dp", "cad"),
                        hw: Hardware | None = None, pack_method: str = "sequential",
                        seeds: Sequence[int] = (0,), tolerance: float = 0.1, overlap: bool = True,
                        **sample_kwargs):
    """A DataFrame of idle fraction and step time vs DP size and context length (tokens per rank).

    Per ``(dp, context, seed)``: ``workload.sample_docs`` draws documents of ``distribution`` (a
    ``workload.DISTRIBUTIONS`` name or a ``workload.PRESETS`` name such as ``distca-pretrain``) for
    ``dp * context`` tokens, no document longer than ``context`` unless ``max_doc_len`` is given;
    ``workload.pack`` lays them out; each method in ``methods`` (``dp``, ``cp``, ``cad``; ``pp`` needs a
    stage count and is not swept) is simulated. Extra keywords go to ``sample_docs``."""
    import pandas as pd

    bad = [m for m in methods if m not in ("dp", "cp", "cad")]
    if bad:
        raise ValueError(f"idle_fraction_sweep cannot sweep method(s) {bad}; choose from: dp, cp, cad")
    kw = resolve(distribution)
    kw.update(sample_kwargs)
    model, hw, rows = as_model(model), hw or Hardware(), []
    for dp in dp_sizes:
        for ctx in context_lengths:
            for seed in seeds:
                docs = sample_docs(total_tokens=int(dp) * int(ctx), seed=seed,
                                   **{"max_doc_len": int(ctx), **kw})
                layout = pack(docs, int(dp), method=pack_method, model=model)
                for method in methods:
                    opts = {"overlap": overlap, "tolerance": tolerance} if method == "cad" else {}
                    r = simulate(method, layout, model, hw, **opts)
                    rows.append({"distribution": distribution, "dp": int(dp), "context": int(ctx),
                                 "seed": seed, "n_docs": layout.n_docs, **r.summary()})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------------
# Pipeline timeline; variable-length chunking and the idle time it leaves
# ---------------------------------------------------------------------------------------------------

def pp_timeline(fwd: np.ndarray, bwd: np.ndarray, unit: float = 1e3):
    """The 1F1B schedule of :func:`one_f_one_b` as a table, one row per op: ``stage``, ``microbatch``,
    ``phase`` (``F``/``B``), ``start_ms`` and ``end_ms`` (seconds x ``unit``), for a Gantt chart.
    An op starts at its end minus its own duration (ops on a stage never overlap)."""
    import pandas as pd
    fwd, bwd = np.asarray(fwd, dtype=np.float64), np.asarray(bwd, dtype=np.float64)
    _, f_end, b_end = one_f_one_b(fwd, bwd)
    rows = [{"stage": s, "microbatch": i, "phase": kind, "start_ms": (end[s, i] - dur[s, i]) * unit,
             "end_ms": end[s, i] * unit}
            for kind, end, dur in (("F", f_end, fwd), ("B", b_end, bwd))
            for s in range(fwd.shape[0]) for i in range(fwd.shape[1])]
    return pd.DataFrame(rows).sort_values(["stage", "start_ms"], ignore_index=True)


def pipeline_run_timeline(results, method: str):
    """One pipeline step of ``method`` from ``python -m cadlib.train --pp`` (the launcher's per-rank
    results) as a Gantt table: per rank a lane of its schedule's slots (``phase`` ``forward`` /
    ``backward``, ``dummy`` where its stage had nothing to run and only served attention), and a lane
    of its attention kernels, marked ``attention served while idle`` inside a dummy slot. Columns
    ``lane``, ``phase``, ``start_ms``, ``end_ms``, ``rank``, ``stage``, ``slot``."""
    import pandas as pd
    rows = []
    for res in sorted(results, key=lambda r: r["rank"]):
        spans = res["timelines"].get(method)
        if spans is None:
            raise ValueError(f"no timeline of method {method!r}; the run has {sorted(res['timelines'])}")
        spans = spans[-1] if spans and isinstance(spans[0], list) else spans
        stage = res["grid"]["stage"]
        name = f"stage {stage} · rank {res['rank']}"
        slots = [r for r in spans if r["lane"] == "tick"]
        for k, r in enumerate(slots):
            kind, micro = r["phase"][0], r["phase"].split()[0][1:]
            dummy = micro == "-"
            phase = ("dummy " if dummy else "") + ("forward" if kind == "F" else "backward")
            rows.append({"lane": name, "phase": phase, "start_ms": r["start_ms"], "end_ms": r["end_ms"],
                         "rank": res["rank"], "stage": stage, "slot": k})
        idle = [(r["start_ms"], r["end_ms"]) for r in slots if r["phase"].split()[0][1:] == "-"]
        for r in spans:
            if r["lane"] == "compute" and r["phase"].startswith("attn"):
                served = any(a <= r["start_ms"] and r["end_ms"] <= b for a, b in idle)
                rows.append({"lane": name + " attention", "phase": "attention served while idle" if served
                             else "attention", "start_ms": r["start_ms"], "end_ms": r["end_ms"],
                             "rank": res["rank"], "stage": stage, "slot": -1})
    return pd.DataFrame(rows)


def varlen_chunking(doc_lens: Sequence[int], n_ranks: int, cap: int, model,
                    hw: Hardware | None = None) -> Layout:
    """Variable-length chunking (WLB-LLM) as DistCA's baseline planner does it: whole documents,
    longest first; each goes to the rank with the least estimated time ``t(n) = linear(n) +
    attention([0, n))`` (fwd+bwd, this simulator's rates) if it fits under ``cap`` tokens, else to the
    rank with the fewest tokens if it fits there, else it waits; waiting documents then go to the
    least-loaded rank, cap or not. Ranks hold different token counts (memory), and no document is cut:
    a rank holding one long document stays the straggler, ``step >= max_d t(n_d)``."""
    lens = [int(n) for n in doc_lens]
    if not lens or min(lens) < 1:
        raise ValueError("doc_lens must be a non-empty list of integers >= 1")
    if int(n_ranks) != n_ranks or n_ranks < 1:
        raise ValueError(f"n_ranks must be an integer >= 1, got {n_ranks}")
    if int(cap) < 1:
        raise ValueError(f"cap (tokens per rank) must be >= 1, got {cap}")
    model, hw, R = as_model(model), hw or Hardware(), int(n_ranks)
    t = (linear_seconds(np.array(lens), model, hw)
         + attention_seconds(np.zeros(len(lens), dtype=np.int64), lens, model, hw))
    load, tokens = np.zeros(R), np.zeros(R, dtype=np.int64)
    ranks: list[list[Chunk]] = [[] for _ in range(R)]

    def put(d: int, r: int) -> None:
        ranks[r].append(Chunk(d, 0, lens[d]))
        load[r] += t[d]
        tokens[r] += lens[d]

    waiting = []
    for d in sorted(range(len(lens)), key=lambda d: (-lens[d], d)):
        light, emptiest = int(np.argmin(load)), int(np.argmin(tokens))
        if tokens[light] + lens[d] <= cap:
            put(d, light)
        elif tokens[emptiest] + lens[d] <= cap:
            put(d, emptiest)
        else:
            waiting.append(d)
    for d in waiting:
        put(d, int(np.argmin(load)))
    return Layout([sorted(r) for r in ranks], lens)


def straggler_idle(distribution: str, dp_sizes: Sequence[int], context: int, model="llama3-8b", *,
                   packings: Sequence[str] = ("sequential", "varlen"), cap_factor: float = 1.0,
                   elongate: float = 1.0, global_tokens: int | None = None, seeds: Sequence[int] = (0,),
                   hw: Hardware | None = None, **sample_kwargs):
    """Idle fraction of data parallelism (:func:`simulate_dp`: linear layers and colocated attention,
    ``idle = sum_g (step - busy_g) / (G step)``) per DP size, packing and seed.

    Per ``(dp, seed)``: a batch of ``distribution`` (``workload`` name or preset), lengths stretched by
    ``elongate`` and clipped to ``context``, of ``dp * context`` tokens (every rank's budget is the
    context: weak scaling) or, with ``global_tokens``, of ``global_tokens`` split over the ranks
    (budget ``global_tokens / dp``: a fixed global batch). ``sequential`` packs every rank to exactly
    its budget (documents cut at rank boundaries); ``varlen`` is :func:`varlen_chunking` with
    ``cap = cap_factor * budget`` tokens per rank."""
    import pandas as pd

    bad = [p for p in packings if p not in ("sequential", "varlen")]
    if bad:
        raise ValueError(f"unknown packing(s) {bad}; choose from: sequential, varlen")
    if not cap_factor >= 1:
        raise ValueError(f"cap_factor must be >= 1 (a rank holds at least the context), got {cap_factor}")
    kw = {**resolve(distribution), "elongate": float(elongate), **sample_kwargs}
    model, hw, rows = as_model(model), hw or Hardware(), []
    for dp in dp_sizes:
        total = int(dp) * int(context) if global_tokens is None else int(global_tokens)
        if total % int(dp):
            raise ValueError(f"global_tokens={global_tokens} must split evenly over dp={dp} ranks")
        budget = total // int(dp)
        for seed in seeds:
            docs = sample_docs(total_tokens=total, seed=seed, **{"max_doc_len": int(context), **kw})
            for p in packings:
                lay = (pack(docs, int(dp), budget) if p == "sequential" else
                       varlen_chunking(docs, int(dp), int(cap_factor * budget), model, hw))
                r = simulate_dp(lay, model, hw)
                tok = lay.tokens_per_rank()
                rows.append({"dp": int(dp), "packing": p, "seed": seed, "tokens_per_rank": budget,
                             "idle_fraction": r.idle_fraction,
                             "step_s": r.step, "tokens_max_over_mean": float(tok.max() / tok.mean()),
                             "longest_doc": max(docs), "n_docs": len(docs)})
    return pd.DataFrame(rows)

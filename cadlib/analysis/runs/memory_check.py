"""The memory model (:mod:`cadlib.core.memory`) against every committed measured peak, and what it
says about the paper's memory claims.

For every committed ``results/bench_e2e_*.json``, every batch and rank, the batch's layouts, plans and
dispatches are rebuilt as :mod:`cadlib.train` builds them (:func:`rebuild`),
each method's rows (:class:`cadlib.core.memory.Rows`: what its attention keeps) are read off them and
the model's peak (profile :data:`cadlib.core.memory.OURS`) is compared with the record's
``peak_mem_gib`` (``torch.cuda.max_memory_allocated``). Host only, no torch.
"""
from __future__ import annotations

import statistics

import numpy as np

from ...core.cost import as_model
from ...core.layout import Layout
from ...core.memory import GIB, MEGATRON, OURS, OURS_FUSED, Rows, configs, estimate, fits, max_tokens
from ...core.methods import METHODS as ALL_METHODS, names
from ...core.paper import (DISTCA_GPUS_PER_NODE, DISTCA_TABLE3_8B, DISTCA_TABLE3_34B, DISTCA_TABLE4_8B,
                           DISTCA_TABLE4_34B, DISTCA_TP)
from ...data.packing import pack
from ...data.workload import sample_docs
from ...dispatch.build import build_dispatch
from ...scheduling.recipes import Recipe, batch_docs, cad_plan, nano_plans

METHODS = names(trainable=True)
TARGET = 0.10
"""The largest relative error allowed against a measured peak."""


def cp_rows(layout: Layout, rank: int) -> Rows:
    """Per-document CP by all-gather (``cadlib.cp.allgather``) on ``layout``: the rank keeps its own q,
    k, v, o; the backward re-gathers ``n + world * M`` KV rows (``M``: the most rows of shared
    documents a rank holds) and its call reads every chunk's prefix ``[0, end)``."""
    arr = layout.chunk_array()                       # (doc, start, end, rank) per chunk
    holders = np.zeros(layout.n_docs, dtype=np.int64)
    pairs = np.unique(arr[:, 0] * layout.n_ranks + arr[:, 3]) if len(arr) else np.zeros(0, np.int64)
    np.add.at(holders, pairs // layout.n_ranks, 1)
    shared = holders > 1
    mine = [c for c in layout.ranks[rank]]
    n = sum(c.length for c in mine)
    counts = [sum(c.length for c in chunks if shared[c.doc]) for chunks in layout.ranks]
    n_buf = n + (layout.n_ranks * max(counts) if shared.any() and layout.n_ranks > 1 else 0)
    return Rows(n, call_kv=sum(c.end for c in mine), regather=n_buf if n_buf > n else 0)


def dispatch_rows(meta, tokens: int | None = None) -> Rows:
    """What a stateful CAD server and its home keep (:mod:`cadlib.runtime.stages`), from this rank's
    :class:`cadlib.dispatch.meta.Dispatch`: Q ``cat([local[:q_keep], received])`` (a view of the
    local q when nothing came), K, V ``cat([local, received])``, O and LSE of the served rows, and
    the home's own O unless it is a view of the server's output (``buffers.to_home``).
    ``tokens``: rows of the linear layers (ping-pong's B: its rows without A's context rows)."""
    n, rq, rkv = meta.n_local, meta.n_recv_q, meta.n_recv_kv
    served = int(meta.cu_q[-1])
    if meta.q_identity:
        view = meta.n_send_q == 0 and served == meta.q_keep + rq and served - n <= n // 8
        home = 0 if view and meta.q_keep + rq == served and n == meta.q_keep else n
    else:
        home = n
    sh = meta.shared()
    return Rows(n if tokens is None else tokens, q=(meta.q_keep + rq) if rq else n, kv=n + rkv,
                out=served, home_o=home, call_q=served, call_kv=sh.n_kv)


def rebuild(config: dict, batch: int, world: int) -> dict:
    """Batch ``batch`` of a run with ``config`` (a committed file's), as :mod:`cadlib.train` builds it:
    ``spec``, the sequential ``layout``, ``cad``'s ``plan``, ping-pong's ``nanos`` and ``nano_plans``
    (files without ``nano_split`` kept documents whole) and WLB's balanced ``wlb_layout``."""
    recipe = Recipe.from_config(config)
    spec = as_model(config["model"], **({"n_layers": config["layers"]} if config.get("layers") else {}))
    docs = batch_docs(recipe, int(batch), world)
    layout = pack(docs, world, recipe.tokens_per_rank, method="sequential")
    nanos, nplans = nano_plans(layout, recipe, spec)
    return {"spec": spec, "layout": layout, "plan": cad_plan(layout, recipe, spec), "nanos": nanos,
            "nano_plans": nplans, "wlb_layout": pack(docs, world, recipe.tokens_per_rank, method="balanced",
                                                     model=spec, cap=config.get("wlb_cap"))}


def method_rows(built: dict, method: str, rank: int) -> list[Rows]:
    """The (nano-)batches of ``method`` on ``rank`` (:class:`Rows`), from :func:`rebuild`'s batch."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
    m = ALL_METHODS[method]
    if m.baseline:                                   # per-document CP on its packing's layout
        return [cp_rows(built["wlb_layout" if m.packing == "balanced" else "layout"], rank)]
    if not m.pingpong:
        return [dispatch_rows(build_dispatch(built["plan"], rank))]
    return [dispatch_rows(build_dispatch(p, rank), len(nb.rows[rank]))     # ping-pong: A, then B
            for nb, p in zip(built["nanos"], built["nano_plans"])]


def predict(config: dict, rows: list[Rows]) -> dict:
    """The model's estimate for one run's GPU: profile ``OURS``, or ``OURS_FUSED`` for a run whose config
    says its layers ran the fused blocks (``linear_blocks``); its ``recompute`` (older runs:
    ``mlp_recompute``)."""
    spec = as_model(config["model"], **({"n_layers": config["layers"]} if config.get("layers") else {}))
    recompute = config.get("recompute") or ("mlp" if config.get("mlp_recompute") else "none")
    profile = OURS_FUSED if config.get("linear_blocks") == "fused" else OURS
    return estimate(spec, rows, recompute=recompute, profile=profile,
                    ce_chunk=int(config.get("ce_chunk") or 8192))


def check_item(item: dict) -> list[dict]:
    """One row per (method, batch, rank) of a committed run (an item of
    :func:`cadlib.analysis.runs.e2e.load_committed`): measured and modelled peak (GiB), relative error,
    the moment and parts of the model's peak."""
    cfg, res = item["config"], item["results"]
    recs = [r for r in res["records"] if r.get("peak_mem_gib")]
    world = int(cfg.get("nproc") or 1 + max(r["rank"] for r in recs))
    built, out = {}, []
    for r in sorted(recs, key=lambda r: (r["batch"], r["method"], r["rank"])):
        b = int(r["batch"])
        if b not in built:
            built[b] = rebuild(cfg, b, world)
        rows = method_rows(built[b], r["method"], int(r["rank"]))
        e = predict(cfg, rows)
        meas = float(r["peak_mem_gib"])
        out.append({"file": item["file"], "method": r["method"], "batch": b, "rank": int(r["rank"]),
                    "measured_gib": meas, "model_gib": e["peak"] / GIB,
                    "err": e["peak"] / GIB / meas - 1, "moment": e["moment"],
                    "tokens": sum(x.tokens for x in rows),
                    "parts_gib": {k: e[k] / GIB for k in ("weights", "init_copy", "optimizer", "grads",
                                                           "activations", "working_set")}})
    return out


def summarise(rows: list[dict]) -> list[dict]:
    """Per (file, method): the measured peak (max over batches and ranks, as the run's summary), the
    model's for the same (batch, rank), their error, and the worst error over every (batch, rank)."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["file"], r["method"]), []).append(r)
    out = []
    for (f, m), g in sorted(groups.items()):
        top = max(g, key=lambda r: r["measured_gib"])
        worst = max(g, key=lambda r: abs(r["err"]))
        model_top = max(g, key=lambda r: r["model_gib"])
        out.append({"file": f, "method": m, "measured_peak_gib": top["measured_gib"],
                    "model_peak_gib": model_top["model_gib"],
                    "err": model_top["model_gib"] / top["measured_gib"] - 1,
                    "model_moment": model_top["moment"], "model_parts_gib": model_top["parts_gib"],
                    "worst_record_err": worst["err"], "worst_record": [worst["batch"], worst["rank"]],
                    "mean_abs_record_err": statistics.fmean(abs(r["err"]) for r in g), "n": len(g)})
    return out


# ---------------------------------------------------------------------------------------------------
# The paper's memory claims and settings
# ---------------------------------------------------------------------------------------------------

def measured_divergence(rows: list[dict], method: str = "wlb") -> list[dict]:
    """Per (file, batch) of ``method`` in :func:`check_item`'s rows: ``max / mean`` over the ranks of
    the measured peak and of the model's (``cadlib.analysis.report.claims``' measure)."""
    groups: dict = {}
    for r in rows:
        if r["method"] == method:
            groups.setdefault((r["file"], r["batch"]), []).append(r)
    return [{"file": f, "batch": b,
             "measured": max(x["measured_gib"] for x in g) / statistics.fmean(x["measured_gib"] for x in g),
             "model": max(x["model_gib"] for x in g) / statistics.fmean(x["model_gib"] for x in g)}
            for (f, b), g in sorted(groups.items()) if len(g) > 1]


def divergence(dist: str, dp: int, *, tokens_per_rank: int = 524288, max_doc_len: int = 524288,
               n_batches: int = 10, model: str = "llama3-8b", tp: int = DISTCA_TP, recompute: str = "mlp",
               profile=MEGATRON, cap: int | None = None) -> dict:
    """Figure 4a's setting: WLB-ideal's variable-length chunks (``cadlib.data.packing``'s balanced
    packing, ``cap`` its token cap) of ``dp`` chunks of ``tokens_per_rank`` tokens (one per node, TP =
    ``tp``), documents of ``dist`` up to ``max_doc_len``; per batch the ``max / mean`` over the DP
    ranks of the model's activation memory and of its whole peak."""
    spec = as_model(model)
    acts, peaks, toks = [], [], []
    for b in range(n_batches):
        docs = sample_docs(dist, dp * tokens_per_rank, seed=b, max_doc_len=max_doc_len)
        lay = pack(docs, dp, tokens_per_rank, method="balanced", model=spec, cap=cap)
        n = [int(t) for t in lay.tokens_per_rank()]
        es = [estimate(spec, [Rows(x)], recompute=recompute, profile=profile, tp=tp, dp=dp) for x in n]
        for out, key in ((acts, "activations"), (peaks, "peak")):
            v = [e[key] for e in es]
            out.append(max(v) / statistics.fmean(v))
        toks.append(max(n) / statistics.fmean(n))
    return {"dist": dist, "dp": dp, "activation_ratio": acts, "peak_ratio": peaks, "tokens_ratio": toks,
            "activation_ratio_mean": statistics.fmean(acts), "activation_ratio_max": max(acts),
            "peak_ratio_mean": statistics.fmean(peaks)}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def paper_tokens(recomputes=("mlp", "none"), profile=MEGATRON) -> list[dict]:
    """Table 3's settings (3D, TP = 8): the paper's tokens per node (batch x MaxDocLen / nodes) against
    the most a node fits under the model: WLB-ideal (per-document CP) at every CP degree its DP x CP
    sweep can take, and CAD (ping-pong, stateless servers); and both methods' GiB per GPU at the
    paper's tokens per node and at twice as many (DistCA's driver draws two batches a step)."""
    out = []
    for model, table in (("llama3-8b", DISTCA_TABLE3_8B), ("llama-34b", DISTCA_TABLE3_34B)):
        for max_len, sizes, gpus in table:
            for bs, g in zip(sizes, gpus):
                nodes = g // DISTCA_GPUS_PER_NODE
                for rc in recomputes:
                    wlb = {cp: max_tokens(model, "wlb", tp=DISTCA_TP, cp=cp, dp=nodes // cp, recompute=rc,
                                          profile=profile) for cp in _divisors(nodes)}
                    out.append({"model": model, "max_doc_len": max_len, "batch": bs, "gpus": g,
                                "recompute": rc, "paper_tokens_per_node": bs * max_len // nodes,
                                "wlb_max_tokens_per_node": wlb,
                                "cad_max_tokens_per_node": max_tokens(model, "cad", tp=DISTCA_TP, dp=nodes,
                                                                      recompute=rc, profile=profile),
                                "gib_at_paper_tokens": cad_vs_wlb_at(model, bs * max_len // nodes, nodes, rc,
                                                                     profile),
                                "gib_at_twice": cad_vs_wlb_at(model, 2 * bs * max_len // nodes, nodes, rc,
                                                              profile)})
    return out


def table4(max_micro: int = 32, profile=MEGATRON) -> list[dict]:
    """Table 4's settings (4D, TP = 8): per setting and method, the configurations that fit in an
    H200 (:func:`cadlib.core.memory.configs`; micro-batches hold whole documents) out of those tried,
    each as ``[pp, cp, dp, n_micro, recompute, tokens per TP group, peak GiB]``."""
    out = []
    for model, table in (("llama3-8b", DISTCA_TABLE4_8B), ("llama-34b", DISTCA_TABLE4_34B)):
        for max_len, sizes, gpus in table:
            for bs, g in zip(sizes, gpus):
                rows = configs(model, g, bs * max_len, max_micro=max_micro, max_doc_len=max_len,
                               recomputes=("mlp", "none"), profile=profile)
                for method in ("wlb", "cad"):
                    mine = [r for r in rows if r["method"] == method]
                    ok = [[r["pp"], r["cp"], r["dp"], r["n_micro"], r["recompute"], r["tokens"],
                           round(r["peak"] / GIB, 1)] for r in mine if r["fits"]]
                    out.append({"model": model, "max_doc_len": max_len, "batch": bs, "gpus": g,
                                "method": method, "tried": len(mine), "fit": len(ok), "fitting": ok})
    return out


def cad_vs_wlb_at(model: str, tokens: int, nodes: int, recompute: str = "mlp", profile=MEGATRON) -> dict:
    """GiB per GPU of both methods at ``tokens`` per node (3D, TP = 8): WLB-ideal at each CP degree
    of ``nodes``, CAD with DP = ``nodes``."""
    wlb = {cp: fits(model, "wlb", tokens, tp=DISTCA_TP, cp=cp, dp=nodes // cp, recompute=recompute,
                    profile=profile)["peak"] / GIB for cp in _divisors(nodes)}
    cad = fits(model, "cad", tokens, tp=DISTCA_TP, dp=nodes, recompute=recompute,
               profile=profile)["peak"] / GIB
    return {"wlb_gib_by_cp": wlb, "cad_gib": cad}

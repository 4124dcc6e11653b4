"""The evidence behind the lessons, for the report's appendix: run-to-run histories, variants of the
committed runs, the cost-model check, long tables. The notebooks teach with one figure and link here.

Each ``*_section`` function reads committed results (``results/`` unless ``results_dir`` says otherwise)
and returns a :data:`Section`: ``{"id", "title", "text", "tables": [(caption, DataFrame)], "figures":
[(caption, plotly figure dict)]}``, or None when its files are missing; :func:`sections` returns
every section there is. :func:`cadlib.analysis.report.writer.write_report` renders them.

Also here: ours for ``distca.composability`` (:func:`composability_ours`, :func:`record_composability`),
whose note is a history of measurements.
"""
from __future__ import annotations

import os
import pathlib

import pandas as pd

from ...core.methods import names
from ...infra.results import RESULTS_DIR, load_result
from ..runs import e2e, server_bench, timelines
from ..runs.server_bench import COMPOSABILITY_TARGET, composability_before_after, composability_targets
from . import claims, metrics

Section = dict
NEAR_PEAK = 0.85
"""``distca.composability``'s "near-peak throughput", read as at least this share of the unsplit
document's TF/s."""
COMPOSABILITY_MIN_SHARD = 128
"""The claim's smallest shard (tokens)."""
COST_MODEL_CHECK = "cost_model_check.json"
"""``scripts/analyses/cost_model_check.py``'s committed output under ``results/``."""


def _dir(results_dir) -> pathlib.Path:
    return pathlib.Path(results_dir or RESULTS_DIR)


# ---------------------------------------------------------------------------------------------------
# Composability: the claim, and its history
# ---------------------------------------------------------------------------------------------------

def composability_ours(rows) -> list[dict]:
    """Ours for ``distca.composability`` from :func:`cadlib.analysis.runs.server_bench.composability`'s rows
    (FA4, every shard on the server, shards >= 128 tokens, 16K and 64K documents): per mode (``fwd``,
    ``fwd_bwd``) the lowest ratio of the **merged** server path (one KV buffer per (server, document)) in
    each document's latest measurement, with ``before``: the same figure for the kernel on per-shard KV
    copies as first measured and, in the note, the range of the earlier merged measurements.
    Dicts with ``setting``, ``ours``, ``before``, ``holds``, ``how``, ``note`` and ``kind``; ``[]``
    without merged measurements."""
    out = []
    for mode in ("fwd", "fwd_bwd"):
        ba = composability_before_after(rows, "fa4", mode)
        ba = ba[ba.shard >= COMPOSABILITY_MIN_SHARD]
        merged, before = ba[ba.kv_share == "merged"], ba[ba.kv_share == "kernel"]
        if merged.empty:
            continue
        newest = merged.groupby("doc").date.transform("max")
        after, earlier = merged[merged.date == newest], merged[merged.date != newest]
        worst = after.loc[after.ratio.idxmin()]
        ours = round(float(worst.ratio), 3)
        prev = round(float(before.ratio.min()), 3) if len(before) else None
        how = (f"lowest {'forward' if mode == 'fwd' else 'forward+backward'} TF/s over the unsplit "
               f"document's, shards >= {COMPOSABILITY_MIN_SHARD} tokens, 16K and 64K documents, FA4, the "
               f"attention server's fused call with one KV buffer per (server, document), each document's "
               f"latest measurement (commits {', '.join(sorted(after.commit.unique()))}); "
               f"holds at >= {NEAR_PEAK:g}")
        note = (f"before (one KV copy per shard, kernel alone, commit {before.commit.iloc[0]}): {prev:.3f}"
                if prev is not None else "before: not measured")
        if len(earlier):
            note += (f"; earlier merged runs ({', '.join(sorted(earlier.commit.unique()))}, the unsplit "
                     f"reference timed once): {earlier.ratio.min():.3f}-{earlier.ratio.max():.3f}")
        if mode == "fwd_bwd":
            parts = []
            for doc, g in composability_targets(rows).groupby("doc"):
                last = g[g.latest].iloc[0]
                part = (f"{doc // 1024}K {last.fwd_bwd:.2f} ({'met' if last.meets else 'missed'}; "
                        f"{last.reference} reference)")
                if len(g) > 1:
                    part += f", earlier {g[~g.latest].fwd_bwd.min():.2f}-{g[~g.latest].fwd_bwd.max():.2f}"
                parts.append(part)
            if parts:
                note += (f"; the target fwd+bwd >= {COMPOSABILITY_TARGET:g} at 512-token shards: "
                         + ", ".join(parts))
            note += (f"; worst point {int(worst.doc) // 1024}K document, {int(worst.shard)}-token shards "
                     f"(commit {worst.commit})")
        out.append({"setting": mode, "ours": ours, "before": prev, "holds": ours >= NEAR_PEAK, "how": how,
                    "note": note, "kind": f"measured on {worst.device} (committed results)"})
    return out


def record_composability(rows):
    """Record :func:`composability_ours` (``distca.composability@fwd`` and ``@fwd_bwd``); returns the
    table (empty without merged measurements)."""
    out = [claims.record("distca.composability", r["ours"], setting=r["setting"], holds=r["holds"],
                         kind=r["kind"], how=r["how"], note=r["note"]) for r in composability_ours(rows)]
    return pd.concat(out, ignore_index=True) if out else metrics.metrics_frame([])


def composability_figure(rows, latest: bool = False):
    """Forward+backward TF/s over the unsplit document's by query shard, every measured series (the
    kernel on per-shard KV copies as first measured, and each run of the merged server path), 16K and
    64K documents side by side, with the target line. ``latest``: of the merged path, each document's
    latest run only (what the lesson shows)."""
    import plotly.express as px

    ba = composability_before_after(rows)
    if latest:
        merged = ba.kv_share == "merged"
        newest = ba[merged].groupby("doc").date.transform("max")
        ba = ba[~merged | ba.date.eq(newest.reindex(ba.index))]
    ba["document"] = (ba.doc // 1024).astype(str) + "K document"
    fig = px.line(ba, x="shard", y="ratio", color="series", line_dash="stage", facet_col="document",
                  markers=True, log_x=True, category_orders={"stage": ["after", "before"]},
                  labels={"shard": "query shard (tokens)", "ratio": "fwd+bwd TF/s ÷ unsplit document"},
                  title=f"Composability on {ba.device.iloc[0]}, FA4, forward+backward: "
                        + ("before and after KV sharing" if latest else "every measurement"))
    fig.add_hline(y=COMPOSABILITY_TARGET, line_dash="dot", line_color="gray",
                  annotation_text=f"target {COMPOSABILITY_TARGET}")
    fig.for_each_annotation(lambda a: a.update(text=a.text.split("=")[-1]))
    fig.for_each_trace(lambda t: t.update(name=t.name.rsplit(", ", 1)[0]))      # the stage is in the name
    fig.update_layout(height=460, legend=dict(orientation="h", y=-0.25, title=None))
    return fig


def composability_section(results_dir=None) -> Section | None:
    rows = server_bench.composability(results_dir)
    if rows.empty:
        return None
    t = composability_targets(rows)
    return {"id": "composability", "title": "Composability: every measurement",
            "text": ("One H200, FA4, bf16, llama3-8b heads (scripts/bench/bench_attention_server.py --part "
                     "composability). Dashed: a KV copy per shard (the kernel alone as first measured, and "
                     "the server path at the KV-sharing commit); solid: the merged server path, one KV "
                     "buffer "
                     "per (server, document), once per run. The same unsplit call measured 556-653 TF/s "
                     "across "
                     "runs, so a reference timed once moves a ratio by several percent; the latest run times "
                     "it before and after the cases."),
            "figures": [("Every committed composability measurement; the lesson (notebook 2.2) shows the "
                         "latest run only.", composability_figure(rows).to_plotly_json())],
            "tables": [("512-token shards, per document and run: forward+backward and forward ratios, the "
                        "per-shard-copy kernel's before, the target.",
                        t.drop(columns=["file"]).round(3))]}


# ---------------------------------------------------------------------------------------------------
# The attention server, the cost model, the end-to-end runs
# ---------------------------------------------------------------------------------------------------

def server_overhead_section(results_dir=None) -> Section | None:
    over = server_bench.server_overhead_summary(server_bench.server_overhead(results_dir))
    if over.empty:
        return None
    cols = [c for c in ("case", "backend", "raw_fwd_tflops", "step_fwd_tflops", "raw_fwd_bwd_tflops",
                        "step_fwd_bwd_tflops", "overhead_fwd", "overhead_fwd_bwd") if c in over]
    return {"id": "server-overhead", "title": "The whole CAD attention step against its fused kernel",
            "text": ("2x H200 (scripts/bench/bench_attention_server.py): metadata, all-to-alls, the fused kernel "
                     "and "
                     "the return, against the fused kernel alone on the same tasks; the lowest TF/s over the "
                     "ranks, and the step's extra time over its kernel (worst rank)."),
            "figures": [], "tables": [("Per case.", over[cols].round(3))]}


def cost_model_section(results_dir=None) -> Section | None:
    path = _dir(results_dir) / COST_MODEL_CHECK
    if not path.exists():
        return None
    res = load_result(path)["results"]
    cm = pd.DataFrame(res["summary"]).set_index("setting")
    cols = [c for c in ("batches", "measured_imbalance_mean", "mae_imbalance_pairs", "mae_imbalance_model",
                        "speedup_err_default_mean", "speedup_err_model_mean", "speedup_err_model_max")
            if c in cm]
    text = ("scripts/analyses/cost_model_check.py rebuilds every batch of the committed 2x H200 end-to-end "
            "runs as cadlib.train did and compares CAD's measured attention imbalance over the ranks with "
            "what "
            "the pair-count model (what the scheduler balances) and the kernel latency table predict, and "
            "the "
            "measured speedup of CAD with ping-pong with the calibrated prediction (target: within 10%).")
    fit = res.get("server_overhead_fit")
    if fit:
        text += (f" Both models under-price the server that sent rows away: it gathers the rest out of its "
                 f"buffers. Fitting {fit['ns_per_q_row']:.0f} ns per gathered query row and "
                 f"{fit['ns_per_kv_row']:.0f} ns per gathered KV row (per layer, forward and backward) takes "
                 f"the per-rank error from {fit['rms_ms_alone']:.1f} to {fit['rms_ms']:.1f} ms rms over "
                 f"{fit['points']} (batch, rank) pairs.")
    return {"id": "cost-model", "title": "The cost models against the end-to-end runs", "text": text,
            "figures": [], "tables": [("Per setting: mean absolute error of the predicted imbalance (pairs, "
                                       "kernel table) and relative error of the predicted speedup.",
                                       cm[cols].round(4))]}


def e2e_section(results_dir=None) -> Section | None:
    loaded = e2e.load_committed(results_dir=results_dir)
    if not loaded:
        return None
    table = e2e.settings_table(loaded).set_index("setting")
    order = ([x["setting"] for x in loaded if not x["variant"]]
             + [x["setting"] for x in loaded if x["variant"]])
    show = [c for c in ("mean speedup wlb", "mean speedup cad", "mean speedup cad-pingpong",
                        "min speedup cad-pingpong", "mean cad-pingpong over wlb", "max slowdown cad-pingpong",
                        "mean exposed_comm_frac", "max exposed_comm_frac", "mean pingpong_gain",
                        "peak GiB colocated", "peak GiB cad-pingpong", "peak GiB wlb") if c in table]
    rec = []
    for x in loaded:
        for b in x["results"]["per_batch"]:
            if b.get("saving_frac", 0) >= e2e.SAVING_THRESHOLD and "recovered" in b:
                rec.append({"setting": x["setting"], "batch": b["batch"], "saving": b["saving_frac"],
                            "recovered": b["recovered"],
                            "speedup cad-pingpong": b.get("speedup cad-pingpong")})
    tables = [("Every committed setting, the defaults first, then the same batches at other knobs "
               "(tolerance 0.05, NCCL's own thread blocks).", table.loc[order, show].T.round(3))]
    if rec:
        tables.append((f"The batches where perfect balance would save at least {e2e.SAVING_THRESHOLD:.0%} of "
                       "colocated's step: the saving, and how much of it CAD with ping-pong recovers "
                       "(target 80%).",
                       pd.DataFrame(rec).round(3)))
    return {"id": "e2e", "title": "End to end on 2x H200: every setting and variant",
            "text": ("scripts/bench/bench_e2e.py: llama3-8b dimensions with 4 layers, bf16, MLP recomputation, "
                     "FA4, "
                     "10 sampled batches per setting, the same batches for every method. results/README.md "
                     "says what each file measured."), "figures": [], "tables": tables}


def overlap_section(results_dir=None) -> Section | None:
    loaded = [x for x in e2e.load_committed(results_dir=results_dir) if not x["variant"]]
    if not loaded:
        return None
    frames, stages = [], []
    for x in loaded:
        tf = timelines.timeline_frame(x["results"]["timelines"])
        ov = timelines.overlap_table(tf, names(cad=True))
        frames.append(ov.assign(setting=x["setting"]))
        for r, rows in tf[tf.method == "cad-pingpong"].groupby("rank"):
            stages.append(timelines.exposed_by_stage(rows).head(3).assign(setting=x["setting"], rank=r))
    ov = pd.concat(frames, ignore_index=True).pivot_table(index=["setting", "rank"],
                                                          columns=["direction", "method"],
                                                          values="overlap_ratio")
    top = pd.concat(stages, ignore_index=True).set_index(["setting", "rank", "phase"])
    return {"id": "overlap", "title": "Ping-pong's overlap in every committed setting",
            "text": ("The share of each rank's communication time during which compute also ran, per pass, "
                     "and where the rest waited: B's exchanges overlap only A's attention (tick 2), so on "
                     "the "
                     "rank whose attention CAD made lighter they can outlast it. A comm span also counts the "
                     "wait for the peer, so part of this is skew between the ranks."),
            "figures": [], "tables": [("Overlap ratio per setting, rank, pass and method.", ov.round(3)),
                                      ("The three most exposed stages of cad-pingpong per setting and rank "
                                       "(ms, "
                                       "summed over layers).",
                                       top[["spans", "comm_ms", "exposed_ms"]].round(1))]}


def sections(results_dir: str | os.PathLike | None = None) -> list[Section]:
    """Every evidence section whose committed files are there, in the order of the lessons."""
    out = []
    for make in (composability_section, server_overhead_section, cost_model_section, e2e_section,
                 overlap_section):
        s = make(results_dir)
        if s is not None:
            out.append(s)
    return out

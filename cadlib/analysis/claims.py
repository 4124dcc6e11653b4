"""Checking the papers' claims: ours against the registry (:data:`cadlib.core.paper.CLAIMS`), with a verdict.

* :func:`verdict` says whether our figure lies in the paper's range, or by how much it misses, with
  the reason where we know it.
* :func:`record` is what a notebook's claim cell calls: it records ours against the claim's id
  through :func:`cadlib.analysis.report.record` (with the paper's figure, unit, kind, how and the verdict) and
  returns the one-row table.
* :func:`e2e_ours` reads the committed end-to-end measurements (``results/bench_e2e_*.json``) into
  ours for the end-to-end claims (speedup per setting, the ping-pong gain, the exposed communication);
  :func:`record_e2e` records them from a notebook cell.
* :func:`claims_table` is the report's closing table: one row per claim (one per measured setting
  where there are several), filled from the metrics a run recorded, then from the committed
  end-to-end results, and otherwise saying that the claim was not run in this profile.
"""
from __future__ import annotations

import math
import os
import pathlib

from ..core.paper import CLAIMS, Claim, claim
from ..infra.results import RESULTS_DIR, find_results, load_result
from . import report
from .e2e import file_variant
from .server_bench import COMPOSABILITY_TARGET, composability_before_after, composability_targets

E2E_PATTERN = "bench_e2e_*.json"
E2E_NOTEBOOK = "04_benchmarks/01_end_to_end.ipynb"
"""Where the measured claims without an end-to-end claim of their own are recorded."""
E2E_CLAIMS = ("distca.speedup_3d_pretrain", "distca.speedup_3d_prolong", "distca.pingpong_gain",
              "distca.comm_hidden", "distca.memory_divergence")
"""The claims :func:`e2e_ours` fills from the end-to-end measurements."""
CLOSE = 0.10
"""A point figure (no range) counts as matched when ours is within this relative distance of it."""
TABLE_COLUMNS = ["claim", "paper", "ours", "kind", "verdict", "notebook", "source"]


def metric_id(claim_id: str, setting: str = "") -> str:
    """The metric id ours is recorded under: the claim's id, ``@setting`` when one is given."""
    claim(claim_id)
    if setting and ("@" in setting or not setting.strip()):
        raise ValueError(f"setting must be a non-empty label without '@', got {setting!r}")
    return f"{claim_id}@{setting}" if setting else claim_id


def _num(x) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def verdict(c: Claim | str, ours, reason: str = "", holds: bool | None = None) -> str:
    """``within the paper's range``, ``matches the paper (within 10%)``, ``above/below the paper's
    range by D`` or, for a qualitative claim, ``holds`` / ``does not hold`` (from ``holds``, or ``ours``
    when it is a bool); then the ``reason`` where one is given. ``ours`` None: ``not run``."""
    c = claim(c) if isinstance(c, str) else c
    tail = f"; {reason}" if reason else ""
    if ours is None:
        return "not run" + tail
    if holds is None and isinstance(ours, bool):
        holds = ours
    if holds is not None:
        return ("holds" if holds else "does not hold") + tail
    if c.paper is None or isinstance(ours, str):
        return "no paper figure to compare" + tail
    if not isinstance(ours, (int, float)) or not math.isfinite(ours):
        raise ValueError(f"ours for {c.id} must be a finite number, got {ours!r}")
    lo, hi = c.low, c.high
    unit = " points" if c.unit == "%" else c.unit
    if not isinstance(c.paper, tuple):
        if ours == c.paper:
            return "matches the paper" + tail
        if abs(ours - c.paper) <= CLOSE * abs(c.paper):
            return f"matches the paper (within {CLOSE:.0%})" + tail
        d = ours - c.paper
        return f"{'above' if d > 0 else 'below'} the paper by {abs(d):.3g}{unit}" + tail
    if (lo is None or ours >= lo) and (hi is None or ours <= hi):
        return "within the paper's range" + tail
    if lo is not None and ours < lo:
        return f"below the paper's range by {lo - ours:.3g}{unit}" + tail
    return f"above the paper's range by {ours - hi:.3g}{unit}" + tail


def record(claim_id: str, ours, *, how: str, kind: str | None = None, reason: str = "", note: str = "",
           setting: str = "", holds: bool | None = None):
    """Record ours against claim ``claim_id`` (see :func:`cadlib.analysis.report.record`) with its verdict;
    returns the one-row table. ``kind`` defaults to the claim's (``measured`` is labelled with this
    machine's device); ``reason``: why ours differs, where known; ``note``: anything else;
    ``setting``: a short label when one claim is checked in several settings (the metric is then
    ``<claim_id>@<setting>``, one row each); ``holds``: for a qualitative claim, whether ours bears
    it out (see :func:`verdict`)."""
    c = claim(claim_id)
    paper = c.paper if c.paper is None or not isinstance(c.paper, tuple) else list(c.paper)
    return report.record(metric_id(c.id, setting), ours, paper=paper, unit=c.unit, kind=kind or c.kind,
                         how=how,
                         note=note,
                         verdict=verdict(c, ours, reason, holds), source=c.source)


# ---------------------------------------------------------------------------------------------------
# End-to-end measurements
# ---------------------------------------------------------------------------------------------------

_REASON_SPEEDUP = ("2 GPUs (DP=2) against the paper's 64-512: the straggler idle CAD removes grows with DP "
                   "(distca.idle_dp4/dp8) and is a few percent at DP=2, less than CAD's extra work costs")
_REASON_PINGPONG = ("on 2 GPUs there is little communication for ping-pong to hide (over NVLink about 1% "
                    "of the step, over the inter-node-like link about 4%), while splitting into two "
                    "nano-batches costs kernel efficiency")


def e2e_ours(results_dir: str | os.PathLike | None = None) -> list[dict]:
    """Ours for the end-to-end claims from every committed ``bench_e2e_*.json`` under ``results_dir``
    (default: the repository's ``results/``): one dict per (claim, file) with ``claim``, ``ours``,
    ``kind`` (``measured on <device>``), ``how``, ``reason``, ``verdict`` and ``file``.

    * ``distca.speedup_3d_<dist>``: per batch, the best baseline's step (the lower of ``colocated`` and
      ``wlb``) over CAD's with ping-pong, averaged over batches;
    * ``distca.pingpong_gain``: ``(mean step_cad / step_cad-pingpong - 1)`` in percent;
    * ``distca.comm_hidden``: ``mean (step_cad-pingpong - step_signal-only) / step_cad-pingpong`` in percent;
    * ``distca.memory_divergence`` (files with ``wlb``): the worst batch's peak memory max/mean over ranks
      under WLB-ideal's variable-length packing (recorded by the end-to-end notebook).
    """
    rows = []
    for path in find_results(E2E_PATTERN, results_dir):
        res = load_result(path)
        cfg, summ = res.get("config", {}), res.get("results", {}).get("summary", {})
        per_batch = res.get("results", {}).get("per_batch", [])
        device = res.get("meta", {}).get("device") or res.get("results", {}).get("device_name") or "a GPU"
        dist = cfg.get("dist")
        setting = (f"{cfg.get('model')} ({cfg.get('layers')} layers), {cfg.get('nproc')} GPUs, "
                   f"{int(cfg.get('tokens_per_rank', 0)) // 1024}K tokens/GPU, {dist}, "
                   f"{len(per_batch)} batches")
        name = pathlib.Path(path).name
        link = cfg.get("link", "nvlink")
        setting += f", {link} link"
        label = f"{dist}_{int(cfg.get('tokens_per_rank', 0)) // 1024}k_{cfg.get('nproc')}gpu_{link}"
        stem = pathlib.Path(path).stem
        variant = file_variant(stem, link)                   # _eps0.05, _ncclctas, _wholedocs
        if variant:
            label += variant                  # a variant's claim must not replace the default run's
            setting += f" ({variant.lstrip('_')})"
        kind = f"measured on {device}"

        def add(cid, ours, how, reason=""):
            rows.append({"claim": cid, "setting": label, "ours": ours, "kind": kind,
                         "how": f"{how}; {setting}; results/{name}",
                         "reason": reason, "verdict": verdict(cid, ours, reason), "file": str(path)})

        steps = [(b.get("step_ms colocated"), b.get("step_ms wlb"), b.get("step_ms cad-pingpong"))
                 for b in per_batch]
        steps = [s for s in steps if s[2] and (s[0] or s[1])]
        cid = f"distca.speedup_3d_{dist}"
        if steps and cid in CLAIMS:
            best = [min(x for x in s[:2] if x) / s[2] for s in steps]
            ours = float(sum(best) / len(best))
            if not any(s[1] for s in steps):
                setting += " (WLB-ideal not run in this setting: colocated is the baseline)"
            pred = summ.get("mean_predicted_speedup")
            reason = _REASON_SPEEDUP + (f"; the calibrated straggler model predicted {pred:.3f}x over "
                                        "colocated for these batches" if pred is not None else "")
            add(cid, round(ours, 4), "mean over batches of the best baseline's step (colocated or WLB-style "
                "packing) / CAD with ping-pong", reason if not CLAIMS[cid].low <= ours else "")
        if summ.get("mean_pingpong_gain") is not None:
            ours = 100 * (float(summ["mean_pingpong_gain"]) - 1)
            c = CLAIMS["distca.pingpong_gain"]
            add(c.id, round(ours, 2), "step without ping-pong / with, minus 1 (mean over batches)",
                _REASON_PINGPONG if ours < c.low else "")
        if summ.get("mean_exposed_comm_frac") is not None:
            ours = 100 * float(summ["mean_exposed_comm_frac"])
            add("distca.comm_hidden", round(ours, 2), "(CAD ping-pong step - signal-only step) / CAD step, "
                "mean over batches")
        div = _memory_divergence(res.get("results", {}).get("records", []), "wlb")
        if div is not None and "distca.memory_divergence" in CLAIMS:
            worst, median = div
            low = CLAIMS["distca.memory_divergence"].low
            uniform = "2048-token documents: every rank holds equal work, nothing to diverge"
            few = "2 ranks, 10 batches: how far memory diverges depends on the long documents a batch holds"
            reason = "" if worst >= low else uniform if dist == "uniform" else few
            how = ("WLB-ideal (balanced variable-length packing): peak memory max/mean over the ranks, the "
                   f"worst of the batches (median {median:.3f})")
            add("distca.memory_divergence", round(worst, 3), how, reason)
            rows[-1]["notebook"] = E2E_NOTEBOOK      # measured beside the simulated ones of 01_stragglers
    return rows


def _memory_divergence(records: list[dict], method: str) -> tuple[float, float] | None:
    """``(worst, median)`` over batches of ``max / mean`` peak memory across ranks for ``method``."""
    import statistics

    per: dict = {}
    for r in records:
        if r.get("method") == method and r.get("peak_mem_gib"):
            per.setdefault(r["batch"], []).append(float(r["peak_mem_gib"]))
    ratios = [max(v) / statistics.fmean(v) for v in per.values() if len(v) > 1]
    return (max(ratios), statistics.median(ratios)) if ratios else None


def record_e2e(results_dir: str | os.PathLike | None = None, notebook: str | None = None):
    """Record every row of :func:`e2e_ours` (a notebook cell's one call); returns them as a table.
    With ``notebook`` (e.g. ``"03_pingpong/01_overlap.ipynb"``), only the claims the registry assigns
    to that notebook, so that each claim is recorded once across the workbook."""
    import pandas as pd

    out = []
    for r in e2e_ours(results_dir):
        c = claim(r["claim"])
        if notebook is not None and r.get("notebook", c.notebook) != notebook:
            continue
        paper = c.paper if not isinstance(c.paper, tuple) else list(c.paper)
        out.append(report.record(metric_id(c.id, r["setting"]), r["ours"], paper=paper, unit=c.unit,
                                 kind=r["kind"], how=r["how"],
                                 verdict=r["verdict"], source=c.source))
    return pd.concat(out, ignore_index=True) if out else report.metrics_frame([])


# ---------------------------------------------------------------------------------------------------
# The report's closing table
# ---------------------------------------------------------------------------------------------------

def _ours_str(value, unit: str) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)):
        return f"{_num(float(value))}{unit}"
    return str(value)


def claims_table(metrics: list[dict], profile: str = "cpu",
                 results_dir: str | os.PathLike | None = None) -> list[dict]:
    """One row per claim of the registry (in its order) with :data:`TABLE_COLUMNS`.

    Ours comes from ``metrics`` (rows of :func:`cadlib.analysis.report.load_metrics` whose ``metric`` is a
    claim id; several rows of one claim, e.g. one per setting, give several table rows), else, for
    the end-to-end claims, from the committed results (:func:`e2e_ours`, labelled as such), else the
    row says the claim was not run in ``profile`` and where it is computed."""
    by_claim: dict[str, list[dict]] = {}
    for m in metrics:
        cid = str(m.get("metric", "")).split("@")[0]
        if cid in CLAIMS:
            by_claim.setdefault(cid, []).append(m)
    committed: dict[str, list[dict]] = {}
    for r in e2e_ours(results_dir):
        committed.setdefault(r["claim"], []).append(r)
    table = []
    for c in CLAIMS.values():
        base = {"claim": f"{c.id}: {c.claim}", "paper": c.paper_str(), "notebook": c.notebook,
                "source": f"{c.source}; {c.setting}; {c.verified}"}
        got = by_claim.get(c.id)
        if got:
            for m in got:
                ours, _, setting = str(m.get("metric")).partition("@")
                ours = m.get("ours")
                table.append({**base, "ours": _ours_str(ours, c.unit) + (f" ({setting})" if setting else ""),
                              "kind": m.get("kind", ""),
                              "verdict": m.get("verdict") or verdict(c, ours),
                              "notebook": m.get("notebook") or c.notebook})
        elif c.id in committed:
            for r in committed[c.id]:
                table.append({**base, "ours": f"{_ours_str(r['ours'], c.unit)} ({r['setting']})",
                              "kind": f"{r['kind']} (committed results/{pathlib.Path(r['file']).name}; "
                                      f"not run in profile {profile})", "verdict": r["verdict"]})
        else:
            if c.gap:
                why = f"not reproduced: {c.gap}"
            else:
                where = ("measured on GPUs (profile h200x2)" if c.kind == "measured" else
                         "its cell did not run")
                why = f"not run in profile {profile}: {where}"
            table.append({**base, "ours": "—", "kind": c.kind, "verdict": why})
    return [{k: row[k] for k in TABLE_COLUMNS} for row in table]


# ---------------------------------------------------------------------------------------------------
# Composability (02_cad/02_attention_servers) and the measured cost model (issue 10)
# ---------------------------------------------------------------------------------------------------

NEAR_PEAK = 0.85
"""``distca.composability``'s "near-peak throughput", read as at least this share of the unsplit
document's TF/s."""
COMPOSABILITY_MIN_SHARD = 128
"""The claim's smallest shard (tokens)."""


def composability_ours(rows) -> list[dict]:
    """Ours for ``distca.composability`` from :func:`cadlib.infra.results.composability`'s rows (FA4, every
    shard on the server, shards >= 128 tokens, 16K and 64K documents): per mode (``fwd``,
    ``fwd_bwd``) the lowest ratio of the **merged** server path (one KV buffer per (server, document),
    issue 10) in each document's latest measurement (the code as it is; since a90939d the unsplit
    reference is timed before and after the cases), with ``before``: the same figure for the kernel
    on per-shard KV copies as first measured (the lowest over the shards that fit in memory) and, in
    the note, the range of the earlier merged measurements.
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
               f"latest measurement (results.composability, kv_share merged; "
               f"commits {', '.join(sorted(after.commit.unique()))}); holds at >= {NEAR_PEAK:g}")
        note = (f"before (one KV copy per shard, kernel alone, commit {before.commit.iloc[0]}): {prev:.3f}"
                if prev is not None else "before: not measured")
        if len(earlier):
            note += (f"; earlier merged runs ({', '.join(sorted(earlier.commit.unique()))}, the unsplit "
                     f"reference timed once): {earlier.ratio.min():.3f}-{earlier.ratio.max():.3f}")
        if mode == "fwd_bwd":
            t = composability_targets(rows)
            parts = []
            for doc, g in t.groupby("doc"):
                last = g[g.latest].iloc[0]
                part = (f"{doc // 1024}K {last.fwd_bwd:.2f} ({'met' if last.meets else 'missed'}; "
                        f"{last.reference} reference)")
                if len(g) > 1:
                    part += f", earlier {g[~g.latest].fwd_bwd.min():.2f}-{g[~g.latest].fwd_bwd.max():.2f}"
                parts.append(part)
            if parts:
                note += (f"; issue 10's target, fwd+bwd >= {COMPOSABILITY_TARGET:g} at 512-token shards: "
                         + ", ".join(parts))
            note += (f"; worst point {int(worst.doc) // 1024}K document, {int(worst.shard)}-token shards "
                     f"(commit {worst.commit})")
        out.append({"setting": mode, "ours": ours, "before": prev, "holds": ours >= NEAR_PEAK, "how": how,
                    "note": note, "kind": f"measured on {worst.device} (committed results)"})
    return out


def record_composability(rows):
    """Record :func:`composability_ours` (``distca.composability@fwd`` and ``@fwd_bwd``); returns the
    table (empty without merged measurements)."""
    import pandas as pd

    out = [record("distca.composability", r["ours"], setting=r["setting"], holds=r["holds"], kind=r["kind"],
                  how=r["how"], note=r["note"]) for r in composability_ours(rows)]
    return pd.concat(out, ignore_index=True) if out else report.metrics_frame([])


COST_MODEL_CHECK = "cost_model_check.json"
"""``scripts/analyses/cost_model_check.py``'s committed output under ``results/``."""


def record_cost_model(results_dir: str | os.PathLike | None = None):
    """Record what the measured kernel cost model buys (``results/cost_model_check.json``, issue 10)
    as plain metrics (the papers make no such claim): ``cost_model.imbalance_mae_pairs`` and
    ``..._measured`` (mean over settings of the mean absolute error of the predicted attention
    imbalance of ``cad``'s plan against the measured one), ``cost_model.speedup_error_default`` and
    ``..._measured`` (the worst setting's mean relative error of the predicted ping-pong speedup).
    Returns the table; an empty one without the file."""
    import statistics

    import pandas as pd

    path = pathlib.Path(results_dir or RESULTS_DIR) / COST_MODEL_CHECK
    if not path.exists():
        return report.metrics_frame([])
    res = load_result(path)
    summ = res["results"]["summary"]
    kind = "measured on 2x H200 (committed end-to-end runs), modelled on CPU"
    src = f"results/{COST_MODEL_CHECK} ({len(summ)} settings)"
    out = []
    for key, label in (("pairs", "pair-count model (plan.imbalance)"), ("model", "measured kernel model")):
        v = statistics.fmean(s[f"mae_imbalance_{key}"] for s in summ)
        name = f"cost_model.imbalance_mae_{'measured' if key == 'model' else key}"
        out.append(report.record(name, round(v, 4), unit="", kind=kind,
                                 how=f"mean over settings of |predicted - measured| max/mean attention over "
                                 f"ranks, cad's plan, {label}; {src}"))
    for key, label in (("default", "pairs at colocated's measured s/FLOP"),
                       ("model", "measured kernel table")):
        vals = [s[f"speedup_err_{key}_mean"] for s in summ if f"speedup_err_{key}_mean" in s]
        if vals:
            name = f"cost_model.speedup_error_{'measured' if key == 'model' else key}"
            out.append(report.record(name, round(100 * max(vals), 2), unit="%", kind=kind,
                                     how=f"worst setting's mean |predicted - measured| / measured CAD "
                                     f"ping-pong speedup, {label}; target <= 10%; {src}"))
    return pd.concat(out, ignore_index=True)

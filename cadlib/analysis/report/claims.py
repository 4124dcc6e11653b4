"""Checking the papers' claims: ours against the registry (:data:`cadlib.core.paper.CLAIMS`), with a verdict.

* :func:`judge` puts ours beside the paper's figure in a fixed vocabulary (:data:`VERDICTS`: holds,
  within, below, above, not reproduced) with what tells them apart (by how much, or why);
  :func:`verdict` writes that as one line, ``"below: 0.06x under 1.07x; 2 GPUs, not 64-512"``.
* :func:`record` is what a notebook's claims call runs for each of ours: it records ours against the
  claim's id through :func:`cadlib.analysis.report.metrics.record` (with the paper's figure, unit, kind, how
  and the verdict) and returns the one-row table.
* :func:`e2e_ours` reads the committed end-to-end measurements (``results/bench_e2e_*.json``) into
  ours for the end-to-end claims; :func:`record_e2e` records them from a notebook cell.
* :func:`claims_table` is the report's claims table: **one row per claim**. Ours is the setting
  closest to the paper's (:data:`CLOSEST`, or the row a notebook marked ``primary``); the other
  settings are folded into a range, and control runs (documents with nothing to balance, runs at
  other knobs than the defaults) are left out of both (they stay in the metrics table). Its
  ``verdict`` answers the question (:data:`cadlib.analysis.report.verdicts.ANSWERS`: reproduced,
  partly, not at this scale, not reproduced), ``direction`` keeps the comparison and ``why`` starts
  with it.
"""
from __future__ import annotations

import math
import os
import pathlib
import re
import statistics

from ...core.paper import CLAIMS, Claim, claim
from ...infra.results import find_results, load_result
from ..runs.e2e import file_variant
from . import metrics
from .verdicts import DIRECTIONS, answer

E2E_PATTERN = "bench_e2e_*.json"
E2E_NOTEBOOK = "04_benchmarks/01_end_to_end.ipynb"
"""Where the measured claims without an end-to-end claim of their own are recorded."""
E2E_CLAIMS = ("distca.speedup_3d_pretrain", "distca.speedup_3d_prolong", "distca.pingpong_gain",
              "distca.comm_hidden", "distca.memory_divergence")
"""The claims :func:`e2e_ours` fills from the end-to-end measurements."""
CLOSE = 0.10
"""A point figure (no range) counts as ``within`` when ours is within this relative distance of it."""
VERDICTS = DIRECTIONS
"""The only words a recorded verdict (a comparison; the claims table turns it into an answer) starts with: a qualitative claim ``holds`` (or is ``not reproduced``); a
figure is ``within`` the paper's range (or 10% of its point), ``below`` or ``above`` it; a claim this
workbook cannot check, or did not run, is ``not reproduced``."""
TABLE_COLUMNS = ["claim", "statement", "paper", "ours", "other settings", "verdict", "why", "kind",
                 "notebook", "source", "value", "direction"]
"""The claims table's columns; ``value`` is ours as a number (None where it is not one), for figures;
``verdict`` the answer, ``direction`` the comparison it came from (:data:`VERDICTS`)."""
CLOSEST: dict[str, tuple[str, ...]] = {
    "distca.idle_dp4": ("h200-replay",),
    "distca.idle_dp8": ("h200-replay",),
    "distca.speedup_3d_pretrain": ("128k_2gpu_nvlink",),
    "distca.speedup_3d_prolong": ("128k_2gpu_nvlink",),
    "distca.pingpong_gain": ("inter-node-like",),
    "distca.comm_hidden": ("inter-node-like",),
    "distca.memory_divergence": ("dp8",),
    "distca.composability": ("fwd_bwd",),
    "distca.scheduler_bytes": ("vs_equal_flops",),
}
"""Per claim, the setting labels (substrings, in order of preference) closest to the paper's: the replay
with measured kernel times for the idle shares (the simulator's rates are a model), the longest
context for the speedups (the paper trains at up to 512K), the inter-node-like link for what hides
communication (the paper runs on several nodes), the largest DP for memory divergence, forward+backward
for composability (training runs both), bytes-blind balancing as the paper's baseline."""
_VARIANT = re.compile(r"_(eps[0-9.]+|ncclctas|wholedocs)$")


def metric_id(claim_id: str, setting: str = "") -> str:
    """The metric id ours is recorded under: the claim's id, ``@setting`` when one is given."""
    claim(claim_id)
    if setting and ("@" in setting or not setting.strip()):
        raise ValueError(f"setting must be a non-empty label without '@', got {setting!r}")
    return f"{claim_id}@{setting}" if setting else claim_id


def _num(x) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def judge(c: Claim | str, ours, holds: bool | None = None) -> tuple[str, str]:
    """``(verdict, detail)``: the verdict one of :data:`VERDICTS`; ``detail`` by how much ours misses a
    figure (``"16.5 points over 19%"``), or what made the claim not reproduced (``"not run"``, ``"no
    paper figure to compare"``). ``ours`` None: not run. ``holds`` (or a bool ``ours``) judges a
    qualitative claim."""
    c = claim(c) if isinstance(c, str) else c
    if ours is None:
        return "not reproduced", "not run"
    if holds is None and isinstance(ours, bool):
        holds = ours
    if holds is not None:
        return ("holds", "") if holds else ("not reproduced", "ours does not bear it out")
    if c.paper is None or isinstance(ours, str):
        return "not reproduced", "no paper figure to compare"
    if not isinstance(ours, (int, float)) or not math.isfinite(ours):
        raise ValueError(f"ours for {c.id} must be a finite number, got {ours!r}")
    unit = " points" if c.unit == "%" else c.unit
    if not isinstance(c.paper, tuple):
        d = ours - c.paper
        if abs(d) <= CLOSE * abs(c.paper):
            return "within", "" if d == 0 else f"within {CLOSE:.0%} of {c.paper_str()}"
        side = "over" if d > 0 else "under"
        return ("above" if d > 0 else "below"), f"{abs(d):.3g}{unit} {side} {c.paper_str()}"
    lo, hi = c.low, c.high
    if (lo is None or ours >= lo) and (hi is None or ours <= hi):
        return "within", ""
    if lo is not None and ours < lo:
        return "below", f"{lo - ours:.3g}{unit} under {_num(lo)}{c.unit}"
    return "above", f"{ours - hi:.3g}{unit} over {_num(hi)}{c.unit}"


def verdict(c: Claim | str, ours, reason: str = "", holds: bool | None = None) -> str:
    """:func:`judge` as one line: the verdict, then ``": "`` and the detail and ``reason`` where there
    are any: ``"within"``, ``"above: 16.5 points over 19%; the paper's batch is not public"``."""
    word, detail = judge(c, ours, holds)
    why = "; ".join(s for s in (detail, reason) if s)
    return f"{word}: {why}" if why else word


def split_verdict(text: str) -> tuple[str, str]:
    """``(verdict, why)`` of a :func:`verdict` line."""
    word, _, why = str(text).partition(": ")
    if word not in VERDICTS:
        raise ValueError(f"a verdict starts with one of {', '.join(VERDICTS)}, got {text!r}")
    return word, why


def record(claim_id: str, ours, *, how: str, kind: str | None = None, reason: str = "", note: str = "",
           setting: str = "", holds: bool | None = None, primary: bool = False, control: bool = False):
    """Record ours against claim ``claim_id`` (see :func:`cadlib.analysis.report.metrics.record`) with its verdict;
    returns the one-row table. ``kind`` defaults to the claim's (``measured`` is labelled with this
    machine's device); ``reason``: why ours differs, where known (one short line); ``note``: anything
    else; ``setting``: a short label when one claim is checked in several settings (the metric is then
    ``<claim_id>@<setting>``, one row each); ``holds``: for a qualitative claim, whether ours bears it
    out; ``primary``: this setting is the closest to the paper's (the claims table shows it as ours);
    ``control``: a control run, left out of the claims table's ours and range."""
    c = claim(claim_id)
    paper = c.paper if c.paper is None or not isinstance(c.paper, tuple) else list(c.paper)
    return metrics.record(metric_id(c.id, setting), ours, paper=paper, unit=c.unit, kind=kind or c.kind,
                         how=how, note=note, verdict=verdict(c, ours, reason, holds), source=c.source,
                         primary=primary, control=control)


NOT_MEASURED = "not measured yet"
"""Ours, written where a claim's measurement is not committed (never a placeholder number)."""


def record_not_measured(claim_id: str, why: str, *, how: str, kind: str, note: str = ""):
    """Record that claim ``claim_id``'s measurement is not committed yet: ours is :data:`NOT_MEASURED` and
    the verdict ``not reproduced: <why>`` (``why``: what it needs, e.g. the command that measures it, or
    the machine it needs). ``kind`` says how it would be obtained (``"measured on 1x H200, ..."``), so
    this machine's device is not written as if it had measured it."""
    c = claim(claim_id)
    if not why.strip():
        raise ValueError(f"why must say what {claim_id} needs to be measured, got {why!r}")
    paper = c.paper if c.paper is None or not isinstance(c.paper, tuple) else list(c.paper)
    return metrics.record(metric_id(c.id), NOT_MEASURED, paper=paper, unit=c.unit, kind=kind, how=how,
                          note=note, verdict=f"not reproduced: {why}", source=c.source)


# ---------------------------------------------------------------------------------------------------
# End-to-end measurements
# ---------------------------------------------------------------------------------------------------

_REASON_SPEEDUP = "2 GPUs (DP=2) against the paper's 64-512: little straggler idle for CAD to remove"
_REASON_PINGPONG = "2 GPUs: the all-to-alls are 1-4% of the step, so there is little to hide"


def e2e_ours(results_dir: str | os.PathLike | None = None) -> list[dict]:
    """Ours for the end-to-end claims from every committed ``bench_e2e_*.json`` under ``results_dir``
    (default: the repository's ``results/``): one dict per (claim, file) with ``claim``, ``setting``,
    ``ours``, ``kind`` (``measured on <device>``), ``how``, ``reason``, ``verdict``, ``control`` and
    ``file``. ``control``: uniform documents (nothing to balance) and files at other knobs than the
    defaults (a name such as ``_eps0.05``).

    * ``distca.speedup_3d_<dist>``: per batch, the best baseline's step (the lower of ``colocated`` and
      ``wlb``) over CAD's with ping-pong, averaged over batches;
    * ``distca.pingpong_gain``: ``(mean step_cad / step_cad-pingpong - 1)`` in percent;
    * ``distca.comm_hidden``: ``mean (step_cad-pingpong - step_signal-only) / step_cad-pingpong`` in percent;
    * ``distca.memory_divergence`` (files with ``wlb``): the worst batch's peak memory max/mean over ranks
      under WLB-ideal's variable-length packing.
    """
    rows = []
    for path in find_results(E2E_PATTERN, results_dir):
        res = load_result(path)
        cfg, summ = res.get("config", {}), res.get("results", {}).get("summary", {})
        per_batch = res.get("results", {}).get("per_batch", [])
        device = res.get("meta", {}).get("device") or res.get("results", {}).get("device_name") or "a GPU"
        dist, link = cfg.get("dist"), cfg.get("link", "nvlink")
        k = int(cfg.get("tokens_per_rank", 0)) // 1024
        setting = (f"{cfg.get('model')} ({cfg.get('layers')} layers), {cfg.get('nproc')} GPUs, "
                   f"{k}K tokens/GPU, "
                   f"{dist}, {len(per_batch)} batches, {link} link")
        name = pathlib.Path(path).name
        label = f"{dist}_{k}k_{cfg.get('nproc')}gpu_{link}"
        variant = file_variant(pathlib.Path(path).stem, link)            # _eps0.05, _ncclctas, _wholedocs
        if variant:
            label += variant                  # a variant's claim must not replace the default run's
            setting += f" ({variant.lstrip('_')})"
        control = bool(variant) or dist == "uniform"
        kind = f"measured on {device}"

        def add(cid, ours, how, reason=""):
            rows.append({"claim": cid, "setting": label, "ours": ours, "kind": kind,
                         "how": f"{how}; {setting}; results/{name}", "reason": reason,
                         "verdict": verdict(cid, ours, reason), "control": control, "file": str(path)})

        steps = [(b.get("step_ms colocated"), b.get("step_ms wlb"), b.get("step_ms cad-pingpong"))
                 for b in per_batch]
        steps = [s for s in steps if s[2] and (s[0] or s[1])]
        cid = f"distca.speedup_3d_{dist}"
        if steps and cid in CLAIMS:
            best = [min(x for x in s[:2] if x) / s[2] for s in steps]
            ours = float(sum(best) / len(best))
            if not any(s[1] for s in steps):
                setting += " (WLB-ideal not run in this setting: colocated is the baseline)"
            add(cid, round(ours, 4), "mean over batches of the best baseline's step (colocated or WLB-style "
                "packing) / CAD with ping-pong", _REASON_SPEEDUP if ours < CLAIMS[cid].low else "")
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
            reason = "" if worst >= low else ("2048-token documents: nothing to diverge" if dist == "uniform"
                                              else "2 ranks, 10 batches: few long documents to diverge on")
            how = ("WLB-ideal (balanced variable-length packing): peak memory max/mean over the ranks, the "
                   f"worst of the batches (median {median:.3f})")
            add("distca.memory_divergence", round(worst, 3), how, reason)
            rows[-1]["notebook"] = E2E_NOTEBOOK      # measured beside the simulated ones of 01_stragglers
    return rows


def _memory_divergence(records: list[dict], method: str) -> tuple[float, float] | None:
    """``(worst, median)`` over batches of ``max / mean`` peak memory across ranks for ``method``."""
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
        out.append(metrics.record(metric_id(c.id, r["setting"]), r["ours"], paper=paper, unit=c.unit,
                                 kind=r["kind"], how=r["how"], verdict=r["verdict"], source=c.source,
                                 control=r["control"]))
    return pd.concat(out, ignore_index=True) if out else metrics.metrics_frame([])


# ---------------------------------------------------------------------------------------------------
# The report's claims table: one row per claim
# ---------------------------------------------------------------------------------------------------

def _ours_str(value, unit: str) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)):
        return f"{_num(float(value))}{unit}"
    return str(value)


def is_control(row: dict) -> bool:
    """A control run: marked so when recorded, or (rows recorded before the mark) a setting of uniform
    documents or of other knobs than the defaults."""
    if "control" in row:
        return bool(row["control"])
    setting = str(row.get("setting") or str(row.get("metric", "")).partition("@")[2])
    return setting.startswith("uniform") or bool(_VARIANT.search(setting))


def pick(claim_id: str, rows: list[dict]) -> tuple[dict | None, list[dict], list[dict]]:
    """``(closest, others, controls)`` of one claim's rows (each with ``setting`` and ``ours``): the row
    closest to the paper's setting (marked ``primary``, else the first matching :data:`CLOSEST`, else the
    first), the other settings, and the control runs."""
    controls = [r for r in rows if is_control(r)]
    rest = [r for r in rows if not is_control(r)]
    if not rest:
        return None, [], controls
    best = next((r for r in rest if r.get("primary")), None)
    for want in CLOSEST.get(claim_id, ()):
        best = best or next((r for r in rest if want in str(r.get("setting", ""))), None)
    best = best or rest[0]
    return best, [r for r in rest if r is not best], controls


def _range(others: list[dict], unit: str) -> str:
    nums = [r["ours"] for r in others if isinstance(r.get("ours"), (int, float))
            and not isinstance(r.get("ours"), bool)]
    if not others:
        return ""
    if len(others) <= 2 or len(nums) < len(others):
        return "; ".join(f"{_ours_str(r['ours'], unit)} ({r['setting']})" for r in others)
    lo, hi = min(nums), max(nums)
    span = _ours_str(float(lo), unit) if lo == hi else f"{_num(float(lo))}–{_ours_str(float(hi), unit)}"
    kinds = sorted({str(r.get("kind", "")).split(" ")[0] for r in others} - {""})
    return f"{span} over {len(others)} settings" + (f" ({' and '.join(kinds)})" if len(kinds) > 1 else "")


def claims_table(recorded: list[dict], profile: str = "cpu",
                 results_dir: str | os.PathLike | None = None) -> list[dict]:
    """One row per claim of the registry (in its order) with :data:`TABLE_COLUMNS`.

    Ours comes from ``recorded`` (rows of :func:`cadlib.analysis.report.metrics.load_metrics` whose ``metric`` is a
    claim id, ``@setting`` where one claim was checked in several settings), and, for the end-to-end
    claims a run did not record, from the committed results (:func:`e2e_ours`, labelled as such).
    Ours is the setting closest to the paper's (:func:`pick`); the other settings make the range; control
    runs are left out and counted. A claim nothing recorded is ``not reproduced``, saying why."""
    rows: dict[str, list[dict]] = {}
    for m in recorded:
        cid, _, setting = str(m.get("metric", "")).partition("@")
        if cid in CLAIMS:
            rows.setdefault(cid, []).append({**m, "setting": setting})
    committed: dict[str, list[dict]] = {}
    for r in e2e_ours(results_dir):
        committed.setdefault(r["claim"], []).append(
            {**r, "kind": f"{r['kind']} (committed results/{pathlib.Path(r['file']).name})"})
    table = []
    for c in CLAIMS.values():
        row = {"claim": c.id, "statement": c.claim, "paper": c.paper_str(), "notebook": c.notebook,
               "source": f"{c.source}; {c.setting}; {c.verified}", "other settings": ""}
        got = rows.get(c.id) or committed.get(c.id, [])
        best, others, controls = pick(c.id, got)
        if best is None:
            if c.gap:
                why = c.gap
            elif controls:
                why = "only control runs recorded"
            else:
                where = ("measured on GPUs (profile h200x2)" if c.kind == "measured"
                         else "its cell did not run")
                why = f"not run in profile {profile}: {where}"
            word, why = answer("not reproduced", why, c.id)
            table.append({**row, "ours": "—", "kind": c.kind, "verdict": word, "why": why,
                          "value": None, "direction": "not reproduced"})
            continue
        try:
            word, why = split_verdict(best.get("verdict") or "")
        except ValueError:                    # recorded before the fixed vocabulary: judged again
            word, why = split_verdict(verdict(c, best.get("ours"), holds=best.get("holds")))
        setting = f" ({best['setting']})" if best.get("setting") else ""
        value = best.get("ours")
        value = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        extra = f"{len(controls)} control run{'s' if len(controls) != 1 else ''} left out" if controls else ""
        others_text = "; ".join(s for s in (_range(others, c.unit), extra) if s)
        said, why = answer(word, why, c.id, value)
        table.append({**row, "ours": _ours_str(best.get("ours"), c.unit) + setting,
                      "other settings": others_text,
                      "kind": best.get("kind", c.kind), "verdict": said, "why": why,
                      "notebook": best.get("notebook") or c.notebook, "value": value, "direction": word})
    return [{k: r[k] for k in TABLE_COLUMNS} for r in table]

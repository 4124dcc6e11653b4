"""The 3D replay under the paper's protocol, and each of our own choices as a step from it.

* :func:`paper_speedups`: per Table 3 setting, CAD with ping-pong over WLB-ideal under the paper's
  protocol (``results/replay/replay_summary_paper.json``, FA2, the paper's kernel; ``_paper_fa4`` beside)
  with its standard error, beside the paper's range for the dataset;
* :func:`oracle_wlb`: one setting's speedup if WLB-ideal took the better of its two CP degrees batch by
  batch instead of one degree per setting (what the ``wlb_choice`` variant does, on the protocol's own
  timings);
* :func:`steps` and :func:`waterfall`: the variants of :data:`cadlib.analysis.replay.protocol.VARIANTS`
  from the fidelity replay (``results/replay/fidelity/replay_summary_fid.json``, written by
  ``bench_replay.py compose --suite paper3d,changes3d,waterfall3d --tag _fid``): switched one at a time
  and cumulatively, in the protocol's order, from the paper's protocol to our earlier replay;
  :func:`waterfall_figure` draws the cumulative steps.

The speedup is the mean WLB-ideal step over the mean CAD step (the paper's captions)::

    speedup = mean_b T_wlb(b) / mean_b T_cad(b)

A waterfall's step ``k`` is the speedup with variants ``1..k`` applied, its ``delta`` the change from step
``k-1``; the deltas add up to the whole difference between the protocol and the last step.
"""
from __future__ import annotations

import pathlib

import numpy as np
import pandas as pd

from ...core.paper import CLAIMS
from ...infra.results import RESULTS_DIR, load_result
from ..replay.protocol import VARIANTS

REPLAY_DIR = RESULTS_DIR / "replay"
FIDELITY_DIR = REPLAY_DIR / "fidelity"
FIDELITY_SUMMARY = "replay_summary_fid.json"
CAD = "cad-pingpong"
LABELS = {v.name: v.label for v in VARIANTS}
"""What each variant says, by name (:data:`cadlib.analysis.replay.protocol.VARIANTS`)."""
WHY = {v.name: v.why for v in VARIANTS}


def _summary(path: pathlib.Path) -> pd.DataFrame:
    return pd.DataFrame(load_result(path)["results"])


def paper_speedups(tag: str = "_paper", results_dir=None) -> pd.DataFrame:
    """Per setting of ``replay_summary<tag>.json``: dataset, MaxDocLen (K), DP, batches, WLB-ideal's CP
    degree, CAD with ping-pong over WLB-ideal and its standard error (``speedup_sem``), the paper's range
    for the dataset and whether the speedup lies inside it."""
    s = _summary(pathlib.Path(results_dir or REPLAY_DIR) / f"replay_summary{tag}.json")
    cad = s[s.method == CAD].set_index("setting")
    wlb = s[s.method == "wlb"].set_index("setting")
    out = pd.DataFrame({"dist": pd.Series(cad.index.str.split("_").str[1], index=cad.index),
                        "context_k": cad.max_doc_len // 1024, "dp": cad.dp, "batches": cad.batches,
                        "wlb_cp": wlb.wlb_cp.reindex(cad.index),
                        "speedup_over_wlb": cad.speedup_over_wlb,
                        "speedup_sem": cad.speedup_over_wlb_sem})
    lo_hi = {d: CLAIMS[f"distca.speedup_3d_{d}"].paper for d in ("pretrain", "prolong")}
    out["paper_low"] = out.dist.map(lambda d: lo_hi[d][0])
    out["paper_high"] = out.dist.map(lambda d: lo_hi[d][1])
    out["inside"] = (out.speedup_over_wlb >= out.paper_low) & (out.speedup_over_wlb <= out.paper_high)
    return out.reset_index().sort_values(["dist", "context_k", "dp"]).reset_index(drop=True)


def oracle_wlb(setting: str, tag: str = "_paper", results_dir=None) -> dict:
    """One setting of the protocol replay (``replay_<setting><tag>.json``): CAD with ping-pong over
    WLB-ideal as the protocol runs it (one CP degree per setting, the better mean of the two timed) and
    over an oracle WLB-ideal that takes the better of the two degrees in every batch:
    ``{"protocol", "oracle", "degrees", "batches"}``."""
    d = load_result(pathlib.Path(results_dir or REPLAY_DIR) / f"replay_{setting}{tag}.json")["results"]
    b = pd.DataFrame(d["per_batch"])
    per_cp = b[b.method.str.startswith("wlb/")].pivot(index="batch", columns="method", values="step_s")
    cad = b[b.method == CAD].set_index("batch").step_s.reindex(per_cp.index)
    protocol = float(per_cp.mean().min() / cad.mean())
    oracle = float(per_cp.min(axis=1).mean() / cad.mean())
    return {"protocol": protocol, "oracle": oracle,
            "degrees": sorted(int(c.split("/")[1]) for c in per_cp.columns), "batches": int(len(cad))}


def _split(rows: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """The fidelity summary's CAD rows as ``paper`` (no ``@``), ``one`` (one change at a time,
    ``<base>@<variant>``, :func:`cadlib.analysis.replay.protocol.one_change`) and ``cumulative``
    (``<base>@upto-<variant>``, :func:`~cadlib.analysis.replay.protocol.variant`)."""
    cad = rows[rows.method == CAD].copy()
    named = cad.setting.str.contains("@")
    paper = cad[~named].assign(base=lambda f: f.setting, variant="paper")
    var = cad[named].copy()
    var["base"] = var.setting.str.split("@").str[0]
    tail = var.setting.str.split("@").str[1]
    var["cumulative"] = tail.str.startswith("upto-")
    var["variant"] = tail.str.removeprefix("upto-")
    unknown = sorted(set(var.variant) - set(LABELS))
    if unknown:
        raise ValueError(f"unknown variants {unknown} in the fidelity summary; known: {', '.join(LABELS)}")
    return {"paper": paper, "one": var[~var.cumulative], "cumulative": var[var.cumulative]}


def fidelity_summary(results_dir=None) -> pd.DataFrame | None:
    """The fidelity replay's summary rows, None while it is not committed."""
    path = pathlib.Path(results_dir or FIDELITY_DIR) / FIDELITY_SUMMARY
    return _summary(path) if path.exists() else None


def steps(base: str, rows: pd.DataFrame, cumulative: bool = True) -> pd.DataFrame:
    """One base setting (``3d_pretrain_128k_dp32``) of the fidelity summary ``rows``: the paper's protocol
    then each variant (cumulatively, or one at a time), in :data:`VARIANTS`' order: ``variant``,
    ``label``, ``speedup`` (CAD with ping-pong over WLB-ideal), ``sem`` and ``delta`` (from the previous
    step when cumulative, from the protocol when one at a time)."""
    parts = _split(rows)
    p = parts["paper"][parts["paper"].base == base]
    if p.empty:
        raise ValueError(f"no protocol row for {base!r}; the summary has: "
                         f"{', '.join(sorted(parts['paper'].base.unique()))}")
    v = parts["cumulative" if cumulative else "one"]
    v = v[v.base == base].set_index("variant")
    out = [{"variant": "paper", "label": "the paper's protocol",
            "speedup": float(p.speedup_over_wlb.iloc[0]), "sem": float(p.speedup_over_wlb_sem.iloc[0])}]
    for var in VARIANTS:
        if var.name in v.index:
            r = v.loc[var.name]
            out.append({"variant": var.name, "label": var.label, "speedup": float(r.speedup_over_wlb),
                        "sem": float(r.get("speedup_over_wlb_sem", np.nan))})
    df = pd.DataFrame(out)
    ref = df.speedup.shift(1) if cumulative else df.speedup.iloc[0]
    df["delta"] = (df.speedup - ref).fillna(0.0)
    return df


def waterfall(base: str, results_dir=None) -> pd.DataFrame | None:
    """:func:`steps` (cumulative) of the committed fidelity replay; None while it is not committed."""
    rows = fidelity_summary(results_dir)
    return None if rows is None else steps(base, rows, cumulative=True)


def waterfall_figure(table: pd.DataFrame, title: str = ""):
    """A waterfall chart of :func:`steps` (cumulative): the protocol's speedup as the first bar, each
    variant's change, and the total (our earlier choices) as the last."""
    import plotly.graph_objects as go

    x = list(table.label) + ["all our choices"]
    y = [table.speedup.iloc[0]] + list(table.delta.iloc[1:]) + [0.0]
    fig = go.Figure(go.Waterfall(x=x, y=y, measure=["absolute"] + ["relative"] * (len(table) - 1) + ["total"],
                                 text=[f"{v:+.3f}" if i else f"{v:.3f}" for i, v in enumerate(y[:-1])]
                                 + [f"{table.speedup.iloc[-1]:.3f}"], textposition="outside"))
    fig.update_layout(title=title or "CAD (ping-pong) over WLB-ideal: the paper's protocol, then our choices",
                      yaxis_title="CAD over WLB-ideal", showlegend=False,
                      yaxis_range=[min(0.9, float(table.speedup.min()) - 0.05),
                                   float(table.speedup.max()) + 0.08])
    return fig

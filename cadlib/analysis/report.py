"""The reproduction report: metrics that notebook cells record, and figures that reach the reader.

* :func:`record` is what a notebook cell calls to put one of our figures beside the paper's. It
  returns a one-row table for display and, when ``$CADLIB_REPORT_DIR`` is set (``scripts/reproduce.py``
  sets it for every notebook it runs, with ``$CADLIB_NOTEBOOK``), appends the row as one JSON line to
  ``$CADLIB_REPORT_DIR/metrics.jsonl``. Run interactively, it only returns the table.
* Plotly figures live in executed notebooks as ``application/vnd.plotly.v1+json``, which static HTML
  cannot show: :mod:`cadlib.analysis.figures_html` renders them (re-exported here).
* :func:`write_report` writes ``report.md`` and a self-contained ``report.html`` that open with the
  answer: a headline block (:mod:`cadlib.analysis.headline`: a few rows and one figure), the claims
  table (one row per claim), then each notebook's summary and key figures with their captions (cells
  tagged ``figure`` or ``summary``), the evidence appendix (:mod:`cadlib.analysis.evidence`), every
  recorded metric (collapsed) and how the run went. plotly.js is packed into the page gzipped
  (:func:`plotlyjs_packed_tag`).
"""
from __future__ import annotations

import datetime as _dt
import html
import importlib.util
import json
import math
import numbers
import os
import pathlib
import re
from typing import Iterable

from ..infra.results import atomic_write_text, device_name
from .figures_html import PLOTLY_MIME as PLOTLY
from .figures_html import captioned_figures, figure_html, plotlyjs_packed_tag, summary_text
from .headline import headline_rows, hero_figure

METRICS_FILE = "metrics.jsonl"
KINDS = ("measured", "replayed", "simulated", "computed")
"""How ours was obtained: ``measured`` on a device, ``simulated`` from the cost model, or ``computed``
exactly (e.g. a FLOP count). A kind may say more after the word, e.g. ``"measured on 2x H200"``."""
METRIC_COLUMNS = ["metric", "paper", "ours", "unit", "kind", "source", "how", "note", "notebook"]
CLAIM_COLUMNS = ["claim", "paper", "ours", "other settings", "verdict", "why", "kind", "notebook"]
"""The columns the report shows of the claims table (:func:`cadlib.analysis.claims.claims_table`)."""
CLAIMS_INTRO = ("One row per headline claim of DistCA and LongCA-bench (registry: cadlib.core.paper.CLAIMS). "
                "Ours is the setting closest to the paper's, the other settings are folded into a range, and "
                "control runs are left out (every recorded value is in the metrics table at the end). "
                "Verdicts: holds, within, below, above, not reproduced; the next column says why in a line.")


# ---------------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------------

def _scalar(value, name: str):
    """A JSON-ready scalar: numbers (numpy too) as float/int, strings and bools as they are."""
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, bool) or isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value}")
        return float(value)
    raise ValueError(f"{name} must be a number, a bool or a string, got {type(value).__name__} {value!r}")


def _paper_fields(paper) -> dict:
    """The paper's figure as ``{"paper": value or [low, high], "paper_unit", "paper_source", "paper_what"}``.

    ``paper`` is None, a number, a ``(low, high)`` range, or an object with ``value`` (and optionally
    ``unit``, ``source``, ``what``), such as :class:`cadlib.core.paper.PaperFigure`."""
    if paper is None:
        return {"paper": None}
    if hasattr(paper, "value"):
        return {"paper": _scalar(paper.value, "paper.value"), "paper_unit": getattr(paper, "unit", ""),
                "paper_source": getattr(paper, "source", ""), "paper_what": getattr(paper, "what", "")}
    if isinstance(paper, (tuple, list)):
        if len(paper) != 2 or paper[0] is None and paper[1] is None:
            raise ValueError(f"paper as a range must be (low, high) (one end may be None), got {paper!r}")
        low, high = (None if v is None else _scalar(v, "paper") for v in paper)
        if low is not None and high is not None and not low <= high:
            raise ValueError(f"paper range must have low <= high, got {paper!r}")
        return {"paper": [low, high]}
    return {"paper": _scalar(paper, "paper")}


def record(metric_id: str, ours, *, paper=None, unit: str = "", kind: str = "simulated", how: str = "",
           note: str = "", verdict: str = "", source: str = "", primary: bool = False, control: bool = False):
    """Record one of our figures beside the paper's; return it as a one-row ``pandas.DataFrame``.

    ``metric_id``: a stable name (e.g. ``"idle_fraction_dp8_512k"``); ``ours``: our value (number, bool
    or string); ``paper``: the paper's value, ``(low, high)`` range or a ``PaperFigure`` (whose unit and
    source are used); ``kind``: one of :data:`KINDS`, optionally followed by detail (a bare
    ``"measured"`` is labelled with the device this cell runs on); ``how``: how ours was obtained;
    ``note``: anything the reader must know (why it differs, what was not reproduced); ``verdict``:
    how ours stands against the paper (``cadlib.analysis.claims.record`` fills it from the claims registry);
    ``source``: where the paper's figure comes from, when ``paper`` does not say; ``primary`` and
    ``control`` (kept only when true): this row is the setting closest to the paper's, or a control run
    (see :func:`cadlib.analysis.claims.claims_table`).
    """
    if not isinstance(metric_id, str) or not metric_id.strip():
        raise ValueError(f"metric_id must be a non-empty string, got {metric_id!r}")
    if not isinstance(kind, str) or not kind.startswith(KINDS):
        raise ValueError(f"kind must start with one of {', '.join(KINDS)}, got {kind!r}")
    for name, v in {"unit": unit, "how": how, "note": note, "verdict": verdict, "source": source}.items():
        if not isinstance(v, str):
            raise ValueError(f"{name} must be a string, got {type(v).__name__} {v!r}")
    row = {"metric": metric_id.strip(), "ours": _scalar(ours, "ours"), **_paper_fields(paper)}
    if source and not row.get("paper_source"):
        row["paper_source"] = source
    row["unit"] = unit or row.pop("paper_unit", "").strip()
    row.pop("paper_unit", None)
    row.update(kind="measured on " + device_name() if kind == "measured" else kind, how=how, note=note,
               notebook=os.environ.get("CADLIB_NOTEBOOK", ""), **({"verdict": verdict} if verdict else {}),
               **({"primary": True} if primary else {}), **({"control": True} if control else {}),
               time=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    out_dir = os.environ.get("CADLIB_REPORT_DIR")
    if out_dir:
        pathlib.Path(out_dir).mkdir(parents=True, exist_ok=True)
        with open(pathlib.Path(out_dir) / METRICS_FILE, "a") as f:
            f.write(json.dumps(row) + "\n")
    return metrics_frame([row])


def load_metrics(path: str | os.PathLike) -> list[dict]:
    """The rows of a ``metrics.jsonl`` (a file or the folder holding it); the last row of each
    ``(notebook, metric)`` wins, so a cell that was run twice is counted once. Missing file: ``[]``."""
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.exists():
        return []
    rows = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            rows[(r.get("notebook", ""), r["metric"])] = r
    return list(rows.values())


def _fmt(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, list):
        if len(v) == 2 and v[0] is None:
            return f"≤ {_fmt(v[1])}"
        if len(v) == 2 and v[1] is None:
            return f"≥ {_fmt(v[0])}"
        return "–".join(_fmt(x) for x in v)
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _source(r: dict) -> str:
    paper = "; ".join(s for s in (r.get("paper_what", ""), r.get("paper_source", "")) if s)
    return paper or ("—" if r.get("paper") is None else "")


def metrics_frame(rows: Iterable[dict]):
    """Rows from :func:`record` / :func:`load_metrics` as a display table (values formatted)."""
    import pandas as pd
    table = [{"metric": r["metric"], "paper": _fmt(r.get("paper")), "ours": _fmt(r.get("ours")),
              "unit": r.get("unit", ""), "kind": r.get("kind", ""), "source": _source(r),
              "how": r.get("how", ""),
              "note": "; ".join(s for s in (r.get("verdict", ""), r.get("note", "")) if s),
              "notebook": r.get("notebook", "")}
             for r in rows]
    return pd.DataFrame(table, columns=METRIC_COLUMNS)


# ---------------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------------

_CSS = ("body{font-family:system-ui,sans-serif;max-width:74em;margin:2em auto;padding:0 1em;color:#222}"
        "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:.25em .6em;"
        "text-align:left;vertical-align:top}th{background:#f0f0f0}pre{background:#f6f6f6;padding:.6em;"
        "overflow-x:auto;white-space:pre-wrap}.failed{color:#b00}.ok{color:#070}.meta{color:#555}"
        ".figure{margin:1em 0 .2em;border:1px solid #eee}.caption{color:#444;font-size:.9em;margin:0 0 1.2em}"
        "table.claims,table.headline,table.metrics{table-layout:fixed;width:100%}"
        "table.claims td,table.metrics td{font-size:.85em;overflow-wrap:anywhere}"
        ".src{color:#777;font-size:.85em}"
        "table.headline td{font-size:1em}.v{font-weight:600;white-space:nowrap}"
        ".v-holds,.v-within{color:#2E7D32}.v-below{color:#1F5FA8}.v-above{color:#C25E00}"
        ".v-not-reproduced{color:#777}details{margin:.4em 0}summary{cursor:pointer;font-weight:600}"
        "section.evidence{border-top:1px solid #ddd;margin-top:1.5em}")
_CLAIM_WIDTHS = (16, 9, 13, 15, 8, 21, 11, 7)


def _md_cell(v) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")


def _md_table(cols: list[str], rows: Iterable) -> list[str]:
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols),
            *["| " + " | ".join(_md_cell(v) for v in r) + " |" for r in rows]]


def _vcls(verdict: str) -> str:
    return "v v-" + re.sub(r"[^a-z]+", "-", verdict.lower()).strip("-")


def _links(row: dict) -> str:
    return " · ".join(f"<a href='{html.escape(href)}'>{html.escape(label)}</a>"
                      for label, href in row.get("links", {}).items())


def _anchor(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")


def write_report(dest: str | os.PathLike, rows: list[dict], meta: dict, profile: str,
                 metrics: list[dict], notes: Iterable[str] = (), claims: list[dict] | None = None,
                 evidence: list[dict] | None = None) -> tuple[pathlib.Path, pathlib.Path]:
    """Write ``dest/report.md`` and a self-contained ``dest/report.html``.

    ``rows``: one dict per notebook with ``notebook``, ``status``, ``seconds``, ``parameters``,
    ``error``, ``executed`` (path of the executed notebook or None) and ``links`` (``{label: href}``).
    ``metrics``: rows from :func:`load_metrics`. ``notes``: lines shown under the header. ``claims``: the
    claims table (rows of :func:`cadlib.analysis.claims.claims_table`): with it the report opens with
    the headline block and the table. ``evidence``: sections of :func:`cadlib.analysis.evidence.sections`."""
    import nbformat

    dest, notes, evidence = pathlib.Path(dest), list(notes), evidence or []
    ok = sum(r["status"] == "ok" for r in rows)
    head = (f"Profile `{profile}` on {meta.get('device')}; torch {meta.get('torch')}, "
            f"commit `{meta.get('commit')}`, {meta.get('date')}.")
    ran = f"{ok}/{len(rows)} notebooks ran cleanly."
    failed = [r for r in rows if r["status"] != "ok"]
    table = metrics_frame(metrics)
    executed = {r["notebook"]: (nbformat.read(str(r["executed"]), as_version=4) if r.get("executed")
                                and os.path.exists(r["executed"]) else None) for r in rows}
    lines = headline_rows(claims) if claims else []

    md = ["# cadlib reproduction: what reproduced", "", f"**{ran}** {head}", "",
          *[f"- {n}" for n in notes], *([""] if notes else [])]
    md += [f"**FAILED:** `{r['notebook']}`" for r in failed] + ([""] if failed else [])
    if claims is not None:
        md += ["## The answer", "", *_md_table(["question", "verdict", "ours", "paper", "why"],
                                               [(x["question"], x["verdict"], x["ours"], x["paper"], x["why"])
                                                for x in lines]),
               "", "## Claims: one row per claim", "", CLAIMS_INTRO, "",
               *_md_table(CLAIM_COLUMNS, [[c.get(k, "") for k in CLAIM_COLUMNS] for c in claims])]
    for r in rows:
        nb = executed[r["notebook"]]
        md += ["", f"## {r['notebook']}", ""]
        if r["status"] != "ok":
            md += ["```", r["error"], "```"]
        md += ["```", (summary_text(nb) if nb else "") or "(no summary output)", "```"]
        if nb:
            md += [f"- Figure: {cap}" for _, cap in captioned_figures(nb)]
    for s in evidence:
        md += ["", f"## Evidence: {s['title']}", "", s["text"]]
        for cap, df in s["tables"]:
            md += ["", cap, "", df.to_markdown() if _has_tabulate() else "```\n" + df.to_string() + "\n```"]
    md += ["", "## Paper vs ours: every recorded metric", ""]
    if table.empty:
        md.append("No notebook recorded a metric in this run (cells call `cadlib.analysis.report.record`).")
    else:
        md += _md_table(METRIC_COLUMNS, table.itertuples(index=False))
    md += ["", "## This run", "", *_md_table(["notebook", "status", "seconds", "parameters"],
                                             [(f"`{r['notebook']}`", r["status"], f"{r['seconds']:.1f}",
                                               f"`{json.dumps(r['parameters'])}`") for r in rows])]
    md_path = atomic_write_text(dest / "report.md", "\n".join(md) + "\n")

    esc = html.escape
    h = ["<!doctype html><html><head><meta charset='utf-8'><title>cadlib reproduction</title>",
         f"<style>{_CSS}</style>", "</head><body>", plotlyjs_packed_tag(),
         "<h1>cadlib reproduction: what reproduced</h1>",
         f"<p class='meta'><b>{esc(ran)}</b> {esc(head).replace('`', '')} "
         "<a href='#run'>The run</a> · <a href='#metrics'>every metric</a>.</p>"]
    h += [f"<p>{esc(n)}</p>" for n in notes]
    h += [f"<p class='failed'>FAILED: <a href='#{esc(_anchor(r['notebook']))}'>{esc(r['notebook'])}</a></p>"
          for r in failed]
    if claims is not None:
        h += ["<section id='headline'><h2>The answer</h2><table class='headline'><tr><th style='width:34%'>"
              "question</th><th style='width:11%'>verdict</th><th style='width:16%'>ours</th>"
              "<th style='width:12%'>paper</th><th>why</th></tr>"]
        h += [f"<tr><td>{esc(x['question'])}</td><td class='{_vcls(x['verdict'])}'>{esc(x['verdict'])}</td>"
              f"<td>{esc(x['ours'])}</td><td>{esc(x['paper'])}</td><td>{esc(x['why'])}</td></tr>"
              for x in lines]
        hero = figure_html({PLOTLY: hero_figure(claims).to_plotly_json()}, "hero")
        h += ["</table>", f"<div class='figure'>{hero}</div><p class='caption'>Every claim this run checked, "
              "ours over the paper's figure: on the dotted line ours is the paper's (inside its range, or a "
              "qualitative claim that holds); left of it ours is below, right of it above. Hover a point for "
              "both figures.</p></section>",
              "<h2 id='claims'>Claims: one row per claim</h2>", f"<p>{esc(CLAIMS_INTRO)}</p>",
              "<table class='claims'><colgroup>" + "".join(f"<col style='width:{w}%'>" for w in _CLAIM_WIDTHS)
              + "</colgroup><tr>" + "".join(f"<th>{esc(k)}</th>" for k in CLAIM_COLUMNS) + "</tr>"]
        for c in claims:
            cells = {k: esc(str(c.get(k, ""))) for k in CLAIM_COLUMNS}
            cells["claim"] = (f"<b>{esc(c['claim'])}</b><br>{esc(c.get('statement', ''))}"
                              f"<div class='src'>{esc(c.get('source', ''))}</div>")
            cells["verdict"] = f"<span class='{_vcls(c['verdict'])}'>{cells['verdict']}</span>"
            h.append(f"<tr class='claim' data-claim='{esc(c['claim'])}'>"
                     + "".join(f"<td>{cells[k]}</td>" for k in CLAIM_COLUMNS) + "</tr>")
        h.append("</table>")
    h.append("<h2>The notebooks</h2>")
    for r in rows:
        nb, anchor = executed[r["notebook"]], _anchor(r["notebook"])
        h.append(f"<h3 id='{esc(anchor)}'>{esc(r['notebook'])}</h3><p class='meta'>{_links(r)}</p>")
        if r["status"] != "ok":
            h.append(f"<pre class='failed'>{esc(r['error'])}</pre>")
        h.append(f"<pre>{esc((summary_text(nb) if nb else '') or '(no summary output)')}</pre>")
        for k, (fig, cap) in enumerate(captioned_figures(nb) if nb else []):
            h.append(f"<div class='figure'>{figure_html(fig, f'{anchor}-fig{k}')}</div>"
                     f"<p class='caption'>{esc(cap)}</p>")
    if evidence:
        h.append("<h2 id='evidence'>Evidence</h2><p>What the lessons rest on: histories of runs, variants, "
                 "the cost-model check and long tables, linked from the notebooks.</p>")
    for s in evidence:
        h.append(f"<section class='evidence' id='evidence-{esc(s['id'])}'><h3>{esc(s['title'])}</h3>"
                 f"<p>{esc(s['text'])}</p>")
        for k, (cap, fig) in enumerate(s["figures"]):
            h.append(f"<div class='figure'>{figure_html({PLOTLY: fig}, 'ev-' + s['id'] + f'-{k}')}</div>"
                     f"<p class='caption'>{esc(cap)}</p>")
        for cap, df in s["tables"]:
            h.append(f"<p class='caption'>{esc(cap)}</p>" + df.to_html(border=0, classes="metrics"))
        h.append("</section>")
    h.append("<h2 id='metrics'>Paper vs ours: every recorded metric</h2>")
    if table.empty:
        h.append("<p>No notebook recorded a metric in this run (cells call "
                 "<code>cadlib.analysis.report.record</code>).</p>")
    else:
        h.append(f"<details><summary>{len(table)} metrics from {table.notebook.nunique()} notebooks "
                 "(click to open)</summary>")
        for name, part in table.groupby("notebook", sort=False):
            h.append(f"<h4>{esc(name or '(no notebook)')}</h4>"
                     + part.drop(columns="notebook").to_html(index=False, escape=True, border=0,
                                                             classes="metrics"))
        h.append("</details>")
    h += ["<h2 id='run'>This run</h2>",
          "<table><tr><th>notebook</th><th>status</th><th>s</th><th>parameters</th><th>open</th></tr>"]
    for r in rows:
        h.append(f"<tr><td><a href='#{esc(_anchor(r['notebook']))}'>{esc(r['notebook'])}</a></td>"
                 f"<td class='{esc(r['status'])}'>{esc(r['status'])}</td><td>{r['seconds']:.1f}</td>"
                 f"<td><code>{esc(json.dumps(r['parameters']))}</code></td><td>{_links(r)}</td></tr>")
    h += ["</table>", "</body></html>"]
    html_path = atomic_write_text(dest / "report.html", "\n".join(h) + "\n")
    return md_path, html_path



def _has_tabulate() -> bool:
    return importlib.util.find_spec("tabulate") is not None

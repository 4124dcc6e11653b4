"""The reproduction report: the page a reader opens first.

:func:`write_report` writes ``report.md`` and a self-contained ``report.html`` that open with the
answer: a headline block (:mod:`cadlib.analysis.report.headline`: a few rows and one figure), the claims
table (one row per claim), then each notebook's summary and key figures with their captions (cells
tagged ``figure`` or ``summary``), the evidence appendix (:mod:`cadlib.analysis.report.evidence`), every
recorded metric (:mod:`cadlib.analysis.report.metrics`, collapsed) and how the run went. Plotly figures
live in executed notebooks as ``application/vnd.plotly.v1+json``, which static HTML cannot show:
:mod:`cadlib.analysis.figures.static` renders them, and packs plotly.js into the page gzipped.
"""
from __future__ import annotations

import html
import importlib.util
import json
import os
import pathlib
import re
from typing import Iterable

from ...infra.results import atomic_write_text
from ..figures.static import PLOTLY_MIME as PLOTLY
from ..figures.static import captioned_figures, figure_html, plotlyjs_packed_tag, summary_text
from .headline import headline_rows, hero_figure
from .metrics import METRIC_COLUMNS, metrics_frame

CLAIM_COLUMNS = ["claim", "paper", "ours", "other settings", "verdict", "why", "kind", "notebook"]
"""The columns the report shows of the claims table (:func:`cadlib.analysis.report.claims.claims_table`)."""
CLAIMS_INTRO = ("One row per headline claim of DistCA and LongCA-bench (registry: cadlib.core.paper.CLAIMS). "
                "Ours is the setting closest to the paper's, the other settings are folded into a range, and "
                "control runs are left out (every recorded value is in the metrics table at the end). "
                "Verdicts answer the claim: reproduced, partly, not at this scale, not reproduced; the next "
                "column says why in a line, starting with the direction (below or above the paper) where "
                "ours misses, and the kind column says what the evidence is.")


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
        ".v-reproduced{color:#2E7D32}.v-partly{color:#1F5FA8}.v-not-at-this-scale{color:#C25E00}"
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
    ``metrics``: rows from :func:`cadlib.analysis.report.metrics.load_metrics`. ``notes``: lines shown under the header. ``claims``: the
    claims table (rows of :func:`cadlib.analysis.report.claims.claims_table`): with it the report opens with
    the headline block and the table. ``evidence``: sections of :func:`cadlib.analysis.report.evidence.sections`."""
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
        md += ["## The answer", "", *_md_table(["question", "evidence", "verdict", "ours", "paper", "why"],
                                               [(x["question"], x["evidence"], x["verdict"], x["ours"],
                                                 x["paper"], x["why"]) for x in lines]),
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
        md.append("No notebook recorded a metric in this run (cells call `cadlib.analysis.report.metrics.record`).")
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
        h += ["<section id='headline'><h2>The answer</h2><table class='headline'><tr><th style='width:22%'>"
              "question</th><th style='width:16%'>evidence</th><th style='width:10%'>verdict</th>"
              "<th style='width:14%'>ours</th><th style='width:11%'>paper</th><th>why</th></tr>"]
        h += [f"<tr><td>{esc(x['question'])}</td><td>{esc(x['evidence'])}</td>"
              f"<td class='{_vcls(x['verdict'])}'>{esc(x['verdict'])}</td>"
              f"<td>{esc(x['ours'])}</td><td>{esc(x['paper'])}</td><td>{esc(x['why'])}</td></tr>"
              for x in lines]
        hero = figure_html({PLOTLY: hero_figure(claims).to_plotly_json()}, "hero")
        h += ["</table>", f"<div class='figure'>{hero}</div><p class='caption'>Every claim this run checked, "
              "ours over the paper's figure (log axis: 0.5x and 2x lie as far from 1): on the dotted line ours "
              "is the paper's (inside its range, or a qualitative claim that holds); left of it ours is below, "
              "right of it above; the colour is the verdict. Hover a point for both figures.</p></section>",
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
                 "<code>cadlib.analysis.report.metrics.record</code>).</p>")
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

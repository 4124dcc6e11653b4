"""The reproduction report: metrics that notebook cells record, and figures that reach the reader.

* :func:`record` is what a notebook cell calls to put one of our figures beside the paper's. It
  returns a one-row table for display and, when ``$CADLIB_REPORT_DIR`` is set (``scripts/reproduce.py``
  sets it for every notebook it runs, with ``$CADLIB_NOTEBOOK``), appends the row as one JSON line to
  ``$CADLIB_REPORT_DIR/metrics.jsonl``. Run interactively, it only returns the table.
* Plotly figures live in executed notebooks as ``application/vnd.plotly.v1+json``, which static HTML
  cannot show: :mod:`cadlib.analysis.figures_html` renders them (re-exported here).
* :func:`write_report` writes ``report.md`` and a self-contained ``report.html``: the metrics of every
  notebook (paper vs ours, with kind and source; a collapsible table per notebook), each notebook's
  summary and its key figures (cells tagged ``figure`` or ``summary``; every figure when no cell is
  tagged). plotly.js is packed into the page gzipped (:func:`plotlyjs_packed_tag`), so the page stays
  near 2 MB.
"""
from __future__ import annotations

import datetime as _dt
import html
import json
import math
import numbers
import os
import pathlib
import re
from typing import Iterable

from ..infra.results import atomic_write_text, device_name
from .figures_html import figure_html, key_figures, plotlyjs_packed_tag, summary_text

METRICS_FILE = "metrics.jsonl"
KINDS = ("measured", "replayed", "simulated", "computed")
"""How ours was obtained: ``measured`` on a device, ``simulated`` from the cost model, or ``computed``
exactly (e.g. a FLOP count). A kind may say more after the word, e.g. ``"measured on 2x H200"``."""
METRIC_COLUMNS = ["metric", "paper", "ours", "unit", "kind", "source", "how", "note", "notebook"]
CLAIM_COLUMNS = ["claim", "paper", "ours", "kind", "verdict", "notebook", "source"]
"""The columns of the report's closing claims table (:func:`cadlib.analysis.claims.claims_table`)."""
CLAIMS_INTRO = ("Every headline claim of DistCA and LongCA-bench (registry: cadlib.core.paper.CLAIMS), with ours: "
                "simulated or computed on the CPU, measured on the named GPUs (committed results where this "
                "profile did not run them). A claim this run did not check says so.")


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
           note: str = "", verdict: str = "", source: str = ""):
    """Record one of our figures beside the paper's; return it as a one-row ``pandas.DataFrame``.

    ``metric_id``: a stable name (e.g. ``"idle_fraction_dp8_512k"``); ``ours``: our value (number, bool
    or string); ``paper``: the paper's value, ``(low, high)`` range or a ``PaperFigure`` (whose unit and
    source are used); ``kind``: one of :data:`KINDS`, optionally followed by detail (a bare
    ``"measured"`` is labelled with the device this cell runs on); ``how``: how ours was obtained;
    ``note``: anything the reader must know (why it differs, what was not reproduced); ``verdict``:
    how ours stands against the paper (``cadlib.analysis.claims.record`` fills it from the claims registry);
    ``source``: where the paper's figure comes from, when ``paper`` does not say.
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

_CSS = ("body{font-family:system-ui,sans-serif;max-width:72em;margin:2em auto;padding:0 1em;color:#222}"
        "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:.25em .6em;"
        "text-align:left;vertical-align:top}th{background:#f0f0f0}pre{background:#f6f6f6;padding:.6em;"
        "overflow-x:auto;white-space:pre-wrap}.failed{color:#b00}.ok{color:#070}"
        ".figure{margin:1em 0;border:1px solid #eee}table.claims{table-layout:fixed;width:100%}"
        "table.claims td{font-size:.85em;overflow-wrap:anywhere}table.claims .src{color:#777;font-size:.85em;"
        "margin-top:.3em}col.c-claim{width:22%}col.c-paper{width:22%}col.c-ours{width:10%}col.c-kind{width:13%}"
        "col.c-verdict{width:23%}col.c-notebook{width:10%}"
        "tr.claim-ok td:nth-child(5){color:#070}tr.claim-off td:nth-child(5){color:#a40}"
        "tr.claim-missing td{color:#777}"
        # the metrics tables: fixed widths in METRIC_COLUMNS order (less the notebook), text wrapped
        "table.metrics{table-layout:fixed;width:100%}table.metrics td{font-size:.85em;overflow-wrap:anywhere}"
        + "".join(f"table.metrics th:nth-child({i + 1}){{width:{w}%}}"
                  for i, w in enumerate((18, 6, 7, 5, 12, 13, 21, 18)))
        + "details{margin:.4em 0}summary{cursor:pointer;font-weight:600}")


def _md_cell(v) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")


def write_report(dest: str | os.PathLike, rows: list[dict], meta: dict, profile: str,
                 metrics: list[dict], notes: Iterable[str] = (),
                 claims: list[dict] | None = None) -> tuple[pathlib.Path, pathlib.Path]:
    """Write ``dest/report.md`` and a self-contained ``dest/report.html``.

    ``rows``: one dict per notebook with ``notebook``, ``status``, ``seconds``, ``parameters``,
    ``error``, ``executed`` (path of the executed notebook or None) and ``links`` (``{label: href}``).
    ``metrics``: rows from :func:`load_metrics`. ``notes``: lines shown under the header. ``claims``:
    the closing table of the papers' claims (rows of :func:`cadlib.analysis.claims.claims_table`; its columns
    :data:`CLAIM_COLUMNS`), shown last."""
    import nbformat

    dest = pathlib.Path(dest)
    ok = sum(r["status"] == "ok" for r in rows)
    head = (f"Profile `{profile}` on {meta.get('device')}; torch {meta.get('torch')}, "
            f"commit `{meta.get('commit')}`, {meta.get('date')}.")
    table = metrics_frame(metrics)
    executed = {}
    for r in rows:
        ex = r.get("executed")
        executed[r["notebook"]] = nbformat.read(str(ex), as_version=4) if ex and os.path.exists(ex) else None

    md = ["# cadlib reproduction", "", head, "", *[f"- {n}" for n in notes], *([""] if notes else []),
          f"**{ok}/{len(rows)} notebooks ran cleanly.** Figures: `report.html`.", "",
          "| notebook | status | seconds | parameters |", "|---|---|---|---|"]
    md += [f"| `{r['notebook']}` | {r['status']} | {r['seconds']:.1f} | `{json.dumps(r['parameters'])}` |"
           for r in rows]
    md += ["", "## Paper vs ours", ""]
    if table.empty:
        md.append("No notebook recorded a metric in this run (cells call `cadlib.analysis.report.record`).")
    else:
        md += ["| " + " | ".join(METRIC_COLUMNS) + " |", "|" + "---|" * len(METRIC_COLUMNS)]
        md += ["| " + " | ".join(_md_cell(v) for v in rec) + " |" for rec in table.itertuples(index=False)]
    for r in rows:
        nb = executed[r["notebook"]]
        md += ["", f"## {r['notebook']}", ""]
        if r["status"] != "ok":
            md += ["```", r["error"], "```"]
        md += ["```", (summary_text(nb) if nb else "") or "(no summary output)", "```"]
        if nb:
            md.append(f"{len(key_figures(nb))} figure(s) in report.html.")
    if claims is not None:
        md += ["", "## Claims: paper vs ours", "", CLAIMS_INTRO, "",
               "| " + " | ".join(CLAIM_COLUMNS) + " |", "|" + "---|" * len(CLAIM_COLUMNS)]
        md += ["| " + " | ".join(_md_cell(c.get(k, "")) for k in CLAIM_COLUMNS) + " |" for c in claims]
    md_path = atomic_write_text(dest / "report.md", "\n".join(md) + "\n")

    esc = html.escape
    h = ["<!doctype html><html><head><meta charset='utf-8'><title>cadlib reproduction</title>",
         f"<style>{_CSS}</style>", "</head><body>", plotlyjs_packed_tag(), "<h1>cadlib reproduction</h1>",
         f"<p>{esc(head).replace('`', '')}</p>"]
    h += [f"<p>{esc(n)}</p>" for n in notes]
    h += [f"<p><b>{ok}/{len(rows)} notebooks ran cleanly.</b></p>",
          "<table><tr><th>notebook</th><th>status</th><th>s</th><th>parameters</th><th>open</th></tr>"]
    for r in rows:
        links = " · ".join(f"<a href='{esc(href)}'>{esc(label)}</a>"
                           for label, href in r.get("links", {}).items())
        h.append(f"<tr><td><a href='#{esc(_anchor(r['notebook']))}'>{esc(r['notebook'])}</a></td>"
                 f"<td class='{esc(r['status'])}'>{esc(r['status'])}</td><td>{r['seconds']:.1f}</td>"
                 f"<td><code>{esc(json.dumps(r['parameters']))}</code></td><td>{links}</td></tr>")
    h += ["</table>", "<h2>Paper vs ours</h2>"]
    if table.empty:
        h.append("<p>No notebook recorded a metric in this run (cells call "
                 "<code>cadlib.analysis.report.record</code>).</p>")
    else:
        # one collapsible table per notebook: a run records about a hundred metrics
        h.append("<p>Every metric the notebooks recorded, grouped by notebook (click to open)."
                 + (" The <a href='#claims'>claims table</a> at the end is the summary." if claims is not None
                    else "") + "</p>")
        for name, part in table.groupby("notebook", sort=False):
            h.append(f"<details><summary>{esc(name or '(no notebook)')}: {len(part)} metric"
                     f"{'s' if len(part) != 1 else ''}</summary>"
                     + part.drop(columns="notebook").to_html(index=False, escape=True, border=0,
                                                             classes="metrics") + "</details>")
    for r in rows:
        nb = executed[r["notebook"]]
        h.append(f"<h2 id='{esc(_anchor(r['notebook']))}'>{esc(r['notebook'])}</h2>")
        if r["status"] != "ok":
            h.append(f"<pre class='failed'>{esc(r['error'])}</pre>")
        h.append(f"<pre>{esc((summary_text(nb) if nb else '') or '(no summary output)')}</pre>")
        anchor = _anchor(r["notebook"])
        for k, fig in enumerate(key_figures(nb) if nb else []):
            h.append(f"<div class='figure'>{figure_html(fig, f'{anchor}-fig{k}')}</div>")
    if claims is not None:
        cols = [k for k in CLAIM_COLUMNS if k != "source"]     # the source goes under the paper's figure
        h += ["<h2 id='claims'>Claims: paper vs ours</h2>", f"<p>{esc(CLAIMS_INTRO)}</p>",
              "<table class='claims'><colgroup>" + "".join(f"<col class='c-{k}'>" for k in cols),
              "</colgroup><tr>" + "".join(f"<th>{esc(k)}</th>" for k in cols) + "</tr>"]
        for c in claims:
            v = str(c.get("verdict", ""))
            cls = ("claim-ok" if v.startswith(("within", "matches", "holds")) else
                   "claim-missing" if v.startswith(("not run", "not reproduced")) else "claim-off")
            cid, _, sentence = str(c.get("claim", "")).partition(": ")
            cells = {k: esc(str(c.get(k, ""))) for k in cols}
            cells["claim"] = f"<b>{esc(cid)}</b><br>{esc(sentence)}"
            cells["paper"] += f"<div class='src'>{esc(str(c.get('source', '')))}</div>"
            h.append(f"<tr class='{cls}'>" + "".join(f"<td>{cells[k]}</td>" for k in cols) + "</tr>")
        h.append("</table>")
    h.append("</body></html>")
    html_path = atomic_write_text(dest / "report.html", "\n".join(h) + "\n")
    return md_path, html_path


def _anchor(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")

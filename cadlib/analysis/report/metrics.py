"""Metrics: one of our figures beside the paper's, recorded for the reproduction report.

:func:`record` is what a notebook cell calls to put one of our figures beside the paper's. It returns
a one-row table for display and, when ``$CADLIB_REPORT_DIR`` is set (``scripts/reproduce.py`` sets it
for every notebook it runs, with ``$CADLIB_NOTEBOOK``), appends the row as one JSON line to
``$CADLIB_REPORT_DIR/metrics.jsonl``. Run interactively, it only returns the table.
:func:`load_metrics` reads them back; :func:`metrics_frame` shows them.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import numbers
import os
import pathlib
import re
from typing import Iterable

import pandas as pd

from ...infra.results import device_name

METRICS_FILE = "metrics.jsonl"
KINDS = ("measured", "replayed", "simulated", "computed")
"""How ours was obtained: ``measured`` on a device, ``simulated`` from the cost model, or ``computed``
exactly (e.g. a FLOP count). A kind may say more after the word, e.g. ``"measured on 2x H200"``."""
METRIC_COLUMNS = ["metric", "paper", "ours", "unit", "kind", "device", "source", "how", "note", "notebook"]
"""The report's table of metrics; ``device`` is the machine that produced the number (:func:`produced_on`)."""

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
    how ours stands against the paper (``cadlib.analysis.report.claims.record`` fills it from the claims registry);
    ``source``: where the paper's figure comes from, when ``paper`` does not say; ``primary`` and
    ``control`` (kept only when true): this row is the setting closest to the paper's, or a control run
    (see :func:`cadlib.analysis.report.claims.claims_table`). Every row carries ``device``, the machine
    that ran the cell (:func:`cadlib.infra.results.device_name`: ``1x NVIDIA H200``, or ``CPU: ...``).
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
    device = device_name()
    row.update(kind="measured on " + device if kind == "measured" else kind, device=device, how=how, note=note,
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


def produced_on(r: dict) -> str:
    """The machine that produced a recorded number: the device a ``measured on <device>`` kind names (a
    committed measurement read on another machine keeps its GPU), else the one that ran the cell
    (``device``; ``—`` for rows recorded before rows carried it)."""
    kind = str(r.get("kind", ""))
    if kind.startswith("measured on "):
        return re.split(r",\s| \((?!\d+ cores\))", kind.removeprefix("measured on "))[0].strip()
    return r.get("device") or "—"


def metrics_frame(rows: Iterable[dict]):
    """Rows from :func:`record` / :func:`load_metrics` as a display table (values formatted)."""
    table = [{"metric": r["metric"], "paper": _fmt(r.get("paper")), "ours": _fmt(r.get("ours")),
              "unit": r.get("unit", ""), "kind": r.get("kind", ""), "device": produced_on(r),
              "source": _source(r),
              "how": r.get("how", ""),
              "note": "; ".join(s for s in (r.get("verdict", ""), r.get("note", "")) if s),
              "notebook": r.get("notebook", "")}
             for r in rows]
    return pd.DataFrame(table, columns=METRIC_COLUMNS)


def record_metrics(rows: list[dict]) -> pd.DataFrame:
    """Put each ``{"metric", "ours", "paper", "unit", "kind", "how", "note"}`` beside the paper: through
    ``cadlib.analysis.report.metrics.record`` when that module exists (the reproduction report gathers them), else as a
    plain table. Rows whose ``ours`` is None or NaN are shown, not recorded."""
    frames, plain = [], []
    for r in rows:
        ok = r.get("ours") is not None and not (isinstance(r["ours"], float) and r["ours"] != r["ours"])
        if ok:
            frames.append(record(r["metric"], r["ours"], paper=r.get("paper"), unit=r.get("unit", ""),
                                 kind=r.get("kind", "measured"), how=r.get("how", ""),
                                 note=r.get("note", "")))
        else:
            p = r.get("paper")
            plain.append({"metric": r["metric"], "paper": getattr(p, "value", p), "ours": r.get("ours"),
                          "unit": r.get("unit", ""), "kind": r.get("kind", ""), "how": r.get("how", ""),
                          "note": r.get("note", "")})
    if plain:
        frames.append(pd.DataFrame(plain))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

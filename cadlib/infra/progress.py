"""How a script started by :func:`cadlib.infra.launch.run_torchrun` (or by plain ``torchrun``) talks
back to the notebook, through three channels, all defined here once:

* **progress**: rank 0 prints one line ``CADLIB_PROGRESS {"step": s, "total": t, "desc": "..."}``
  (:func:`report_progress`); :func:`parse_progress` is the inverse the launcher uses.
* **results**: every rank writes one JSON object to ``$CADLIB_RESULTS_DIR/rank<k>.json``
  (:func:`write_result`), atomically (temporary file, then ``os.replace``).
* **logs**: :func:`log` prints ``[rank<k>] message``; torchrun keeps each rank's stdout/stderr.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from .results import atomic_write_text, json_default

PROGRESS_TAG = "CADLIB_PROGRESS"
"""Prefix of a structured progress line; the rest of the line is one JSON object."""
ENV_RESULTS_DIR = "CADLIB_RESULTS_DIR"
"""Environment variable naming the folder that :func:`write_result` writes ``rank<k>.json`` into."""
ENV_PG_BACKEND = "CADLIB_PG_BACKEND"
"""Environment variable naming the process-group backend the launcher chose (``gloo`` or ``nccl``)."""
def launched_by_torchrun() -> bool:
    """True when torchrun (or another launcher of the env:// protocol) started this process."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def env_rank() -> int:
    """This process's global rank from ``$RANK`` (0 when not launched by torchrun)."""
    return int(os.environ.get("RANK", "0"))


def log(msg: str, file=None) -> None:
    """Print ``[rank<k>] msg`` and flush, so torchrun's per-rank logs stay readable."""
    print(f"[rank{env_rank()}] {msg}", file=file or sys.stdout, flush=True)


def format_progress(step: int, total: int, desc: str = "") -> str:
    """The progress line: ``CADLIB_PROGRESS {"step": step, "total": total, "desc": desc}``."""
    if isinstance(step, bool) or isinstance(total, bool) or not isinstance(step, int) \
            or not isinstance(total, int):
        raise ValueError(f"progress needs integer step and total, got step={step!r}, total={total!r}")
    if total < 1 or not 0 <= step <= total:
        raise ValueError(f"progress needs total >= 1 and 0 <= step <= total, got step={step}, "
                         f"total={total}")
    return f"{PROGRESS_TAG} " + json.dumps({"step": step, "total": total, "desc": str(desc)})


def parse_progress(line: str) -> dict | None:
    """Inverse of :func:`format_progress`: the ``{"step", "total", "desc"}`` dict, or None."""
    text = line.strip()
    if not text.startswith(PROGRESS_TAG + " "):
        return None
    try:
        obj = json.loads(text[len(PROGRESS_TAG) + 1:])
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("step"), int) \
            or not isinstance(obj.get("total"), int):
        return None
    return {"step": obj["step"], "total": obj["total"], "desc": str(obj.get("desc", ""))}


def report_progress(step: int, total: int, desc: str = "") -> None:
    """On rank 0 only, print the progress line that drives the launcher's progress bar."""
    line = format_progress(step, total, desc)
    if env_rank() == 0:
        print(line, flush=True)


def write_result(obj: Any, results_dir: str | os.PathLike | None = None) -> Path | None:
    """Write this rank's result to ``<results_dir>/rank<k>.json`` atomically and return the path.

    ``results_dir`` defaults to ``$CADLIB_RESULTS_DIR`` (set by :func:`cadlib.infra.launch.run_torchrun`).
    Without either (a script run on its own) nothing is written and None is returned.
    """
    folder = results_dir if results_dir is not None else os.environ.get(ENV_RESULTS_DIR)
    if not folder:
        return None
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rank = env_rank()
    path = folder / f"rank{rank}.json"
    atomic_write_text(path, json.dumps(obj, default=json_default))
    return path


def read_results(results_dir: str | os.PathLike) -> dict[int, Any]:
    """All ``rank<k>.json`` files of ``results_dir`` as ``{k: object}``, sorted by rank."""
    out = {}
    for p in Path(results_dir).glob("rank*.json"):
        suffix = p.stem[len("rank"):]
        if suffix.isdigit():
            out[int(suffix)] = json.loads(p.read_text())
    return dict(sorted(out.items()))

"""Run folders, atomic writes and the provenance every result file carries.

Every GPU (and CPU) result file records the device name, torch version, git commit, date and the
full configuration (DESIGN.md): use :func:`save_result` so that is never forgotten.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import pathlib
import platform
import subprocess
import tempfile
from typing import Any

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "results"


def atomic_write_text(path: str | os.PathLike, text: str) -> pathlib.Path:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace`` (no torn files)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def atomic_write_json(path: str | os.PathLike, obj: Any) -> pathlib.Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, default=_json_default) + "\n")


def _json_default(o):
    try:
        import numpy as np
        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(o, pathlib.Path):
        return str(o)
    raise TypeError(f"cannot serialise {type(o).__name__} to JSON")


def git_commit(root: str | os.PathLike = REPO_ROOT) -> str:
    """The ``CADLIB_COMMIT`` environment variable when set (a working tree copied to a GPU node may
    carry a stale ``.git``: the launcher of such a run names the commit it sent), else the checkout's
    commit with ``-dirty`` when tracked files differ, else ``unknown``."""
    if os.environ.get("CADLIB_COMMIT"):
        return os.environ["CADLIB_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name() -> str:
    try:
        import torch
        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            return f"{n}x {torch.cuda.get_device_name(0)}"
    except ImportError:  # pragma: no cover
        pass
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU: {cpu} ({os.cpu_count()} cores)"


def environment_info() -> dict:
    """Device, library versions, commit and UTC date, for the ``meta`` block of a result file."""
    info = {"device": device_name(), "python": platform.python_version(), "commit": git_commit(),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node()}
    for mod in ("torch", "numpy"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:  # pragma: no cover
            info[mod] = None
    try:
        import torch
        info["cuda"] = torch.version.cuda
    except ImportError:  # pragma: no cover
        pass
    return info


def save_result(path: str | os.PathLike, config: dict, results: Any, **extra) -> pathlib.Path:
    """Write ``{"meta": environment_info(), "config": ..., "results": ..., **extra}`` atomically."""
    return atomic_write_json(path, {"meta": environment_info(), "config": config, "results": results,
                                    **extra})


def load_result(path: str | os.PathLike) -> dict:
    path = pathlib.Path(path)
    if not path.is_absolute() and not path.exists():
        path = RESULTS_DIR / path
    with open(path) as f:
        return json.load(f)


def new_run_dir(root: str | os.PathLike = REPO_ROOT / "runs", name: str | None = None) -> pathlib.Path:
    """``runs/<UTC timestamp>[-name]/``, created; a suffix keeps two runs in one second apart."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    base = pathlib.Path(root) / (stamp + (f"-{name}" if name else ""))
    path, k = base, 1
    while path.exists():
        path, k = pathlib.Path(f"{base}.{k}"), k + 1
    path.mkdir(parents=True)
    return path

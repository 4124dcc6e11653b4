"""Run folders, atomic writes and the provenance every result file carries.

Every GPU (and CPU) result file records the device name, torch version, git commit, date and the
full configuration (docs/design.md): use :func:`save_result` so that is never forgotten.
"""
from __future__ import annotations

import datetime as _dt
import importlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import platform
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, is_dataclass
from typing import Any

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
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
    return atomic_write_text(path, json.dumps(obj, indent=2, default=json_default) + "\n")


def json_default(obj: Any) -> Any:
    """The one JSON fallback of the library: tensors and numpy values (``tolist()``/``item()``),
    dataclasses (``asdict``), sets and tuples (lists), paths (strings)."""
    if is_dataclass(obj) and not isinstance(obj, type):
        return asdict(obj)
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    if isinstance(obj, pathlib.PurePath):
        return str(obj)
    raise TypeError(f"cannot store a {type(obj).__name__} as JSON; use JSON types (dict, list, str, int, "
                    "float, bool, None), tensors, numpy values or dataclasses")


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
    """``<n>x <GPU name>`` when this process has loaded torch and sees CUDA devices (a GPU run always
    has), else the CPU's model name and core count."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
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
        info[mod] = _version(mod)
    torch = sys.modules.get("torch")
    info["cuda"] = torch.version.cuda if torch is not None else None
    return info


def _version(package: str) -> str | None:
    """A package's version: its ``__version__`` when this process has loaded it, else its installed
    metadata's (the package is not imported)."""
    if package in sys.modules:
        return getattr(sys.modules[package], "__version__", None)
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


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


def find_results(pattern: str, results_dir: str | os.PathLike | None = None) -> list[pathlib.Path]:
    """Result files matching a glob ``pattern`` under ``results_dir`` (default: this repository's
    ``results/``), sorted by name."""
    return sorted(pathlib.Path(results_dir or RESULTS_DIR).glob(pattern))


def calibration_file(results_dir: str | os.PathLike | None = None,
                     device: str | None = None) -> pathlib.Path | None:
    """The committed calibration of this machine's GPU (``python -m cadlib.calibrate``), or None.

    ``<results_dir>/calibration_<gpu>.json``, where ``<gpu>`` is the GPU's name in lower case, words
    joined by ``_``, or one word of it (``1x NVIDIA H200`` -> ``calibration_h200.json``). ``device``:
    the name to look up (default :func:`device_name`, with torch loaded when it is installed); a CPU
    has none."""
    if device is None:
        if importlib.util.find_spec("torch") is not None:
            importlib.import_module("torch")          # device_name() reads CUDA through a loaded torch
        device = device_name()
    if device.startswith("CPU"):
        return None
    words = [w for w in re.split(r"[^a-z0-9]+", device.lower())
             if w and w != "nvidia" and not re.fullmatch(r"\d+x", w)]
    base = pathlib.Path(results_dir or RESULTS_DIR)
    for name in dict.fromkeys(["_".join(words), *words]):
        if name and (base / f"calibration_{name}.json").is_file():
            return base / f"calibration_{name}.json"
    return None

"""Run folders, atomic writes and the provenance every result file carries.

Every GPU (and CPU) result file records the device name, torch version, git commit, date and the
full configuration (docs/design.md): use :func:`save_result` so that is never forgotten.
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
    return atomic_write_text(path, json.dumps(obj, indent=2, default=json_default) + "\n")


def json_default(obj: Any) -> Any:
    """The one JSON fallback of the library: tensors and numpy values (``tolist()``/``item()``),
    dataclasses (``asdict``), sets and tuples (lists), paths (strings)."""
    from dataclasses import asdict, is_dataclass

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


# ---------------------------------------------------------------------------------------------------
# Committed benchmark results as tables (what the notebooks plot)
# ---------------------------------------------------------------------------------------------------

def find_results(pattern: str, results_dir: str | os.PathLike | None = None) -> list[pathlib.Path]:
    """Result files matching a glob ``pattern`` under ``results_dir`` (default: this repository's
    ``results/``), sorted by name."""
    return sorted(pathlib.Path(results_dir or RESULTS_DIR).glob(pattern))


OVERHEAD_COLUMNS = ("backend", "dist", "tokens_per_gpu", "world", "rank", "step_fwd_tflops", "raw_fwd_tflops",
                    "step_fwd_bwd_tflops", "raw_fwd_bwd_tflops", "step_over_raw_fwd", "step_over_raw_fwd_bwd",
                    "comm_fwd_fraction", "comm_fwd_bwd_fraction")


def server_overhead(results_dir: str | os.PathLike | None = None,
                    pattern: str = "bench_attention_server_overhead_*gpu.json"):
    """The attention-server overhead benchmark (``scripts/bench_attention_server.py --part overhead``)
    as one row per (file, case, rank): ``OVERHEAD_COLUMNS`` plus ``device`` and ``file``. ``step_*``
    is the whole CAD attention step (metadata, all-to-alls, fused kernel, return), ``raw_*`` the fused
    kernel alone on the same tasks. Empty frame (with those columns) when no file matches."""
    import pandas as pd
    rows = []
    for path in find_results(pattern, results_dir):
        res = load_result(path)
        for case in res.get("results", []):
            for r in case.get("ranks", []):
                rows.append({**{k: r.get(k) for k in OVERHEAD_COLUMNS},
                             "device": res.get("meta", {}).get("device"), "file": path.name})
    return pd.DataFrame(rows, columns=[*OVERHEAD_COLUMNS, "device", "file"])


def server_overhead_summary(rows):
    """Per case (backend, distribution, tokens per GPU, GPUs) of :func:`server_overhead`'s rows: the
    lowest step TF/s over the ranks and the lowest fused-kernel TF/s, forward and forward+backward, and
    the overhead: per rank ``raw TF/s / step TF/s - 1`` (the step's extra time over its own kernel's
    on the same tasks), the largest over the ranks.
    ``case`` labels a row for plots, e.g. ``fa4 pretrain 64K x2``."""
    import pandas as pd
    keys = ["backend", "dist", "tokens_per_gpu", "world"]
    if len(rows) == 0:
        return pd.DataFrame(columns=[*keys, "case"])
    rows = rows.assign(**{f"overhead_{m}": rows[f"raw_{m}_tflops"] / rows[f"step_{m}_tflops"] - 1
                          for m in ("fwd", "fwd_bwd")})
    g = rows.groupby(keys, sort=True)
    out = g.agg(step_fwd_tflops=("step_fwd_tflops", "min"), raw_fwd_tflops=("raw_fwd_tflops", "min"),
                step_fwd_bwd_tflops=("step_fwd_bwd_tflops", "min"),
                raw_fwd_bwd_tflops=("raw_fwd_bwd_tflops", "min"), overhead_fwd=("overhead_fwd", "max"),
                overhead_fwd_bwd=("overhead_fwd_bwd", "max")).reset_index()
    out.insert(0, "case", [f"{b} {d} {t // 1024}K x{w}" for b, d, t, w in
                           zip(out.backend, out.dist, out.tokens_per_gpu, out.world)])
    return out


COMPOSABILITY_COLUMNS = ["backend", "doc", "shard", "kv_share", "pattern", "order", "mode", "tflops", "ratio",
                         "stage", "path", "reference", "device", "commit", "date", "file"]
COMPOSABILITY_PATHS = {"kernel": "kernel alone, a KV copy per shard",
                       "copy": "server, a KV copy per shard",
                       "merged": "server, one KV per (server, document)",
                       "unsplit": "unsplit document"}
"""What each ``kv_share`` mode of the composability benchmark runs (``path`` column)."""


def composability(results_dir: str | os.PathLike | None = None,
                  pattern: str = "bench_attention_server_composability_1gpu_*.json"):
    """The composability benchmark (a document cut into query shards, each with its KV prefix, in
    one fused call) as one row per (file, backend, document, shard, kv_share, pattern, mode):
    ``tflops`` and ``ratio`` (TF/s over the unsplit document of the same file), ``mode`` ``fwd`` or
    ``fwd_bwd``; skipped (out of memory) measurements have no row.

    * ``kv_share``: ``kernel`` (the kernel alone on per-shard KV copies; files written before the
      server merged shards carry no such field), ``copy`` (the server path, a KV copy per shard),
      ``merged`` (the server path, one KV buffer per (server, document): issue 10) or ``unsplit``
      (the reference row, ratio 1); ``path`` says it in words (:data:`COMPOSABILITY_PATHS`).
    * ``stage``: ``before`` (per-shard copies: ``kernel``, ``copy``), ``after`` (``merged``) or
      ``unsplit``: what a plot of issue 10's change compares.
    * ``pattern``: ``all`` or ``alternate`` (every other shard on the server: nothing merges);
      ``order``: the kernel mode's call order (``lpt``, longest KV prefix first as the server, or ``doc``).
    * ``reference``: ``bracketed`` where the file timed the unsplit document before and after the
      cases and divides by their mean (``scripts/server_composability.py`` since a90939d), ``single``
      where it was timed once, before the cases. The same unsplit 16K call measured 556-653 TF/s
      forward+backward across the committed files (577 and 635 within one bracketed run), so a
      single-reference ratio can be off by several percent.
    * ``device``, ``commit`` (the code measured), ``date`` and ``file``."""
    import pandas as pd
    rows = []
    for path in find_results(pattern, results_dir):
        res = load_result(path)
        meta, cfg = res.get("meta", {}), res.get("config", {})
        bracketed = any(r.get("when") for r in res.get("results", []))
        for r in res.get("results", []):
            kv = r.get("kv_share", "kernel")
            if kv == "kernel" and r.get("shard") == r.get("doc_len"):
                kv = "unsplit"                        # older files: the one-shard row is the unsplit call
            stage = {"merged": "after", "unsplit": "unsplit"}.get(kv, "before")
            for mode in ("fwd", "fwd_bwd"):
                if r.get(f"{mode}_vs_unsplit") is not None:
                    rows.append({"backend": r["backend"], "doc": r["doc_len"], "shard": r["shard"],
                                 "kv_share": kv, "pattern": r.get("pattern", "all"),
                                 "order": cfg.get("order", "lpt"), "mode": mode,
                                 "tflops": r[f"{mode}_tflops"], "ratio": r[f"{mode}_vs_unsplit"],
                                 "stage": stage, "path": COMPOSABILITY_PATHS.get(kv, kv),
                                 "reference": "bracketed" if bracketed else "single",
                                 "device": meta.get("device"), "commit": str(meta.get("commit", ""))[:7],
                                 "date": meta.get("date", ""), "file": path.name})
    return pd.DataFrame(rows, columns=COMPOSABILITY_COLUMNS)


COMPOSABILITY_TARGET = 0.95
"""Issue 10's target: forward+backward on 512-token shards at least this share of the unsplit
document's TF/s, on 16K and 64K documents (1 x H200, FA4, bf16, llama3-8b heads)."""


def composability_before_after(rows, backend: str = "fa4", mode: str = "fwd_bwd"):
    """Issue 10's comparison from :func:`composability`'s rows: one row per (document, shard, series)
    of ``backend`` and ``mode``, every shard on the server (pattern ``all``, call order ``lpt``),
    unsplit rows left out. ``series``: ``<stage>: <path> (<commit>)``; the server paths keep one
    series per commit measured (a later commit's rerun is its own line), the kernel alone (the same
    kernel at every commit) only its first measurement, the one issue 10 started from."""
    sel = rows[(rows.backend == backend) & (rows["mode"] == mode) & (rows.pattern == "all")
               & (rows.order == "lpt") & (rows.stage != "unsplit")].copy()
    first = sel[sel.kv_share == "kernel"].groupby("doc").date.transform("min")
    sel = sel.drop(first.index[sel.loc[first.index, "date"] != first])
    sel["series"] = sel.stage + ": " + sel.path + " (" + sel.commit + ")"
    return sel.sort_values(["doc", "stage", "date", "shard"], ascending=[True, False, True, True]) \
        .reset_index(drop=True)


def composability_targets(rows, shard: int = 512, target: float = COMPOSABILITY_TARGET, backend: str = "fa4"):
    """Per document and measurement (file) of the merged server path at ``shard``-token shards: the
    forward+backward and forward ratios, ``meets`` (fwd+bwd >= ``target``), ``before``, the
    per-shard-copy kernel's first fwd+bwd ratio at that shard (NaN where it did not fit in memory),
    ``reference`` (see :func:`composability`), ``date`` and ``latest`` (the newest measurement of the
    document: the code as it is, with the best reference; what the target is judged on)."""
    import pandas as pd
    ba = composability_before_after(rows, backend)
    fwd = composability_before_after(rows, backend, "fwd")
    out = []
    for (doc, commit), g in ba[(ba.kv_share == "merged") & (ba.shard == shard)].groupby(["doc", "commit"]):
        f = fwd[(fwd.kv_share == "merged") & (fwd.shard == shard) & (fwd.doc == doc) & (fwd.commit == commit)]
        before = ba[(ba.kv_share == "kernel") & (ba.shard == shard) & (ba.doc == doc)].ratio
        out.append({"doc": int(doc), "shard": shard, "commit": commit, "file": g.file.iloc[0],
                    "fwd_bwd": float(g.ratio.iloc[0]),
                    "fwd": float(f.ratio.iloc[0]) if len(f) else float("nan"),
                    "before_fwd_bwd": float(before.iloc[0]) if len(before) else float("nan"),
                    "target": target, "meets": bool(g.ratio.iloc[0] >= target),
                    "reference": g.reference.iloc[0], "date": g.date.iloc[0]})
    cols = ["doc", "shard", "commit", "file", "fwd_bwd", "fwd", "before_fwd_bwd", "target", "meets",
            "reference", "date"]
    t = pd.DataFrame(out, columns=cols).sort_values(["doc", "date"]).reset_index(drop=True)
    t["latest"] = t.date.eq(t.groupby("doc").date.transform("max"))
    return t

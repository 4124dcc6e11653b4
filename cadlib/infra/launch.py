"""Running torchrun from a notebook cell: live logs, a progress bar, clear errors, timeouts, results.

:func:`run_torchrun` starts ``python -m torch.distributed.run --standalone --nproc-per-node=N
--log-dir <run>/torch --tee 3 [-m] target args...`` in its own process session and

* prints rank 0's output live (other ranks' stderr too, tagged ``[rank<k>]``),
* drives a ``tqdm.auto`` bar from the ``CADLIB_PROGRESS`` lines rank 0 prints
  (:func:`cadlib.infra.progress.report_progress`),
* returns one DataFrame row per rank from the ``rank<k>.json`` files the ranks write
  (:func:`cadlib.infra.progress.write_result`),
* on a failing rank raises :class:`TorchrunError` carrying that rank's traceback,
* on timeout or Ctrl-C stops the launcher *and every worker* (workers run in their own sessions,
  so a group kill of the launcher alone would orphan them): SIGTERM, then SIGKILL after a grace.

A run folder holds everything: ``console.log`` (the launcher's console, as torchrun printed it),
``results/rank<k>.json``, ``error.json`` (the root-cause rank's error, copied there by torchrun
because ``TORCHELASTIC_ERROR_FILE`` names it) and torch's per-rank logs
``torch/<rdzv-id>_<suffix>/attempt_<n>/<local_rank>/{stdout.log, stderr.log, error.json}``.
"""
from __future__ import annotations

import importlib.util
import json
import os
import queue
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Mapping, Sequence

from . import proctree
from .backend import PG_BACKENDS, resolve_pg_backend
from .progress import ENV_PG_BACKEND, ENV_RESULTS_DIR, parse_progress, read_results

TAIL_LINES = 40
"""Lines of a log quoted in an error message."""
_TEE_PREFIX = re.compile(r"^\[[^\]\d]*(\d+)\]:(.*)$")  # torchrun --tee: "[default0]:text"
_MODULE_NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_REPO_ROOT = Path(__file__).resolve().parents[2]


class TorchrunError(RuntimeError):
    """A torchrun run exited non-zero. The message holds the failing rank's traceback."""

    def __init__(self, message: str, *, returncode: int, rank: int | None, run_dir: Path):
        super().__init__(message)
        self.returncode = returncode
        self.rank = rank
        self.run_dir = run_dir


# ---------------------------------------------------------------- the command and its environment
def _target_argv(module_or_script: str | os.PathLike) -> list[str]:
    """``["-m", name]`` for an importable module name, ``[abs_path]`` for a ``.py`` file."""
    text = os.fspath(module_or_script)
    if isinstance(module_or_script, os.PathLike) or text.endswith(".py") or os.sep in text:
        path = Path(text).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"script {text!r} not found (looked at {path}); pass a path to an existing "
                             f".py file or an importable module name such as 'cadlib.train'")
        return [str(path)]
    try:
        found = _MODULE_NAME.match(text) is not None and importlib.util.find_spec(text) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ValueError(f"no module named {text!r}; pass an importable module name such as "
                         f"'cadlib.train' or a path to a .py file")
    return ["-m", text]


def torchrun_command(target_argv: Sequence[str], nproc: int, log_dir: str | os.PathLike,
                     args: Sequence[str] = (), nnodes: int = 1, rdzv_endpoint: str | None = None,
                     rdzv_id: str = "cadlib") -> list[str]:
    """The torchrun command line, per-rank logs teed to the console. Without ``rdzv_endpoint`` the
    rendezvous is ``--standalone`` (this machine only, bound to localhost); with ``host:port`` it is a
    c10d rendezvous at that endpoint for ``nnodes`` nodes (run the same command on every node)."""
    if rdzv_endpoint is None:
        rdzv = ["--standalone"]
    else:
        rdzv = [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
                f"--rdzv-id={rdzv_id}"]
    return [sys.executable, "-m", "torch.distributed.run", *rdzv,
            f"--nproc-per-node={nproc}", "--log-dir", os.fspath(log_dir), "--tee", "3",
            *target_argv, *args]


def _child_env(env: Mapping[str, str | None] | None, pg_backend: str, run_dir: Path) -> dict[str, str]:
    """os.environ, then ``env`` overrides (None removes a key), then the launcher's own variables."""
    out = dict(os.environ)
    out.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own default; setting it silences its banner
    out["PYTHONUNBUFFERED"] = "1"  # ranks' lines reach the notebook as they are printed
    if (_REPO_ROOT / "pyproject.toml").is_file() and (_REPO_ROOT / "cadlib").is_dir():
        parts = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p]
        if str(_REPO_ROOT) not in parts:
            out["PYTHONPATH"] = os.pathsep.join([str(_REPO_ROOT), *parts])
    for key, value in (env or {}).items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = str(value)
    out[ENV_PG_BACKEND] = pg_backend
    out[ENV_RESULTS_DIR] = str(run_dir / "results")
    out["TORCHELASTIC_ERROR_FILE"] = str(run_dir / "error.json")  # the agent copies the root cause here
    return out


# ------------------------------------------------------------------------------- console handling
class _Console:
    """Turns torchrun's teed console lines into notebook output, progress and a console.log."""

    def __init__(self, path: Path, echo: bool, progress: bool):
        self.file = open(path, "w")
        self.echo, self.show_progress = echo, progress
        self.bar = None
        self.events: list[dict] = []
        self.agent_stderr: list[str] = []
        self.rank0_tail: deque[str] = deque(maxlen=TAIL_LINES)
        if echo or progress:
            from tqdm.auto import tqdm  # the notebooks extra: a deferred optional import

            # tqdm makes its write lock on first use; a Ctrl-C landing inside that leaves tqdm without
            # a lock, and the KeyboardInterrupt surfaces as an AttributeError. Made here, before any
            # line streams, a Ctrl-C stops the run as one.
            tqdm.get_lock()

    def feed(self, stream: str, line: str) -> None:
        self.file.write(line + "\n")
        m = _TEE_PREFIX.match(line)
        if m is None:  # the launcher's own output (warnings, its ChildFailedError report)
            if stream == "stderr":
                self.agent_stderr.append(line)
            return
        rank, text = int(m.group(1)), m.group(2)
        event = parse_progress(text) if stream == "stdout" else None
        if event is not None:
            self.events.append(event)
            self._update_bar(event)
            return
        if rank == 0:
            self.rank0_tail.append(text)
        if self.echo and (rank == 0 or stream == "stderr"):
            out = sys.stdout if stream == "stdout" else sys.stderr
            from tqdm.auto import tqdm  # the notebooks extra: a deferred optional import

            tqdm.write(text if rank == 0 else f"[rank{rank}] {text}", file=out)

    def _update_bar(self, event: dict) -> None:
        if not self.show_progress:
            return
        if self.bar is None or self.bar.total != event["total"] or event["step"] < self.bar.n:
            self.close_bar()
            from tqdm.auto import tqdm  # the notebooks extra: a deferred optional import

            self.bar = tqdm(total=event["total"], desc=event["desc"], leave=True)
        self.bar.set_description(event["desc"], refresh=False)
        self.bar.n = event["step"]
        self.bar.refresh()

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def close(self) -> None:
        self.close_bar()
        self.file.close()


def _pump(pipe, stream: str, lines: queue.Queue) -> None:
    try:
        for line in iter(pipe.readline, ""):
            lines.put((stream, line.rstrip("\r\n")))
    finally:
        lines.put((stream, None))


class _Expired(Exception):
    pass


def _stream_until_exit(proc: subprocess.Popen, console: _Console, deadline: float) -> int:
    """Feed the launcher's lines to ``console`` until it exits; raise _Expired past ``deadline``."""
    lines: queue.Queue = queue.Queue()
    for pipe, stream in ((proc.stdout, "stdout"), (proc.stderr, "stderr")):
        threading.Thread(target=_pump, args=(pipe, stream, lines), daemon=True).start()
    open_streams, exited_at = 2, None
    while open_streams:
        now = time.monotonic()
        if now > deadline:
            raise _Expired
        try:
            stream, line = lines.get(timeout=0.1)
        except queue.Empty:
            if proc.poll() is not None:
                exited_at = exited_at or now
                if now - exited_at > 2.0:  # a grandchild kept a pipe open: stop waiting for EOF
                    break
            continue
        if line is None:
            open_streams -= 1
        else:
            console.feed(stream, line)
    try:
        return proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
    except subprocess.TimeoutExpired:
        raise _Expired from None


# --------------------------------------------------------------------------------- failure report
def rank_log_dir(run_dir: str | os.PathLike) -> Path | None:
    """torch's per-rank log folder of a run (``torch/*/attempt_<last>``), None before it exists."""
    attempts = sorted(Path(run_dir).glob("torch/*/attempt_*"), key=lambda p: int(p.name[8:]))
    return attempts[-1] if attempts else None


def _tail(path: Path, n: int = TAIL_LINES) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def _error_json_text(path: Path) -> str | None:
    """The traceback (or message) of an elastic error file ``{"message": {"message", "extraInfo"}}``."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    msg = data.get("message") if isinstance(data, dict) else None
    if isinstance(msg, dict):
        callstack = (msg.get("extraInfo") or {}).get("py_callstack")
        return callstack or msg.get("message")
    return str(msg) if msg else None


def _root_cause(agent_stderr: list[str]) -> tuple[int | None, str]:
    """Rank and exit code of torchrun's "Root Cause (first observed failure)" report."""
    for i, line in enumerate(agent_stderr):
        if "Root Cause" in line:
            rank, exitcode = None, ""
            for later in agent_stderr[i + 1:i + 12]:
                if rank is None and (m := re.search(r"\brank\s*:\s*(\d+)", later)):
                    rank = int(m.group(1))
                if not exitcode and (m := re.search(r"exitcode\s*:\s*(.*)", later)):
                    exitcode = " ".join(m.group(1).split())
            return rank, exitcode
    return None, ""


def _failure(rc: int, what: str, run_dir: Path, console: _Console) -> TorchrunError:
    rank, exitcode = _root_cause(console.agent_stderr)
    ranks_dir = rank_log_dir(run_dir)
    details, source = _error_json_text(run_dir / "error.json"), "error file"
    if details is None and ranks_dir is not None:
        candidates = ([ranks_dir / str(rank)] if rank is not None else []) + sorted(
            (p for p in ranks_dir.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
        for d in candidates:
            if (text := _error_json_text(d / "error.json")) is not None:
                details, rank = text, int(d.name)
                break
        if details is None:  # no error file (script without @record, or a crash): quote stderr
            logs = [ranks_dir / str(rank)] if rank is not None else candidates
            for d in logs:
                if (text := _tail(d / "stderr.log")).strip():
                    details, rank, source = text, int(d.name), "stderr.log tail"
                    break
    if details is None:
        details, source = "\n".join(console.agent_stderr[-TAIL_LINES:]), "torchrun output"
    who = f"rank {rank}" if rank is not None else "an unknown rank"
    how = f" (exitcode {exitcode})" if exitcode else ""
    message = (f"torchrun {what} failed with exit code {rc}; root cause: {who}{how}. "
               f"From its {source}:\n{details.rstrip()}\nlogs: {run_dir}")
    return TorchrunError(message, returncode=rc, rank=rank, run_dir=run_dir)


# ---------------------------------------------------------------------------------------- results
def results_frame(run_dir: Path, nproc: int):
    """One row per rank that wrote a result: ``rank`` first, then a dict's keys (else ``result``)."""
    import pandas as pd  # the notebooks extra: a deferred optional import

    raw = read_results(run_dir / "results")
    rows = [{"rank": r, **{k: v for k, v in obj.items() if k != "rank"}} if isinstance(obj, dict)
            else {"rank": r, "result": obj} for r, obj in raw.items()]
    df = pd.DataFrame(rows) if rows else pd.DataFrame({"rank": pd.Series(dtype="int64")})
    df = df.sort_values("rank", kind="stable").reset_index(drop=True)
    df.attrs.update(results=list(raw.values()), missing_ranks=sorted(set(range(nproc)) - set(raw)))
    return df


def _cuda_available() -> bool:
    """Whether torch sees CUDA here. torch is loaded when a run starts, not when this module is imported:
    a machine without torch can import cadlib (the what-if, the analysis) and is told here that launching
    needs it."""
    try:
        torch = importlib.import_module("torch")
    except ImportError as e:
        raise RuntimeError("run_torchrun starts torch.distributed.run: install torch first "
                           "(`make venv` does)") from e
    return torch.cuda.is_available()


def run_torchrun(module_or_script: str | os.PathLike, nproc: int, args: Sequence[str] | str = (),
                 timeout: float = 600, pg_backend: str = "auto",
                 env: Mapping[str, str | None] | None = None, log_dir: str | os.PathLike | None = None,
                 echo: bool = True, progress: bool = True, nnodes: int = 1,
                 rdzv_endpoint: str | None = None):
    """Run ``module_or_script`` on ``nproc`` local ranks with torchrun; one result row per rank.

    Multi-node: pass ``nnodes`` and ``rdzv_endpoint="head:29500"`` and run the same call on every node
    (each node's frame holds its own ranks' results); by default the rendezvous stays on localhost.

    ``args`` are passed to the script (a string is split like a shell would). ``pg_backend``, the
    process-group backend ("auto", "gloo", "nccl"; auto = nccl when CUDA is available), reaches the
    ranks as ``$CADLIB_PG_BACKEND``.
    ``env`` overrides entries of ``os.environ`` (None removes one). Each run gets a fresh folder
    ``torchrun-<date>-<time>-<random>`` under ``log_dir`` (default: the system temp folder).
    The frame's ``attrs`` hold ``results`` (the raw objects by rank), ``missing_ranks``, ``run_dir``,
    ``log_dir`` (torch's per-rank logs), ``progress`` (parsed progress events), ``command``,
    ``pg_backend`` and ``wall_s``.

    Raises TorchrunError when torchrun exits non-zero, TimeoutError after ``timeout`` s, and re-raises
    KeyboardInterrupt; in the last two cases every process of the run is stopped first.
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be an integer >= 1 (ranks on this machine), got {nproc!r}")
    if isinstance(nnodes, bool) or not isinstance(nnodes, int) or nnodes < 1:
        raise ValueError(f"nnodes must be an integer >= 1, got {nnodes!r}")
    if rdzv_endpoint is None and nnodes > 1:
        raise ValueError(f"nnodes={nnodes} needs rdzv_endpoint='host:port' (the rendezvous of all nodes); "
                         "without it the run stays on this machine")
    if rdzv_endpoint is not None and not re.fullmatch(r"[\w.\-\[\]:]+:\d+", str(rdzv_endpoint)):
        raise ValueError(f"rdzv_endpoint must be 'host:port', got {rdzv_endpoint!r}")
    if pg_backend != "auto" and pg_backend not in PG_BACKENDS:
        raise ValueError(f"unknown process-group backend pg_backend={pg_backend!r}; choose one of: auto, "
                         f"{', '.join(PG_BACKENDS)}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    resolved = resolve_pg_backend(pg_backend, _cuda_available())
    target = _target_argv(module_or_script)
    argv = shlex.split(args) if isinstance(args, str) else [str(a) for a in args]
    base = Path(log_dir).expanduser() if log_dir is not None else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=time.strftime("torchrun-%Y%m%d-%H%M%S-"), dir=base))
    cmd = torchrun_command(target, nproc, run_dir / "torch", argv, nnodes, rdzv_endpoint)
    what = " ".join(target[-1:] + argv)

    console = _Console(run_dir / "console.log", echo, progress)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=_child_env(env, resolved, run_dir), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            errors="replace", bufsize=1, start_new_session=True)
    try:
        rc = _stream_until_exit(proc, console, t0 + timeout)
    except BaseException as exc:
        stopped = proctree.terminate_tree(proc.pid, proctree.KILL_GRACE_S)
        proc.wait()
        console.close()
        if isinstance(exc, _Expired):
            tail = "\n".join(console.rank0_tail) or "(nothing)"
            raise TimeoutError(f"torchrun {what} did not finish within {timeout} s; stopped "
                               f"{len(stopped)} processes (SIGTERM, then SIGKILL to those left after "
                               f"{proctree.KILL_GRACE_S} s). Last lines of rank 0:\n{tail}\nlogs: {run_dir}"
                               ) from None
        raise
    console.close()
    if rc != 0:
        raise _failure(rc, what, run_dir, console)
    df = results_frame(run_dir, nproc)
    df.attrs.update(run_dir=str(run_dir), log_dir=str(rank_log_dir(run_dir)), progress=console.events,
                    command=cmd, wall_s=time.monotonic() - t0, pg_backend=resolved)
    return df

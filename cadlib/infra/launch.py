"""Running torchrun from a notebook cell: live logs, a progress bar, clear errors, timeouts, results.

:func:`run_torchrun` starts ``python -m torch.distributed.run --standalone --nproc-per-node=N
--log-dir <run>/torch --tee 3 [-m] target args...`` in its own process session and

* prints rank 0's output live (other ranks' stderr too, tagged ``[rank<k>]``),
* drives a ``tqdm.auto`` bar from the ``CADLIB_PROGRESS`` lines rank 0 prints
  (:func:`cadlib.infra.progress.report_progress`),
* returns one DataFrame row per rank from the ``rank<k>.json`` files the ranks write
  (:func:`cadlib.infra.progress.write_result`),
* on a failing rank raises :class:`TorchrunError` carrying that rank's traceback
  (:mod:`cadlib.infra.console` reads it back),
* on timeout or Ctrl-C stops the launcher *and every worker* (workers run in their own sessions,
  so a group kill of the launcher alone would orphan them): SIGTERM, then SIGKILL after a grace.
  Every process of a run carries ``$CADLIB_RUN`` (the run folder) in its environment, so workers
  orphaned by an agent that died are found and stopped too.

A run folder holds everything: ``console.log`` (the launcher's console, as torchrun printed it),
``results/rank<k>.json``, ``error.json`` (the root-cause rank's error, copied there by torchrun
because ``TORCHELASTIC_ERROR_FILE`` names it) and torch's per-rank logs
``torch/<rdzv-id>_<suffix>/attempt_<n>/<local_rank>/{stdout.log, stderr.log, error.json}``.
Several nodes: :func:`run_torchrun` with ``nnodes`` and ``rdzv_endpoint`` on each node, or
:func:`cadlib.infra.nodes.run_nodes` for several node agents on this one machine; both go through the
supervisor here (:func:`run_agents`).
"""
from __future__ import annotations

import importlib.util
import math
import os
import queue
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Mapping, NamedTuple, Sequence

from . import proctree
from .backend import PG_BACKENDS, resolve_pg_backend
from .console import Console, TorchrunError, failure, rank_log_dir
from .progress import ENV_PG_BACKEND, ENV_RESULTS_DIR, read_results

__all__ = ["run_torchrun", "TorchrunError", "rank_log_dir", "results_frame", "torchrun_command",
           "RDZV_JOIN_TIMEOUT_S"]

RDZV_JOIN_TIMEOUT_S = 120
"""Seconds a node's torchrun agent waits for every node to join the c10d rendezvous before it gives up
(torchrun's ``--rdzv-conf join_timeout``; torch's own default is 600): a node that never starts ends
the run after this long, with an error naming the rendezvous."""
ENV_RUN = "CADLIB_RUN"
"""Environment variable that marks every process of a run (agents, workers, what they start) with the
run folder, so that the processes of a run are found even once their parent died."""
_MODULE_NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_REPO_ROOT = Path(__file__).resolve().parents[2]


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
                     rdzv_id: str = "cadlib", join_timeout: float = RDZV_JOIN_TIMEOUT_S,
                     local_addr: str | None = None) -> list[str]:
    """The torchrun command line, per-rank logs teed to the console. Without ``rdzv_endpoint`` the
    rendezvous is ``--standalone`` (this machine only, bound to localhost); with ``host:port`` it is a
    c10d rendezvous at that endpoint for ``nnodes`` nodes (run the same command on every node), which
    gives up after ``join_timeout`` s when not every node joined. ``local_addr``: the address this
    node goes by in the rendezvous (torch orders the nodes by it; default: the host's name)."""
    if rdzv_endpoint is None:
        rdzv = ["--standalone"]
    else:
        rdzv = [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
                f"--rdzv-id={rdzv_id}", f"--rdzv-conf=join_timeout={int(math.ceil(join_timeout))}",
                *([f"--local-addr={local_addr}"] if local_addr else [])]
    return [sys.executable, "-m", "torch.distributed.run", *rdzv,
            f"--nproc-per-node={nproc}", "--log-dir", os.fspath(log_dir), "--tee", "3",
            *target_argv, *args]


def child_env(env: Mapping[str, str | None] | None, pg_backend: str, run_dir: Path,
              run_id: str | None = None) -> dict[str, str]:
    """os.environ, then ``env`` overrides (None removes a key), then the launcher's own variables: the
    backend, where results and the root-cause error go (under ``run_dir``), the run's marker
    ``$CADLIB_RUN`` (``run_id``, default ``run_dir``)."""
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
    out[ENV_RUN] = str(run_id if run_id is not None else run_dir)
    return out


# -------------------------------------------------------------------------------- the supervisor
class Agent(NamedTuple):
    """One torchrun agent of a run: its command, environment, folder and console; ``node``, the node it
    stands for when one run starts several (None: the only agent this launcher starts)."""

    cmd: list[str]
    env: dict[str, str]
    run_dir: Path
    console: Console
    node: int | None = None


def _pump(pipe, agent: int, stream: str, lines: queue.Queue) -> None:
    try:
        for line in iter(pipe.readline, ""):
            lines.put((agent, stream, line.rstrip("\r\n")))
    finally:
        lines.put((agent, stream, None))


class _Expired(Exception):
    pass


def _supervise(procs: list[subprocess.Popen], consoles: list[Console], deadline: float) -> int | None:
    """Feed each agent's lines to its console until every agent has exited (returns None) or one has
    exited non-zero (returns its index; the others may still run); raise _Expired past ``deadline``."""
    lines: queue.Queue = queue.Queue()
    for i, proc in enumerate(procs):
        for pipe, stream in ((proc.stdout, "stdout"), (proc.stderr, "stderr")):
            threading.Thread(target=_pump, args=(pipe, i, stream, lines), daemon=True).start()
    open_streams, exited_at = [2] * len(procs), [None] * len(procs)
    while True:
        try:
            i, stream, line = lines.get(timeout=0.1)
            if line is None:
                open_streams[i] -= 1
            else:
                consoles[i].feed(stream, line)
        except queue.Empty:
            pass
        now = time.monotonic()
        if now > deadline:
            raise _Expired
        done = []
        for i, proc in enumerate(procs):
            if exited_at[i] is None and proc.poll() is not None:
                exited_at[i] = now
            # an agent's output is complete at its pipes' end, or 2 s after it exited (a grandchild
            # that kept a pipe open must not hold the run)
            done.append(exited_at[i] is not None and (not open_streams[i] or now - exited_at[i] > 2.0))
        # the first to exit non-zero; of those seen in one pass, an agent killed by a signal first (a
        # dead agent is the cause, a peer that lost it the consequence)
        failed = sorted((exited_at[i], procs[i].returncode > 0, i) for i, d in enumerate(done)
                        if d and procs[i].returncode != 0)
        if failed or all(done):
            return failed[0][2] if failed else None


def _stop(procs: list[subprocess.Popen], run_id: str) -> list[int]:
    """Stop every agent and every process marked with ``run_id`` (a dead agent's orphaned workers
    too): SIGTERM, then SIGKILL after :data:`cadlib.infra.proctree.KILL_GRACE_S`; reap the agents."""
    stopped = proctree.terminate([p.pid for p in procs], proctree.KILL_GRACE_S,
                                 extra=lambda: proctree.marked(ENV_RUN, run_id))
    for p in procs:
        p.wait()
    return stopped


def _agent_error(agent: Agent, proc: subprocess.Popen, what: str, nnodes: int, rdzv_endpoint: str | None,
                 join_timeout: float, others: str) -> TorchrunError:
    """The error of an agent that exited non-zero: killed by a signal, a rendezvous that did not complete,
    or a failing rank (:func:`cadlib.infra.console.failure`). ``others``: what the run's other nodes
    were doing, a line of its own ("" with one agent)."""
    rc = proc.returncode
    if agent.node is not None:
        where = f"node {agent.node} of {nnodes}"
    else:
        where = f"this node ({socket.gethostname()})" if nnodes > 1 else "the run"
    if rc < 0:
        try:
            sig = signal.Signals(-rc).name
        except ValueError:
            sig = f"signal {-rc}"
        message = (f"{where}: its torchrun agent (pid {proc.pid}) was killed by {sig} while running "
                   f"{what}{others}\nlogs: {agent.run_dir}")
    elif agent.console.rendezvous_timed_out():
        message = (f"{where}: the c10d rendezvous of {nnodes} nodes at {rdzv_endpoint} did not complete "
                   f"within join_timeout={join_timeout:g} s: not every node joined (a node whose agent never "
                   f"started, or that cannot reach {rdzv_endpoint}; every node runs the same command)"
                   f"{others}\nlogs: {agent.run_dir}")
    else:
        return failure(rc, what, agent.run_dir, agent.console, agent.node, nnodes, others)
    return TorchrunError(message, returncode=rc, rank=None, run_dir=agent.run_dir, node=agent.node)


def run_agents(agents: Sequence[Agent], run_id: str, what: str, timeout: float, nnodes: int = 1,
               rdzv_endpoint: str | None = None, join_timeout: float = RDZV_JOIN_TIMEOUT_S) -> None:
    """Start every agent (each in its own session), stream their consoles and wait for all of them.
    When one exits non-zero the others are stopped at once and :class:`TorchrunError` names it (its
    node, and what the other nodes were doing); after ``timeout`` s TimeoutError; a KeyboardInterrupt
    is re-raised. In those three cases every process of the run (marked ``$CADLIB_RUN=run_id``) is
    stopped first: SIGTERM, then SIGKILL after :data:`cadlib.infra.proctree.KILL_GRACE_S`."""
    procs: list[subprocess.Popen] = []
    t0 = time.monotonic()
    try:
        for a in agents:
            procs.append(subprocess.Popen(a.cmd, env=a.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, errors="replace", bufsize=1,
                                          start_new_session=True))
        failed = _supervise(procs, [a.console for a in agents], t0 + timeout)
    except BaseException as exc:
        stopped = _stop(procs, run_id)
        for a in agents:
            a.console.close()
        if isinstance(exc, _Expired):
            tail = "\n".join(agents[0].console.rank0_tail) or "(nothing)"
            raise TimeoutError(f"torchrun {what} did not finish within {timeout} s; stopped "
                               f"{len(stopped)} processes (SIGTERM, then SIGKILL to those left after "
                               f"{proctree.KILL_GRACE_S} s). Last lines of rank 0:\n{tail}\n"
                               f"logs: {run_id}") from None
        raise
    others = ""
    if failed is not None:
        states = [f"node {a.node} " + ("was still running" if p.poll() is None
                                        else f"had exited with {p.returncode}")
                  for i, (a, p) in enumerate(zip(agents, procs)) if i != failed and a.node is not None]
        stopped = _stop(procs, run_id)          # the other nodes, and the workers a dead agent left
        if len(agents) > 1:
            others = f"\n{', '.join(states)}; stopped the run's {len(stopped)} processes"
    for a in agents:
        a.console.close()
    if failed is not None:
        raise _agent_error(agents[failed], procs[failed], what, nnodes, rdzv_endpoint, join_timeout, others)


# ---------------------------------------------------------------------------------------- results
def results_frame(run_dir: Path, nproc: int):
    """One row per rank that wrote a result: ``rank`` first, then a dict's keys (else ``result``);
    ``attrs["missing_ranks"]``: the ranks below ``nproc`` (the world) without a result file."""
    import pandas as pd  # the notebooks extra: a deferred optional import

    raw = read_results(run_dir / "results")
    rows = [{"rank": r, **{k: v for k, v in obj.items() if k != "rank"}} if isinstance(obj, dict)
            else {"rank": r, "result": obj} for r, obj in raw.items()]
    df = pd.DataFrame(rows) if rows else pd.DataFrame({"rank": pd.Series(dtype="int64")})
    df = df.sort_values("rank", kind="stable").reset_index(drop=True)
    df.attrs.update(results=list(raw.values()), missing_ranks=sorted(set(range(nproc)) - set(raw)))
    return df


def _torch():
    """torch, loaded when a run starts, not when this module is imported: a machine without torch can
    use cadlib's what-if and analysis, and is told here that launching needs it."""
    try:
        return importlib.import_module("torch")
    except ImportError as e:
        raise RuntimeError("run_torchrun starts torch.distributed.run: install torch first "
                           "(`make venv` does)") from e


def _cuda_available() -> bool:
    """Whether torch sees CUDA here."""
    return _torch().cuda.is_available()


def cuda_device_count() -> int:
    """How many CUDA devices torch sees here (0 without CUDA)."""
    return _torch().cuda.device_count()


class Prepared(NamedTuple):
    """A launch's checked arguments: the backend, the target's argv, the script's args, its folder."""

    pg_backend: str
    target: list[str]
    argv: list[str]
    run_dir: Path
    what: str


def prepare(module_or_script: str | os.PathLike, nproc: int, args: Sequence[str] | str, timeout: float,
            pg_backend: str, log_dir: str | os.PathLike | None, join_timeout: float = RDZV_JOIN_TIMEOUT_S,
            prefix: str = "torchrun") -> Prepared:
    """Check a launch's arguments (a ValueError names the one that is wrong and what is valid), resolve
    the backend and the target, and make the run's fresh folder ``<prefix>-<date>-<time>-<random>``
    under ``log_dir`` (default: the system temp folder)."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be an integer >= 1 (ranks on this machine), got {nproc!r}")
    if pg_backend != "auto" and pg_backend not in PG_BACKENDS:
        raise ValueError(f"unknown process-group backend pg_backend={pg_backend!r}; choose one of: auto, "
                         f"{', '.join(PG_BACKENDS)}")
    for name, value in (("timeout", timeout), ("join_timeout", join_timeout)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
    resolved = resolve_pg_backend(pg_backend, _cuda_available())
    target = _target_argv(module_or_script)
    argv = shlex.split(args) if isinstance(args, str) else [str(a) for a in args]
    base = Path(log_dir).expanduser() if log_dir is not None else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=time.strftime(f"{prefix}-%Y%m%d-%H%M%S-"), dir=base))
    return Prepared(resolved, target, argv, run_dir, " ".join(target[-1:] + argv))


def run_torchrun(module_or_script: str | os.PathLike, nproc: int, args: Sequence[str] | str = (),
                 timeout: float = 600, pg_backend: str = "auto",
                 env: Mapping[str, str | None] | None = None, log_dir: str | os.PathLike | None = None,
                 echo: bool = True, progress: bool = True, nnodes: int = 1,
                 rdzv_endpoint: str | None = None, join_timeout: float = RDZV_JOIN_TIMEOUT_S):
    """Run ``module_or_script`` on ``nproc`` local ranks with torchrun; one result row per rank.

    Multi-node: pass ``nnodes`` and ``rdzv_endpoint="head:29500"`` and run the same call on every node
    (each node's frame holds its own ranks' results, and ``missing_ranks`` lists the world's others);
    by default the rendezvous stays on localhost. When not every node has joined within
    ``join_timeout`` s (:data:`RDZV_JOIN_TIMEOUT_S`) the run ends with a TorchrunError saying so.
    :func:`cadlib.infra.nodes.run_nodes` starts several nodes' agents on this one machine.

    ``args`` are passed to the script (a string is split like a shell would). ``pg_backend``, the
    process-group backend ("auto", "gloo", "nccl"; auto = nccl when CUDA is available), reaches the
    ranks as ``$CADLIB_PG_BACKEND``.
    ``env`` overrides entries of ``os.environ`` (None removes one). Each run gets a fresh folder
    ``torchrun-<date>-<time>-<random>`` under ``log_dir`` (default: the system temp folder).
    The frame's ``attrs`` hold ``results`` (the raw objects by rank), ``missing_ranks``, ``run_dir``,
    ``log_dir`` (torch's per-rank logs), ``progress`` (parsed progress events), ``command``,
    ``pg_backend`` and ``wall_s``.

    Raises TorchrunError when torchrun exits non-zero, TimeoutError after ``timeout`` s, and re-raises
    KeyboardInterrupt; in every case every process of the run is stopped first.
    """
    if isinstance(nnodes, bool) or not isinstance(nnodes, int) or nnodes < 1:
        raise ValueError(f"nnodes must be an integer >= 1, got {nnodes!r}")
    if rdzv_endpoint is None and nnodes > 1:
        raise ValueError(f"nnodes={nnodes} needs rdzv_endpoint='host:port' (the rendezvous of all nodes); "
                         "without it the run stays on this machine")
    if rdzv_endpoint is not None and not re.fullmatch(r"[\w.\-\[\]:]+:\d+", str(rdzv_endpoint)):
        raise ValueError(f"rdzv_endpoint must be 'host:port', got {rdzv_endpoint!r}")
    run = prepare(module_or_script, nproc, args, timeout, pg_backend, log_dir, join_timeout)
    cmd = torchrun_command(run.target, nproc, run.run_dir / "torch", run.argv, nnodes, rdzv_endpoint,
                           join_timeout=join_timeout)
    agent = Agent(cmd, child_env(env, run.pg_backend, run.run_dir), run.run_dir,
                  Console(run.run_dir / "console.log", echo, progress))
    t0 = time.monotonic()
    run_agents([agent], str(run.run_dir), run.what, timeout, nnodes, rdzv_endpoint, join_timeout)
    df = results_frame(run.run_dir, nproc * nnodes)
    df.attrs.update(run_dir=str(run.run_dir), log_dir=str(rank_log_dir(run.run_dir)),
                    progress=agent.console.events, command=cmd, wall_s=time.monotonic() - t0,
                    pg_backend=run.pg_backend)
    return df

"""What a torchrun agent prints, read back: live notebook output, a progress bar, ``console.log``, and
the failing rank's traceback for the error a failed run raises.

torchrun ``--tee 3`` prefixes each worker line with its *local* rank (``[default<j>]:text``); a
:class:`Console` adds the node's first global rank (0 on one node) to name ranks globally. Lines
without a prefix are the agent's own (its warnings, its ``ChildFailedError`` report).

The error report (:func:`failure`) reads, in order: the root-cause rank's error file (copied by torchrun
to ``TORCHELASTIC_ERROR_FILE``), the per-rank error files and ``stderr.log`` tails under
``torch/<rdzv-id>_<suffix>/attempt_<n>/<local_rank>/``, and last the agent's own output.
"""
from __future__ import annotations

import json
import re
import sys
from collections import deque
from pathlib import Path

from .progress import parse_progress

TAIL_LINES = 40
"""Lines of a log quoted in an error message."""
_TEE_PREFIX = re.compile(r"^\[[^\]\d]*(\d+)\]:(.*)$")  # torchrun --tee: "[default0]:text"
RENDEZVOUS_TIMEOUT = "RendezvousTimeoutError"
"""What torchrun's agent raises when the nodes of a c10d rendezvous did not all join in time."""


class TorchrunError(RuntimeError):
    """A torchrun run exited non-zero. The message holds the failing rank's traceback; ``node`` is the
    node (agent) that failed when several were started (None for one)."""

    def __init__(self, message: str, *, returncode: int, rank: int | None, run_dir: Path,
                 node: int | None = None):
        super().__init__(message)
        self.returncode = returncode
        self.rank = rank
        self.run_dir = run_dir
        self.node = node


class Console:
    """Turns one agent's teed console lines into notebook output, progress and a ``console.log``.
    ``first_rank``: the global rank of the node's local rank 0 (0 on one node)."""

    def __init__(self, path: Path, echo: bool, progress: bool, first_rank: int = 0):
        self.file = open(path, "w")
        self.echo, self.show_progress, self.first_rank = echo, progress, first_rank
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
        rank, text = self.first_rank + int(m.group(1)), m.group(2)
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

    def rendezvous_timed_out(self) -> bool:
        """Whether the agent gave up waiting for the other nodes of its rendezvous."""
        return any(RENDEZVOUS_TIMEOUT in line for line in self.agent_stderr)


# --------------------------------------------------------------------------------- failure report
def rank_log_dir(run_dir: str | Path) -> Path | None:
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


def _root_cause(agent_stderr: list[str]) -> tuple[int | None, int | None, str]:
    """Global rank, local rank and exit code of torchrun's "Root Cause (first observed failure)"
    report (``rank : 3 (local_rank: 1)``)."""
    for i, line in enumerate(agent_stderr):
        if "Root Cause" in line:
            rank, local, exitcode = None, None, ""
            for later in agent_stderr[i + 1:i + 12]:
                if rank is None and (m := re.search(r"\brank\s*:\s*(\d+)(?:\s*\(local_rank:\s*(\d+)\))?",
                                                    later)):
                    rank = int(m.group(1))
                    local = int(m.group(2)) if m.group(2) is not None else None
                if not exitcode and (m := re.search(r"exitcode\s*:\s*(.*)", later)):
                    exitcode = " ".join(m.group(1).split())
            return rank, local, exitcode
    return None, None, ""


def failure(rc: int, what: str, run_dir: Path, console: Console, node: int | None = None,
            nnodes: int = 1, context: str = "") -> TorchrunError:
    """The error of an agent that exited with ``rc``: which rank failed first and its traceback (or the
    tail of its stderr); with several nodes, which node's agent it was. ``context`` (what the other
    nodes were doing) goes before the logs' folder."""
    rank, local, exitcode = _root_cause(console.agent_stderr)
    if rank is not None and local is None:
        local = rank - console.first_rank
    ranks_dir = rank_log_dir(run_dir)
    details, source = _error_json_text(run_dir / "error.json"), "error file"
    if details is None and ranks_dir is not None:
        candidates = ([ranks_dir / str(local)] if local is not None else []) + sorted(
            (p for p in ranks_dir.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
        for d in candidates:
            if (text := _error_json_text(d / "error.json")) is not None:
                details, rank = text, console.first_rank + int(d.name)
                break
        if details is None:  # no error file (script without @record, or a crash): quote stderr
            logs = [ranks_dir / str(local)] if local is not None else candidates
            for d in logs:
                if (text := _tail(d / "stderr.log")).strip():
                    details, rank, source = text, console.first_rank + int(d.name), "stderr.log tail"
                    break
    if details is None:
        details, source = "\n".join(console.agent_stderr[-TAIL_LINES:]), "torchrun output"
    who = f"rank {rank}" if rank is not None else "an unknown rank"
    how = f" (exitcode {exitcode})" if exitcode else ""
    where = f"node {node} of {nnodes}: " if node is not None else ""
    message = (f"{where}torchrun {what} failed with exit code {rc}; root cause: {who}{how}. "
               f"From its {source}:\n{details.rstrip()}{context}\nlogs: {run_dir}")
    return TorchrunError(message, returncode=rc, rank=rank, run_dir=run_dir, node=node)

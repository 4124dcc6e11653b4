"""Stopping a process and every descendant it started, also those in other process sessions.

torchrun's workers run in their own sessions, so a group kill of the launcher alone would orphan
them. :func:`terminate_tree` sends SIGTERM to the whole tree, waits ``grace`` seconds, then SIGKILLs
what is left. Processes are identified by (pid, start time) so a recycled pid is never signalled.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Mapping

KILL_GRACE_S = 5.0
"""Seconds between SIGTERM and SIGKILL when a run is stopped (timeout or Ctrl-C)."""
_HAVE_PROC = os.path.isdir("/proc")


def _proc_stat(pid: int) -> tuple[int, str, int] | None:
    """``(ppid, state, start_time)`` from ``/proc/<pid>/stat`` (fields 4, 3 and 22), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    rest = data[data.rindex(")") + 2:].split()
    return int(rest[1]), rest[0], int(rest[19])


def _descendants(pid: int) -> dict[int, float]:
    """Every descendant of ``pid`` (children in other sessions too) as ``{pid: start_time}``."""
    if _HAVE_PROC:
        children: dict[int, list[int]] = {}
        starts = {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit() and (st := _proc_stat(int(entry.name))) is not None:
                children.setdefault(st[0], []).append(int(entry.name))
                starts[int(entry.name)] = float(st[2])
        out, todo = {}, list(children.get(pid, []))
        while todo:
            p = todo.pop()
            if p not in out:
                out[p] = starts[p]
                todo.extend(children.get(p, []))
        return out
    try:
        import psutil
        return {c.pid: c.create_time() for c in psutil.Process(pid).children(recursive=True)}
    except Exception:  # no psutil, or the process is already gone: only the launcher's group is known
        return {}


def _identity(pid: int) -> float | None:
    """The start time of a live (non-zombie) process, None when it is gone or a zombie."""
    if _HAVE_PROC:
        st = _proc_stat(pid)
        return None if st is None or st[1] in "ZXx" else float(st[2])
    try:
        import psutil
        p = psutil.Process(pid)
        return None if p.status() == psutil.STATUS_ZOMBIE else p.create_time()
    except ImportError:
        try:
            os.kill(pid, 0)
            return 0.0
        except OSError:
            return None
    except Exception:
        return None


def _alive(pid: int, start: float) -> bool:
    ident = _identity(pid)
    return ident is not None and (ident == start or start == 0.0)


def _signal_all(procs: Mapping[int, float], sig: int) -> None:
    """Send ``sig`` to the process group of each live process (never our own group) and to it."""
    own_group = os.getpgrp()
    for pid, start in procs.items():
        if not _alive(pid, start):
            continue
        try:
            group = os.getpgid(pid)
            if group != own_group:
                os.killpg(group, sig)
            os.kill(pid, sig)
        except OSError:
            pass


def terminate_tree(root_pid: int, grace: float = KILL_GRACE_S) -> list[int]:
    """Stop ``root_pid`` and all its descendants: SIGTERM, then SIGKILL what is left after ``grace`` s.

    The tree is read before the first signal (workers are reparented once the launcher dies) and
    re-read while waiting. Returns the pids that were signalled.
    """
    start = _identity(root_pid)
    known = {root_pid: start if start is not None else 0.0, **_descendants(root_pid)}
    _signal_all(known, signal.SIGTERM)
    try:
        end = time.monotonic() + grace
        while time.monotonic() < end:
            known.update(_descendants(root_pid))
            if not any(_alive(p, s) for p, s in known.items()):
                break
            time.sleep(0.05)
    finally:  # also when a second Ctrl-C arrives while waiting
        # Workers first, so that a launcher still alive reaps them (no zombies under a container's
        # non-reaping PID 1); then, after a moment for it to exit on its own, the launcher.
        _signal_all({p: s for p, s in known.items() if p != root_pid}, signal.SIGKILL)
        end = time.monotonic() + 1.0
        while _alive(root_pid, known[root_pid]) and time.monotonic() < end:
            time.sleep(0.02)
        _signal_all(known, signal.SIGKILL)
    return sorted(known)

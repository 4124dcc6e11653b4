"""Stopping a process and every descendant it started, also those in other process sessions.

torchrun's workers run in their own sessions, so a group kill of the launcher alone would orphan
them. :func:`terminate_tree` sends SIGTERM to the whole tree, waits ``grace`` seconds, then SIGKILLs
what is left. Processes are identified by (pid, start time) so a recycled pid is never signalled.
A worker whose agent died is no one's descendant any more; :func:`marked` finds it by a variable of
the environment every process of a run inherits, and :func:`terminate` stops such ones with the trees.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Callable, Iterable, Mapping

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


def marked(key: str, value: str) -> dict[int, float]:
    """Every live process whose environment (as it started) holds ``key=value``, as ``{pid: start}``:
    the processes of one run, those whose parent died included."""
    out = {}
    if _HAVE_PROC:
        needle = f"{key}={value}".encode()
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/environ", "rb") as f:
                    found = needle in f.read().split(b"\0")
            except OSError:          # gone, or another user's
                continue
            if found and (start := _identity(int(entry.name))) is not None:
                out[int(entry.name)] = start
        return out
    try:
        import psutil
    except ImportError:              # neither /proc nor psutil: only the process trees are known
        return out
    for p in psutil.process_iter():
        try:
            if p.environ().get(key) == value and p.status() != psutil.STATUS_ZOMBIE:
                out[p.pid] = p.create_time()
        except psutil.Error:
            continue
    return out


def terminate_tree(root_pid: int, grace: float = KILL_GRACE_S) -> list[int]:
    """Stop ``root_pid`` and all its descendants (:func:`terminate` of one root)."""
    return terminate([root_pid], grace)


def terminate(roots: Iterable[int], grace: float = KILL_GRACE_S,
              extra: Callable[[], Mapping[int, float]] | None = None) -> list[int]:
    """Stop the ``roots``, all their descendants and the processes ``extra()`` names: SIGTERM, then
    SIGKILL what is left after ``grace`` s.

    The trees are read before the first signal (workers are reparented once the launcher dies) and
    re-read while waiting, ``extra`` too. Returns the pids that were signalled.
    """
    roots = list(roots)

    def scan() -> dict[int, float]:
        found = dict(extra()) if extra is not None else {}
        for r in roots:
            found.update(_descendants(r))
        return found

    known = {r: (s if (s := _identity(r)) is not None else 0.0) for r in roots}
    known.update(scan())
    _signal_all(known, signal.SIGTERM)
    try:
        end = time.monotonic() + grace
        while time.monotonic() < end:
            for pid, start in scan().items():
                if pid not in known:             # started since: it gets the SIGTERM too
                    known[pid] = start
                    _signal_all({pid: start}, signal.SIGTERM)
            if not any(_alive(p, s) for p, s in known.items()):
                break
            time.sleep(0.05)
    finally:  # also when a second Ctrl-C arrives while waiting
        # Workers first, so that a launcher still alive reaps them (no zombies under a container's
        # non-reaping PID 1); then, after a moment for it to exit on its own, the launchers.
        _signal_all({p: s for p, s in known.items() if p not in roots}, signal.SIGKILL)
        end = time.monotonic() + 1.0
        while any(_alive(r, known[r]) for r in roots) and time.monotonic() < end:
            time.sleep(0.02)
        _signal_all(known, signal.SIGKILL)
    return sorted(known)

"""Run a module's ``main`` on several CPU ranks for the multi-process correctness tests, forked from a
server process that imported torch and cadlib once.

``run_torchrun`` (tested on its own in ``tests/infra/test_launch.py``, and run by the notebooks' cells
under nbval) starts a fresh interpreter for the launcher and for every rank, and each imports torch:
about 2.5 s of CPU apiece, so a 4-rank launch costs ~12 s of CPU before any work, and on CI's two
cores the suite's ~30 launches spent most of its time there. Here the ranks are forked from
multiprocessing's forkserver, which preloads torch and the modules under test. What runs is the same
code: each rank gets torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``), joins the gloo process group over ``env://``, and writes its result
file where ``run_torchrun`` reads it; the frame returned is ``run_torchrun``'s.
"""
from __future__ import annotations

import importlib
import multiprocessing
import os
import pathlib
import runpy
import socket
import sys
import tempfile
import time
import traceback

from cadlib.infra import launch
from cadlib.infra.progress import ENV_PG_BACKEND, ENV_RESULTS_DIR

PRELOAD = ["torch", "torch.distributed", "cadlib.verify", "cadlib.train", "cadlib.cp.check"]
_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(PRELOAD)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(target: str, argv: list[str], env: dict[str, str], log_dir: str) -> None:
    """One rank: its output to ``log_dir/{stdout,stderr}.log``, then the module's ``main(argv)`` (or
    the script as ``__main__``); the exit status is main's (1 with the traceback on stderr if it
    raised)."""
    os.makedirs(log_dir, exist_ok=True)
    for fd, name in ((1, "stdout.log"), (2, "stderr.log")):
        f = os.open(os.path.join(log_dir, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.update(env)
    import torch
    torch.set_num_threads(1)                      # torchrun's OMP_NUM_THREADS=1
    code = 0
    try:
        sys.argv = [target, *argv]
        if target.endswith(".py"):
            runpy.run_path(target, run_name="__main__")
        else:                                     # what `python -m target` runs: sys.exit(main())
            code = importlib.import_module(target).main(argv) or 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(target: str | os.PathLike, world: int, args=(), timeout: float = 300):
    """``target`` (a module name or a script path) on ``world`` gloo ranks; one row per rank, as
    :func:`cadlib.infra.launch.run_torchrun` returns them. A rank that fails stops the others (as
    torchrun does) and raises :class:`~cadlib.infra.launch.TorchrunError` with ``run_dir`` holding
    every rank's ``ranks/<k>/stdout.log`` and ``stderr.log``; TimeoutError after ``timeout`` s."""
    run_dir = pathlib.Path(tempfile.mkdtemp(prefix=time.strftime("ranks-%Y%m%d-%H%M%S-")))
    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "OMP_NUM_THREADS": "1",
            ENV_PG_BACKEND: "gloo", ENV_RESULTS_DIR: str(run_dir / "results")}
    procs = [_CTX.Process(target=_rank, args=(str(target), [str(a) for a in args],
                                              {**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                                              str(run_dir / "ranks" / str(r))))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    failed = None
    try:
        while any(p.exitcode is None for p in procs):
            failed = next((r for r, p in enumerate(procs) if p.exitcode not in (None, 0)), None)
            if failed is not None:
                time.sleep(1.0)                     # the others may fail on their own check too
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{target} on {world} ranks did not finish within {timeout} s; "
                                   f"logs: {run_dir}")
            time.sleep(0.02)
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join()
    if failed is None:
        failed = next((r for r, p in enumerate(procs) if p.exitcode != 0), None)
    if failed is not None:
        tail = (run_dir / "ranks" / str(failed) / "stderr.log").read_text()[-3000:]
        code = procs[failed].exitcode
        raise launch.TorchrunError(f"{target} failed on rank {failed} (exit {code}):\n{tail}",
                                   returncode=code, rank=failed, run_dir=run_dir)
    df = launch.results_frame(run_dir, world)
    df.attrs["run_dir"] = str(run_dir)
    return df

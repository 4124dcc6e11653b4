"""Several nodes on one machine: ``nnodes`` torchrun agents, each standing for a node with its own
``nproc_per_node`` ranks, meeting in one c10d rendezvous on the loopback address. A cluster runs one
agent per node (:func:`cadlib.infra.launch.run_torchrun` with ``nnodes`` and ``rdzv_endpoint`` on each,
or ``scripts/slurm/train.sbatch``); :func:`run_nodes` runs the same agents here, so that a multi-node
run is tested where no cluster is at hand (gloo on CPU).

Node ``k`` goes by the address ``127.0.0.<k+1>`` in the rendezvous, and torch numbers the nodes in the
order of their addresses: node ``k`` is ``GROUP_RANK`` k and holds global ranks
``k * nproc_per_node`` to ``(k + 1) * nproc_per_node - 1``, whose ``LOCAL_RANK`` runs from 0 and
whose ``LOCAL_WORLD_SIZE`` is ``nproc_per_node``, as on a real node. Each node has its own folder
``node<k>/`` (its agent's ``console.log``, torch's per-rank logs, ``error.json`` and ``results/``:
what that node's own disk would hold); the launcher collects every node's ``rank<r>.json`` into the
run folder's ``results/`` and returns one frame of all ranks with the node of each.

When a node's agent exits non-zero or dies, the other nodes are stopped at once and
:class:`~cadlib.infra.launch.TorchrunError` names that node (``err.node``); a rendezvous that does not
complete ends after ``join_timeout`` s; the whole run after ``timeout`` s (TimeoutError). In each case
every process of the run is stopped (SIGTERM, then SIGKILL after
:data:`cadlib.infra.proctree.KILL_GRACE_S`), the workers of an agent that died included.
"""
from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path
from typing import Mapping, Sequence

from .console import Console
from .launch import (RDZV_JOIN_TIMEOUT_S, Agent, child_env, cuda_device_count, prepare, results_frame,
                     run_agents, torchrun_command)
from .progress import read_results

MAX_LOCAL_NODES = 9
"""The most nodes :func:`run_nodes` starts: node addresses ``127.0.0.1`` to ``127.0.0.9`` sort as text
in node order, which torch's rendezvous uses to number the nodes."""
LOOPBACK = "127.0.0.1"
"""Where the rendezvous listens: node 0's address."""


def node_addr(node: int) -> str:
    """The address node ``node`` goes by in the rendezvous (``127.0.0.<node+1>``, all loopback)."""
    return f"127.0.0.{node + 1}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def node_devices(nnodes: int, nproc_per_node: int, visible: Sequence[str]) -> list[str]:
    """``CUDA_VISIBLE_DEVICES`` of each node under NCCL: node ``k`` sees the ``k``-th ``nproc_per_node``
    of the ``visible`` devices, so that no two nodes share a GPU."""
    if nnodes * nproc_per_node > len(visible):
        raise ValueError(f"nnodes x nproc_per_node = {nnodes} x {nproc_per_node} GPUs, but {len(visible)} "
                         f"are visible ({','.join(visible) or 'none'}); use fewer, or pg_backend='gloo'")
    return [",".join(visible[k * nproc_per_node:(k + 1) * nproc_per_node]) for k in range(nnodes)]


def _visible_devices() -> list[str]:
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d for d in listed.split(",") if d.strip()]
    return [str(i) for i in range(cuda_device_count())]


def collect_results(run_dir: Path, nnodes: int) -> dict[int, int]:
    """Copy every node's ``node<k>/results/rank<r>.json`` into ``run_dir/results`` (what one shared
    folder would hold); returns ``{rank: node}``."""
    out = run_dir / "results"
    out.mkdir(exist_ok=True)
    node_of = {}
    for k in range(nnodes):
        for rank in read_results(run_dir / f"node{k}" / "results"):
            if rank in node_of:
                raise RuntimeError(f"rank {rank} wrote a result on node {node_of[rank]} and on node {k}; "
                                   f"logs: {run_dir}")
            node_of[rank] = k
            shutil.copyfile(run_dir / f"node{k}" / "results" / f"rank{rank}.json", out / f"rank{rank}.json")
    return node_of


def run_nodes(module_or_script: str | os.PathLike, nnodes: int, nproc_per_node: int,
              args: Sequence[str] | str = (), timeout: float = 600, join_timeout: float = RDZV_JOIN_TIMEOUT_S,
              pg_backend: str = "auto", env: Mapping[str, str | None] | None = None,
              log_dir: str | os.PathLike | None = None, echo: bool = True, progress: bool = True):
    """Run ``module_or_script`` on ``nnodes`` nodes of ``nproc_per_node`` ranks each, every node a torchrun
    agent on this machine, all in one c10d rendezvous at ``127.0.0.1:<free port>``; one row per rank.

    The frame is :func:`cadlib.infra.launch.run_torchrun`'s with a ``node`` column; its ``attrs`` hold
    ``results``, ``missing_ranks`` (of the whole world), ``run_dir``, ``node_dirs``, ``progress``,
    ``commands`` (one per node), ``rdzv_endpoint``, ``pg_backend`` and ``wall_s``. Under NCCL each node
    sees its own GPUs (:func:`node_devices`). ``args``, ``pg_backend``, ``env``, ``log_dir``, ``echo``
    and ``progress`` are run_torchrun's.

    Raises TorchrunError naming the node whose agent failed or died, or whose rendezvous did not complete
    within ``join_timeout`` s; TimeoutError after ``timeout`` s; re-raises KeyboardInterrupt. Every
    process of the run is stopped first.
    """
    if isinstance(nnodes, bool) or not isinstance(nnodes, int) or not 1 <= nnodes <= MAX_LOCAL_NODES:
        raise ValueError(f"nnodes must be an integer from 1 to {MAX_LOCAL_NODES} (nodes on this machine), "
                         f"got {nnodes!r}")
    if isinstance(nproc_per_node, bool) or not isinstance(nproc_per_node, int) or nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be an integer >= 1 (ranks per node), got {nproc_per_node!r}")
    run = prepare(module_or_script, nproc_per_node, args, timeout, pg_backend, log_dir, join_timeout,
                  prefix="nodes")
    devices = node_devices(nnodes, nproc_per_node, _visible_devices()) if run.pg_backend == "nccl" else None
    endpoint = f"{LOOPBACK}:{_free_port()}"
    agents = []
    for k in range(nnodes):
        node_dir = run.run_dir / f"node{k}"
        node_dir.mkdir()
        node_env = dict(env or {}, **({"CUDA_VISIBLE_DEVICES": devices[k]} if devices else {}))
        cmd = torchrun_command(run.target, nproc_per_node, node_dir / "torch", run.argv, nnodes, endpoint,
                               rdzv_id=run.run_dir.name, join_timeout=join_timeout, local_addr=node_addr(k))
        agents.append(Agent(cmd, child_env(node_env, run.pg_backend, node_dir, run_id=str(run.run_dir)),
                            node_dir, Console(node_dir / "console.log", echo, progress and k == 0,
                                              first_rank=k * nproc_per_node), node=k))
    t0 = time.monotonic()
    run_agents(agents, str(run.run_dir), run.what, timeout, nnodes, endpoint, join_timeout)
    node_of = collect_results(run.run_dir, nnodes)
    df = results_frame(run.run_dir, nnodes * nproc_per_node)
    df.insert(1, "node", [node_of[r] for r in df["rank"]])
    df.attrs.update(run_dir=str(run.run_dir), node_dirs=[str(a.run_dir) for a in agents],
                    progress=agents[0].console.events, commands=[a.cmd for a in agents],
                    rdzv_endpoint=endpoint, pg_backend=run.pg_backend, wall_s=time.monotonic() - t0)
    return df

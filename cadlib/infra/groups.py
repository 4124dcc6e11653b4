"""Process groups, made in one place: :func:`init_from_env` is gpt-fast's ``maybe_init_dist`` made
explicit. Under torchrun it joins the default process group (backend from ``$CADLIB_PG_BACKEND``, else
NCCL when CUDA is available, else gloo). Started without torchrun (a notebook kernel, ``python
script.py``) it still returns a usable one-rank group: a gloo (or NCCL) group of world size 1 over an
in-memory ``HashStore``, so the same code, collectives with an explicit group included, runs alone or
distributed and no port is taken. Groups are passed explicitly, never read from a global.
"""
from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from . import backend
from .progress import launched_by_torchrun


class Dist(NamedTuple):
    """What a rank needs to know: its rank, the world size, the process group, its device, and the node
    layout as the launcher gave it (torchrun's ``GROUP_RANK``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``:
    this rank's node, its rank on that node, the node's rank count), never assumed."""

    rank: int
    world: int
    group: Any  # torch.distributed.ProcessGroup (the default group); passed explicitly, never global
    device: torch.device
    node: int = 0
    local_rank: int = 0
    local_world: int = 1

    @property
    def pg_backend(self) -> str:
        return dist.get_backend(self.group)


def resolve_pg_backend(pg_backend: str | None = None) -> str:
    """``pg_backend``, else ``$CADLIB_PG_BACKEND``, else ``nccl`` when CUDA is available, else ``gloo``
    (:func:`cadlib.infra.backend.resolve_pg_backend` with this process's CUDA)."""
    return backend.resolve_pg_backend(pg_backend, torch.cuda.is_available())


def init_from_env(pg_backend: str | None = None) -> Dist:
    """Join (or create) the default process group and pick this rank's device.

    Under torchrun: ``init_process_group(backend)`` over ``env://``. Without torchrun: a one-rank
    group over an in-memory ``HashStore``. If a default group already exists it is reused.
    The device is ``cuda:$LOCAL_RANK`` under NCCL (made current), else ``cpu``; a ValueError when the
    node has fewer GPUs than ``$LOCAL_RANK`` needs.
    """
    name = resolve_pg_backend(pg_backend)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if name == "nccl" and local_rank >= torch.cuda.device_count():
        raise ValueError(f"LOCAL_RANK {local_rank} needs GPU cuda:{local_rank}, but this node sees "
                         f"{torch.cuda.device_count()} (LOCAL_WORLD_SIZE={local_world}): start at most that "
                         f"many processes per node (torchrun --nproc-per-node)")
    device = torch.device("cuda", local_rank) if name == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        extra = {"device_id": device} if device.type == "cuda" else {}
        if launched_by_torchrun():
            dist.init_process_group(name, init_method="env://", **extra)
        else:
            dist.init_process_group(name, store=dist.HashStore(), rank=0, world_size=1, **extra)
    group = dist.group.WORLD
    return Dist(dist.get_rank(group), dist.get_world_size(group), group, device,
                int(os.environ.get("GROUP_RANK", "0")), local_rank, local_world)


def comm_group(group, max_ctas: int | None = None):
    """A process group of ``group``'s ranks for communication that overlaps compute (CAD's
    all-to-alls under ping-pong). With NCCL and ``max_ctas``, its communicator runs on at most that
    many thread blocks (``ncclConfig_t.maxCTAs``, what Megatron-LM sets per overlapped group): every
    block NCCL holds is an SM the attention and GEMM kernels beside it cannot use. Without
    ``max_ctas``, ``group`` itself; on gloo (which has no such setting) a plain group of the same
    ranks, so CPU and GPU run the same code. Call it on every rank (a collective) before the first step."""
    if max_ctas is not None and (isinstance(max_ctas, bool) or not isinstance(max_ctas, int) or max_ctas < 1):
        raise ValueError(f"max_ctas must be a positive int (thread blocks per NCCL communicator) or None, "
                         f"got {max_ctas!r}")
    if max_ctas is None or not dist.is_initialized():
        return group
    ranks = dist.get_process_group_ranks(group)
    opts = None
    if dist.get_backend(group) == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts.config.max_ctas = max_ctas
        opts.config.min_ctas = 1
    return dist.new_group(ranks, pg_options=opts, backend=dist.get_backend(group))


class Grid(NamedTuple):
    """The data- x pipeline-parallel grid, ``torch.arange(world).view(pp, dp)`` (as picotron builds
    it): global rank ``s * dp + d`` is data-parallel rank ``d`` of pipeline stage ``s``. ``dp_group``:
    this stage's data-parallel ranks (the gradient all-reduce, per-document CP); ``pp_group``: this
    pipeline's stages (point to point between stages); ``ranks[s][d]``: the global rank."""

    dp: int
    pp: int
    stage: int
    dp_rank: int
    dp_group: Any
    pp_group: Any
    ranks: list

    def rank_of(self, stage: int, dp_rank: int | None = None) -> int:
        """The global rank of ``stage``'s data-parallel rank ``dp_rank`` (default: this rank's)."""
        return self.ranks[stage][self.dp_rank if dp_rank is None else dp_rank]


def check_grid(world: int, pp: int, dp: int | None = None) -> int:
    """The data-parallel degree of ``world`` ranks in ``pp`` stages (``dp`` if given); ValueError
    unless ``dp * pp == world``. Call it on every rank before any collective."""
    for name, v in (("pp", pp), ("dp", dp)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if dp is None:
        if world % pp:
            raise ValueError(f"pp={pp} must divide the world size {world} (dp = world / pp ranks per stage)")
        return world // pp
    if dp * pp != world:
        raise ValueError(f"dp x pp = {dp} x {pp} = {dp * pp} must equal the world size {world}")
    return dp


def make_grid(env: Dist, pp: int, dp: int | None = None) -> Grid:
    """Build the grid's process groups (a collective: every rank calls it, in the same order; the
    sizes are checked first, :func:`check_grid`). With one stage the data-parallel group is the
    world and there is no pipeline group; with one rank per stage, no data-parallel group."""
    dp = check_grid(env.world, pp, dp)
    grid = torch.arange(env.world).view(pp, dp)
    stage, dp_rank = divmod(env.rank, dp)
    dp_group, pp_group = env.group, None
    if pp > 1:
        for s in range(pp):                     # every rank creates every group, in the same order
            g = dist.new_group(grid[s].tolist())
            dp_group = g if s == stage else dp_group
        for d in range(dp):
            g = dist.new_group(grid[:, d].tolist())
            pp_group = g if d == dp_rank else pp_group
    return Grid(dp, pp, stage, dp_rank, dp_group, pp_group, grid.tolist())


def allreduce_grads(params, group) -> None:
    """Data-parallel gradient sum over ``group``, one flat bucket per dtype (the loss is already
    normalised by the whole batch's tokens, so the sum is the gradient)."""
    grads = [p.grad for p in params if p.grad is not None]
    for dtype in {g.dtype for g in grads}:
        gs = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in gs])
        dist.all_reduce(flat, group=group)
        off = 0
        for g in gs:
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()


def barrier(group=None) -> None:
    """Wait for every rank of ``group`` (no-op when no process group exists)."""
    if dist.is_initialized():
        dist.barrier(group=group)


def destroy() -> None:
    """Tear down the default process group if one exists (safe to call twice). A barrier first: a
    rank that tore gloo down while its peer was still finishing (rank 0 writing results) was seen to
    abort at exit ("terminate called without an active exception") about one run in four."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()

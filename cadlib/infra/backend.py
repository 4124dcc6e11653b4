"""The process-group backend, chosen by name without torch: the launcher picks it before any rank
starts (so a bad name fails in the notebook cell, not in every rank), and :mod:`cadlib.infra.groups`
picks it in each rank. Only whether CUDA is available comes from the caller."""
from __future__ import annotations

import os

from .progress import ENV_PG_BACKEND

PG_BACKENDS = ("gloo", "nccl")
"""The process-group backends a run may ask for (``auto``: NCCL when CUDA is available, else gloo)."""


def resolve_pg_backend(pg_backend: str | None, cuda_available: bool) -> str:
    """``pg_backend``, else ``$CADLIB_PG_BACKEND``, else ``nccl`` when ``cuda_available``, else ``gloo``."""
    name = pg_backend or os.environ.get(ENV_PG_BACKEND) or "auto"
    if name == "auto":
        name = "nccl" if cuda_available else "gloo"
    if name not in PG_BACKENDS:
        raise ValueError(f"unknown process-group backend {name!r}; choose one of: auto, "
                         f"{', '.join(PG_BACKENDS)}")
    if name == "nccl" and not cuda_available:
        raise ValueError("process-group backend 'nccl' needs CUDA, but torch.cuda.is_available() is False; "
                         "use 'gloo' or 'auto'")
    return name


def missing_gpus(need: int, nproc: int, gpus: int) -> str | None:
    """One line when a live run that needs ``need`` GPUs cannot have them on this machine, else None.

    ``gpus``: the CUDA devices here (``torch.cuda.device_count()``, 0 without CUDA); ``nproc``: the
    processes asked (0: one per GPU). The run gets ``min(nproc or gpus, gpus)`` GPUs. Without CUDA it
    runs on CPU processes (gloo) and nothing is missing, so the CPU path is unchanged."""
    for name, value, low in (("need", need, 1), ("nproc", nproc, 0), ("gpus", gpus, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if gpus == 0 or min(nproc or gpus, gpus) >= need:
        return None
    asked = f" (nproc={nproc})" if nproc and nproc < min(gpus, need) else ""
    return (f"needs {need} GPUs; this machine has {gpus}{asked}: showing the committed results")

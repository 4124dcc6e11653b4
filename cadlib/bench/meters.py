"""What a benchmark records beside its times: the device's memory peak, TF/s, the kernels' versions."""
from __future__ import annotations

import importlib.metadata

import torch

GB = 1e9

KERNEL_PACKAGES = ("flash-attn-4", "flash-attn", "nvidia-cutlass-dsl")
"""The attention kernels' packages whose versions a result records (None where not installed)."""


def reset_peak(device) -> None:
    """Start a new memory peak on ``device`` (a GPU; nothing on the CPU), the cache emptied first."""
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gb(device) -> float | None:
    """The largest allocation on ``device`` since :func:`reset_peak`, in GB (None on the CPU)."""
    return torch.cuda.max_memory_allocated(device) / GB if torch.device(device).type == "cuda" else None


def tflops(flops: float, ms: float) -> float:
    """``flops / (ms * 1e-3) / 1e12``: TF/s of ``flops`` done in ``ms`` milliseconds (NaN for ``ms <= 0``)."""
    return flops / (ms * 1e-3) / 1e12 if ms > 0 else float("nan")


def backend_versions() -> dict:
    """torch's version and each of :data:`KERNEL_PACKAGES`' (None where not installed)."""
    out = {"torch": torch.__version__}
    for pkg in KERNEL_PACKAGES:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out

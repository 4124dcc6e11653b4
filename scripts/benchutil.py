"""Timing and memory helpers shared by the GPU benchmark scripts (CUDA events after warm-up on a GPU,
perf_counter on the CPU), so every script times the same way."""
from __future__ import annotations

import importlib.metadata
import statistics
import time

import torch
import torch.distributed as dist

GB = 1e9


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn, device, warmup: int, iters: int, group=None, ahead: bool = False, before=None) -> dict:
    """Median (and min) milliseconds of ``fn()``: CUDA events on a GPU, perf_counter on the CPU.
    With ``group``, every rank passes a barrier before each timed call. ``ahead`` (GPU): the start
    event waits behind a ~10 ms device sleep, so ``fn``'s kernels are queued before it fires and the
    time is the device's alone (else a kernel with a slow host launch, as FA4's, is timed with its
    launch). ``before()`` runs after that sleep is queued, before the start event."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        if group is not None:
            dist.barrier(group=group)
        sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if ahead:
                torch.cuda._sleep(20_000_000)                 # cycles: ~10 ms at an H200's clock
            if before is not None:
                before()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            if before is not None:
                before()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "iters": iters}


def reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gb(device):
    return torch.cuda.max_memory_allocated(device) / GB if device.type == "cuda" else None


def rand(gen, n, h, head_dim, device, dtype):
    """Standard-normal ``[n, h, head_dim]`` made on ``device`` (``gen`` is a generator there)."""
    return torch.randn(n, h, head_dim, generator=gen, device=device).to(dtype)


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12 if ms > 0 else float("nan")


def backend_versions() -> dict:
    out = {"torch": torch.__version__}
    for pkg in ("flash-attn-4", "flash-attn", "nvidia-cutlass-dsl"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out

"""The one timer of the benchmarks: CUDA events on a GPU, the wall clock on the CPU, after warm-up.

A timed call runs ``warmup`` times untimed, then ``iters`` times between two marks of a
:class:`Clock`; its time is ``t_end - t_start`` in milliseconds. A call may be cut into phases (a
forward and its backward), each timed between consecutive marks of one run:

    ms[phase][i] = mark[phase + 1] - mark[phase]        for timed run i = 0 .. iters - 1

On a GPU the marks are CUDA events on the current stream, so a time is the device's time between
them; on the CPU they are ``time.perf_counter()``. The options each serve one measurement:
``pre`` builds untimed inputs per run (its value is the first phase's argument), ``after`` cleans up
untimed, ``group`` lines the ranks up with a barrier before each timed run, ``ahead`` queues the run
behind a ~10 ms device sleep (so a kernel whose host launch is slow, as FA4's, is timed on the
device alone), ``before`` queues work after that sleep and before the start mark, ``flush`` zeroes a
buffer before each run (one larger than L2 evicts it), and ``sync_each=False`` queues every run
before one synchronisation at the end instead of synchronising the device around each.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

WARMUP = 1
"""Untimed runs before the timed ones, by default. FA4 compiles a kernel variant the first time a call
needs it (seconds, at any point of a run, not only on the first call), and a timing that includes the
compile is off by up to 190x: the replay's cache written before it timed with this warm-up holds a few
such entries (:func:`cadlib.analysis.replay.times.compile_suspects`). So every new shape runs once
untimed first."""

SLEEP_CYCLES = 20_000_000
"""``ahead``'s device sleep, in GPU clock cycles: about 10 ms at an H200's clock."""

RESERVE_GIB = 100
"""What :func:`reserve_pool` holds by default: most of an H200's 141 GB. A call timed without a warm-up
pays ``cudaMalloc`` for each buffer size the caching allocator has no cached block for; on 144 FA2 server
calls of the paper protocol (1x H200) that put the forward 1.5% and the backward 0.9% above the warmed-up
time (sums; 0.4 and 0.7 ms medians), while after reserving the pool the unwarmed times were 0.997 and 1.001
of the warmed ones: the warm-up's work at none of its cost (``scripts/probes/probe_warmup.py``,
``results/replay/warmup_probe_h200.json``). Every one of these timings synchronises the device before the
call, so the forward's host work runs on an idle device; hidden behind a device sleep (``ahead``), as a
training step hides it, the same forwards take 1.3% less (0.42 ms a call, median), the backwards 0.2%."""

FLUSH_MB = 256
"""The kernel benchmarks' flush buffer, several times a GPU's L2 cache (tens of MB): zeroed before each
timed call, so every call starts with a cold cache."""


class Clock:
    """Marks on one device's timeline: CUDA events recorded on the current stream on a GPU,
    ``time.perf_counter()`` on the CPU; :meth:`Clock.ms` is the time between two of them."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b) -> float:
        """Milliseconds from mark ``a`` to mark ``b`` (on a GPU, waits for ``b``)."""
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b)
        return (b - a) * 1e3

    def wait(self, mark) -> None:
        """Wait until the device has passed ``mark`` (a mark on the CPU has already passed)."""
        if self.cuda:
            mark.synchronize()

    def sync(self) -> None:
        """Wait for the device's queued work (nothing to wait for on the CPU)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)


def _run(phases, args: tuple, clock: Clock | None = None) -> list:
    """One run: ``phases[0](*args)``, then each later phase with the previous one's value; with
    ``clock``, its marks before, between and after the phases."""
    marks = [clock.mark()] if clock else []
    x = phases[0](*args)
    if clock:
        marks.append(clock.mark())
    for phase in phases[1:]:
        x = phase(x)
        if clock:
            marks.append(clock.mark())
    return marks


def reserve_pool(device, gib: float = RESERVE_GIB) -> int:
    """Allocate one block of ``gib`` GiB on ``device`` (at most 90% of its free memory) and free it at
    once: the caching allocator keeps the segment, and later allocations split it instead of calling
    ``cudaMalloc`` inside a timed call (:data:`RESERVE_GIB`). Call it again after ``empty_cache``. A no-op
    on the CPU or with ``gib`` 0; returns the bytes reserved."""
    if gib < 0:
        raise ValueError(f"gib must be >= 0, got {gib}")
    device = torch.device(device)
    if device.type != "cuda" or gib == 0:
        return 0
    n = min(int(gib * 2**30), int(0.9 * torch.cuda.mem_get_info(device)[0]))
    torch.empty(n, dtype=torch.uint8, device=device)
    return n


def time_phases(phases: Sequence[Callable], device, *, iters: int, warmup: int = WARMUP, pre=None,
                after=None, group=None, ahead: bool = False, before=None, flush: torch.Tensor | None = None,
                sync_each: bool = True) -> list[list[float]]:
    """Milliseconds of each phase in each of ``iters`` timed runs, after ``warmup`` untimed runs:
    ``out[p][i]``. A run calls ``phases[0](pre())`` (``phases[0]()`` without ``pre``), then each later
    phase with the previous phase's value; ``after()`` follows every run, untimed. See the module
    docstring for ``group``, ``ahead``, ``before``, ``flush`` and ``sync_each``."""
    if not phases:
        raise ValueError("phases must hold at least one callable")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    clock = Clock(device)
    for _ in range(warmup):
        _run(phases, (pre(),) if pre else ())
        if after:
            after()
    runs = []
    for _ in range(iters):
        args = (pre(),) if pre else ()
        if sync_each:
            clock.sync()
        if group is not None and dist.get_world_size(group) > 1:
            dist.barrier(group=group)
        if ahead and clock.cuda:
            torch.cuda._sleep(SLEEP_CYCLES)
        if before:
            before()
        if flush is not None:
            flush.zero_()
        marks = _run(phases, args, clock)
        if sync_each:
            clock.wait(marks[-1])
        runs.append(marks)
        if after:
            after()
    clock.sync()
    return [[clock.ms(m[p], m[p + 1]) for m in runs] for p in range(len(phases))]


def time_samples(fn: Callable, device, *, iters: int, warmup: int = WARMUP, **options) -> list[float]:
    """Milliseconds of each of ``iters`` timed calls of ``fn`` (:func:`time_phases` with one phase)."""
    return time_phases([fn], device, iters=iters, warmup=warmup, **options)[0]


def stats(ms: Sequence[float]) -> dict:
    """Median, min and the 20% and 80% quantiles of ``ms``, and how many."""
    return {"median_ms": float(np.median(ms)), "min_ms": float(min(ms)),
            "q20_ms": float(np.quantile(ms, 0.2)), "q80_ms": float(np.quantile(ms, 0.8)), "iters": len(ms)}


def flush_buffer(device) -> torch.Tensor | None:
    """A :data:`FLUSH_MB` buffer on ``device`` for ``flush`` (None on the CPU: nothing to flush)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.empty(FLUSH_MB * 2 ** 20, dtype=torch.uint8, device=device)


def time_kernel(fn: Callable, device, *, iters: int, warmup: int, flush: torch.Tensor | None,
                pre=None) -> dict:
    """The kernel benchmarks' timing (``bench_kernels``, ``bench_sparse``): ``iters`` calls of ``fn``
    (``fn(pre())`` with ``pre``) after ``warmup`` untimed ones, each after ``flush`` is zeroed, all
    queued before one synchronisation; ``{"median_ms", "q20_ms", "q80_ms", "reps"}``."""
    st = stats(time_samples(fn, device, iters=iters, warmup=warmup, pre=pre, flush=flush, sync_each=False))
    return {"median_ms": st["median_ms"], "q20_ms": st["q20_ms"], "q80_ms": st["q80_ms"], "reps": st["iters"]}


def time_fn(fn: Callable, device, *, iters: int, warmup: int = WARMUP, **options) -> dict:
    """:func:`stats` of :func:`time_samples`: ``{"median_ms", "min_ms", "q20_ms", "q80_ms", "iters"}``."""
    return stats(time_samples(fn, device, iters=iters, warmup=warmup, **options))

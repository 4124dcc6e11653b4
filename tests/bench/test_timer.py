"""cadlib.bench.timer on the CPU: the warm-up runs are never timed, phases are timed apart, and the hooks
run where the docstring says."""
import time

import pytest
import torch

from cadlib.bench.timer import (WARMUP, Clock, flush_buffer, reserve_pool, stats, time_fn, time_kernel,
                                 time_phases, time_samples)


def test_the_first_run_is_a_warm_up_and_never_timed():
    """A call that compiles on first use (here: sleeps 200 ms once) is timed without its compile."""
    calls = []

    def fn():
        calls.append(len(calls))
        if len(calls) == 1:
            time.sleep(0.2)
    ms = time_samples(fn, "cpu", iters=3)
    assert WARMUP == 1 and len(calls) == WARMUP + 3 and len(ms) == 3
    assert max(ms) < 100, ms
    calls.clear()
    ms0 = time_samples(fn, "cpu", iters=2, warmup=0)
    assert ms0[0] >= 199 and ms0[1] < 100, ms0                   # without the warm-up, the compile is timed


def test_phases_are_timed_apart_and_chain_their_values():
    seen = []

    def first(x):
        time.sleep(0.1)
        return x + 1

    def second(y):
        seen.append(y)
        time.sleep(0.001)
    order = []
    fw, bw = time_phases([first, second], "cpu", iters=2, warmup=1, pre=lambda: order.append("pre") or 10,
                         after=lambda: order.append("after"))
    assert seen == [11, 11, 11]                                # pre's value, plus one, in every run
    assert order == ["pre", "after"] * 3
    assert all(f >= 99 for f in fw) and all(b < 50 for b in bw), (fw, bw)


def test_without_pre_the_first_phase_gets_no_argument_and_options_run_on_the_cpu():
    flushed, before = [], []

    class Buffer:
        def zero_(self):
            flushed.append(1)
    out = time_fn(lambda: None, "cpu", iters=5, before=lambda: before.append(1), flush=Buffer(), ahead=True,
                  sync_each=False)
    assert out["iters"] == 5 and out["min_ms"] <= out["median_ms"] <= out["q80_ms"]
    assert len(before) == len(flushed) == 5                    # before each timed run only


def test_stats_and_clock():
    s = stats([4.0, 1.0, 3.0, 2.0])
    assert s == {"median_ms": 2.5, "min_ms": 1.0, "q20_ms": pytest.approx(1.6), "q80_ms": pytest.approx(3.4),
                 "iters": 4}
    clock = Clock("cpu")
    a = clock.mark()
    time.sleep(0.01)
    b = clock.mark()
    clock.wait(b)
    clock.sync()
    assert 9 <= clock.ms(a, b) < 100


@pytest.mark.parametrize("kw, match", [(dict(iters=0), "iters must be >= 1"),
                                       (dict(iters=1, warmup=-1), "warmup must be >= 0")])
def test_bad_counts_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        time_samples(lambda: None, "cpu", **kw)
    with pytest.raises(ValueError, match="phases"):
        time_phases([], "cpu", iters=1)


def test_the_pool_is_reserved_on_a_gpu_only():
    assert reserve_pool("cpu") == 0 and reserve_pool("cpu", 0) == 0
    with pytest.raises(ValueError, match="gib must be >= 0"):
        reserve_pool("cpu", -1)


@pytest.mark.gpu
def test_a_reserved_pool_stays_cached_for_later_allocations():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.cuda.empty_cache()
    n = reserve_pool("cuda", 1)
    assert 0 < n <= 2**30 and torch.cuda.memory_reserved() >= n and torch.cuda.memory_allocated() < n
    x = torch.empty(2**20, dtype=torch.uint8, device="cuda")  # split from the cached segment
    assert torch.cuda.memory_reserved() >= n
    del x


@pytest.mark.gpu
@pytest.mark.parametrize("sync_each", [True, False])
def test_on_a_gpu_the_events_time_the_device(sync_each):
    """A device sleep of ~5 ms in the first phase is timed there, not in the second (queued at once)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    sleep, nothing = (lambda: torch.cuda._sleep(10_000_000)), (lambda _: None)
    fw, bw = time_phases([sleep, nothing], "cuda", iters=3, ahead=True, sync_each=sync_each)
    assert all(f > 1.0 for f in fw) and all(b < 0.5 for b in bw), (fw, bw)


def test_the_kernel_benchmarks_timing_records_median_quantiles_and_reps():
    assert flush_buffer("cpu") is None                        # nothing to flush on the CPU
    got = []
    out = time_kernel(lambda x: got.append(x), "cpu", iters=4, warmup=2, flush=None, pre=lambda: 7)
    assert set(out) == {"median_ms", "q20_ms", "q80_ms", "reps"} and out["reps"] == 4
    assert got == [7] * 6 and out["q20_ms"] <= out["median_ms"] <= out["q80_ms"]

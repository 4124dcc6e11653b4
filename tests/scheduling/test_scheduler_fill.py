"""The guard's ``equal_flops`` (cadlib/scheduler_fill.py) against the engine's ``mode="flops"``:
the same plan, loads, moves and bytes, with the scalar path and with its numpy fallback."""
import numpy as np
import pytest
from helpers import KVB, QB

from cadlib.data.packing import pack
from cadlib.data.workload import sample_docs, sample_kwargs
from cadlib.scheduling.engine import Greedy
from cadlib.scheduling.shards import cut_shards, end_cut
from cadlib.scheduling.water_fill import WaterFill
from cadlib.testing import random_tiny_layout

FIELDS = ("doc", "q_start", "q_end", "home", "server")


def test_end_cut_matches_cut_shards():
    """``end_cut`` is ``cut_shards``' end row with the engine's validity rule, also past ``2**46``."""
    rng = np.random.default_rng(1)
    for _ in range(5000):
        hi = 10 ** 7 if rng.random() < 0.3 else 400
        a = int(rng.integers(0, hi))
        b = a + int(rng.integers(1, hi))
        T = (b * (b + 1) - a * (a + 1)) // 2
        x = int(rng.integers(1, 2 * T + 2))
        y = int(rng.integers(x - 1 if rng.random() < 0.5 else 0, 2 * T + 2))
        m = int(rng.choice([1, 8, 32, 512, int(rng.integers(1, b - a + 2))]))
        k, p = (int(z[0, 0]) for z in cut_shards([a], [b], x, y, m, sides=1))
        e = a + m if b - a >= 2 * m else b
        valid = k > 0 and p <= y and (e * (e + 1) - a * (a + 1)) // 2 <= y
        assert end_cut(a, b, x, y, m) == ((k, p) if valid else (0, -1)), (a, b, x, y, m)


def _same(ch, n_docs, S, tol, m):
    g = Greedy(ch, n_docs, S, tol, m, QB, KVB, "bytes")
    load0 = g.load.copy()
    g.prepare()
    g.run()                                                    # the fill starts from the greedy's state
    e = Greedy(ch, n_docs, S, tol, m, QB, KVB, "flops")
    reached = e.run()
    w = WaterFill(g, load0)
    assert w.run() == reached
    ta, tb = e.task_arrays(), w.task_arrays()
    assert all(np.array_equal(getattr(ta, f), getattr(tb, f)) for f in FIELDS)
    assert (w.moved_bytes, w.n_moves, w.n_splits) == (e.moved_bytes, e.n_moves, e.n_splits)
    assert np.array_equal(w.load, e.load) and w.imbalance() == e.imbalance()


@pytest.mark.parametrize("scalar_max", [16, 0])
def test_fill_matches_engine_on_random_layouts(scalar_max, monkeypatch):
    """300 random layouts, several tolerances, shard sizes and server counts; ``scalar_max`` 0 takes
    the numpy fallback on every move."""
    monkeypatch.setattr("cadlib.scheduling.water_fill.SCALAR_MAX", scalar_max)
    rng = np.random.default_rng(0)
    for _ in range(300):
        layout, S = random_tiny_layout(rng)
        tol, m = float(rng.choice([0.0, 0.02, 0.1, 0.3])), int(rng.choice([1, 8, 32]))
        _same(layout.chunk_array(), layout.n_docs, S, tol, m)


@pytest.mark.parametrize("dist", ["distca-pretrain", "prolong"])
@pytest.mark.parametrize("method", ["sequential", "balanced"])
def test_fill_matches_engine_on_realistic_batches(dist, method):
    for seed in range(2):
        kw = sample_kwargs(dist)
        docs = sample_docs(kw.pop("dist"), 16 * 32768, seed=seed, **kw)
        layout = pack(docs, 16, 32768, method=method)
        for tol in (0.02, 0.1):
            _same(layout.chunk_array(), layout.n_docs, 16, tol, 512)

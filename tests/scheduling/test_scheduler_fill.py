"""``equal_flops`` (cadlib/scheduling/water_fill.py) against its plain reference, ``reference_greedy``'s
``mode="flops"``: the same plan, loads, splits and exact bytes, with the scalar path and with its numpy
fallback, on random layouts and realistic batches."""
import numpy as np
import pytest
from helpers import KVB, MODEL, QB

from cadlib.core.cost import causal_pairs
from cadlib.core.plan import Plan
from cadlib.data.packing import pack
from cadlib.data.workload import sample_docs, sample_kwargs
from cadlib.scheduling.engine import Greedy
from cadlib.scheduling.greedy import reference_greedy
from cadlib.scheduling.scheduler import colocated
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


def _same(layout, S, tol, m, after_greedy):
    """WaterFill's plan is the reference's, from a fresh greedy or (``after_greedy``, as the guard runs
    it) from one that has moved."""
    ch = layout.chunk_array()
    g = Greedy(ch, layout.n_docs, S, tol, m, QB, KVB)
    load0 = g.load.copy()
    if after_greedy:
        g.run()
    w = WaterFill(g, load0)
    reached = w.run()
    ref, ref_reached = reference_greedy(ch, S, tol, m, QB, KVB, "flops")
    t = w.task_arrays()
    got = sorted(zip(*(getattr(t, f).tolist() for f in FIELDS)))
    assert got == sorted(map(tuple, ref)) and reached == ref_reached
    load = np.zeros(S, dtype=np.int64)
    for d, a, b, h, srv in ref:
        load[srv] += causal_pairs(a, b)
    assert np.array_equal(w.load, load) and w.n_splits == len(ref) - len(ch)
    whole = sum(r[4] != h % S for r, h in zip(ref, ch[:, 3].tolist()))    # (the chunks come first)
    assert w.n_moves == w.n_splits + whole
    plan = Plan.from_arrays(layout, *(np.array([r[i] for r in ref], dtype=np.int64) for i in range(5)),
                            n_servers=S, chunks=ch)
    assert w.moved_bytes == plan.forward_bytes(MODEL) - colocated(layout, S).forward_bytes(MODEL)


@pytest.mark.parametrize("scalar_max", [16, 0])
def test_fill_matches_reference_on_random_layouts(scalar_max, monkeypatch):
    """300 random layouts, several tolerances, shard sizes and server counts; ``scalar_max`` 0 takes
    the numpy fallback on every move."""
    monkeypatch.setattr("cadlib.scheduling.water_fill.SCALAR_MAX", scalar_max)
    rng = np.random.default_rng(0)
    for i in range(300):
        layout, S = random_tiny_layout(rng)
        tol, m = float(rng.choice([0.0, 0.02, 0.1, 0.3])), int(rng.choice([1, 8, 32]))
        _same(layout, S, tol, m, after_greedy=i % 2 == 1)


@pytest.mark.parametrize("dist", ["distca-pretrain", "prolong"])
@pytest.mark.parametrize("method", ["sequential", "balanced"])
def test_fill_matches_reference_on_realistic_batches(dist, method):
    for seed in range(2):
        kw = sample_kwargs(dist)
        docs = sample_docs(kw.pop("dist"), 16 * 32768, seed=seed, **kw)
        layout = pack(docs, 16, 32768, method=method)
        for tol in (0.02, 0.1):
            _same(layout, 16, tol, 512, after_greedy=seed == 1)

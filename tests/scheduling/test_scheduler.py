"""Tests of the CAD scheduler (cadlib/scheduling/scheduler.py, cadlib/scheduling/engine.py): the
engine against the plain reference greedy, the plan's own accounting, a per-token search for the cut,
the balance bound the greedy guarantees, and never more bytes than the bytes-blind equal-FLOPs
baseline."""
import math

import numpy as np
import pytest
from helpers import KVB, MODEL, QB, check_scheduler_plan, layouts, reference_token_matrices
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cadlib.core.cost import causal_pairs
from cadlib.core.layout import Layout, layout_from_lists
from cadlib.scheduling.engine import Greedy
from cadlib.scheduling.greedy import reference_greedy
from cadlib.scheduling.scheduler import colocated, equal_flops, place, schedule
from cadlib.scheduling.shards import cut_near, cut_shards, tri_floor
from cadlib.scheduling.water_fill import WaterFill
from cadlib.testing import random_tiny_layout


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=layouts(), tol=st.floats(0.0, 1.0), min_shard=st.sampled_from([1, 2, 4, 16]),
       servers=st.one_of(st.none(), st.integers(1, 64)), method=st.sampled_from(["cad", "equal_flops"]))
def test_random_layouts(layout, tol, min_shard, servers, method):
    plan = place(layout, method, servers, MODEL, tol, min_shard)
    check_scheduler_plan(plan, layout, servers)
    q, kv = reference_token_matrices(plan)              # per-token reference accounting
    np.testing.assert_array_equal(q, plan.token_matrices()[0])
    np.testing.assert_array_equal(kv, plan.token_matrices()[1])
    base = colocated(layout, servers).forward_bytes(MODEL)
    assert plan.meta["moved_bytes"] == q.sum() * QB + kv.sum() * KVB - base
    load = plan.server_pairs()
    mean = load.sum() / plan.n_servers
    assert plan.meta["reached"] == bool(load.max() <= (1 + tol) * mean)
    # Guarantee: every valid move of a task [a, b) carries at most (2m - 1) * b pairs (a shard of m
    # tokens, or a whole task shorter than 2m). Receivers have room U - load summing to
    # S * tol * mean + (donors' excess), so while a donor exists some receiver has room
    # > tol * mean; if that exceeds every minimal move, the greedy always finds a move and ends balanced.
    if tol * mean >= (2 * min_shard - 1) * max(layout.doc_lens):
        assert plan.meta["reached"]
        assert plan.imbalance() <= 1 + tol + 1e-12
    if method == "cad" and min_shard == 1 and plan.meta["reached"]:
        assert plan.imbalance() <= 1 + tol + 1e-12


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=layouts(max_docs=16, max_len=400), tol=st.sampled_from([0.0, 0.02, 0.05, 0.1, 0.3]),
       min_shard=st.sampled_from([1, 8, 32]), servers=st.one_of(st.none(), st.integers(1, 16)))
def test_never_worse_than_equal_flops_on_random_layouts(layout, tol, min_shard, servers):
    """``schedule`` reaches the tolerance whenever ``equal_flops`` does, then with no more forward
    bytes; when neither does, with no higher peak load."""
    cad = schedule(layout, servers, MODEL, tol, min_shard)
    eq = equal_flops(layout, servers, tol, min_shard)
    if eq.meta["reached"]:
        assert cad.meta["reached"]
        assert cad.forward_bytes(MODEL) <= eq.forward_bytes(MODEL)
    elif not cad.meta["reached"]:
        assert cad.server_pairs().max() <= eq.server_pairs().max()


@settings(max_examples=100, deadline=None)
@given(a=st.integers(0, 300), n=st.integers(1, 200), xf=st.floats(0, 1), yf=st.floats(0, 1.5),
       m=st.integers(1, 40), from_end=st.booleans())
def test_cut_matches_token_search(a, n, xf, yf, m, from_end):
    """Reference: try every k; the fewest valid tokens with pairs >= x, else the most with pairs <= y."""
    b = a + n
    total = causal_pairs(a, b)
    x = max(1, int(xf * total))
    y = int(yf * total)

    def pairs(k):
        return causal_pairs(b - k, b) if from_end else causal_pairs(a, a + k)

    valid = [k for k in range(1, n + 1) if k == n or m <= k <= n - m]
    up = min(k for k in valid if pairs(k) >= x)
    if pairs(up) <= y:
        want = up
    else:
        fits = [k for k in valid if pairs(k) <= y]
        want = max(fits) if fits else 0
    k, p = cut_shards([a], [b], [x], [y], m)
    k, p = k[0 if from_end else 1], p[0 if from_end else 1]
    assert int(k[0]) == want
    if want:
        assert int(p[0]) == pairs(want)
    if y >= x - 1:                                      # the engine's case: cut_near, the same cut
        kn, pn = cut_near(np.array([a]), np.array([b]), np.array([x]), np.array([y]), m)
        assert int(kn[0 if from_end else 1, 0]) == want
        if want:
            assert int(pn[0 if from_end else 1, 0]) == pairs(want)


def test_cut_near_is_cut_shards_where_x_is_at_most_y_plus_one():
    """``cut_near`` (the fewest-token roots alone) equals ``cut_shards`` for ``1 <= x <= y + 1`` as the
    engine forms them (``x`` the ceiling of at most the room, ``y`` its floor), also past ``2**46``."""
    rng = np.random.default_rng(3)
    for _ in range(2000):
        N = int(rng.integers(1, 40))
        hi = int(rng.choice([50, 400, 10 ** 5, 2 ** 24]))
        a = rng.integers(0, hi, N)
        b = a + rng.integers(1, hi, N)
        T = (b * (b + 1) - a * (a + 1)) // 2
        room = np.maximum(rng.random(N) * (2 * T + 2) * rng.choice([0.01, 0.3, 1, 3]), 1e-3)
        excess = rng.random() * (2 * T.max() + 2) * rng.choice([0.01, 0.3, 1, 3])
        x = np.maximum(np.ceil(np.minimum(excess, room)), 1).astype(np.int64)
        y = np.floor(room).astype(np.int64)
        m = int(rng.choice([1, 8, 32, 512, int(rng.integers(1, hi))]))
        for want, got in zip(cut_shards(a, b, x, y, m), cut_near(a, b, x, y, m)):
            assert np.array_equal(want, got)


def test_hand_computed_cut():
    """2 ranks, one 2048-token doc split in halves, tolerance 0, min_shard 1. Rank 1's tail [1024, 2048)
    carries 1573376 pairs, rank 0 524800; mean 1049088, so 524288 pairs should move to rank 0.
    End shard: k = 274 tokens [1774, 2048) (523751 pairs; 275 would overfill rank 0) needs KV
    [1024, 2048): (274 * 8192 + 1024 * 4096) / 523751 = 12.3 B/pair. Start shard: [1024, 1448)
    (sum_{i=1024}^{1447} (i+1) = 524276 <= 524288) needs KV [1024, 1448) only:
    (424 * 8192 + 424 * 4096) / 524276 = 9.9 B/pair, so the start shard wins. No token of the tail
    fits in the 12 pairs left, so the tolerance-0 target is not reached."""
    layout = layout_from_lists([[(0, 0, 1024)], [(0, 1024, 2048)]], [2048])
    plan = schedule(layout, model=MODEL, tolerance=0.0, min_shard=1)
    assert sorted(plan.tasks) == sorted([(0, 0, 1024, 0, 0), (0, 1024, 1448, 1, 0), (0, 1448, 2048, 1, 1)])
    assert plan.meta["n_moves"] == 1 and plan.meta["n_splits"] == 1 and plan.meta["reached"] is False
    assert plan.server_pairs().tolist() == [524800 + 524276, 1573376 - 524276]
    q, kv = plan.token_matrices()
    assert q[1, 0] == 424 and kv[1, 0] == 424
    # with 1% tolerance the same single move is enough
    assert schedule(layout, model=MODEL, tolerance=0.01, min_shard=1).meta["reached"] is True


def test_empty_ranks_one_token_docs_and_server_counts():
    layout = layout_from_lists([[], [(0, 0, 1), (1, 0, 300)], [], [(2, 0, 1), (1, 300, 600)]], [1, 600, 1])
    for servers in (None, 1, 2, 3, 7):
        for fn in (schedule, equal_flops, colocated):
            plan = fn(layout, servers) if fn is not schedule else fn(layout, servers, min_shard=1)
            check_scheduler_plan(plan, layout, servers)
    plan = colocated(layout, 3)
    assert all(t.server == t.home % 3 for t in plan.tasks)
    assert schedule(layout, 1).imbalance() == 1.0


def test_bad_arguments():
    layout = layout_from_lists([[(0, 0, 10)]], [10])
    with pytest.raises(ValueError, match="n_servers must be an integer >= 1"):
        schedule(layout, 0)
    with pytest.raises(ValueError, match="n_servers must be an integer >= 1"):
        schedule(layout, n_servers=2.7)
    with pytest.raises(ValueError, match="n_servers must be an integer >= 1"):
        schedule(layout, n_servers="2")
    with pytest.raises(ValueError, match="tolerance must be a finite number >= 0"):
        schedule(layout, tolerance=-0.1)
    with pytest.raises(ValueError, match="tolerance must be a finite number >= 0"):
        equal_flops(layout, tolerance=float("nan"))
    with pytest.raises(ValueError, match="tolerance must be a finite number >= 0"):
        schedule(layout, tolerance="0.1")
    with pytest.raises(ValueError, match="tolerance must be a finite number >= 0"):
        schedule(layout, tolerance=float("inf"))
    with pytest.raises(ValueError, match="min_shard must be an integer >= 1"):
        schedule(layout, min_shard=0)
    with pytest.raises(ValueError, match="min_shard must be an integer >= 1"):
        schedule(layout, min_shard=1.5)
    with pytest.raises(ValueError, match="model must be a ModelSpec or one of"):
        schedule(layout, model=42)
    with pytest.raises(ValueError, match="unknown method 'best'; choose one of"):
        place(layout, "best")
    with pytest.raises(ValueError, match="unknown dtype"):
        schedule(layout, dtype="int3")
    with pytest.raises(ValueError, match="layout must be a cadlib.core.layout.Layout"):
        schedule([[(0, 0, 10)]])
    plan = schedule(layout, n_servers=np.int64(2), min_shard=np.int64(4), tolerance=np.float32(0.1))
    assert plan.n_servers == 2


def _skewed(seed):
    """A tail-heavy layout: each of 16 ranks holds 8192 tokens; every fourth rank holds the tail of a
    long document (its head on the previous rank) next to short ones."""
    rng = np.random.default_rng(seed)
    ranks, lens = [], []
    for r in range(16):
        chunks, room = [], 8192
        if r % 4 == 1:                                   # tail of the long doc started on rank r - 1
            d = lens.index(-1)
            lens[d] = 8192 + 6144
            chunks.append((d, 8192, 8192 + 6144))
            room -= 6144
        while room > 0:
            n = int(min(room, rng.integers(64, 1024)))
            if r % 4 == 0 and room == 8192:              # head of a long doc fills this rank
                n = 8192
                lens.append(-1)
            else:
                lens.append(n)
            chunks.append((len(lens) - 1, 0, n))
            room -= n
        ranks.append(chunks)
    return Layout([list(c) for c in ranks], lens)


def test_cad_moves_fewer_bytes_than_equal_flops():
    for seed in range(3):
        layout = _skewed(seed)
        cad = schedule(layout, model=MODEL, tolerance=0.1, min_shard=128)
        eq = equal_flops(layout, tolerance=0.1, min_shard=128)
        assert cad.meta["reached"] and eq.meta["reached"]
        assert cad.imbalance() <= 1.1 + 1e-12 and eq.imbalance() <= 1.1 + 1e-12
        base = colocated(layout).total_bytes(MODEL)
        assert cad.total_bytes(MODEL) - base < 0.95 * (eq.total_bytes(MODEL) - base)   # measured 0.86-0.90


def testtri_floor_exact_near_square_boundaries():
    """``tri_floor`` against ``math.isqrt`` at ``c(c+1) + d`` for ``d`` in -2..2, across the float fast
    path (``v < 2**46``) and the corrected path above it."""

    rng = np.random.default_rng(0)
    c = np.r_[np.arange(0, 2000), rng.integers(0, 2 ** 23, 3000), 2 ** 23 - np.arange(1, 500),
              rng.integers(2 ** 23, 2 ** 30, 2000)].astype(np.int64)
    for d in (-2, -1, 0, 1, 2):
        v = np.maximum(c * (c + 1) + d, 0)
        for part in (v[v < 2 ** 46], v[v >= 2 ** 46]):
            want = [(math.isqrt(4 * int(x) + 1) - 1) // 2 for x in part]
            np.testing.assert_array_equal(tri_floor(part), want)


def test_cut_exact_at_large_boundaries():
    """The float roots in ``_cuts`` (floor and ceiling) against exact integer bisection, for tasks of
    up to 4M tokens and ``x``, ``y`` within one pair of a shard boundary."""
    from bisect import bisect_left

    rng = np.random.default_rng(1)
    for _ in range(300):
        m = int(rng.choice([1, 512]))
        a = int(rng.integers(0, 2 ** 22))
        n = int(rng.integers(2 * m + 1, 2 ** 22))
        b = a + n
        from_end = bool(rng.integers(0, 2))

        def pairs(k):
            return causal_pairs(b - k, b) if from_end else causal_pairs(a, a + k)

        class Pairs:                                    # pairs(k) for bisect, k = 0..n
            def __getitem__(self, k):
                return pairs(k)

            def __len__(self):
                return n + 1

        k0 = int(rng.integers(m, n - m + 1))
        for dx in (-1, 0, 1):
            for dy in (-1, 0, 1):
                x, y = max(1, pairs(k0) + dx), pairs(k0) + dy
                up = bisect_left(Pairs(), x)           # fewest tokens with pairs >= x, then valid
                up = n if max(up, m) > n - m else max(up, m)
                if pairs(up) <= y:
                    want = up
                else:
                    dn = bisect_left(Pairs(), y + 1) - 1   # most tokens with pairs <= y, then valid
                    want = n if dn >= n else (min(dn, n - m) if min(dn, n - m) >= m else 0)
                k, p = cut_shards([a], [b], [x], [y], m)
                k, p = k[0 if from_end else 1], p[0 if from_end else 1]
                assert int(k[0]) == want
                if want:
                    assert int(p[0]) == pairs(want)


@pytest.mark.parametrize("tokens_per_rank", [32 * 1024, 128 * 1024])
def test_cad_moves_no_more_bytes_than_equal_flops_on_prolong(tokens_per_rank):
    """ProLong at 64 servers (long documents cut over neighbouring ranks): the communication-aware
    scheduler dispatches no more bytes than the bytes-blind water-filling, both reaching 1.1 x mean."""
    from cadlib.data.packing import pack
    from cadlib.data.workload import sample_docs
    tpr = tokens_per_rank
    layout = pack(sample_docs("prolong", 64 * tpr, seed=0), 64, tpr, method="sequential")
    ch = layout.chunk_array()
    cad, eq = (place(layout, m, 64, MODEL, 0.1, 512, chunks=ch) for m in ("cad", "equal_flops"))
    assert cad.meta["reached"] and eq.meta["reached"]
    assert cad.imbalance() <= 1.1 + 1e-12
    assert cad.forward_bytes(MODEL) <= eq.forward_bytes(MODEL)


def test_engine_matches_reference_greedy():
    """The vectorised engine makes exactly the reference greedy's moves, and ``WaterFill`` its
    ``flops`` mode's, on 200 random layouts (several tolerances, shard sizes and server counts)."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        layout, S = random_tiny_layout(rng)
        tol, m = float(rng.choice([0.0, 0.02, 0.1, 0.3])), int(rng.choice([1, 8, 32]))
        ch = layout.chunk_array()
        for mode in ("bytes", "flops"):
            ref, ref_reached = reference_greedy(ch, S, tol, m, QB, KVB, mode)
            g = Greedy(ch, layout.n_docs, S, tol, m, QB, KVB)
            if mode == "flops":
                g = WaterFill(g, g.load)
            reached = g.run()
            t = g.task_arrays()
            got = sorted(zip(*(c.tolist() for c in (t.doc, t.q_start, t.q_end, t.home, t.server))))
            assert got == sorted(map(tuple, ref)) and reached == ref_reached


GRID_SUBSET = [(dist, pk, seed) for dist in ("distca-pretrain", "prolong")
               for pk in ("sequential", "balanced") for seed in (0, 1)]


@pytest.mark.parametrize("dist,pk,seed", GRID_SUBSET)
def test_never_worse_than_equal_flops_on_realistic_batches(dist, pk, seed):
    """8 ranks x 32K tokens (a corner of the benchmark grid), tolerance 0.02, 0.05, 0.1, min_shard 512:
    the greedy alone (no guard) reaches the tolerance whenever equal_flops does, within 3% of its
    bytes; with the guard (the default) never above them."""
    from cadlib.data.packing import pack
    from cadlib.data.workload import sample_docs, sample_kwargs
    kw = sample_kwargs(dist)
    docs = sample_docs(kw.pop("dist"), 8 * 32768, seed=seed, **kw)
    layout = pack(docs, 8, 32768, method=pk)
    ch = layout.chunk_array()
    for tol in (0.02, 0.05, 0.1):
        eq = place(layout, "equal_flops", 8, MODEL, tol, 512, chunks=ch)
        raw = place(layout, "cad", 8, MODEL, tol, 512, chunks=ch, guard=False)
        cad = place(layout, "cad", 8, MODEL, tol, 512, chunks=ch)
        if eq.meta["reached"]:
            assert raw.meta["reached"] and cad.meta["reached"]
        assert raw.forward_bytes(MODEL) <= 1.03 * eq.forward_bytes(MODEL)
        assert cad.forward_bytes(MODEL) <= eq.forward_bytes(MODEL)


def test_forward_bytes_of_moves_are_exact():
    """The forward bytes the greedy tracks move by move equal Plan's accounting (stale holdings would
    show), in both modes."""
    rng = np.random.default_rng(5)
    for _ in range(30):
        layout, S = random_tiny_layout(rng)
        base = colocated(layout, S).forward_bytes(MODEL)
        for method in ("cad", "equal_flops"):
            plan = place(layout, method, S, MODEL, 0.05, 8, guard=False)
            plan.validate()
            q, kv = reference_token_matrices(plan)
            assert plan.meta["moved_bytes"] == q.sum() * QB + kv.sum() * KVB - base

"""The CAD greedy alone (``place(..., guard=False)``): properties it keeps on random layouts (its
moves are the plain reference's, its bytes exact, its pruning changes no move); and with the guard
(the default), never worse than the bytes-blind ``equal_flops``."""
import numpy as np
from helpers import KVB, MODEL, QB, check_scheduler_plan, layouts, reference_token_matrices
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cadlib.scheduling.engine import Greedy
from cadlib.scheduling.greedy import reference_greedy
from cadlib.scheduling.scheduler import colocated, place
from cadlib.testing import random_tiny_layout


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=layouts(max_ranks=16, max_docs=10, max_len=200), tol=st.sampled_from([0.0, 0.02, 0.1, 0.3]),
       min_shard=st.sampled_from([1, 8, 32]), servers=st.one_of(st.none(), st.integers(1, 12)))
def test_greedy_alone_keeps_its_invariants(layout, tol, min_shard, servers):
    """Without the guard: a valid plan, the engine's moves equal the plain reference greedy's, the
    tracked bytes are exact, no server ends above the starting peak (every move lowers the donor,
    the most loaded server, and fills its receiver to at most ``U``), ``reached`` means the tolerance."""
    plan = place(layout, "cad", servers, MODEL, tol, min_shard, guard=False)
    check_scheduler_plan(plan, layout, servers)
    assert plan.meta["guard"] is False
    S = plan.n_servers
    ref, ref_reached = reference_greedy(layout.chunk_array(), S, tol, min_shard, QB, KVB, "bytes")
    assert sorted(plan.tasks) == sorted(map(tuple, ref)) and plan.meta["reached"] == ref_reached
    q, kv = reference_token_matrices(plan)
    base = colocated(layout, servers)
    assert plan.meta["moved_bytes"] == q.sum() * QB + kv.sum() * KVB - base.forward_bytes(MODEL)
    load = plan.server_pairs()
    assert load.max() <= base.server_pairs().max()
    assert plan.meta["reached"] == bool(load.max() <= (1 + tol) * load.sum() / S)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=layouts(max_docs=16, max_len=400), tol=st.sampled_from([0.0, 0.02, 0.05, 0.1, 0.3]),
       min_shard=st.sampled_from([1, 8, 32]), servers=st.one_of(st.none(), st.integers(1, 16)))
def test_guarded_plan_never_worse_than_equal_flops(layout, tol, min_shard, servers):
    """With the guard (the default): the tolerance whenever ``equal_flops`` reaches it, then no more
    forward bytes; neither reaching it: no higher peak."""
    ch = layout.chunk_array()
    cad = place(layout, "cad", servers, MODEL, tol, min_shard, chunks=ch)
    eq = place(layout, "equal_flops", servers, MODEL, tol, min_shard, chunks=ch)
    if eq.meta["reached"]:
        assert cad.meta["reached"] and cad.forward_bytes(MODEL) <= eq.forward_bytes(MODEL)
    elif not cad.meta["reached"]:
        assert cad.server_pairs().max() <= eq.server_pairs().max()


def _random_cases(n, seed):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        layout, S = random_tiny_layout(rng)
        yield layout, S, float(rng.choice([0.0, 0.02, 0.1, 0.3])), int(rng.choice([1, 8, 32]))


def test_pruning_changes_no_move(monkeypatch):
    """``Greedy.prune`` drops only rows that cannot be the best move: the plans with and without it
    are the same, on random layouts where it drops rows."""
    prune, dropped = Greedy.prune, []

    def counting(self, v, F, keep, excess, room):
        before = int(keep.sum())
        prune(self, v, F, keep, excess, room)
        dropped.append(before - int(keep.sum()))

    cases = list(_random_cases(300, 8))
    monkeypatch.setattr(Greedy, "prune", counting)
    pruned = [place(lay, "cad", S, MODEL, tol, m, guard=False).tasks for lay, S, tol, m in cases]
    monkeypatch.setattr(Greedy, "prune", lambda *args: None)
    for (lay, S, tol, m), tasks in zip(cases, pruned):
        assert sorted(place(lay, "cad", S, MODEL, tol, m, guard=False).tasks) == sorted(tasks)
    assert sum(x > 0 for x in dropped) > 50


def test_guarded_plan_never_loses_on_random_layouts():
    """With the guard, against ``equal_flops`` on 1,000 random tiny layouts: no more bytes where both
    reach the tolerance, no missed tolerance, no higher peak where neither reaches it."""
    count = {"bytes": 0, "miss": 0, "peak": 0}
    for layout, S, tol, m in _random_cases(1000, 0):
        ch = layout.chunk_array()
        cad = place(layout, "cad", S, MODEL, tol, m, chunks=ch)
        eq = place(layout, "equal_flops", S, MODEL, tol, m, chunks=ch)
        if eq.meta["reached"] and not cad.meta["reached"]:
            count["miss"] += 1
        elif eq.meta["reached"]:
            count["bytes"] += cad.forward_bytes(MODEL) > eq.forward_bytes(MODEL)
        elif not cad.meta["reached"]:
            count["peak"] += cad.server_pairs().max() > eq.server_pairs().max()
    assert count == {"bytes": 0, "miss": 0, "peak": 0}, count

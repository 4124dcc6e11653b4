"""Dispatch metadata, single process: counts match Plan.token_matrices(), indices round-trip.

Every token carries its global id ``doc * BIG + pos``; exchanges are simulated with numpy
(``simulate_exchange``), so a wrong index shows up as a wrong id."""
import numpy as np
import pytest
from helpers import check_plan, local_ids, random_scattered_plan
from hypothesis import given, settings
from hypothesis import strategies as st

from cadlib.core.layout import Layout
from cadlib.core.plan import CATask, Plan, layout_to_tasks
from cadlib.dispatch.build import build_all, build_dispatch, local_index_map, simulate_exchange
from cadlib.runtime.device import to_device


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), n_ranks=st.integers(1, 5))
def test_random_plans_round_trip(seed, n_ranks):
    check_plan(random_scattered_plan(seed, n_ranks))


def test_colocated_plan_moves_nothing():
    plan = random_scattered_plan(3, 3)
    plan = Plan(plan.layout, layout_to_tasks(plan.layout))
    ds = build_all(plan)
    # a document split over ranks still needs remote KV prefixes; a colocated Q never moves
    assert not any(d.q_traffic for d in ds) and all(sum(d.q_send_splits) == 0 for d in ds)
    check_plan(plan)


def test_servers_computing_their_whole_buffer_read_it_in_place():
    # rank 0: docs 0 (6) and 1 (2) in that order; rank 1: doc 2 (10), whose tail [6, 10) rank 0 serves
    layout = Layout([[(0, 0, 6), (1, 0, 2)], [(2, 0, 10)]], [6, 2, 10])
    tasks = [CATask(0, 0, 6, 0, 0), CATask(1, 0, 2, 0, 0), CATask(2, 0, 6, 1, 1), CATask(2, 6, 8, 1, 0),
             CATask(2, 8, 10, 1, 0)]
    d0, d1 = build_all(Plan(layout, tasks))
    # rank 0 computes all 8 local rows and the 4 received ones: buffer order (not LPT, which would
    # list doc 2's shards first), no gather; the two received shards are still one merged segment
    assert d0.q_identity and d0.q_rows.tolist() == list(range(12)) and d0.shared().n_segments == 3
    assert d0.task_doc.tolist() == [0, 1, 2, 2]
    # rank 1 sends part of its rows away: LPT order, gathers as before
    assert not d1.q_identity
    # buffer order would split a merge group: rank 0 holds doc 0's [4, 8) and serves [0, 4) from rank 1,
    # which lands after its own rows; LPT lists [0, 4), [4, 8) together (one segment), so LPT stays
    layout = Layout([[(0, 4, 8), (1, 0, 3)], [(0, 0, 4)]], [8, 3])
    tasks = [CATask(0, 4, 8, 0, 0), CATask(1, 0, 3, 0, 0), CATask(0, 0, 4, 1, 0)]
    d0 = build_all(Plan(layout, tasks))[0]
    assert not d0.q_identity and d0.shared().n_segments == 2
    check_plan(Plan(layout, tasks))


def test_kv_sent_once_per_server_and_doc():
    # doc 0 = [0, 8) on rank 0 and [8, 16) on rank 1; three tasks of rank 1's chunk all served on
    # rank 2 need prefixes [0, 10), [0, 13), [0, 16): rank 0 sends its 8 tokens once, rank 1 its 8
    layout = Layout([[(0, 0, 8)], [(0, 8, 16)], []], [16])
    tasks = [CATask(0, 0, 8, 0, 0), CATask(0, 8, 10, 1, 2), CATask(0, 10, 13, 1, 2), CATask(0, 13, 16, 1, 2)]
    plan = Plan(layout, tasks)
    d2 = build_dispatch(plan, 2)
    assert d2.kv_recv_splits == [8, 8, 0] and d2.q_recv_splits == [0, 8, 0]
    assert d2.n_local == 0 and d2.n_tasks == 3 and len(d2.kv_rows) == 10 + 13 + 16
    assert build_dispatch(plan, 0).kv_send_splits == [0, 0, 8]
    check_plan(plan)


def test_tasks_spanning_two_chunks_of_one_rank():
    layout = Layout([[(0, 5, 9), (1, 0, 3), (0, 0, 5)], [(1, 3, 7)]], [9, 7])
    plan = Plan(layout, [CATask(0, 0, 9, 0, 1), CATask(1, 0, 3, 0, 1), CATask(1, 3, 7, 1, 0)])
    assert local_index_map(layout)[0].tolist() == [7, 8, 9, 10, 11, 0, 1, 2, 3]
    check_plan(plan)


def test_scheduler_plans_round_trip():
    scheduler = pytest.importorskip("cadlib.scheduling.scheduler")
    workload = pytest.importorskip("cadlib.data.workload")
    packing = pytest.importorskip("cadlib.data.packing")
    for n_ranks, dist in [(2, "pretrain"), (3, "prolong"), (4, "pile")]:
        docs = workload.sample_docs(dist, 1200 * n_ranks, seed=n_ranks)
        layout = packing.pack(docs, n_ranks, 1200)
        check_plan(scheduler.schedule(layout, min_shard=16))


def test_errors_say_what_is_valid():
    plan = random_scattered_plan(0, 2)
    with pytest.raises(ValueError, match=r"rank 5 is outside the plan's ranks 0\.\.1"):
        build_dispatch(plan, 5)
    wide = Plan(plan.layout, plan.tasks, n_servers=3)
    with pytest.raises(ValueError, match="must be equal"):
        build_dispatch(wide, 0)
    with pytest.raises(ValueError, match="choose one of: q, kv"):
        simulate_exchange(build_all(plan), local_ids(plan.layout), "o")


def test_to_device_copies_every_index_array():
    """``Dispatch.to``: every index array as a tensor (int64; cu_q/cu_k int32), cached per device."""
    torch = pytest.importorskip("torch")
    d = build_dispatch(random_scattered_plan(7, 3), 1)
    dev = to_device(d, "cpu")
    assert to_device(d, "cpu") is dev
    for name in ("q_send_index", "kv_send_index", "q_rows", "kv_rows", "ret_rows", "self_rows", "self_local"):
        t = getattr(dev, name)
        assert t.dtype == torch.int64 and np.array_equal(t.numpy(), getattr(d, name))
    assert dev.cu_q.dtype == torch.int32 and np.array_equal(dev.cu_k.numpy(), d.cu_k)


def test_a_layout_without_chunks_has_no_traffic():
    """An empty nano-batch (one rank's tokens all in the other one): nothing to send, nothing to serve."""
    layout = Layout([[]], [])
    d = build_dispatch(Plan(layout, [], validate=False), 0)
    assert (d.n_local, d.n_tasks, d.q_traffic, d.kv_traffic) == (0, 0, False, False)

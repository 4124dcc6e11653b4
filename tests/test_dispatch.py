"""Dispatch metadata, single process: counts match Plan.token_matrices(), indices round-trip.

Every token carries its global id ``doc * BIG + pos``; exchanges are simulated with numpy
(``simulate_exchange``), so a wrong index shows up as a wrong id."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cadlib.dispatch import build_all, build_dispatch, kv_needs, local_index_map, simulate_exchange
from cadlib.plan import CATask, Layout, Plan, layout_to_tasks

BIG = 1 << 20


def random_plan(seed: int, n_ranks: int, max_docs: int = 6, max_len: int = 40) -> Plan:
    """Documents cut into random chunks scattered over ranks (some ranks may be empty), each chunk
    cut into random tasks placed on random servers."""
    rng = np.random.default_rng(seed)
    doc_lens = rng.integers(1, max_len, size=rng.integers(1, max_docs + 1)).tolist()
    ranks: list[list[tuple[int, int, int]]] = [[] for _ in range(n_ranks)]
    for d, n in enumerate(doc_lens):
        cuts = np.unique(rng.integers(1, n, size=rng.integers(0, 4))) if n > 1 else []
        bounds = [0, *[int(c) for c in cuts], n]
        for a, b in zip(bounds[:-1], bounds[1:]):
            ranks[int(rng.integers(n_ranks))].append((d, a, b))
    for r in ranks:
        rng.shuffle(r)
    layout = Layout(ranks, doc_lens)
    tasks = []
    for t in layout_to_tasks(layout):
        cuts = np.unique(rng.integers(t.q_start + 1, t.q_end, size=rng.integers(0, 3))) if t.n_q > 1 else []
        bounds = [t.q_start, *[int(c) for c in cuts], t.q_end]
        for a, b in zip(bounds[:-1], bounds[1:]):
            tasks.append(CATask(t.doc, a, b, t.home, int(rng.integers(n_ranks))))
    rng.shuffle(tasks)
    return Plan(layout, tasks)


def local_ids(layout: Layout) -> list[np.ndarray]:
    return [np.concatenate([c.doc * BIG + np.arange(c.start, c.end) for c in r]).astype(np.int64)
            if r else np.zeros(0, dtype=np.int64) for r in layout.ranks]


def reverse(dispatches, server_bufs, kind):
    """The return trip: each server sends its received rows back to their sources (numpy)."""
    R = len(dispatches)
    back = []
    for d, buf in zip(dispatches, server_bufs):
        splits = d.q_recv_splits if kind == "q" else d.kv_recv_splits
        back.append(np.split(buf, np.cumsum(splits)[:-1]))
    return [np.concatenate([back[s][dst] for s in range(R)]) for dst in range(R)]


def check_plan(plan: Plan) -> None:
    R = plan.layout.n_ranks
    ds = build_all(plan)
    ids = local_ids(plan.layout)
    q_mat, kv_mat = plan.token_matrices()
    # counts: the all-to-all split sizes are the plan's token matrices, and send/recv agree
    assert np.array_equal(np.array([d.q_send_splits for d in ds]), q_mat)
    assert np.array_equal(np.array([d.kv_send_splits for d in ds]), kv_mat)
    assert np.array_equal(np.array([d.q_recv_splits for d in ds]).T, q_mat)
    assert np.array_equal(np.array([d.kv_recv_splits for d in ds]).T, kv_mat)
    assert all(d.q_traffic == bool(q_mat.sum()) and d.kv_traffic == bool(kv_mat.sum()) for d in ds)
    # KV dedup: every (server, doc) receives each remote prefix token exactly once
    recv_kv = simulate_exchange(ds, ids, "kv")
    need = kv_needs(plan)
    for s in range(R):
        expect = sorted(d * BIG + p for (srv, d), e in need.items() if srv == s for p in range(e)
                        if plan.layout.owner_map()[d][p] != s)
        assert sorted(recv_kv[s].tolist()) == expect
    # the fused kernel call: per served task its query ids and its KV prefix ids
    recv_q = simulate_exchange(ds, ids, "q")
    out_rows = []
    for s, d in enumerate(ds):
        # server buffers: received rows first on sent-last plans (Dispatch.recv_first)
        qbuf = np.concatenate([recv_q[s], ids[s]] if d.recv_first else [ids[s], recv_q[s]])
        kvbuf = np.concatenate([recv_kv[s], ids[s]] if d.recv_first else [ids[s], recv_kv[s]])
        assert (qbuf.size, kvbuf.size) == (d.n_local + d.n_recv_q, d.n_local + d.n_recv_kv)
        assert np.array_equal(qbuf[d.q_local_at:d.q_local_at + d.n_local], ids[s])
        assert np.array_equal(kvbuf[d.kv_recv_at:d.kv_recv_at + d.n_recv_kv], recv_kv[s])
        tasks = [plan.tasks[i] for i in d.tasks]
        assert sorted(d.tasks) == [i for i, t in enumerate(plan.tasks) if t.server == s]
        assert np.array_equal(np.diff(d.cu_q), [t.n_q for t in tasks])
        assert np.array_equal(np.diff(d.cu_k), [t.q_end for t in tasks])
        assert d.cu_q.dtype == np.int32 and d.max_k == max([t.q_end for t in tasks], default=0)
        q_expect = [t.doc * BIG + np.arange(t.q_start, t.q_end) for t in tasks]
        k_expect = [t.doc * BIG + np.arange(0, t.q_end) for t in tasks]
        assert np.array_equal(qbuf[d.q_rows], np.concatenate(q_expect) if tasks else [])
        assert np.array_equal(kvbuf[d.kv_rows], np.concatenate(k_expect) if tasks else [])
        out_rows.append(qbuf[d.q_rows])            # the server's "output": its query ids
    # return of O/LSE/dQ: home rows get back their own ids, each written exactly once
    back = reverse(ds, [o[d.ret_rows] for o, d in zip(out_rows, ds)], "q")
    for r, d in enumerate(ds):
        home = np.full(d.n_local, -1, dtype=np.int64)
        home[d.self_local] = out_rows[r][d.self_rows]
        home[d.q_send_index] = back[r]
        assert np.array_equal(home, ids[r])
        assert len(d.self_local) + len(d.q_send_index) == d.n_local
    # dK/dV: each task adds 1 to its prefix tokens; owners get the number of tasks reading each token
    grads = []
    for s, d in enumerate(ds):
        acc = np.zeros(d.n_local + d.n_recv_kv, dtype=np.int64)
        np.add.at(acc, d.kv_rows, 1)
        grads.append(acc)
    back = reverse(ds, [g[d.kv_recv_at:d.kv_recv_at + d.n_recv_kv] for g, d in zip(grads, ds)], "kv")
    for r, d in enumerate(ds):
        total = grads[r][d.kv_local_at:d.kv_local_at + d.n_local].copy()
        np.add.at(total, d.kv_send_index, back[r])
        expect = [sum(1 for t in plan.tasks if t.doc == x // BIG and x % BIG < t.q_end) for x in ids[r]]
        assert total.tolist() == expect


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), n_ranks=st.integers(1, 5))
def test_random_plans_round_trip(seed, n_ranks):
    check_plan(random_plan(seed, n_ranks))


def test_colocated_plan_moves_nothing():
    plan = random_plan(3, 3)
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
    scheduler = pytest.importorskip("cadlib.scheduler")
    workload = pytest.importorskip("cadlib.workload")
    packing = pytest.importorskip("cadlib.packing")
    for n_ranks, dist in [(2, "pretrain"), (3, "prolong"), (4, "pile")]:
        docs = workload.sample_docs(dist, 1200 * n_ranks, seed=n_ranks)
        layout = packing.pack(docs, n_ranks, 1200)
        check_plan(scheduler.schedule(layout, min_shard=16))


def test_errors_say_what_is_valid():
    plan = random_plan(0, 2)
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
    d = build_dispatch(random_plan(7, 3), 1)
    dev = d.to("cpu")
    assert d.to("cpu") is dev
    for name in ("q_send_index", "kv_send_index", "q_rows", "kv_rows", "ret_rows", "self_rows", "self_local"):
        t = getattr(dev, name)
        assert t.dtype == torch.int64 and np.array_equal(t.numpy(), getattr(d, name))
    assert dev.cu_q.dtype == torch.int32 and np.array_equal(dev.cu_k.numpy(), d.cu_k)

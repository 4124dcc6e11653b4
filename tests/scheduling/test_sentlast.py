"""Sent rows last (cadlib.scheduling.sentlast): the re-ordered plan is the same plan, and donors read in place.

Single process: the re-ordered plan has the same tasks, every rank the same tokens (as a permutation
of its rows), ``Plan.validate()`` passes and the dispatch round-trips (``check_plan`` of
test_dispatch); the home side sends a slice and donors' servers read their query buffers, and the
kept documents' KV, in place; plans without the option keep the old rules; ping-pong's nano-batch B
keeps reading the right rows of A as context. The distributed checks (losses, gradients, the
reference attention) are in test_train.py and test_cad.py."""
import numpy as np
import pytest
import torch
from helpers import BIG, check_plan, local_ids, random_scattered_plan
from hypothesis import given, settings
from hypothesis import strategies as st

from cadlib.core.layout import Layout
from cadlib.core.plan import CATask, Plan
from cadlib.data.packing import pack
from cadlib.data.workload import sample_docs
from cadlib.dispatch.build import build_all, build_dispatch
from cadlib.dispatch.kvshare import build_shared
from cadlib.dispatch.meta import INDEX_NAMES
from cadlib.runtime.server import scatter_kv_grad
from cadlib.scheduling.nanosplit import schedule_nano, split_nano_batches
from cadlib.scheduling.scheduler import schedule
from cadlib.scheduling.sentlast import sent_last, sent_last_nanos


def check_equivalent(plan: Plan):
    s = sent_last(plan)
    new = s.plan
    for f in ("doc", "q_start", "q_end", "home", "server"):
        assert np.array_equal(getattr(new, f), getattr(plan, f))
    assert new.meta["sent_last"] and new.n_servers == plan.n_servers
    new.validate()
    old_ids, new_ids = local_ids(plan.layout), local_ids(new.layout)
    for r in range(plan.layout.n_ranks):
        assert np.array_equal(old_ids[r][s.old_rows(r)], new_ids[r])           # a permutation of its rows
        assert np.array_equal(s.new_rows(r)[s.old_rows(r)], np.arange(old_ids[r].size))
    check_plan(new)
    for r, d in enumerate(build_all(new)):
        # the rows a rank sends away are one slice, right after the rows its server computes
        kept = int(np.sum((plan.q_end - plan.q_start)[(plan.home == r) & (plan.server == r)]))
        assert d.index["q_send_index"].is_arange(kept, d.n_send_q)
        if d.q_identity:
            n = d.n_recv_q + d.q_keep                       # cat([received, kept]) or cat([kept, received])
            local_first = [*range(d.q_keep), *range(d.n_local, d.n_local + d.n_recv_q)]
            assert d.q_rows.tolist() == (list(range(n)) if d.recv_first else local_first)
    return s


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), n_ranks=st.integers(1, 5))
def test_random_plans_stay_the_same_plan(seed, n_ranks):
    check_equivalent(random_scattered_plan(seed, n_ranks))


@pytest.mark.parametrize("n_ranks, dist", [(2, "pretrain"), (3, "prolong"), (4, "pile")])
def test_scheduler_plans_stay_the_same_plan_and_donors_read_in_place(n_ranks, dist):
    docs = sample_docs(dist, 1200 * n_ranks, seed=n_ranks)
    plan = schedule(pack(docs, n_ranks, 1200), min_shard=16, tolerance=0.02)
    before = build_all(plan)
    assert any(d.n_send_q for d in before) and not any(d.q_identity for d in before if d.n_send_q)
    after = build_all(check_equivalent(plan).plan)
    assert all(d.q_identity for d in after if d.n_send_q and not d.n_recv_q)


def test_a_rank_that_sends_nothing_keeps_its_layout():
    layout = Layout([[(0, 0, 6), (1, 0, 2)], [(2, 0, 10)]], [6, 2, 10])
    tasks = [CATask(0, 0, 6, 0, 0), CATask(1, 0, 2, 0, 0), CATask(2, 0, 4, 1, 1), CATask(2, 4, 10, 1, 0)]
    new = sent_last(Plan(layout, tasks)).plan.layout
    assert new.ranks[0] == layout.ranks[0] and new.ranks[1] == [(2, 0, 4), (2, 4, 10)]   # rank 1 sends
    colocated = Plan(layout, [CATask(0, 0, 6, 0, 0), CATask(1, 0, 2, 0, 0), CATask(2, 0, 10, 1, 1)])
    assert sent_last(colocated).plan.layout == layout


def test_donor_reads_query_rows_and_kept_kv_in_place():
    # rank 0 holds doc 0 [0, 8) and doc 1 [0, 6); it sends doc 0's end [5, 8) and doc 1's START [0, 2)
    layout = Layout([[(0, 0, 8), (1, 0, 6)], [(2, 0, 4)]], [8, 6, 4])
    tasks = [CATask(0, 0, 5, 0, 0), CATask(0, 5, 8, 0, 1), CATask(1, 0, 2, 0, 1), CATask(1, 2, 6, 0, 0),
             CATask(2, 0, 4, 1, 1)]
    plan = Plan(layout, tasks)
    d0 = build_dispatch(plan, 0)
    assert not d0.q_identity and d0.gathered_rows() == (9, 11)
    s = sent_last(plan)
    assert s.plan.layout.ranks[0] == [(0, 0, 5), (1, 2, 6), (0, 5, 8), (1, 0, 2)]   # kept, then sent
    assert s.old_rows(0).tolist() == [0, 1, 2, 3, 4, 10, 11, 12, 13, 5, 6, 7, 8, 9]
    d0 = build_dispatch(s.plan, 0)
    # query rows [0, 9) in place; doc 1's kept part reads its sent start: its KV is still gathered
    assert d0.q_identity and d0.q_keep == 9 and d0.gathered_rows() == (0, 11)
    # without doc 1's start sent, the kept tasks' KV is the buffer's first 5 + 6 rows: read in place
    tasks[2], tasks[3] = CATask(1, 0, 2, 0, 0), CATask(1, 2, 6, 0, 1)
    d0 = build_dispatch(sent_last(Plan(layout, tasks)).plan, 0)
    sh = d0.shared()
    assert d0.q_identity and d0.q_keep == 7 and sh.kv_identity and sh.n_kv == 7
    assert d0.gathered_rows() == (0, 0)
    # a plan laid out that way without the option keeps the old rules (gathers, as committed runs did)
    same = Plan(sent_last(Plan(layout, tasks)).plan.layout, tasks)
    d0 = build_dispatch(same, 0)
    assert not d0.q_identity and not d0.shared().kv_identity and d0.q_keep == d0.n_local


def test_receiver_keeps_lpt_when_buffer_order_splits_a_merge():
    # rank 1 holds doc 0 [4, 8) and receives doc 0 [2, 4) from rank 0: in the old layout (local rows
    # first) the shard lands after its own rows and would split one segment, so the call stays in LPT
    # order (gathers)
    layout = Layout([[(0, 0, 4)], [(0, 4, 8), (1, 0, 3)]], [8, 3])
    tasks = [CATask(0, 0, 2, 0, 0), CATask(0, 2, 4, 0, 1), CATask(0, 4, 8, 1, 1), CATask(1, 0, 3, 1, 1)]
    d1 = build_dispatch(Plan(layout, tasks), 1)
    assert not d1.q_identity and d1.shared().n_segments == 2
    # sent-last servers put the received rows first: [doc 0 [2, 4) | doc 0 [4, 8), doc 1] is one
    # segment after another, and the KV buffer [doc 0 [0, 4) | doc 0 [4, 8), doc 1] their prefixes
    d0, d1 = build_all(sent_last(Plan(layout, tasks)).plan)
    assert d0.q_identity and d0.gathered_rows() == (0, 0)
    assert d1.recv_first and d1.q_identity and d1.shared().n_segments == 2 and d1.gathered_rows() == (0, 0)


def test_continued_document_reads_its_remote_prefix_in_place():
    # sequential packing: doc 1 begins on rank 0 and continues on rank 1, whose first document it is;
    # rank 0 also sends doc 0's end to rank 1. Rank 1's KV buffer, received first, is [doc 0 [0, 6) |
    # doc 1 [0, 3) | doc 1 [3, 8), doc 2]: every segment reads its prefix in place
    layout = Layout([[(0, 0, 6), (1, 0, 3)], [(1, 3, 8), (2, 0, 5)]], [6, 8, 5])
    tasks = [CATask(0, 0, 4, 0, 0), CATask(0, 4, 6, 0, 1), CATask(1, 0, 3, 0, 0), CATask(1, 3, 8, 1, 1),
             CATask(2, 0, 5, 1, 1)]
    before = build_dispatch(Plan(layout, tasks), 1)
    assert before.gathered_rows()[1] == 6 + 8 + 5
    d0, d1 = build_all(sent_last(Plan(layout, tasks)).plan)
    assert d1.recv_first and d1.n_recv_kv == 6 + 3 and d1.kv_recv_at == 0 and d1.kv_local_at == 9
    assert d1.gathered_rows() == (0, 0) and d1.shared().n_kv == 6 + 3 + 10


def test_kv_prefix_gradient_pads_the_rest_with_zeros():
    # explicit kv_rows [0, 5): read in place only with prefix; dK of the other rows is zero
    args = ([0], [0], [5], np.array([0, 5]), np.array([0, 5]), np.arange(5), 8)
    assert not build_shared(*args).kv_identity and build_shared(*args, prefix=True).kv_identity

    class Dev:
        meta = build_shared(*args, prefix=True)
    g = torch.randn(5, 2, 3)
    out = scatter_kv_grad(g, Dev, 8, torch.float32)
    assert out.shape == (8, 2, 3) and torch.equal(out[:5], g) and not out[5:].any()


def nano_ids(nb, full_ids, r):
    return full_ids[r][np.asarray(nb.rows[r], dtype=np.int64)]


@pytest.mark.parametrize("seed", range(3))
def test_nano_batches_reorder_and_context_follows_a(seed):
    docs = sample_docs("pretrain", 4 * 1024, seed, max_doc_len=2000)
    layout = pack(docs, 4, 1024)
    nanos = split_nano_batches(layout, "tokens", split_docs=True, min_piece=16)
    plans = [schedule_nano(nb, min_shard=16, tolerance=0.0) for nb in nanos]
    new_n, new_p = sent_last_nanos(nanos, plans)
    full = local_ids(layout)
    assert nanos[1].has_context
    for old, new, p in zip(nanos, new_n, new_p):
        assert p.layout is new.layout and p.meta["sent_last"]
        assert new.n_context_chunks == old.n_context_chunks and new.docs is old.docs
        glob = np.r_[old.docs, 0]
        for r in range(4):
            # the same rows of the full buffer, in the order of the new layout
            assert sorted(new.rows[r].tolist()) == sorted(old.rows[r].tolist())
            ids = local_ids(new.layout)[r]
            n_q = len(new.rows[r])
            as_global = glob[ids[:n_q] // BIG] * BIG + ids[:n_q] % BIG
            assert np.array_equal(as_global, nano_ids(new, full, r))
    a, b = new_n
    for r in range(4):
        # B's context rows: the rows of A's (new) buffer holding the positions of B's context chunks
        ids_b = local_ids(b.layout)[r][len(b.rows[r]):]
        ids_a = local_ids(a.layout)[r][np.asarray(b.context[r], dtype=np.int64)] if len(b.context[r]) else []
        assert np.array_equal(b.docs[ids_b // BIG] * BIG + ids_b % BIG,
                              a.docs[np.asarray(ids_a, dtype=np.int64) // BIG] * BIG
                              + np.asarray(ids_a, dtype=np.int64) % BIG)
    assert any(d.q_identity and d.n_send_q for p in new_p for d in build_all(p))


def test_partly_covered_chunk_is_an_error():
    layout = Layout([[(0, 0, 8)], [(1, 0, 2)]], [8, 2])
    plan = Plan.from_arrays(layout, [0, 1], [0, 0], [4, 2], [0, 1], [1, 1])
    with pytest.raises(ValueError, match="covered by tasks in part"):
        sent_last(plan)


def test_plans_without_the_mark_keep_their_dispatch():
    # the continued-document plan above, unmarked: every map as the local-first code built it (values
    # recorded from the dispatch before received-first buffers existed)
    layout = Layout([[(0, 0, 6), (1, 0, 3)], [(1, 3, 8), (2, 0, 5)]], [6, 8, 5])
    tasks = [CATask(0, 0, 4, 0, 0), CATask(0, 4, 6, 0, 1), CATask(1, 0, 3, 0, 0), CATask(1, 3, 8, 1, 1),
             CATask(2, 0, 5, 1, 1)]
    r = list(range(19))
    want = [
        {"q_send_index": [4, 5], "kv_send_index": r[:9], "q_rows": [0, 1, 2, 3, 6, 7, 8],
         "kv_rows": [0, 1, 2, 3, 6, 7, 8], "ret_rows": [], "self_rows": r[:7],
         "self_local": [0, 1, 2, 3, 6, 7, 8], "kv_send_uniq": r[:9], "kv_send_slot": r[:9],
         "shared": [0, 1, 2, 3, 6, 7, 8], "q_identity": False,
         "q_keep": 9, "kv_identity": False, "tasks": [0, 2], "cu_q": [0, 4, 7], "cu_k": [0, 4, 7]},
        {"q_send_index": [], "kv_send_index": [], "q_rows": r[:12], "kv_rows": [16, 17, 18, *r[:16]],
         "ret_rows": [10, 11], "self_rows": r[:10], "self_local": r[:10], "kv_send_uniq": [],
         "kv_send_slot": [],
         "shared": [16, 17, 18, *r[:16]], "q_identity": True, "q_keep": 10, "kv_identity": False,
         "tasks": [3, 4, 1], "cu_q": [0, 5, 10, 12], "cu_k": [0, 8, 13, 19]}]
    for d, w in zip(build_all(Plan(layout, tasks)), want):
        sh = d.shared()
        got = {n: getattr(d, n).tolist() for n in w if n in INDEX_NAMES or n == "cu_q"}
        assert len(got) == len(INDEX_NAMES) + 1
        assert got == {n: w[n] for n in got}
        assert sh.kv_rows.tolist() == w["shared"] and sh.cu_k.tolist() == w["cu_k"]
        assert (d.q_identity, d.q_keep, sh.kv_identity, d.tasks) == (w["q_identity"], w["q_keep"],
                                                                    w["kv_identity"], w["tasks"])
        assert not d.recv_first and not d.prefix
        assert (d.q_local_at, d.q_recv_at, d.kv_local_at, d.kv_recv_at) == (0, d.q_keep, 0, d.n_local)


def test_server_keeps_local_first_when_received_rows_continue_its_document():
    # rank 1 sends all of doc 0 [4, 8), the continuation of rank 0's doc 0 [0, 4): rank 0 reads
    # [doc 0 [0, 4) | received [4, 8)] in place only local first, so its server keeps that layout
    layout = Layout([[(0, 0, 4)], [(0, 4, 8), (1, 0, 3)]], [8, 3])
    tasks = [CATask(0, 0, 4, 0, 0), CATask(0, 4, 8, 1, 0), CATask(1, 0, 3, 1, 1)]
    d0, d1 = build_all(sent_last(Plan(layout, tasks)).plan)
    assert not d0.recv_first and d0.q_identity and d0.gathered_rows() == (0, 0)
    assert d1.gathered_rows() == (0, 0)

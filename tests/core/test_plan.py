"""Layouts, CA-tasks and plans: coverage validation, splitting, loads and bytes."""
import numpy as np
import pytest

from cadlib.core.cost import ModelSpec
from cadlib.core.layout import Chunk, Layout
from cadlib.core.plan import Plan, layout_to_tasks


def two_rank_layout():
    # doc 0 (120 tokens) has a head on rank 0 and a tail on rank 1; doc 1 (50) the other way round
    return Layout([[(0, 0, 100), (1, 0, 20)], [(1, 20, 50), (0, 100, 120)]], [120, 50])


def test_layout_validates_coverage():
    L = two_rank_layout()
    assert L.tokens_per_rank().tolist() == [120, 50]
    assert L.owner_map()[0][99] == 0 and L.owner_map()[0][100] == 1
    with pytest.raises(ValueError, match=r"tokens \[100, 120\) are held by no rank"):
        Layout([[(0, 0, 100)]], [120])
    with pytest.raises(ValueError, match="held twice"):
        Layout([[(0, 0, 100)], [(0, 90, 120)]], [120])
    with pytest.raises(ValueError, match="lengths must be >= 1"):
        Layout([[]], [0])
    with pytest.raises(ValueError, match="unknown document"):
        Layout([[(3, 0, 1)]], [1])
    with pytest.raises(ValueError, match="at least one rank"):
        Layout([], [])
    Layout([[], [(0, 0, 1)]], [1])  # an empty rank is fine


def test_colocated_tasks_and_loads():
    L = two_rank_layout()
    P = Plan(L, layout_to_tasks(L))
    assert [t.server for t in P.tasks] == [0, 0, 1, 1]
    expected = [100 * 101 // 2 + 20 * 21 // 2, (50 * 51 - 20 * 21) // 2 + (120 * 121 - 100 * 101) // 2]
    assert P.server_pairs().tolist() == expected
    assert P.imbalance() == pytest.approx(max(expected) / np.mean(expected))


def test_token_matrices_count_kv_once_per_server_and_doc():
    L = two_rank_layout()
    P = Plan(L, layout_to_tasks(L))
    q, kv = P.token_matrices()
    assert q.sum() == 0
    # rank 1 serves doc0 [100,120) -> needs doc0 [0,100) from rank 0; doc1 [20,50) -> [0,20) from rank 0
    assert kv.tolist() == [[0, 120], [0, 0]]
    # move rank 0's doc-0 task to rank 1: queries 100 tokens go, KV of doc 0 is still counted once
    tasks = list(P.tasks)
    tasks[0] = tasks[0]._replace(server=1)
    P2 = Plan(L, tasks)
    q2, kv2 = P2.token_matrices()
    assert q2.tolist() == [[0, 100], [0, 0]]
    assert kv2.tolist() == [[0, 120], [0, 0]]
    m = ModelSpec.from_name("llama3-8b")
    b = P2.bytes_matrix(m)
    assert b[0, 1] == 100 * m.q_bytes() + 120 * m.kv_bytes()
    assert b[1, 0] == 100 * m.o_bytes()                         # O comes back
    bb = P2.bytes_matrix(m, backward=True)
    assert bb[0, 1] == b[0, 1] + 100 * m.o_bytes()              # dO out
    assert bb[1, 0] == b[1, 0] + 100 * m.q_bytes() + 120 * m.kv_bytes()    # dq, dk, dv back
    # DistCA's stateless servers: the LSE comes back with O, and the backward sends dO, O, LSE, Q and
    # the KV again
    r = P2.bytes_matrix(m, resend=True)
    assert r[0, 1] == b[0, 1] and r[1, 0] == 100 * (m.o_bytes() + m.lse_bytes())
    rb = P2.bytes_matrix(m, backward=True, resend=True)
    assert rb[0, 1] == b[0, 1] + 100 * (2 * m.o_bytes() + m.lse_bytes() + m.q_bytes()) + 120 * m.kv_bytes()
    assert rb[1, 0] == r[1, 0] + 100 * m.q_bytes() + 120 * m.kv_bytes()
    # with the tokens each GPU serves itself: rank 0 keeps doc 1's [0, 20) and its KV; rank 1 serves
    # doc 0 whole (KV [0, 100) from rank 0, [100, 120) its own) and doc 1's [20, 50) (KV [0, 20) from
    # rank 0, [20, 50) its own)
    ql, kvl = P2.token_matrices(local=True)
    assert ql.tolist() == [[20, 100], [0, 50]] and kvl.tolist() == [[20, 120], [0, 50]]


def test_plan_rejects_lost_duplicated_or_misplaced_tokens():
    L = two_rank_layout()
    tasks = layout_to_tasks(L)
    with pytest.raises(ValueError, match="exactly 1"):
        Plan(L, tasks[1:])
    with pytest.raises(ValueError, match="exactly 1"):
        Plan(L, tasks + [tasks[0]])
    with pytest.raises(ValueError, match="home rank"):
        Plan(L, [tasks[0]._replace(home=1)] + tasks[1:])
    with pytest.raises(ValueError, match="server"):
        Plan(L, [tasks[0]._replace(server=5)] + tasks[1:])


def test_from_arrays_validates_on_demand():
    L = two_rank_layout()
    tasks = layout_to_tasks(L)
    cols = np.array(tasks).T
    P = Plan.from_arrays(L, *cols, meta={"x": 1})
    assert P.tasks == tasks and P.n_servers == 2 and P.meta == {"x": 1}
    assert P.imbalance() == Plan(L, tasks).imbalance()
    P.validate()
    lost = Plan.from_arrays(L, *cols[:, 1:])              # built without the coverage check ...
    with pytest.raises(ValueError, match="exactly 1"):
        lost.validate()                                   # ... which runs on demand
    with pytest.raises(ValueError, match="server 7"):
        Plan.from_arrays(L, *cols[:4], np.full(4, 7))     # ranges are checked always, in O(tasks)
    with pytest.raises(ValueError, match="lies outside its document"):
        Plan.from_arrays(L, cols[0], cols[1], cols[2] + 500, cols[3], cols[4])


@pytest.mark.parametrize("bad", [-3, 0, 2.5, "2", True])
def test_plan_rejects_bad_n_servers(bad):
    L = two_rank_layout()
    with pytest.raises(ValueError, match="n_servers must be an integer >= 1"):
        Plan(L, layout_to_tasks(L), n_servers=bad)


def test_chunk_length():
    assert Chunk(0, 3, 10).length == 7

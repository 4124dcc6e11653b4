"""What several test modules share: random plans and layouts, and the checks run on them (the
library's own fixtures are in :mod:`cadlib.testing`)."""
import numpy as np
from hypothesis import strategies as st

from cadlib.core.cost import ModelSpec, causal_pairs
from cadlib.core.layout import Layout, layout_from_lists
from cadlib.core.plan import CATask, Plan, layout_to_tasks
from cadlib.dispatch.build import build_all, simulate_exchange
from cadlib.dispatch.kvexchange import kv_needs

BIG = 1 << 20


def random_scattered_plan(seed: int, n_ranks: int, max_docs: int = 6, max_len: int = 40) -> Plan:
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


MODEL = ModelSpec.from_name("llama3-8b")
QB, KVB = MODEL.q_bytes("bf16"), MODEL.kv_bytes("bf16")


@st.composite
def layouts(draw, max_ranks=64, max_docs=12, max_len=96):
    """Random doc lengths (1-token docs included), each doc cut at random points into chunks placed
    on random ranks (empty ranks happen); optionally one doc spans every rank."""
    n_ranks = draw(st.integers(1, max_ranks))
    lens = draw(st.lists(st.one_of(st.just(1), st.integers(1, max_len)), min_size=1, max_size=max_docs))
    if draw(st.booleans()):
        lens.append(n_ranks * draw(st.integers(1, 4)))
        span_all = True
    else:
        span_all = False
    ranks = [[] for _ in range(n_ranks)]
    for d, n in enumerate(lens):
        if span_all and d == len(lens) - 1:
            step = n // n_ranks
            for r in range(n_ranks):
                ranks[r].append((d, r * step, (r + 1) * step))
            continue
        k = draw(st.integers(0, min(n - 1, 4)))
        cuts = draw(st.lists(st.integers(1, max(1, n - 1)), min_size=k, max_size=k)) if n > 1 else []
        cuts = sorted(set(cuts))
        bounds = [0, *cuts, n]
        for s, e in zip(bounds[:-1], bounds[1:]):
            ranks[draw(st.integers(0, n_ranks - 1))].append((d, s, e))
    return layout_from_lists(ranks, lens)


def check_scheduler_plan(plan, layout, n_servers):
    plan.validate()                                     # every query token in exactly one task, home = owner
    own = layout.owner_map()
    for t in plan.tasks:
        assert own[t.doc][t.q_start] == t.home
    total = sum(causal_pairs(0, n) for n in layout.doc_lens)
    assert plan.server_pairs().sum() == total
    assert plan.n_servers == (layout.n_ranks if n_servers is None else n_servers)


def reference_token_matrices(plan):
    """Token-by-token: each (server, doc) needs KV [0, max q_end); count the owners of those tokens."""
    R = plan.layout.n_ranks
    G = max(R, plan.n_servers)
    q = np.zeros((G, G), dtype=np.int64)
    kv = np.zeros((G, G), dtype=np.int64)
    need = {}
    for t in plan.tasks:
        if t.home != t.server:
            q[t.home, t.server] += t.n_q
        need[(t.server, t.doc)] = max(need.get((t.server, t.doc), 0), t.q_end)
    own = plan.layout.owner_map()
    for (server, doc), end in need.items():
        counts = np.bincount(own[doc][:end], minlength=R)
        if server < R:
            counts[server] = 0
        kv[:R, server] += counts
    return q, kv

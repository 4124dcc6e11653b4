"""Straggler simulator: DP, PP 1F1B, CP and CAD step times against hand-computed cases and a
reference longest-path computation of the 1F1B schedule."""
import functools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cadlib.analysis.model.compose import one_f_one_b
from cadlib.analysis.model.idle import idle_fraction_sweep
from cadlib.analysis.model.sim import (
    Hardware,
    StepTimes,
    attention_seconds,
    comm_seconds,
    linear_seconds,
    simulate,
    simulate_cad,
    simulate_cp,
    simulate_dp,
    simulate_pp,
)
from cadlib.core.cost import (
    H200_MATMUL_TFLOPS,
    H200_NVLINK_ALL_TO_ALL_GBPS,
    IB_GBPS_PER_GPU,
    ModelSpec,
    attention_tflops,
)
from cadlib.core.layout import Layout
from cadlib.core.plan import CATask, Plan, layout_to_tasks
from cadlib.data.packing import per_doc_zigzag_layout

MODEL = ModelSpec.from_name("llama3-8b")
HW = Hardware()
FREE = Hardware(link_gbps=math.inf, inter_node_gbps=math.inf)


# -- first-principles references (no sim.py code) ------------------------------------------------------

def lin_ref(tokens, mult=3.0, layers=MODEL.n_layers):
    """tokens * 2 * params * layers * (1 + 2) / (matmul * mfu)."""
    flops = tokens * 2 * MODEL.linear_params_per_layer() * layers * mult
    return flops / (HW.matmul_tflops * HW.mfu_linear * 1e12)


def attn_ref(a, b, layers=MODEL.n_layers):
    """Forward+backward seconds of one causal task [a, b): 4 * pairs * H * d * L * 3.5 / rate(b - a)."""
    pairs = sum(i + 1 for i in range(a, b))
    flops = 4 * pairs * MODEL.n_heads * MODEL.head_dim * layers * 3.5
    return flops / (attention_tflops(b - a, "fa2", True) * 1e12)


def test_hardware_defaults_are_the_cost_model_numbers():
    assert HW.matmul_tflops == H200_MATMUL_TFLOPS
    assert HW.link_gbps == H200_NVLINK_ALL_TO_ALL_GBPS and HW.inter_node_gbps == IB_GBPS_PER_GPU
    assert HW.attn_kernel == "fa2"


def test_work_times_match_the_formulas():
    assert linear_seconds(1000, MODEL, HW) == pytest.approx(lin_ref(1000), rel=1e-12)
    assert linear_seconds(1000, MODEL, HW, "fwd") == pytest.approx(lin_ref(1000, 1.0), rel=1e-12)
    for a, b in [(0, 100), (0, 4096), (1000, 1700), (0, 40000)]:
        assert attention_seconds([a], [b], MODEL, HW)[0] == pytest.approx(attn_ref(a, b), rel=1e-9)
        f, bw = (attention_seconds([a], [b], MODEL, HW, p)[0] for p in ("fwd", "bwd"))
        assert f + bw == pytest.approx(attn_ref(a, b), rel=1e-9)
        assert f == pytest.approx(4 * sum(range(a + 1, b + 1)) * 32 * 128 * 32
                                  / (attention_tflops(b - a, "fa2", False) * 1e12), rel=1e-9)
    # FA4 is faster than FA2 on the same task
    fa4 = Hardware(attn_kernel="fa4")
    assert attention_seconds([0], [8192], MODEL, fa4)[0] < attention_seconds([0], [8192], MODEL, HW)[0]


# -- data parallel ------------------------------------------------------------------------------------

def test_dp_balanced_layout_has_no_idle():
    # four ranks, each one 4096-token document and two 2048-token documents
    lens = [4096, 2048, 2048] * 4
    ranks = [[(3 * r + k, 0, lens[3 * r + k]) for k in range(3)] for r in range(4)]
    res = simulate_dp(Layout(ranks, lens), MODEL)
    assert np.allclose(res.idle, 0.0) and res.idle_fraction == pytest.approx(0.0, abs=1e-12)
    assert res.step == pytest.approx(lin_ref(8192) + attn_ref(0, 4096) + 2 * attn_ref(0, 2048), rel=1e-9)


def test_dp_long_document_makes_the_others_wait():
    # same tokens everywhere; rank 0 holds one 16K document, ranks 1..3 sixteen 1K documents each
    lens = [16384] + [1024] * 48
    ranks = [[(0, 0, 16384)]] + [[(1 + 16 * (r - 1) + k, 0, 1024) for k in range(16)] for r in (1, 2, 3)]
    res = simulate_dp(Layout(ranks, lens), MODEL)
    slow, fast = lin_ref(16384) + attn_ref(0, 16384), lin_ref(16384) + 16 * attn_ref(0, 1024)
    assert res.step == pytest.approx(slow, rel=1e-9)
    assert res.idle == pytest.approx([0.0] + [slow - fast] * 3, rel=1e-9)
    assert res.idle_fraction == pytest.approx(3 * (slow - fast) / (4 * slow), rel=1e-9)


def test_dp_tail_chunk_pays_for_its_kv_prefix():
    lay = Layout([[(0, 0, 4096)], [(0, 4096, 8192)]], [8192])
    res = simulate_dp(lay, MODEL)
    assert res.breakdown["attention"] == pytest.approx([attn_ref(0, 4096), attn_ref(4096, 8192)], rel=1e-9)
    assert res.breakdown["attention"][1] > 2.9 * res.breakdown["attention"][0]   # 3x the pairs


# -- pipeline parallel, 1F1B ----------------------------------------------------------------------------

def reference_1f1b(fwd, bwd):
    """Longest path through the 1F1B dependency graph (memoised recursion, not an event loop)."""
    p, m = fwd.shape
    order = {}
    for s in range(p):
        w = min(p - s - 1, m)
        ops = [("F", i) for i in range(w)] + [x for k in range(m - w) for x in (("F", w + k), ("B", k))]
        order[s] = ops + [("B", i) for i in range(m - w, m)]
    pos = {(s, op): k for s in order for k, op in enumerate(order[s])}

    @functools.lru_cache(maxsize=None)
    def end(s, kind, i):
        k = pos[(s, (kind, i))]
        ready = [end(s, *order[s][k - 1])] if k else []
        if kind == "F" and s > 0:
            ready.append(end(s - 1, "F", i))
        if kind == "B" and s < p - 1:
            ready.append(end(s + 1, "B", i))
        return max(ready, default=0.0) + (fwd if kind == "F" else bwd)[s, i]
    return max(end(0, "B", i) for i in range(m))


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 5), m=st.integers(1, 9), f=st.floats(0.1, 3.0), ratio=st.floats(0.5, 3.0))
def test_1f1b_equal_microbatches_give_the_textbook_bubble(p, m, f, ratio):
    b = f * ratio
    makespan, _, _ = one_f_one_b(np.full((p, m), f), np.full((p, m), b))
    assert makespan == pytest.approx((m + p - 1) * (f + b), rel=1e-9)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), p=st.integers(1, 4), m=st.integers(1, 6))
def test_1f1b_event_simulation_matches_longest_path(data, p, m):
    times = st.lists(st.floats(0.0, 5.0), min_size=p * m, max_size=p * m)
    fwd = np.array(data.draw(times)).reshape(p, m)
    bwd = np.array(data.draw(times)).reshape(p, m)
    assert one_f_one_b(fwd, bwd)[0] == pytest.approx(reference_1f1b(fwd, bwd), rel=1e-9, abs=1e-12)


def test_1f1b_slow_microbatch_hand_computed():
    # p=2, m=2, F=1, B=2: 9 = (m+p-1)(F+B). One microbatch at F=2, B=4: stage 1 runs its F and B
    # back to back and stage 0 waits for it; by hand the step is 14 whichever microbatch is slow.
    f, b = np.ones((2, 2)), 2 * np.ones((2, 2))
    assert one_f_one_b(f, b)[0] == pytest.approx(9.0)
    for slow in (0, 1):
        f2, b2 = f.copy(), b.copy()
        f2[:, slow], b2[:, slow] = 2.0, 4.0
        assert one_f_one_b(f2, b2)[0] == pytest.approx(14.0)


def test_pp_equal_microbatches_bubble_fraction():
    p, m = 4, 8
    lay = Layout([[(i, 0, 4096)] for i in range(m)], [4096] * m)
    res = simulate_pp(lay, MODEL, pp_stages=p)
    assert res.idle_fraction == pytest.approx((p - 1) / (m + p - 1), rel=1e-9)
    per_mb = (lin_ref(4096) + attn_ref(0, 4096)) / p          # one stage holds L/p layers
    assert res.step == pytest.approx((m + p - 1) * per_mb, rel=1e-9)
    assert res.busy == pytest.approx([m * per_mb] * p, rel=1e-9)


def test_pp_slow_microbatch_delays_the_step():
    p, m, n = 2, 4, 4096
    even = simulate_pp(Layout([[(i, 0, n)] for i in range(m)], [n] * m), MODEL, pp_stages=p)
    # microbatch 2 holds one 4096-token document, the others four 1024-token documents each
    lens = [1024] * 12 + [n]
    ranks = [[(4 * k + j, 0, 1024) for j in range(4)] for k in range(2)] + [[(12, 0, n)]] \
        + [[(8 + j, 0, 1024) for j in range(4)]]
    res = simulate_pp(Layout(ranks, lens), MODEL, pp_stages=p)
    assert res.step < even.step   # short documents: less attention, every microbatch faster
    lps = MODEL.n_layers // p
    fast = lin_ref(n, 1.0, lps), lin_ref(n, 2.0, lps)
    fa = [fast[0] + 4 * attention_seconds([0], [1024], MODEL, HW, "fwd", lps)[0],
          fast[1] + 4 * attention_seconds([0], [1024], MODEL, HW, "bwd", lps)[0]]
    sl = [fast[0] + attention_seconds([0], [n], MODEL, HW, "fwd", lps)[0],
          fast[1] + attention_seconds([0], [n], MODEL, HW, "bwd", lps)[0]]
    f = np.array([[fa[0], fa[0], sl[0], fa[0]]] * p)
    b = np.array([[fa[1], fa[1], sl[1], fa[1]]] * p)
    assert res.step == pytest.approx(reference_1f1b(f, b), rel=1e-9)
    uniform = reference_1f1b(np.full((p, m), fa[0]), np.full((p, m), fa[1]))
    assert res.step > uniform + (sl[0] - fa[0]) + (sl[1] - fa[1])   # delayed by more than its own extra


def test_pp_list_of_layouts_and_dp_grid():
    mbs = [Layout([[(0, 0, 2048)]], [2048]), Layout([[(0, 0, 1024), (1, 0, 1024)]], [1024, 1024])]
    a = simulate_pp(mbs, MODEL, pp_stages=4)
    b = simulate_pp(Layout([[(0, 0, 2048)], [(1, 0, 1024), (2, 0, 1024)]], [2048, 1024, 1024]), MODEL,
                    pp_stages=4)
    assert a.step == pytest.approx(b.step) and a.busy == pytest.approx(b.busy)
    # 4 ranks read as 2 pipelines x 2 microbatches: the pipeline holding the long document decides
    grid = Layout([[(0, 0, 8192)], [(1, 0, 8192)], [(2 + k, 0, 1024) for k in range(8)],
                   [(10 + k, 0, 1024) for k in range(8)]], [8192, 8192] + [1024] * 16)
    res = simulate_pp(grid, MODEL, pp_stages=2, n_microbatches=2)
    assert res.n_ranks == 4 and res.meta["stage_busy"].shape == (2, 2)
    span = res.meta["pipeline_makespan"]
    assert res.step == pytest.approx(span[0]) and span[0] > span[1]


# -- CAD -------------------------------------------------------------------------------------------------

def test_cad_balanced_plan_free_comm_idles_only_from_linear_imbalance():
    # rank 0 holds three 1000-token documents, rank 1 one; the plan sends doc 2 to server 1
    lay = Layout([[(0, 0, 1000), (1, 0, 1000), (2, 0, 1000)], [(3, 0, 1000)]], [1000] * 4)
    plan = Plan(lay, [CATask(0, 0, 1000, 0, 0), CATask(1, 0, 1000, 0, 0), CATask(2, 0, 1000, 0, 1),
                      CATask(3, 0, 1000, 1, 1)])
    res = simulate_cad(plan, MODEL, FREE)
    assert res.idle == pytest.approx([0.0, lin_ref(2000)], rel=1e-9)
    assert res.step == pytest.approx(lin_ref(3000) + 2 * attn_ref(0, 1000), rel=1e-9)
    assert res.idle_fraction == pytest.approx(lin_ref(2000) / (2 * res.step), rel=1e-9)


def test_cad_colocated_plan_equals_dp():
    lay = Layout([[(0, 0, 8192)], [(1 + k, 0, 1024) for k in range(8)]], [8192] + [1024] * 8)
    dp, cad = simulate_dp(lay, MODEL), simulate_cad(Plan(lay, layout_to_tasks(lay)), MODEL)
    assert cad.step == pytest.approx(dp.step, rel=1e-12) and cad.busy == pytest.approx(dp.busy, rel=1e-12)


def swapped_plan(n=1000):
    """Two ranks with one n-token document each; each document's attention runs on the other rank."""
    lay = Layout([[(0, 0, n)], [(1, 0, n)]], [n, n])
    return Plan(lay, [CATask(0, 0, n, 0, 1), CATask(1, 0, n, 1, 0)])


def comm_ref(n, gbps):
    """Hand count for swapped_plan, per GPU (symmetric): forward sends q+kv and returns o; backward sends
    dO and returns dq, dk, dv (the servers keep what they received). Seconds for all layers."""
    qb, kvb, ob = MODEL.q_bytes(), MODEL.kv_bytes(), MODEL.o_bytes()
    fwd = n * (qb + kvb + ob)
    bwd = n * (ob + qb + kvb)
    return fwd * MODEL.n_layers / (gbps * 1e9), bwd * MODEL.n_layers / (gbps * 1e9)


def test_cad_communication_adds_without_overlap_and_hides_with_it():
    plan, n = swapped_plan(), 1000
    free = simulate_cad(plan, MODEL, FREE)
    assert free.step == pytest.approx(lin_ref(n) + attn_ref(0, n), rel=1e-9)
    fast = Hardware(link_gbps=50.0)
    cf, cb = comm_ref(n, 50.0)
    assert cf < lin_ref(n, 1.0) and cb < lin_ref(n, 2.0)
    no = simulate_cad(plan, MODEL, fast, overlap=False)
    assert no.step == pytest.approx(free.step + cf + cb, rel=1e-9)
    assert no.breakdown["comm"] == pytest.approx([cf + cb] * 2, rel=1e-9)
    # ping-pong (DistCA's ticks over two halves): A's send hides behind B's linear layers, but B's send
    # only behind A's attention, which is short here; so the step lies between the two
    pp = simulate_cad(plan, MODEL, fast, overlap=True)
    assert free.step < pp.step < no.step
    assert pp.step <= free.step + cf / 2 + cb / 2 + 1e-12
    slow = Hardware(link_gbps=1.0)     # comm longer than everything beside it: ticks wait for it
    over = simulate_cad(plan, MODEL, slow, overlap=True)
    assert over.step > simulate_cad(plan, MODEL, fast, overlap=True).step
    assert over.breakdown["comm_exposed"] == pytest.approx(over.busy - over.breakdown["linear"]
                                                           - over.breakdown["attention"])


def test_cad_resend_prices_distcas_stateless_backward():
    # DistCA's servers keep nothing: O returns with its LSE, and the backward sends dO, O, LSE, Q and
    # K, V again (then dQ, dK, dV back); per GPU of swapped_plan, all layers
    plan, n, gbps = swapped_plan(), 1000, 50.0
    qb, kvb, ob, lse = MODEL.q_bytes(), MODEL.kv_bytes(), MODEL.o_bytes(), MODEL.lse_bytes()
    s = MODEL.n_layers / (gbps * 1e9)
    got = simulate_cad(plan, MODEL, Hardware(link_gbps=gbps), overlap=False, resend=True)
    want = n * (qb + kvb + ob + lse) * s + n * (2 * ob + lse + qb + kvb + qb + kvb) * s
    assert got.breakdown["comm"] == pytest.approx([want] * 2, rel=1e-9)
    assert simulate("cad", plan, MODEL, Hardware(link_gbps=gbps), overlap=False, resend=True).step == got.step
    assert got.step > simulate_cad(plan, MODEL, Hardware(link_gbps=gbps), overlap=False).step


def test_cad_inter_node_traffic_uses_the_inter_node_link():
    plan = swapped_plan()
    one_node = simulate_cad(plan, MODEL, Hardware(link_gbps=100.0, inter_node_gbps=10.0), overlap=False)
    two_nodes = simulate_cad(plan, MODEL, Hardware(link_gbps=100.0, inter_node_gbps=10.0, gpus_per_node=1),
                             overlap=False)
    cf, cb = comm_ref(1000, 100.0)
    assert one_node.breakdown["comm"] == pytest.approx([cf + cb] * 2, rel=1e-9)
    assert two_nodes.breakdown["comm"] == pytest.approx([10 * (cf + cb)] * 2, rel=1e-9)
    m = np.array([[0.0, 3e9], [1e9, 0.0]])
    assert comm_seconds(m, Hardware(link_gbps=1.0)) == pytest.approx([3.0, 3.0])


def test_cad_needs_in_place_servers():
    lay = Layout([[(0, 0, 2048)], [(1, 0, 2048)]], [2048, 2048])
    plan = Plan(lay, [CATask(0, 0, 2048, 0, 0), CATask(1, 0, 2048, 1, 0)], n_servers=1)
    with pytest.raises(ValueError, match=r"n_servers == n_ranks \(2\); got n_servers=1"):
        simulate_cad(plan, MODEL)


# -- per-document CP -------------------------------------------------------------------------------------

def test_cp_zigzag_balances_attention_and_all_gathers_kv():
    lay = Layout([[(0, 0, 8192)], [(1, 0, 4096), (2, 0, 4096)]], [8192, 4096, 4096])
    zz = per_doc_zigzag_layout(lay.doc_lens, 2)
    assert zz.ranks[0][:2] == [(0, 0, 2048), (0, 6144, 8192)]
    res = simulate_cp(lay, MODEL, HW)
    assert res.breakdown["attention"][0] == pytest.approx(res.breakdown["attention"][1], rel=1e-9)
    kv = 8192 * MODEL.kv_bytes() * MODEL.n_layers / (HW.link_gbps * 1e9)   # the other half of 16K tokens
    assert res.breakdown["comm"] == pytest.approx([3 * kv] * 2, rel=1e-9)
    assert res.idle_fraction == pytest.approx(0.0, abs=1e-12)
    assert simulate_cp(lay, MODEL, HW, overlap=True).step < res.step
    # short documents over many ranks leave tiny shards that run at a low rate
    short = Layout([[(i, 0, 1024)] for i in range(8)], [1024] * 8)
    assert simulate_cp(short, MODEL, FREE).breakdown["attention"].sum() \
        > 1.5 * simulate_dp(short, MODEL).breakdown["attention"].sum()


# -- dispatcher, errors, sweep ---------------------------------------------------------------------------

def test_dispatcher_routes_and_rejects():
    lay = Layout([[(0, 0, 512)], [(1, 0, 256)]], [512, 256])
    assert simulate("dp", lay, "llama3-8b").step == pytest.approx(simulate_dp(lay, MODEL).step)
    assert simulate("pp", lay, MODEL, pp_stages=2).method == "pp"
    assert simulate("cp", lay, MODEL, overlap=True).method == "cp"
    assert simulate("cad", Plan(lay, layout_to_tasks(lay)), MODEL, overlap=False).method == "cad"
    with pytest.raises(ValueError, match="unknown method 'fsdp'; choose one of: dp, pp, cp, cad"):
        simulate("fsdp", lay, MODEL)
    with pytest.raises(ValueError, match="takes no option"):
        simulate("dp", lay, MODEL, overlap=True)
    with pytest.raises(ValueError, match="needs pp_stages"):
        simulate("pp", lay, MODEL)
    with pytest.raises(ValueError, match="only when 'cad' is given a Layout"):
        simulate("cad", Plan(lay, layout_to_tasks(lay)), MODEL, tolerance=0.1)


def test_bad_inputs_raise_value_errors():
    lay = Layout([[(0, 0, 512)], [(1, 0, 256)]], [512, 256])
    with pytest.raises(ValueError, match="unknown attention kernel 'fa3'"):
        Hardware(attn_kernel="fa3")
    with pytest.raises(ValueError, match="mfu_linear must be in"):
        Hardware(mfu_linear=1.5)
    with pytest.raises(ValueError, match="link_gbps must be > 0"):
        Hardware(link_gbps=0)
    with pytest.raises(ValueError, match="gpus_per_node"):
        Hardware(gpus_per_node=0)
    with pytest.raises(ValueError, match="unknown dtype"):
        Hardware(dtype="int3")
    with pytest.raises(ValueError, match="unknown phase 'both'"):
        linear_seconds(10, MODEL, HW, "both")
    with pytest.raises(ValueError, match="plan must be a Plan"):
        simulate_cad(lay, MODEL)
    with pytest.raises(ValueError, match="layout must be a Layout"):
        simulate_dp([[(0, 0, 5)]], MODEL)
    with pytest.raises(ValueError, match="divides n_layers=32"):
        simulate_pp(lay, MODEL, pp_stages=3)
    with pytest.raises(ValueError, match="n_microbatches=3 must be >= 1 and divide the 2"):
        simulate_pp(lay, MODEL, pp_stages=2, n_microbatches=3)
    with pytest.raises(ValueError, match="microbatch layouts were given"):
        simulate_pp([lay], MODEL, pp_stages=2, n_microbatches=2)
    with pytest.raises(ValueError, match="microbatches must be a Layout"):
        simulate_pp([], MODEL, pp_stages=2)
    with pytest.raises(ValueError, match="equal non-empty"):
        one_f_one_b(np.ones((2, 3)), np.ones((3, 2)))
    with pytest.raises(ValueError, match="must be square"):
        comm_seconds(np.ones((2, 3)), HW)
    with pytest.raises(ValueError, match="shorter than the busiest"):
        StepTimes("dp", np.array([2.0]), 1.0, {})
    with pytest.raises(ValueError, match="unknown model"):
        simulate_dp(lay, "gpt-5")


def test_sweep_rejects_bad_methods_and_distributions():
    with pytest.raises(ValueError, match="cannot sweep method"):
        idle_fraction_sweep("pretrain", [2], [4096], methods=("dp", "pp"))
    with pytest.raises(ValueError, match="unknown distribution"):
        idle_fraction_sweep("prolog", [2], [4096])


def test_sweep_end_to_end_with_workload_and_scheduler():
    df = idle_fraction_sweep("distca-pretrain", [2, 8], [16384], methods=("dp", "cp", "cad"), seeds=(0, 1))
    assert len(df) == 2 * 1 * 2 * 3
    assert set(df.columns) >= {"distribution", "dp", "context", "seed", "method", "step_s", "idle_fraction"}
    assert ((df.idle_fraction >= 0) & (df.idle_fraction < 1)).all()
    mean = df.groupby(["method", "dp"]).idle_fraction.mean()
    assert mean["cp", 8] < mean["dp", 8]    # zigzag CP balances attention; DP has stragglers
    assert mean["dp", 8] > mean["dp", 2]    # more ranks, more chance that one holds a long document
    assert mean["cad", 8] < mean["dp", 8] / 4   # the scheduler rebalances attention across servers
    steps = df.pivot_table(index=["dp", "seed"], columns="method", values="step_s")
    assert (steps["cad"] <= steps["dp"] * 1.001).all()


def test_simulate_cad_schedules_a_layout():
    from cadlib.data.packing import pack
    from cadlib.data.workload import sample_docs
    from cadlib.scheduling.scheduler import schedule
    lay = pack(sample_docs("pretrain", 8 * 16384, seed=3, max_doc_len=16384), 8)
    via_layout = simulate("cad", lay, MODEL, tolerance=0.05)
    direct = simulate_cad(schedule(lay, 8, MODEL, 0.05), MODEL)
    assert via_layout.step == pytest.approx(direct.step, rel=1e-12)
    assert via_layout.idle_fraction < simulate_dp(lay, MODEL).idle_fraction


# -- the 1F1B timeline table ----------------------------------------------------------------------------

def test_pp_timeline_rows_match_the_schedule():
    from cadlib.analysis.model.idle import pp_timeline
    rng = np.random.default_rng(0)
    f = rng.uniform(0.5, 2.0, (3, 5))
    b = 2 * f
    df = pp_timeline(f, b, unit=1.0)
    assert len(df) == 2 * f.size and set(df.phase) == {"F", "B"}
    assert df.end_ms.max() == pytest.approx(one_f_one_b(f, b)[0])
    for s, g in df.groupby("stage"):
        g = g.sort_values("start_ms")
        assert (g.start_ms.to_numpy()[1:] >= g.end_ms.to_numpy()[:-1] - 1e-12).all()   # no overlap
        for r in g.itertuples():
            want = (f if r.phase == "F" else b)[s, r.microbatch]
            assert r.end_ms - r.start_ms == pytest.approx(want)
    # a forward on stage s starts after the same microbatch's forward on stage s-1 ended
    fe = df[df.phase == "F"].set_index(["stage", "microbatch"])
    for s in range(1, 3):
        for i in range(5):
            assert fe.loc[(s, i), "start_ms"] >= fe.loc[(s - 1, i), "end_ms"] - 1e-12


# -- variable-length chunking and the idle time it leaves --------------------------------------------------

def _whole_docs_once(layout):
    got = sorted((c.doc, c.start, c.end) for r in layout.ranks for c in r)
    return got == [(d, 0, n) for d, n in enumerate(layout.doc_lens)]


def test_varlen_chunking_hand_cases():
    from cadlib.analysis.model.idle import varlen_chunking
    # longest first to the least-loaded rank: 4 -> r0, 4 -> r1, 2 -> r0 (tie), 2 -> r1
    lay = varlen_chunking([4, 2, 4, 2], 2, cap=6, model=MODEL)
    assert _whole_docs_once(lay)
    assert sorted(lay.tokens_per_rank().tolist()) == [6, 6]
    assert sorted(sorted(c.length for c in r) for r in lay.ranks) == [[2, 4], [2, 4]]
    # the third 5 fits nowhere under the cap: it waits, then goes to the least-loaded rank anyway
    lay = varlen_chunking([5, 5, 5], 2, cap=6, model=MODEL)
    assert _whole_docs_once(lay) and sorted(lay.tokens_per_rank().tolist()) == [5, 10]
    with pytest.raises(ValueError, match="cap"):
        varlen_chunking([5], 1, cap=0, model=MODEL)
    with pytest.raises(ValueError, match="n_ranks"):
        varlen_chunking([5], 0, cap=8, model=MODEL)


def test_varlen_chunking_balances_time_not_tokens_and_keeps_the_longest_document_whole():
    from cadlib.analysis.model.idle import varlen_chunking
    lens = [65536] + [4096] * 48        # one long document and many short ones, 2 ranks
    seq_idle = simulate_dp(Layout([[(0, 0, 65536), (1, 0, 4096), (2, 0, 4096), (3, 0, 4096),
                                    (4, 0, 4096)], [(d, 0, 4096) for d in range(5, 49)]], lens),
                           MODEL).idle_fraction
    lay = varlen_chunking(lens, 2, cap=10 ** 9, model=MODEL)
    assert _whole_docs_once(lay)
    res = simulate_dp(lay, MODEL)
    assert res.idle_fraction < seq_idle
    tok = lay.tokens_per_rank()
    assert tok.max() > tok.min()                                   # unequal tokens: memory diverges
    t_long = linear_seconds(65536, MODEL, HW) + attention_seconds([0], [65536], MODEL, HW)[0]
    assert res.step >= t_long * (1 - 1e-12)                        # a whole document is a floor


def test_straggler_idle_frame_and_validation():
    from cadlib.analysis.model.idle import straggler_idle
    # equal documents that fill every rank exactly: nobody waits under either packing
    df = straggler_idle("uniform", [2, 4], 8192, length=2048, seeds=(0, 1))
    assert set(df.columns) >= {"dp", "packing", "seed", "idle_fraction", "tokens_per_rank",
                               "tokens_max_over_mean"}
    assert len(df) == 2 * 2 * 2 and df.idle_fraction.max() == pytest.approx(0.0, abs=1e-12)
    fixed = straggler_idle("uniform", [2, 4], 8192, length=2048, global_tokens=16384)
    assert sorted(fixed.tokens_per_rank.unique()) == [4096, 8192]
    with pytest.raises(ValueError, match="split evenly"):
        straggler_idle("uniform", [3], 8192, length=2048, global_tokens=16384)
    with pytest.raises(ValueError, match="packing"):
        straggler_idle("uniform", [2], 8192, packings=("wlb",), length=2048)
    with pytest.raises(ValueError, match="cap_factor"):
        straggler_idle("uniform", [2], 8192, cap_factor=0.5, length=2048)

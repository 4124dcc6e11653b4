"""The 4D replay's host side: Table 4's settings and their configurations, microbatches of whole
documents that every method attends alike, and one small setting composed end to end."""
import json

import numpy as np
import pytest

from cadlib.analysis.replay import phases as replay_phases, pipelined as replay4d, settings4d, times as replay_times
from cadlib.core.measured import MeasuredCost
from cadlib.core.paper import DISTCA_TABLE4_8B
from cadlib.infra.results import RESULTS_DIR, load_result


def test_paper_settings_are_table_4():
    ss = settings4d.paper_4d_settings()
    assert len(ss) == 18 and {s.gpus for s in ss} == {64, 128, 256}
    assert {(s.max_doc_len, s.batch) for s in ss} == {(c, b) for c, bs, _ in DISTCA_TABLE4_8B for b in bs}
    for s in ss:
        for pp, dp, n_micro in s.configs():       # every node a stage of one pipeline replica
            assert pp * dp == s.nodes and dp * s.micro_tokens >= s.max_doc_len
            assert n_micro * dp * s.micro_tokens == s.total_tokens


def test_microbatches_hold_whole_documents_for_every_method():
    s = settings4d.Setting4D("t", "distca-pretrain", 32, 4, 131072, elongate=1.0, batches=1)
    pp, dp, n_micro = s.configs()[1]
    groups = settings4d.step_groups(s, 0, dp, n_micro)
    docs = sorted(n for g in groups for n in g)
    assert all(sum(g) == dp * s.micro_tokens for g in groups)
    base = settings4d.micro_layouts(s, groups, dp)
    for c in (1, 2):
        wlb = settings4d.wlb_micro_layouts(s, groups, dp, c)
        assert sorted(n for lay in wlb for n in lay.doc_lens) == docs      # the same documents, whole
    assert sorted(n for lay in base for n in lay.doc_lens) == docs


def test_a_small_setting_composes_every_configuration():
    times = json.loads((RESULTS_DIR / "replay" / "times_h200.json").read_text())["times"]
    rates = replay_phases.link_rates(load_result("comm_overlap_probe_2xh200_nvlink.json"))
    cost = MeasuredCost.load(RESULTS_DIR / "kernel_profile_h200.json", "fa4")
    s = settings4d.Setting4D("t", "distca-pretrain", 32, 4, 131072, batches=1, pps=(1, 2))
    price = replay_times.SegmentPrice(s.spec, "fa4", cost, 1.04, record=True)
    res = replay4d.replay_setting_4d(s, times, rates, "fa4", price)
    rows = res["per_config"]
    assert {(r["pp"], r["method"]) for r in rows} >= {(p, m) for p in (1, 2) for m in replay4d.METHODS_4D}
    assert all(r["step_s"] > r["pipeline_s"] > 0 for r in rows)
    cad = [r for r in rows if r["method"] == "cad-pingpong"]
    assert all(r["plan_imbalance_max"] <= 1 + s.tolerance + 1e-6 for r in cad)
    # the signal-only control is never slower than the same schedule with the bytes
    for r in cad:
        sig = next(x for x in rows if x["method"] == "signal-only" and x["pp"] == r["pp"])
        assert sig["step_s"] <= r["step_s"] + 1e-9
    views = {r["view"] for r in res["summary"]}
    assert {"any", "budget", "pp=1", "pp=2"} <= views
    assert all(np.isfinite(r["speedup_over_wlb"]) for r in res["summary"])
    assert res["attention_calls"]["timed"] == 0 and res["attention_calls"]["modelled"] > 0
    # a timed call replaces its modelled time, and is counted as timed
    k, sh = next(iter(price.shapes.items()))
    timed = replay_times.SegmentPrice(s.spec, "fa4", cost, 1.04, times={k: {"fwd_ms": 1.0, "bwd_ms": 2.0}})
    assert timed.seconds(np.array(sh["q"]), np.array(sh["kv"])) == (1e-3, 2e-3) and timed.timed == 1


def test_segment_model_check_scales_the_table_to_the_timed_sample():
    cost = MeasuredCost.load(RESULTS_DIR / "kernel_profile_h200.json", "fa4")
    spec = settings4d.paper_4d_settings(1)[0].spec
    shapes = {replay_times.segments_key(q, kv, spec, "fa4"): {"q": q, "kv": kv}
              for q, kv in (([512, 2048], [4096, 2048]), ([16384], [65536]), ([128] * 40, [128] * 40))}
    assert replay_times.segment_model_check({}, shapes, cost, spec, "fa4") is None      # nothing timed
    factors = (2.0, 0.5, 1.0)
    times = {}
    for (k, sh), f in zip(shapes.items(), factors):
        p = cost.fused_seconds(np.asarray(sh["q"]), np.asarray(sh["kv"]), "fwd_bwd", spec) * 1e3
        times[k] = {"fwd_ms": 0.25 * f * p, "bwd_ms": 0.75 * f * p}
    first = next(iter(shapes))
    times[first] = {**times[first], "modelled": True}       # a modelled entry is not a timing
    got = replay_times.segment_model_check(times, shapes, cost, spec, "fa4")
    assert got["calls"] == 2 and np.isclose(got["median"], 0.75)
    p = [cost.fused_seconds(np.asarray(sh["q"]), np.asarray(sh["kv"]), "fwd_bwd", spec) for sh in shapes.values()]
    assert np.isclose(got["scale"], (0.5 * p[1] + p[2]) / (p[1] + p[2]))     # time-weighted, not the median


def test_lockstep_ticks_move_the_bytes_of_stateless_servers():
    # one plan over two ranks: rank 1 serves rank 0's document end [5, 8) (Q 3, KV [0, 8))
    from cadlib.core.layout import layout_from_lists
    from cadlib.core.plan import Plan
    lay = layout_from_lists([[(0, 0, 8)], [(1, 0, 2)]], [8, 2])
    plan = Plan.from_arrays(lay, [0, 0, 1], [0, 5, 0], [5, 8, 2], [0, 0, 1], [0, 1, 1], n_servers=2)
    spec = settings4d.Setting4D("t", "distca-pretrain", 16, 2, 131072).spec   # Q 1024 B, K+V 512, LSE 16
    pre, post = replay4d._cad_bytes([plan], spec, backward=False)
    assert [x.tolist() for x in pre[0]] == [[3 * 1024 + 8 * 512, 0], [0, 3 * 1024 + 8 * 512]]
    assert [x.tolist() for x in post[0]] == [[0, 3 * 1040], [3 * 1040, 0]]        # O and its LSE back
    pre, post = replay4d._cad_bytes([plan], spec, backward=True)
    assert [x.tolist() for x in pre[0]] == [[3 * 3088 + 8 * 512, 0], [0, 3 * 3088 + 8 * 512]]
    assert [x.tolist() for x in post[0]] == [[0, 3 * 1024 + 8 * 512], [3 * 1024 + 8 * 512, 0]]
    with pytest.raises(ValueError, match="Setting4D.backward must be 'resend'"):
        settings4d.Setting4D("t", "distca-pretrain", 16, 2, 131072, backward="stateful")

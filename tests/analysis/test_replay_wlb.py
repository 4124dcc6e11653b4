"""WLB-ideal in the replay, as the paper runs it and as ours: the CP degrees a setting composes, DistCA's
packer and whole-replica all-gather in a batch's work, one degree per setting chosen by its mean step,
and both speedup definitions in the summary."""
from dataclasses import replace

import numpy as np
import pytest

from cadlib.analysis.replay import calls as replay_calls, phases as replay_phases, results as replay_results
from cadlib.analysis.replay import settings as replay, settings4d, times as replay_times
from cadlib.data.packing import per_doc_gather_tokens, replica_gather_tokens, wlb_distca_layout

ALL_CP = (1, 2, 4, 8, 16, 32)


def _tiny(**kw):
    kw = {"batches": 3, "wlb_cp": (1, 2, 4), "methods": ("colocated", "wlb"), **kw}
    return replay.Setting("t", "pretrain", 4, tokens=4096, max_doc_len=4096, tp=1, model="tiny", min_shard=32,
                          link="nvlink", **kw)


def test_the_setting_rule_runs_the_two_largest_degrees_with_a_sequence_per_replica():
    by = {s.name: s for s in replay.paper_3d_settings()}
    # Table 3 batch sizes: 8 sequences at 128K on 8 nodes, 2 at 512K on 8 nodes, 8 at 512K on 32 nodes
    cases = {"3d_pretrain_128k_dp8": (8, (8, 4)), "3d_pretrain_512k_dp8": (2, (8, 4)),
             "3d_prolong_128k_dp32": (32, (32, 16)), "3d_prolong_512k_dp32": (8, (32, 16))}
    for name, (seqs, degrees) in cases.items():
        s = replace(by[name], wlb_cp=ALL_CP, wlb_choice="setting")
        assert s.sequences_per_step() == seqs and s.wlb_degrees() == degrees
    s = replace(by["3d_pretrain_512k_dp8"], wlb_cp=(1, 2), wlb_choice="setting")     # 8 / 2 > 2 sequences
    with pytest.raises(ValueError, match="no CP degree dividing dp=8"):
        s.wlb_degrees()
    assert replace(s, wlb_choice="batch").wlb_degrees() == (1, 2)                    # ours: every degree
    assert replace(by["3d_prolong_512k_dp32"], wlb_cp=ALL_CP, wlb_choice="setting", wlb_top=3
                   ).wlb_degrees() == (32, 16, 8)


def test_distcas_packer_keeps_documents_whole_and_the_replica_gather_moves_the_whole_group():
    s = _tiny(wlb_packer="distca", wlb_gather="replica")
    docs = replay.batch_lengths(s, 0)
    w = replay.method_work(s, docs, "wlb", 2)
    lay = wlb_distca_layout(docs, 4, 2, s.tokens, s.model)
    assert w.meta["cp"] == 2 and np.array_equal(w.tokens, lay.tokens_per_rank())
    ch = lay.chunk_array()
    for d in range(len(docs)):                            # a document lies in one replica
        assert len({int(r) // 2 for r in ch[ch[:, 0] == d, 3]}) == 1
    kvb = s.spec.kv_bytes("bf16")
    sent, recv = replica_gather_tokens(lay, 2)
    assert np.array_equal(w.bytes["in"][0], sent * kvb) and np.array_equal(w.bytes["in"][1], recv * kvb)
    assert np.array_equal(w.bytes["in_bwd"][0], recv * kvb)                      # dK, dV reduce-scattered
    assert not w.bytes["out"][0].any() and not w.bytes["out_bwd"][0].any()     # K, V kept for the backward
    ours = replay.method_work(_tiny(wlb_packer="distca"), docs, "wlb", 2)     # "sharing": gathered twice
    assert np.array_equal(ours.bytes["out_bwd"][1], per_doc_gather_tokens(lay)[1] * kvb)
    assert ours.bytes["in"][1].sum() <= w.bytes["in"][1].sum()


def test_one_degree_per_setting_by_its_mean_step_and_both_speedups():
    s = _tiny(wlb_choice="setting")
    links = replay_phases.Links.of(s, {"nvlink": 300.0, "ib": 50.0})
    per = []
    for b in range(s.batches):
        works = replay_phases.batch_work(s, b)
        assert {k for k in works if k.startswith("wlb")} == {"wlb/4", "wlb/2"}     # the same in every batch
        per.append(replay_phases.model_compose(s, works, links))
        assert "wlb" not in per[-1]
    means = replay_phases.wlb_means(per)
    cp = replay_phases.choose_wlb(s, per)
    assert cp == min(means, key=means.get) and all(p["wlb"].step == p[f"wlb/{cp}"].step for p in per)
    assert replay_phases.choose_wlb(replace(s, wlb_choice="batch"), per) is None

    rows = []
    steps = {"colocated": (4.0, 6.0), "wlb/2": (2.0, 4.0), "wlb/4": (3.0, 2.0), "cad-pingpong": (1.0, 3.0)}
    for b in range(2):                  # wlb/4 has the lower mean step (2.5 against 3.0)
        for k, v in steps.items():
            rows.append({"batch": b, "method": k, "step_s": v[b], "idle_fraction": 0.0,
                         "sim_step_s": 2 * v[b]})
        rows.append({**rows[-2], "method": "wlb", "cp": 4, "sim_cp": 4})
    summ = {r["method"]: r for r in replay_results.summarise(s, rows)}
    cad = summ["cad-pingpong"]
    assert cad["speedup_over_wlb_ratio_of_means"] == pytest.approx(2.5 / 2.0)
    assert cad["speedup_over_wlb_mean_of_ratios"] == pytest.approx((3.0 + 2 / 3) / 2)
    assert cad["speedup_over_wlb"] == cad["speedup_over_wlb_ratio_of_means"]
    assert cad["sim_speedup_over_colocated"] == pytest.approx(10 / 4)
    assert cad["speedup_definition"] == "ratio_of_means"
    assert summ["wlb"]["wlb_cp"] == 4 and summ["wlb"]["wlb_step_s_mean_by_cp"] == {"2": 3.0, "4": 2.5}
    ours = {r["method"]: r for r in replay_results.summarise(replace(s, wlb_choice="batch"), rows)}
    assert ours["cad-pingpong"]["speedup_over_wlb"] == cad["speedup_over_wlb_mean_of_ratios"]
    assert "wlb_cp" not in ours["wlb"]


def test_a_replayed_setting_reports_its_one_degree_per_batch_and_in_the_summary():
    s = _tiny(wlb_choice="setting", batches=2, methods=("colocated", "wlb", "cad-pingpong"))
    keys = set()
    for b in range(s.batches):
        keys |= set(replay_results.missing_times(s, replay_phases.batch_work(s, b), {}, "fa4"))
    rng = np.random.default_rng(0)                   # made-up durations: only the bookkeeping is checked
    times = {k: {"fwd_ms": float(rng.uniform(1, 2)), "bwd_ms": float(rng.uniform(2, 4)), "ms": 1.0,
                 "pre_ms": 1.0, "post_ms": 1.0, "pre_bwd_ms": 2.0, "post_bwd_ms": 2.0} for k in keys}
    res = replay_results.replay_setting(s, times, {"nvlink": 300.0, "ib": 50.0}, "fa4")
    rows = res["per_batch"]
    wl = [r for r in rows if r["method"] == "wlb"]
    means = {c: np.mean([r["step_s"] for r in rows if r["method"] == f"wlb/{c}"]) for c in (2, 4)}
    assert {r["cp"] for r in wl} == {min(means, key=means.get)} and len({r["sim_cp"] for r in wl}) == 1
    summ = {r["method"]: r for r in res["summary"]}
    assert summ["wlb"]["wlb_cp"] == wl[0]["cp"] and set(summ["wlb"]["wlb_step_s_mean_by_cp"]) == {"2", "4"}
    sp = summ["cad-pingpong"]
    assert sp["speedup_over_wlb"] == sp["speedup_over_wlb_ratio_of_means"] == pytest.approx(
        np.mean([r["step_s"] for r in wl]) / summ["cad-pingpong"]["step_s_mean"])
    assert all(r["calls_timed"] for r in rows) and sp["batches_timed"] == 2
    assert "speedup_over_wlb_timed" not in sp

    # one call of batch 1 priced from the table: batch 1 is no longer timed; the speedup over batch 0 alone
    k = next(iter(replay_times.attention_jobs(replay_phases.batch_work(s, 1).values(), s.spec, "fa4")))
    times[k] = {**times[k], "modelled": True}
    res = replay_results.replay_setting(s, times, {"nvlink": 300.0, "ib": 50.0}, "fa4")
    assert {r["batch"] for r in res["per_batch"] if not r["calls_timed"]} == {1}
    sp = {r["method"]: r for r in res["summary"]}["cad-pingpong"]
    step = {r["method"]: r["step_s"] for r in res["per_batch"] if r["batch"] == 0}
    assert sp["batches_timed"] == 1
    assert sp["speedup_over_wlb_timed"] == pytest.approx(step["wlb"] / step["cad-pingpong"])


def test_unwarmed_outliers_are_the_unwarmed_calls_far_over_the_table():
    from cadlib.core.measured import MeasuredCost
    from cadlib.infra.results import RESULTS_DIR
    s = _tiny(batches=2, methods=("colocated", "wlb", "cad-pingpong"))
    cost = MeasuredCost.load(RESULTS_DIR / "kernel_profile_h200.json", "fa4")
    rates = {"nvlink": 300.0, "ib": 50.0}
    times = {}
    for b in range(s.batches):
        works = replay_phases.batch_work(s, b).values()
        times.update(replay_times.model_attention_times(works, s.spec, "fa4", cost))
    for t in times.values():                        # as if timed without a warm-up, at the table's time
        del t["modelled"]
        t["warmup"] = 0
    keys = sorted(times)
    assert replay_calls.unwarmed_outliers([s], times, cost, "fa4", rates) == []
    for k, warm in ((keys[0], 0), (keys[1], 1)):     # three times the table's, without and with a warm-up
        times[k] = {**times[k], "bwd_ms": 3 * (times[k]["fwd_ms"] + times[k]["bwd_ms"]), "warmup": warm}
    assert replay_calls.unwarmed_outliers([s], times, cost, "fa4", rates) == [keys[0]]     # warmed: trusted
    assert replay_calls.unwarmed_outliers([s], times, cost, "fa4", rates, limit=10.0) == []


def test_4d_wlb_as_distcas_4d_driver_packs_a_whole_step():
    s = settings4d.Setting4D("t", "distca-pretrain", 64, 16, 131072, batches=1, wlb_packer="distca-4d")
    pp, dp, n_micro = next(c for c in s.configs() if c[0] == 2)            # 4 nodes a stage, 4 micro-batches
    groups = settings4d.step_groups(s, 0, dp, n_micro)
    docs = sorted(n for g in groups for n in g)
    for packer in ("distca", "distca-4d"):
        lays = settings4d.wlb_micro_layouts(replace(s, wlb_packer=packer), groups, dp, 2)
        assert len(lays) == n_micro and all(lay.n_ranks == dp for lay in lays)
        got = sorted(n for lay in lays for n in lay.doc_lens)
        assert len(got) >= len(docs) and all(n in got for n in docs)   # every document whole (and dummies)
    # the micro-batches are the buckets j // (dp / cp) of one packing over n_micro x dp / cp buckets
    from cadlib.data.packing import wlb_distca_buckets
    flat = [n for g in groups for n in g]
    buckets, lens = wlb_distca_buckets(flat, n_micro * dp // 2, sum(flat) // (n_micro * dp // 2) // n_micro,
                                       s.model)
    lays = settings4d.wlb_micro_layouts(s, groups, dp, 2)
    for m, lay in enumerate(lays):
        want = sorted(lens[d] for b in buckets[m * dp // 2:(m + 1) * dp // 2] for d in b)
        assert sorted(lay.doc_lens) == want
    # the sweep's admissible degrees: 8 nodes // cp at most the sequences of a micro-batch (16 / 4)
    assert replace(s, wlb_choice="setting").wlb_degrees(dp, n_micro) == (2, 4)
    assert s.wlb_degrees(dp, n_micro) == (1, 2, 4)
    with pytest.raises(ValueError, match="Setting4D.wlb_gather must be one of"):
        replace(s, wlb_gather="ring")


def test_ratio_sem_matches_the_spread_of_the_estimator():
    """The delta-method standard error of mean(a)/mean(b) over paired batches equals the spread of that
    ratio over many independent draws of the batches (within 10%), and is 0 for one batch."""
    rng = np.random.default_rng(0)
    n, draws = 15, 4000

    def draw():
        shared = rng.normal(0, 0.3, n)                       # batch-to-batch size, common to both methods
        return 7.0 + shared + rng.normal(0, 0.2, n), 6.0 + shared + rng.normal(0, 0.2, n)

    ratios = [a.mean() / b.mean() for a, b in (draw() for _ in range(draws))]
    predicted = np.mean([replay_results.ratio_sem(*draw()) for _ in range(400)])
    assert abs(predicted / np.std(ratios) - 1) < 0.1
    assert replay_results.ratio_sem([7.0], [6.0]) == 0.0

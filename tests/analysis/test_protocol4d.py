"""The 4D protocol (cadlib.analysis.replay.protocol.paper_4d, cadlib.analysis.replay.sweep4d): Table 4's
settings, DistCA's configuration grid, the memory filter, the setting-level WLB choice, a small sweep."""
import json
from dataclasses import replace

import numpy as np
import pytest

from cadlib.analysis.replay import phases as replay_phases, protocol as P, sweep4d as S, times as replay_times
from cadlib.analysis.replay.settings4d import Setting4D
from cadlib.core import memory
from cadlib.core.measured import MeasuredCost
from cadlib.core.paper import DISTCA_TABLE4_8B
from cadlib.infra.results import RESULTS_DIR, load_result


@pytest.mark.parametrize("dataset", ["pretrain", "prolong"])
def test_paper_4d_settings_are_table_4_under_the_protocol(dataset):
    ss = P.paper_4d(dataset)
    assert len(ss) == 9
    assert {(s.max_doc_len, s.batch, s.gpus) for s in ss} == {
        (c, b, g) for c, bs, gs in DISTCA_TABLE4_8B for b, g in zip(bs, gs)}
    for s in ss:
        assert s.dist == P.PAPER_DISTS[dataset] and s.sequence_len == s.max_doc_len
        assert s.batches == P.PAPER_BATCHES_4D >= 10 and s.total_tokens == s.batch * s.max_doc_len
        assert all(getattr(s, k) == v for k, v in P.PAPER_4D.items())
    # 128K on 64 GPUs: 32 sequences, 512K tokens per node (the notes' section 5)
    assert ss[0].total_tokens // ss[0].nodes == 4 * 131072
    with pytest.raises(ValueError, match="unknown dataset"):
        P.paper_4d("pile")


def test_4d_variants_change_one_field():
    s = P.paper_4d("pretrain")[0]
    for v in P.VARIANTS_4D:
        x = P.one_change_4d(s, v.name)
        assert x.name == f"{s.name}@{v.name}"
        changed = [f for f in s.__dataclass_fields__ if f != "name" and getattr(s, f) != getattr(x, f)]
        assert 1 <= len(changed) <= 2 and set(changed) <= set(v.fields)
    with pytest.raises(ValueError, match="unknown 4D variant"):
        P.one_change_4d(s, "kernel")


def test_zconfig_grid_follows_distca():
    cfgs = S.zconfig_grid(8, 32, 32)
    assert cfgs and all(c.bs * c.n_micro == 16 for c in cfgs)
    assert all(c.n_micro == 1 if c.pp == 1 else c.n_micro >= 2 * c.pp for c in cfgs)
    assert not [c for c in cfgs if c.method == "cad" and (c.bs < 1 or c.cp != 1)]
    assert all(c.pp * c.cp <= 8 and 8 // c.cp <= 2 * c.bs for c in cfgs if c.method == "wlb")
    assert S.Config4D("cad", 1, 1, 16) in cfgs and S.Config4D("wlb", 2, 4, 4, 2) in cfgs
    assert S.Config4D("wlb", 2, 16, 1, 1) not in cfgs            # 8 replicas, 2 sequences a micro-batch
    with pytest.raises(ValueError, match="even number"):
        S.zconfig_grid(8, 3, 32)


def test_memory_filter_excludes_an_over_budget_configuration():
    s = P.paper_4d("pretrain")[0]                                 # 128K, 64 GPUs, 32 sequences
    cfgs = S.zconfig_grid(s.nodes, s.batch, 32)
    mem = S.memory_fits(s, cfgs)
    plain = S.Config4D("wlb", 1, 1, 16, 1)          # 4M tokens on 8 nodes, no PP: 512K a GPU group
    assert not mem[plain]["fits"] and mem[plain]["peak_gib"] * memory.GIB > memory.CAPACITY
    assert mem[S.Config4D("wlb", 2, 4, 4, 2)]["fits"]
    direct = memory.fits(s.model, "wlb", s.total_tokens // 8, tp=8, pp=1, cp=1, dp=8, n_micro=1,
                         recompute="mlp")
    assert direct["peak"] / memory.GIB == pytest.approx(mem[plain]["peak_gib"])


def _row(method, cp, batch, step, fits=True):
    return {"method": method, "pp": 2, "dp": 4, "cp": cp, "n_micro": 8, "bs": 2, "batch": batch,
            "step_s": step, "fits": fits, "peak_gib": 1.0}


def test_wlb_ideal_is_one_configuration_per_setting_and_the_speedup_a_ratio_of_means():
    s = Setting4D("t", "pretrain-distca", 64, 32, 131072, batches=2)
    rows = [_row("wlb", 1, 0, 10.0), _row("wlb", 1, 1, 14.0),     # mean 12
            _row("wlb", 2, 0, 12.0), _row("wlb", 2, 1, 11.0),     # mean 11.5: the setting's choice
            _row("wlb", 4, 0, 5.0, fits=False), _row("wlb", 4, 1, 5.0, fits=False),
            _row("cad-pingpong", 1, 0, 9.0), _row("cad-pingpong", 1, 1, 10.0)]
    out = {(r["view"], r["method"]): r for r in S.summarise(s, rows)}
    w, c = out["paper", "wlb"], out["paper", "cad-pingpong"]
    assert w["cp"] == 2 and w["step_s_mean"] == 11.5 and w["step_s_se"] == pytest.approx(0.5)
    assert c["speedup_over_wlb"] == pytest.approx(11.5 / 9.5)
    assert c["speedup_se"] == pytest.approx(S.ratio_se([12.0, 11.0], [9.0, 10.0]))
    assert out["oracle", "wlb"]["step_s_mean"] == pytest.approx(10.5)       # batch by batch: 10, 11
    assert out["any", "wlb"]["cp"] == 4                                     # no memory limit


def test_ratio_se_matches_the_sampling_spread():
    rng = np.random.default_rng(0)
    w = 10 + rng.normal(0, 1, (4000, 10))
    c = 8 + 0.5 * (w - 10) + rng.normal(0, 0.5, (4000, 10))
    ratios = w.mean(1) / c.mean(1)
    ses = [S.ratio_se(a, b) for a, b in zip(w[:200], c[:200])]
    assert np.mean(ses) == pytest.approx(ratios.std(), rel=0.15)


def test_a_small_sweep_composes_both_methods():
    times = json.loads((RESULTS_DIR / "replay" / "times_h200.json").read_text())["times"]
    rates = replay_phases.link_rates(load_result("comm_overlap_probe_2xh200_nvlink.json"))
    cost = MeasuredCost.load(RESULTS_DIR / "kernel_profile_h200.json", "torch_flash")
    s = replace(P.paper_4d("pretrain")[0], name="t", gpus=32, batch=8, max_doc_len=65536, sequence_len=65536,
                batches=2, linear="fused-sp")
    price = replay_times.SegmentPrice(s.spec, "torch_flash", cost, 1.05)
    res = S.replay_sweep(s, times, rates, "torch_flash", price)
    rows = res["per_config"]
    assert {(r["method"], r["pp"]) for r in rows} >= {("wlb", 1), ("wlb", 2), ("cad-pingpong", 1),
                                                      ("cad-pingpong", 2)}
    assert all(r["step_s"] > 0 and r["step_s"] == pytest.approx(r["pipeline_s"]) for r in rows)  # no opt.
    cad = [r for r in rows if r["method"] == "cad-pingpong"]
    assert all(r["tolerance_max"] >= 0.05 and r["buffer_failed_ticks"] == 0 for r in cad)
    paper = {r["method"]: r for r in res["summary"] if r["view"] == "paper"}
    assert paper["wlb"]["batches"] == 2 and np.isfinite(paper["cad-pingpong"]["speedup_over_wlb"])
    assert res["attention_calls"]["modelled"] > 0
    # the step's documents are the same for every configuration: WLB's microbatches hold them all, whole
    seqs = S.step_sequences(s.dist, s.sequence_len, s.batch, 0, s.seed)
    c = S.Config4D("wlb", 2, 4, 1, 2)
    groups = S.micro_groups(s, seqs, c)
    assert sorted(n for g in groups for n in g) == sorted(n for q in seqs for n in q)

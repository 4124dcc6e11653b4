"""The measured kernel cost model (cadlib.core.measured) on a small synthetic table, and its hooks in the
scheduler and the simulator; the profiling script's CPU mode writes a table it can load."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cadlib.analysis.runs.cost_check import compare_models, model_imbalance
from cadlib.analysis.model.sim import simulate, simulate_cad
from cadlib.core.layout import Layout
from cadlib.core.measured import MeasuredCost, segment_pairs
from cadlib.core.plan import CATask, Plan
from cadlib.data.packing import pack
from cadlib.data.workload import sample_docs
from cadlib.scheduling.scheduler import schedule

ROOT = Path(__file__).resolve().parents[2]
QS, KS = [128, 512, 2048, 8192], [128, 512, 2048, 8192, 32768]


def true_rate(q, k, phase):
    """Pairs per second: small query shards are slow, more so with backward."""
    q0 = 400.0 if phase == "fwd_bwd" else 60.0
    peak = 1.5e11 if phase == "fwd" else 0.45e11
    return peak * q / (q + q0) * k / (k + 256.0)


def synthetic_table(overhead_ms=0.02):
    rows = []
    for q in QS:
        for k in KS:
            if k >= q:
                n = 4
                p = segment_pairs(q, k) * n
                rows.append({"backend": "fa4", "kind": "task", "q_len": q, "kv_len": k, "n_seg": n,
                             **{f"{ph}_ms": 1e3 * p / true_rate(q, k, ph) for ph in ("fwd", "fwd_bwd")}})
    for n in (1, 4, 16, 64):
        p = segment_pairs(512, 8192) * n
        rows.append({"backend": "fa4", "kind": "fused", "q_len": 512, "kv_len": 8192, "n_seg": n,
                     **{f"{ph}_ms": overhead_ms + 1e3 * p / true_rate(512, 8192, ph)
                        for ph in ("fwd", "fwd_bwd")}})
    rows.append({"backend": "torch_flash", "kind": "task", "q_len": 128, "kv_len": 128, "n_seg": 1,
                 "fwd_ms": 0.01, "fwd_bwd_ms": 0.03})
    return {"meta": {"device": "synthetic"}, "results": rows,
            "config": {"n_heads": 32, "n_kv_heads": 8, "head_dim": 128, "dtype": "bfloat16"}}


@pytest.fixture(scope="module")
def cost():
    return MeasuredCost.from_table(synthetic_table())


def test_interpolation_reproduces_grid_points_and_fits_overhead(cost):
    for q in QS:
        for k in KS:
            if k >= q:
                for ph in ("fwd", "fwd_bwd"):
                    want = segment_pairs(q, k) / true_rate(q, k, ph)
                    assert np.isclose(cost.task_seconds(q, k, ph), want, rtol=1e-9)
    assert np.isclose(cost.overhead["fwd"], 0.02e-3, rtol=1e-6)
    assert np.isclose(cost.task_seconds(512, 2048, "bwd"),
                      cost.task_seconds(512, 2048, "fwd_bwd") - cost.task_seconds(512, 2048, "fwd"))
    # between grid points: the rate lies between its neighbours'
    r = segment_pairs(1024, 4096) / cost.task_seconds(1024, 4096)
    lo, hi = sorted(true_rate(q, k, "fwd_bwd") for q, k in ((512, 2048), (2048, 8192)))
    assert lo <= r <= hi


def test_latency_is_monotone_in_query_and_kv_length(cost):
    ks = np.geomspace(130, 60000, 40)
    for q in (100, 128, 300, 1000, 5000):
        t = cost.task_seconds(np.full(ks[ks >= q].size, q), ks[ks >= q])
        assert np.all(np.diff(t) > 0)
    qs = np.geomspace(16, 30000, 40)
    t = cost.task_seconds(qs, np.full(qs.size, 32768.0))
    assert np.all(np.diff(t) > 0)
    assert cost.fused_seconds([512] * 3, [8192] * 3) > cost.fused_seconds([512] * 2, [8192] * 2)


def test_min_shard_comes_from_the_table(cost):
    eff = [cost.efficiency(q) for q in QS]
    assert eff == sorted(eff)                      # larger shards are more efficient here
    assert cost.min_shard(0.5) <= cost.min_shard(0.1) <= cost.min_shard(0.01)
    assert cost.min_shard(0.1) in QS
    assert cost.min_shard(0.9) == 128
    with pytest.raises(ValueError, match="within must be in"):
        cost.min_shard(1.5)


def test_bad_tables_and_arguments_raise():
    with pytest.raises(ValueError, match="'config' and 'results'"):
        MeasuredCost.from_table({"results": []})
    with pytest.raises(ValueError, match="no 'task' rows"):
        MeasuredCost.from_table({"config": {}, "results": []})
    with pytest.raises(ValueError, match="backend 'fa9' is not in the table; it has: fa4, torch_flash"):
        MeasuredCost.from_table(synthetic_table(), "fa9")
    c = MeasuredCost.from_table(synthetic_table(), "torch_flash")   # a one-point table: held constant
    assert c.overhead == {"fwd": 0.0, "fwd_bwd": 0.0}
    assert np.isclose(c.task_seconds(256, 1024) / c.task_seconds(128, 128),
                      segment_pairs(256, 1024) / segment_pairs(128, 128))
    with pytest.raises(ValueError, match="phase must be one of"):
        c.task_seconds(1, 1, "backward")
    with pytest.raises(ValueError, match="q_len <= kv_len"):
        c.task_seconds(10, 5)


def test_server_seconds_merge_contiguous_shards(cost):
    layout = Layout([[(0, 0, 4096)], []], [4096])
    tasks = [CATask(0, a, a + 512, 0, 0) for a in range(0, 4096, 512)]
    split = Plan(layout, tasks)
    t_merged = cost.server_seconds(split)
    t_copy = cost.server_seconds(split, merge=False)
    assert t_merged[1] == 0 and np.isclose(t_merged[0], cost.fused_seconds([4096], [4096]))
    assert t_copy[0] > t_merged[0]


def test_scheduler_and_simulator_accept_the_table(cost):
    layout = pack(sample_docs("prolong", 8 * 16384, seed=0), 8, 16384)
    plan = schedule(layout, cost_model=cost)
    assert plan.meta["min_shard"] == cost.min_shard() and plan.meta["measured_imbalance"] >= 1.0
    assert schedule(layout).meta["min_shard"] == 512 and "measured_imbalance" not in schedule(layout).meta
    with pytest.raises(ValueError, match="cost_model must be a cadlib.core.measured.MeasuredCost"):
        schedule(layout, cost_model="h200.json")
    base = simulate_cad(plan, "llama3-8b")
    meas = simulate_cad(plan, "llama3-8b", cost=cost)
    assert meas.step > 0 and not np.allclose(meas.breakdown["attention"], base.breakdown["attention"])
    via = simulate("cad", layout, "llama3-8b", cost=cost)
    assert np.isclose(via.step, meas.step)
    row = model_imbalance(plan, cost, "llama3-8b")
    assert row["pairs"] >= 1.0 and row["measured"] >= 1.0 and row["pair_rate_model"] >= 1.0


def test_compare_models_rows(cost):
    rows = compare_models(cost, dists=("pretrain",), n_servers=(4,), tokens_per_rank=8192)
    assert len(rows) == 1 and {"pairs", "measured", "min_shard"} <= set(rows[0])


def test_profile_script_cpu_quick_writes_a_loadable_table(tmp_path):
    out = tmp_path / "kp.json"
    script = ROOT / "scripts" / "bench" / "profile_kernels.py"
    subprocess.run([sys.executable, str(script), "--device", "cpu", "--quick", "--time-budget-s", "60",
                    "--out", str(out)], check=True, cwd=ROOT, capture_output=True, timeout=300)
    table = json.loads(out.read_text())
    assert {"meta", "config", "results"} <= set(table) and table["meta"]["commit"]
    assert {r["kind"] for r in table["results"]} == {"task", "fused"}
    c = MeasuredCost.load(out)
    assert c.backend == "sdpa_ref" and c.task_seconds(32, 64) > 0 and c.min_shard() in (16, 32, 64)


# --------------------------------------------------------------------- what it buys on end-to-end runs
from cadlib.analysis.runs.cost_check import attention_ms, e2e_check, e2e_check_summary, rebuild_plans  # noqa: E402

E2E_CFG = {"model": "tiny", "layers": 2, "tokens_per_rank": 4096, "dist": "prolong", "doc_len": None,
           "max_doc_len": None, "seed": 0, "tolerance": 0.05, "min_shard": 512, "nano_balance": "tokens",
           "nano_split": "docs", "nproc": 2}


def fake_e2e_item(cost, batches=(0, 1), skew=1.1):
    """A committed-style end-to-end item whose records carry the rebuilt plans' imbalance, cad's
    attention measured as the cost model's times ``skew`` on rank 0, colocated's the model's."""
    records, per_batch = [], []
    for b in batches:
        spec, layout, plan, nanos, coloc = rebuild_plans(E2E_CFG, b, 2)
        cad = cost.server_seconds(plan, "fwd_bwd", spec) * spec.n_layers * 1e3 * np.array([skew, 1.0])
        col = cost.server_seconds(coloc, "fwd_bwd", spec) * spec.n_layers * 1e3
        for r in range(2):
            records.append({"method": "cad", "batch": b, "rank": r, "attention_ms": float(cad[r]),
                            "plan_imbalance": [plan.imbalance()], "step_ms": 100.0})
            records.append({"method": "colocated", "batch": b, "rank": r, "attention_ms": float(col[r]),
                            "plan_imbalance": [coloc.imbalance()], "step_ms": 100.0 + col.max()})
        per_batch.append({"batch": b, "speedup cad-pingpong": 1.05})
    return {"file": "bench_e2e_fake.json", "setting": "prolong 4K x2", "kernel_only_spans": True,
            "config": E2E_CFG, "results": {"records": records, "per_batch": per_batch}}


def test_rebuild_plans_follow_train():
    from cadlib.scheduling.nanosplit import split_nano_batches
    from cadlib.scheduling.recipes import Recipe, batch_docs
    spec, layout, plan, nanos, coloc = rebuild_plans(E2E_CFG, 1, 2)
    docs = batch_docs(Recipe.from_config(E2E_CFG), 1, 2)
    assert layout.doc_lens == list(docs) and layout.n_ranks == 2 and spec.n_layers == 2
    assert plan.meta["min_shard"] == 512 and plan.imbalance() <= coloc.imbalance() + 1e-12
    assert len(nanos) == 2 and all(p.layout.n_ranks == 2 for p in nanos)
    whole = split_nano_batches(layout, "tokens", split_docs=False)
    _, _, _, nanos_whole, _ = rebuild_plans({k: v for k, v in E2E_CFG.items() if k != "nano_split"}, 1, 2)
    assert [p.layout.doc_lens for p in nanos_whole] == [nb.layout.doc_lens for nb in whole]


def test_e2e_check_on_a_fake_run(cost):
    item = fake_e2e_item(cost)
    rows = e2e_check(item, cost)
    assert [r["batch"] for r in rows] == [0, 1]
    for r in rows:
        spec, _, plan, nanos, _ = rebuild_plans(E2E_CFG, r["batch"], 2)
        t = cost.server_seconds(plan, "fwd_bwd", spec)
        assert np.isclose(r["pairs"], plan.imbalance()) and np.isclose(r["model"], t.max() / t.mean())
        meas = t * np.array([1.1, 1.0])
        assert np.isclose(r["measured"], meas.max() / meas.mean())
        assert np.isclose(r["calibration"], 1.0)           # colocated measured = the model's
        a = attention_ms(nanos, cost, spec)
        col_max = max(x["attention_ms"] for x in item["results"]["records"]
                      if x["method"] == "colocated" and x["batch"] == r["batch"])
        assert np.isclose(r["speedup_model"], (100 + col_max) / (100 + a))
    summ = e2e_check_summary(rows)
    assert len(summ) == 1 and summ[0]["batches"] == 2
    mae = np.mean([abs(r["model"] - r["measured"]) for r in rows])
    assert np.isclose(summ[0]["mae_imbalance_model"], mae)
    assert {"speedup_err_default_mean", "speedup_err_model_max"} <= set(summ[0])


def test_e2e_check_refuses_a_plan_that_is_not_the_runs(cost):
    item = fake_e2e_item(cost, batches=(0,))
    for r in item["results"]["records"]:
        r["plan_imbalance"] = [r["plan_imbalance"][0] + 0.01]
    with pytest.raises(ValueError, match="rebuilt plan's imbalance"):
        e2e_check(item, cost)


def test_cost_model_check_script_writes_its_json(tmp_path):
    import shutil
    src = ROOT / "results" / "bench_e2e_2x_uniform_64k_nvlink.json"
    if not src.exists():
        pytest.skip("no committed end-to-end result")
    shutil.copy(src, tmp_path / src.name)
    out = tmp_path / "cmc.json"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "analyses" / "cost_model_check.py"),
                    "--results-dir", str(tmp_path), "--out", str(out)],
                   check=True, cwd=ROOT, capture_output=True, timeout=120)
    res = json.loads(out.read_text())
    assert res["config"]["inputs"] == [str(tmp_path / src.name), "results/kernel_profile_h200.json"]
    assert res["meta"]["commit"] and len(res["results"]["per_batch"]) == 10
    s = res["results"]["summary"][0]
    assert s["mae_imbalance_model"] < 0.05 and s["speedup_err_model_max"] < 0.1


def test_server_overhead_fit_recovers_a_per_row_cost():
    from cadlib.analysis.runs.cost_check import server_overhead_fit
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(12):
        model = rng.uniform(50, 300, 2)
        q, kv = rng.integers(0, 200_000, 2), rng.integers(0, 100_000, 2)
        meas = 0.95 * model + 4 * (30 * q + 20 * kv) / 1e6          # 4 layers, ns per row per layer
        rows.append({"attention_ms_measured": meas.tolist(), "attention_ms_model": model.tolist(),
                     "q_gathered_rows": q.tolist(), "kv_gathered_rows": kv.tolist(), "layers": 4})
    fit = server_overhead_fit(rows)
    assert fit["points"] == 24 and fit["rms_ms"] < 1e-6 < fit["rms_ms_alone"]
    assert np.allclose([fit["scale"], fit["ns_per_q_row"], fit["ns_per_kv_row"]], [0.95, 30, 20])
    with pytest.raises(ValueError, match="at least 4"):
        server_overhead_fit(rows[:1])


def test_gathered_rows_only_where_a_server_sent_rows_away():
    from cadlib.analysis.runs.cost_check import gathered_rows
    from cadlib.core.layout import layout_from_lists
    from cadlib.scheduling.scheduler import colocated, schedule
    layout = layout_from_lists([[(0, 0, 900)], [(1, 0, 100)]], [900, 100])
    assert [gathered_rows(colocated(layout), r) for r in range(2)] == [(0, 0), (0, 0)]
    plan = schedule(layout, n_servers=2, tolerance=0.05, min_shard=16)
    assert any(t.home == 0 and t.server == 1 for t in plan.tasks)          # rank 0 sends work away
    q, kv = gathered_rows(plan, 0)
    assert 0 < q < 900 and 0 < kv <= 900
    assert gathered_rows(plan, 1)[0] == 0                             # the receiver reads in place

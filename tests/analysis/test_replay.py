"""The scale replay's host side: the paper's settings, every method's work for a batch (the bytes its
collectives move balance), WLB's context-parallel layout, and a whole time-and-compose run on the CPU."""
import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from cadlib.analysis.replay import phases as replay_phases, results as replay_results, settings as replay, times as replay_times
from cadlib.analysis.runs.e2e import load_committed
from cadlib.core.cost import ModelSpec
from cadlib.data.packing import per_doc_gather_tokens, wlb_layout

ROOT = Path(__file__).resolve().parents[2]


def test_paper_settings_are_table_3_at_128k_tokens_per_group():
    ss = replay.paper_3d_settings()
    assert len(ss) == 18 and {s.dp for s in ss} == {8, 16, 32}
    assert all(s.tokens == replay.TOKENS_PER_GROUP and s.tp == 8 for s in ss)
    assert {s.max_doc_len for s in ss} == {131072, 262144, 524288}
    assert ss[0].spec == ModelSpec.from_name("llama3-8b").shard(8)


def test_shard_and_its_errors():
    sh = ModelSpec.from_name("llama3-8b").shard(8)
    assert (sh.n_heads, sh.n_kv_heads, sh.ffn, sh.vocab, sh.hidden) == (4, 1, 1792, 16032, 4096)
    with pytest.raises(ValueError, match="tp=3 must divide"):
        ModelSpec.from_name("llama3-8b").shard(3)


def test_batch_work_balances_bytes_and_covers_every_method():
    s = replay.Setting("t", "pretrain", 4, tokens=4096, max_doc_len=4096, tp=1, model="tiny", batches=1,
                       wlb_cp=(1, 2), min_shard=32, link="nvlink")
    works = replay_phases.batch_work(s, 0)
    assert set(works) == {"colocated", "wlb/1", "wlb/2", "cad", "cad-pingpong", "signal-only"}
    for k, w in works.items():
        for name, (sent, recv) in w.bytes.items():
            assert np.sum(sent) == np.sum(recv), (k, name)
        assert w.tokens.sum() == 4 * 4096
    assert works["cad-pingpong"].tokens.shape == (2, 4)


def test_wlb_layout_splits_every_chunk_over_its_group():
    docs = [3000, 500, 9000, 700, 2000, 1184]
    lay = wlb_layout(docs, 4, 2, 4096)
    assert lay.total_tokens == sum(docs)
    ch = lay.chunk_array()
    for d in range(len(docs)):                    # every document's pieces on one group of 2 ranks
        groups = {r // 2 for r in ch[ch[:, 0] == d, 3]}
        assert len(groups) >= 1
    sent, recv = per_doc_gather_tokens(lay)
    assert sent.sum() == recv.sum() and recv.min() >= 0
    with pytest.raises(ValueError, match="cp=3 must divide"):
        wlb_layout(docs, 4, 3, 4096)


def test_time_and_compose_on_the_cpu(tmp_path, capsys):
    path = ROOT / "scripts" / "bench" / "bench_replay.py"
    spec = importlib.util.spec_from_file_location("bench_replay", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_replay"] = bench           # its pool's workers find their function by name
    spec.loader.exec_module(bench)                # in this process: no second interpreter to start
    cache, out = tmp_path / "t.json", tmp_path / "out"
    assert bench.main(["time", "--smoke", "--cache", str(cache), "--workers", "1"]) == 0
    attn = [e for k, e in json.loads(cache.read_text())["times"].items() if k.startswith("attn|")]
    # one untimed run first; no pool reserved on a CPU
    assert attn and all(e["warmup"] == 1 and e["iters"] == 1 and e["reserve_gib"] == 0 for e in attn)
    # --retime-keys times exactly the listed calls again, and leaves every other one as it was
    data = json.loads(cache.read_text())
    listed = sorted(k for k in data["times"] if k.startswith("attn|"))[:2]
    for k in listed:
        data["times"][k]["fwd_ms"] = -1.0
    cache.write_text(json.dumps(data))
    (tmp_path / "keys.json").write_text(json.dumps(listed))
    assert bench.main(["time", "--smoke", "--cache", str(cache), "--workers", "1",
                       "--retime-keys", str(tmp_path / "keys.json")]) == 0
    again = json.loads(cache.read_text())["times"]
    assert all(again[k]["fwd_ms"] > 0 for k in listed)
    assert all(again[k] == e for k, e in data["times"].items() if k not in listed)
    with pytest.raises(SystemExit):
        bench.main(["time", "--smoke", "--cache", str(cache), "--warmup", "-1"])
    with pytest.raises(SystemExit):
        bench.main(["time", "--smoke", "--cache", str(cache), "--reserve-gib", "-1"])
    (tmp_path / "dict.json").write_text(json.dumps({"a": 1}))
    for bad in (["--retime-keys", str(tmp_path / "none.json")],
                ["--retime-keys", str(tmp_path / "dict.json")], ["--retime", "--retime-unpooled"]):
        with pytest.raises(SystemExit):
            bench.main(["time", "--smoke", "--cache", str(cache), *bad])
        assert ("not a JSON list of cache keys" if "--retime-keys" in bad else "choose one of") in \
            capsys.readouterr().err
    # --retime-unpooled times again only the calls timed without a reserved pool
    data = json.loads(cache.read_text())
    old_key = sorted(k for k in data["times"] if k.startswith("attn|"))[0]
    data["times"][old_key] = {"fwd_ms": -1.0, "bwd_ms": -1.0, "iters": 1, "warmup": 0}
    cache.write_text(json.dumps(data))
    assert bench.main(["time", "--smoke", "--cache", str(cache), "--workers", "1", "--retime-unpooled"]) == 0
    again = json.loads(cache.read_text())["times"]
    assert again[old_key]["fwd_ms"] > 0 and "reserve_gib" in again[old_key]
    assert all(again[k] == e for k, e in data["times"].items() if k != old_key)
    with pytest.raises(SystemExit):
        bench.main(["compose", "--smoke", "--cache", str(cache), "--model-missing", "--fit-batches", "0"])
    assert bench.main(["compose", "--smoke", "--cache", str(cache), "--out", str(out)]) == 0
    summary = json.loads((out / "replay_summary.json").read_text())["results"]
    methods = {r["method"] for r in summary}
    assert {"colocated", "wlb", "cad", "cad-pingpong", "signal-only"} <= methods
    assert all(r["batches"] == 2 and r["step_s_mean"] > 0 for r in summary)
    rows = json.loads((out / "replay_smoke_pretrain_dp4.json").read_text())["results"]["per_batch"]
    assert all(r["sim_step_s"] > 0 for r in rows)


def test_linear_variants_have_keys_of_their_own_and_compose_from_them(tmp_path):
    """The committed keys keep their form; the fused, sequence-parallel timings live under keys of their
    own, and a setting composes the variant it names (here the smoke's times, halved, under fused-sp)."""
    spec = ModelSpec.from_name("llama3-8b").shard(8)
    sk = replay_times.spec_key(spec, "fa4")
    assert replay_times.linear_key(spec, "fa4", 4096) == f"linear|{sk}|4096"
    assert replay_times.head_key(spec, "fa4", 4096, "fused-sp", 8) == f"head@fused-sp/tp8|{sk}|4096"
    with pytest.raises(ValueError, match="unknown linear variant 'fast'"):
        replay_times.linear_key(spec, "fa4", 4096, "fast")
    with pytest.raises(ValueError, match="Setting.linear must be one of"):
        replay.Setting("x", "uniform", 2, linear="fast")
    path = ROOT / "scripts" / "bench" / "bench_replay.py"
    mod = importlib.util.spec_from_file_location("bench_replay", path)
    bench = importlib.util.module_from_spec(mod)
    sys.modules["bench_replay"] = bench
    mod.loader.exec_module(bench)
    cache, out = tmp_path / "t.json", tmp_path / "out"
    assert bench.main(["time", "--smoke", "--cache", str(cache), "--workers", "1"]) == 0
    data = json.loads(cache.read_text())
    for k, v in list(data["times"].items()):
        if k.startswith(("linear|", "head|")):
            part, rest = k.split("|", 1)
            data["times"][f"{part}@fused-sp/tp1|{rest}"] = replay_times.scaled({k: v}, 0.5)[k]
    cache.write_text(json.dumps(data))
    steps = {}
    for var, tag in (("", ""), ("fused-sp", "_f")):
        assert bench.main(["compose", "--smoke", "--cache", str(cache), "--out", str(out), "--tag", tag,
                           "--linear", var]) == 0
        res = json.loads((out / f"replay_smoke_pretrain_dp4{tag}.json").read_text())
        assert res["config"]["linear"] == var
        steps[var] = {r["method"]: r["step_s_mean"] for r in res["results"]["summary"]}
    assert all(steps["fused-sp"][m] < steps[""][m] for m in steps[""])


def _run(path, nproc, head_ms, tokens=65536):
    cfg = {"model": "llama3-8b", "layers": 4, "tokens_per_rank": tokens, "ce_chunk": 8192,
           "mlp_recompute": True, "dtype": "bf16", "nproc": nproc}
    recs = [{"method": m, "batch": 0, "rank": 0, "step_ms": 1.0, "head_ms": h}
            for m, h in zip(("colocated", "cad"), head_ms)]
    path.write_text(json.dumps({"meta": {"device": f"{nproc}x H200"}, "config": cfg,
                                "results": {"records": recs}}))


def test_device_ratio_is_the_runs_head_over_the_one_gpu_runs(tmp_path):
    _run(tmp_path / "bench_e2e_2x_a.json", 2, (110.0, 112.0))
    _run(tmp_path / "bench_e2e_1x_a.json", 1, (100.0, 102.0))
    _run(tmp_path / "bench_e2e_1x_b.json", 1, (300.0, 300.0), tokens=131072)    # another token count
    s = replay.Setting("v", "uniform", 2, tp=1, source="bench_e2e_2x_a.json")
    d = replay_results.device_ratio(s, tmp_path)
    assert d["ratio"] == pytest.approx(111 / 101) and d["runs"] == 1 and d["device"] == "2x H200"
    assert replay_results.device_ratio(replace(s, source="bench_e2e_1x_a.json"), tmp_path) is None
    assert replay_results.device_ratio(replace(s, source=None), tmp_path) is None
    _run(tmp_path / "bench_e2e_2x_c.json", 2, (110.0, 110.0), tokens=4096)     # no one-GPU run to match
    assert replay_results.device_ratio(replace(s, source="bench_e2e_2x_c.json"), tmp_path) is None


def test_scaled_times_scale_every_duration_and_nothing_else():
    t = {"a": {"fwd_ms": 2.0, "bwd_ms": 3.0}, "o": {"ms": 4.0, "params": 10},
         "m": {"fwd_ms": 1.0, "modelled": True}}
    got = replay_times.scaled(t, 1.5)
    assert got == {"a": {"fwd_ms": 3.0, "bwd_ms": 4.5}, "o": {"ms": 6.0, "params": 10},
                   "m": {"fwd_ms": 1.5, "modelled": True}}
    assert t["a"]["fwd_ms"] == 2.0
    with pytest.raises(ValueError, match="factor must be > 0"):
        replay_times.scaled(t, 0)


def test_committed_validation_holds_the_device_ratio_of_every_two_gpu_run():
    for it in load_committed():
        if it["file"].startswith("bench_e2e_2x_") and it["variant"] == "":
            d = replay_results.device_ratio(replay.e2e_setting(it))
            assert d is not None and 1.0 < d["ratio"] < 1.06, (it["file"], d)


def test_compile_suspects_flag_a_pass_that_holds_a_compile_and_nothing_else():
    t = {"ok": {"fwd_ms": 30.0, "bwd_ms": 75.0, "iters": 1},              # backward 2.5x forward
         "fwd_compiled": {"fwd_ms": 423.5, "bwd_ms": 14.6, "iters": 1},
         "both": {"fwd_ms": 2424.7, "bwd_ms": 2709.5, "iters": 2},
         "bwd_compiled": {"fwd_ms": 4.8, "bwd_ms": 35.6, "iters": 1},
         "tiny": {"fwd_ms": 3.0, "bwd_ms": 2.0, "iters": 1},               # under min_ms: noise
         "retimed": {"fwd_ms": 423.5, "bwd_ms": 14.6, "iters": 1, "warmup": 1},
         "modelled": {"fwd_ms": 423.5, "bwd_ms": 14.6, "modelled": True},
         "head": {"ms": 500.0}}
    assert replay_times.compile_suspects(t) == ["both", "bwd_compiled", "fwd_compiled"]


def _toy_plan():
    # rank 0 holds doc 0 [0, 8), ranks 1 and 2 a 2-token document each; server 0 serves doc 0's [0, 3),
    # server 2 its [3, 5) (KV [0, 5)), server 1 its [5, 8) (KV [0, 8)) and doc 1, server 2 doc 2
    from cadlib.core.layout import layout_from_lists
    from cadlib.core.plan import Plan
    lay = layout_from_lists([[(0, 0, 8)], [(1, 0, 2)], [(2, 0, 2)]], [8, 2, 2])
    return Plan.from_arrays(lay, [0, 0, 0, 1, 2], [0, 3, 5, 0, 0], [3, 5, 8, 2, 2], [0, 0, 0, 1, 2],
                            [0, 2, 1, 1, 2], n_servers=3)


def test_cad_bytes_stateful_and_resend_by_hand():
    from cadlib.dispatch.build import build_all
    spec = ModelSpec.from_name("llama3-8b").shard(8)          # Q, O 1024 B; K+V 512 B; LSE 16 B a token
    ds = build_all(_toy_plan())
    # rank 0 sends Q 3 + 2 and KV 8 + 5 (once per (server, document)); server 1 gets Q 3, KV 8; server 2
    # Q 2, KV 5
    fwd = ([5 * 1024 + 13 * 512, 0, 0], [0, 3 * 1024 + 8 * 512, 2 * 1024 + 5 * 512])
    st = {k: tuple(x.tolist() for x in v) for k, v in replay._cad_bytes(ds, spec).items()}
    assert st == {"in": fwd, "out": ([0, 3072, 2048], [5120, 0, 0]),
                  "out_bwd": ([5120, 0, 0], [0, 3072, 2048]), "in_bwd": fwd[::-1]}
    # DistCA's resend: O + LSE back (1040 a token); out again dO, O, LSE, Q (3088 a token) and the KV
    rs = {k: tuple(x.tolist() for x in v) for k, v in replay._cad_bytes(ds, spec, resend=True).items()}
    assert rs == {"in": fwd, "out": ([0, 3 * 1040, 2 * 1040], [5 * 1040, 0, 0]),
                  "out_bwd": ([5 * 3088 + 13 * 512, 0, 0], [0, 3 * 3088 + 8 * 512, 2 * 3088 + 5 * 512]),
                  "in_bwd": fwd[::-1]}


def test_cad_protocol_choices_reach_the_work():
    s = replay.Setting("t", "pretrain", 4, tokens=4096, max_doc_len=4096, tp=1, model="llama3-8b", batches=1,
                       methods=("cad", "cad-pingpong"), min_shard=32, link="nvlink")
    docs = replay.batch_lengths(s, 0)
    base = {m: replay.method_work(s, docs, m) for m in s.methods}
    assert all(set(w.meta) == {"imbalance"} for w in base.values())         # the defaults record nothing new
    # resend: the same plans, more bytes where DistCA's stateless servers send more
    rs = replace(s, backward="resend")
    for m in s.methods:
        w, w0 = replay.method_work(rs, docs, m), base[m]
        assert np.array_equal(w.tokens, w0.tokens) and np.array_equal(w.bytes["in"][0], w0.bytes["in"][0])
        assert (np.asarray(w.bytes["out_bwd"][0]) >= np.asarray(w0.bytes["out_bwd"][0])).all()
        assert np.asarray(w.bytes["out_bwd"][0]).sum() > np.asarray(w0.bytes["out_bwd"][0]).sum()
    # DistCA's planner
    ds = replace(s, cad_planner="distca")
    lay = replay.method_layout(docs, 4, ds.recipe(), replay.METHODS["cad-pingpong"])
    nanos, plans, rec = replay.cad_plans(ds, lay, ds.recipe(), ds.spec, pingpong=True)
    assert len(nanos) == 2 and all(p.meta["method"] == "distca" for p in plans) and rec == {}
    # DistCA's tolerance rule: the first tolerance from the setting's whose plans fit, recorded
    big = replace(s, tolerance_rule="buffer", tolerance=0.05, backward="resend")
    w = replay.method_work(big, docs, "cad-pingpong")
    assert w.meta["tolerance"] == 0.05 and not w.meta["buffer_grown"] and w.meta["buffer_gib"] == 2.0
    tiny = replace(big, buffer_gib=1e-6)
    w = replay.method_work(tiny, docs, "cad")
    assert w.meta["tolerance"] == 1.0 and w.meta["buffer_grown"] and w.meta["buffer_gib"] == 1.5
    assert 0 < w.meta["buffer_need_gib"] <= 1.0
    with pytest.raises(ValueError, match="Setting.buffer_gib must be a finite number > 0"):
        replace(s, buffer_gib=0)


def test_the_warmup_check_compares_unwarmed_with_warmed_timings_of_the_same_calls(capsys):
    spec = importlib.util.spec_from_file_location("merge_replay_times",
                                                  ROOT / "scripts" / "analyses" / "merge_replay_times.py")
    merge = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(merge)
    old = {"a": {"fwd_ms": 10.0, "bwd_ms": 20.0, "warmup": 1},
           "b": {"fwd_ms": 4.0, "bwd_ms": 8.0, "warmup": 1},
           "m": {"fwd_ms": 1.0, "bwd_ms": 2.0, "modelled": True}}
    new = {"a": {"fwd_ms": 11.0, "bwd_ms": 20.0, "warmup": 0},
           "b": {"fwd_ms": 4.0, "bwd_ms": 10.0, "warmup": 0},
           "m": {"fwd_ms": 5.0, "bwd_ms": 5.0, "warmup": 0}, "c": {"fwd_ms": 1.0, "bwd_ms": 1.0, "warmup": 0}}
    got = merge.warmup_check(old, new)
    assert got["calls"] == 2                                # neither the modelled call nor the new one
    assert got["fwd"]["median"] == pytest.approx(1.05) and got["bwd"]["max"] == pytest.approx(1.25)
    assert got["fwd_bwd"]["median"] == pytest.approx((31 / 30 + 14 / 12) / 2)
    assert merge.warmup_check(old, {"a": old["a"]}) is None
    for argv, fragment in ((["--limit", "1"], "--limit must be > 1"),
                           (["--datasets", "pretrain,c4"], "--datasets must name some of"),
                           ([], "the new cache 'no-such-cache.json' is not a file")):
        with pytest.raises(SystemExit):                 # before any file is read
            merge.main(["no-such-cache.json", *argv])
        assert fragment in capsys.readouterr().err


def test_the_merge_lists_dropped_calls_for_a_warmed_retime_and_notes_the_run(tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("merge_replay_times",
                                                  ROOT / "scripts" / "analyses" / "merge_replay_times.py")
    merge = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(merge)
    monkeypatch.setattr(merge.protocol, "paper_3d", lambda dist: [])
    monkeypatch.setattr(merge.calls, "unwarmed_outliers", lambda todo, added, *a: sorted(
        k for k, e in added.items() if e.get("warmup") == 0 and e["fwd_ms"] > 5))
    cache, new = tmp_path / "cache.json", tmp_path / "new.json"
    cache.write_text(json.dumps({"times": {"a": {"fwd_ms": 1.0, "bwd_ms": 2.0, "warmup": 1}}}))
    unwarmed = {"b": {"fwd_ms": 2.0, "bwd_ms": 4.0, "warmup": 0, "reserve_gib": 100.0},
                "c": {"fwd_ms": 9.0, "bwd_ms": 9.0, "warmup": 0, "reserve_gib": 100.0}}
    new.write_text(json.dumps({"times": {"a": {"fwd_ms": 1.0, "bwd_ms": 2.0, "warmup": 1}, **unwarmed}}))
    dropped = tmp_path / "dropped.json"
    assert merge.main([str(new), "--cache", str(cache), "--dropped-out", str(dropped),
                       "--check-out", str(tmp_path / "check.json")]) == 0
    got = json.loads(cache.read_text())
    assert set(got["times"]) == {"a", "b"} and json.loads(dropped.read_text()) == ["c"]
    assert got["meta_runs"][0]["dropped_outliers"] == ["c"] and "note" not in got["meta_runs"][0]
    assert f"--retime-keys {dropped}" in capsys.readouterr().out
    # the same call timed again with a warm-up is taken, whatever its ratio to the table
    new.write_text(json.dumps({"times": {**got["times"], "c": {"fwd_ms": 8.8, "bwd_ms": 9.0, "warmup": 1}}}))
    assert merge.main([str(new), "--cache", str(cache), "--note", "the dropped calls, warmed up",
                       "--check-out", str(tmp_path / "check.json")]) == 0
    got = json.loads(cache.read_text())
    assert got["times"]["c"]["warmup"] == 1 and got["meta_runs"][1]["dropped_outliers"] == []
    assert got["meta_runs"][1]["note"] == "the dropped calls, warmed up"
    # a committed timing made without a reserved pool, timed again with one: kept unless asked to replace
    got["times"]["d"] = {"fwd_ms": 1.0, "bwd_ms": 2.0, "iters": 1}        # another, timed without a pool
    cache.write_text(json.dumps(got))
    again = {**got["times"], "a": {"fwd_ms": 0.9, "bwd_ms": 2.2, "warmup": 0, "reserve_gib": 100.0},
             "d": {"fwd_ms": 1.0, "bwd_ms": 90.0, "warmup": 0, "reserve_gib": 100.0}}   # its first run
    new.write_text(json.dumps({"times": again}))
    argv = [str(new), "--cache", str(cache), "--check-out", str(tmp_path / "check.json")]
    assert merge.main(argv) == 0 and json.loads(cache.read_text())["times"]["a"]["fwd_ms"] == 1.0
    assert merge.main([*argv, "--replace-unpooled", "--dropped-out", str(dropped)]) == 0
    got = json.loads(cache.read_text())
    assert got["times"]["d"]["bwd_ms"] == 2.0 and json.loads(dropped.read_text()) == ["d"]
    assert got["times"]["a"]["fwd_ms"] == 0.9 and got["times"]["b"] == unwarmed["b"]   # b had its pool
    assert got["meta_runs"][-1]["replaced_unpooled"] == 1
    assert got["meta_runs"][-1]["replaced_new_over_old_median"] == pytest.approx({"fwd": 0.9, "bwd": 1.1})
    assert got["meta_runs"][-1]["screened"] == "paper3d pretrain,prolong"
    # the pool changed as well as the warm-up: no warm-up check is written from that pair
    assert not (tmp_path / "check.json").exists()
    # a call committed without a warm-up, timed again with one (the same pool): the warmed time is taken
    warmed = {**unwarmed["b"], "bwd_ms": 3.0, "warmup": 1}
    new.write_text(json.dumps({"times": {**got["times"], "b": warmed}}))
    assert merge.main(argv) == 0
    got = json.loads(cache.read_text())
    assert got["times"]["b"]["bwd_ms"] == 3.0 and got["meta_runs"][-1]["replaced_rewarmed"] == 1
    # then the median of five warmed-up runs replaces one warmed-up run; one run never replaces five
    five = {**got["times"]["b"], "bwd_ms": 4.0, "iters": 5}
    new.write_text(json.dumps({"times": {**got["times"], "b": five}}))
    assert merge.main(argv) == 0 and json.loads(cache.read_text())["times"]["b"]["bwd_ms"] == 4.0
    new.write_text(json.dumps({"times": {**got["times"], "b": {**five, "bwd_ms": 9.0, "iters": 1}}}))
    assert merge.main(argv) == 0 and json.loads(cache.read_text())["times"]["b"]["bwd_ms"] == 4.0

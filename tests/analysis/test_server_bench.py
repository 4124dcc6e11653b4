"""Result files as tables: the committed benchmark JSON reshaped for the notebooks' plots."""
import json

import numpy as np
import pandas as pd
import pytest

from cadlib.analysis.figures import plots

from cadlib.analysis.runs import server_bench


def _rank(rank, step_fb, raw_fb, **kw):
    return {"backend": "fa4", "dist": "pretrain", "tokens_per_gpu": 65536, "world": 2, "rank": rank,
            "step_fwd_tflops": step_fb * 1.1, "raw_fwd_tflops": raw_fb * 1.1, "step_fwd_bwd_tflops": step_fb,
            "raw_fwd_bwd_tflops": raw_fb, "comm_fwd_fraction": 0.1, "comm_fwd_bwd_fraction": 0.2, **kw}


def _write(path, cases, device="1x H200"):
    path.write_text(json.dumps({"meta": {"device": device}, "config": {}, "results": cases}))


def test_server_overhead_rows_and_summary(tmp_path):
    _write(tmp_path / "bench_attention_server_overhead_2gpu.json",
           [{"ranks": [_rank(0, 400.0, 500.0), _rank(1, 450.0, 480.0)]},
            {"ranks": [_rank(0, 300.0, 330.0, dist="prolong"), _rank(1, 310.0, 320.0, dist="prolong")]}])
    _write(tmp_path / "unrelated.json", [{"ranks": [_rank(0, 1.0, 1.0)]}])
    rows = server_bench.server_overhead(tmp_path)
    assert len(rows) == 4 and set(rows.file) == {"bench_attention_server_overhead_2gpu.json"}
    assert list(rows.columns[:len(server_bench.OVERHEAD_COLUMNS)]) == list(server_bench.OVERHEAD_COLUMNS)
    assert rows.device.unique().tolist() == ["1x H200"]
    summ = server_bench.server_overhead_summary(rows).set_index("dist")
    assert summ.loc["pretrain", "case"] == "fa4 pretrain 64K x2"
    assert summ.loc["pretrain", "step_fwd_bwd_tflops"] == 400.0        # the slowest rank
    assert summ.loc["pretrain", "raw_fwd_bwd_tflops"] == 480.0
    assert summ.loc["pretrain", "overhead_fwd_bwd"] == pytest.approx(500 / 400 - 1)   # worst rank
    assert summ.loc["prolong", "overhead_fwd"] == pytest.approx(330 / 300 - 1)


def test_empty_results_give_empty_frames(tmp_path):
    rows = server_bench.server_overhead(tmp_path)
    assert rows.empty and "step_fwd_tflops" in rows.columns
    assert server_bench.server_overhead_summary(rows).empty
    assert server_bench.composability(tmp_path).empty


def test_composability_rows(tmp_path):
    _write(tmp_path / "bench_attention_server_composability_1gpu_lpt_16k.json",
           [{"backend": "fa4", "doc_len": 16384, "shard": 512, "fwd_tflops": 590.0, "fwd_vs_unsplit": 0.95,
             "fwd_bwd_tflops": 430.0, "fwd_bwd_vs_unsplit": 0.77},
            {"backend": "fa4", "doc_len": 16384, "shard": 128, "fwd_tflops": 560.0, "fwd_vs_unsplit": 0.9,
             "fwd_bwd_tflops": None, "fwd_bwd_vs_unsplit": None}])
    df = server_bench.composability(tmp_path)
    assert len(df) == 3 and sorted(df["mode"].unique()) == ["fwd", "fwd_bwd"]
    assert list(df.columns) == server_bench.COMPOSABILITY_COLUMNS
    row = df[(df.shard == 512) & (df["mode"] == "fwd_bwd")].iloc[0]
    assert row.tflops == 430.0 and row.ratio == 0.77 and row.device == "1x H200"
    assert (row.kv_share, row.stage, row.order, row.pattern) == ("kernel", "before", "lpt", "all")


def _comp_row(doc, shard, kv, fb, fwd=1.0, **kw):
    return {"backend": "fa4", "doc_len": doc, "shard": shard, "kv_share": kv, "fwd_tflops": 600 * fwd,
            "fwd_vs_unsplit": fwd, "fwd_bwd_tflops": 600 * fb, "fwd_bwd_vs_unsplit": fb, **kw}


def _write_comp(path, rows, commit, date, **cfg):
    path.write_text(json.dumps({"meta": {"device": "1x H200", "commit": commit, "date": date},
                                "config": {"order": "lpt", **cfg}, "results": rows}))


def test_composability_before_after_and_targets(tmp_path):
    # the old files: kernel alone on per-shard copies (no kv_share field), the unsplit row shard == doc
    _write_comp(tmp_path / "bench_attention_server_composability_1gpu_lpt_16k.json",
                [{k: v for k, v in _comp_row(16384, s, None, fb).items() if k != "kv_share"}
                 for s, fb in ((128, 0.44), (512, 0.78), (16384, 1.0))], "9964619abc", "2026-01-01T00:00:00")
    _write_comp(tmp_path / "bench_attention_server_composability_1gpu_lpt_64k.json",
                [{k: v for k, v in _comp_row(65536, 512, None, 0.71).items() if k != "kv_share"}],
                "9964619abc", "2026-01-01T00:00:00")
    new = [_comp_row(d, d, "unsplit", 1.0) for d in (16384, 65536)]
    new += [_comp_row(16384, s, kv, fb) for s, kv, fb in ((128, "merged", 0.92), (512, "merged", 0.90),
                                                          (512, "copy", 0.51), (512, "kernel", 0.70))]
    new += [_comp_row(65536, 512, "merged", 0.99, fwd=0.97), _comp_row(65536, 512, "merged", 0.5,
                                                                        pattern="alternate")]
    _write_comp(tmp_path / "bench_attention_server_composability_1gpu_kvshare.json", new, "42d4937",
                "2026-02-01T00:00:00")
    _write_comp(tmp_path / "bench_attention_server_composability_1gpu_docorder.json",
                [{k: v for k, v in _comp_row(16384, 512, None, 0.1).items() if k != "kv_share"}],
                "a754a1c", "2025-12-01T00:00:00", order="doc")
    df = server_bench.composability(tmp_path)
    assert set(df.stage) == {"before", "after", "unsplit"}
    assert (df[df.kv_share == "unsplit"].ratio == 1.0).all()
    assert (df[df.kv_share == "merged"].stage == "after").all()
    assert set(df[df.file.str.contains("docorder")].order) == {"doc"}
    ba = server_bench.composability_before_after(df)
    assert (ba["mode"] == "fwd_bwd").all() and set(ba.pattern) == {"all"} and set(ba.order) == {"lpt"}
    assert "unsplit" not in set(ba.kv_share)
    # the kernel alone: only its first measurement (9964619), not the rerun at 42d4937 nor the doc order
    assert set(ba[ba.kv_share == "kernel"].commit) == {"9964619"}
    assert set(ba.series) == {"before: kernel alone, a KV copy per shard (9964619)",
                              "before: server, a KV copy per shard (42d4937)",
                              "after: server, one KV per (server, document) (42d4937)"}
    t = server_bench.composability_targets(df).set_index("doc")
    assert t.loc[16384, "fwd_bwd"] == 0.90 and not t.loc[16384, "meets"]
    assert t.loc[16384, "before_fwd_bwd"] == 0.78
    assert t.loc[65536, "meets"] and t.loc[65536, "fwd"] == 0.97 and t.loc[65536, "before_fwd_bwd"] == 0.71


def test_committed_composability_before_and_after():
    df = server_bench.composability()
    if not (df.kv_share == "merged").any():
        pytest.skip("no committed KV-sharing composability results")
    t = server_bench.composability_targets(df)
    assert t[t.doc == 65536].meets.all()              # the composability target met on 64K in every run ...
    assert t[t.latest].meets.all() and set(t[t.latest].reference) == {"bracketed"}    # ... and on 16K now,
    assert not t[(t.doc == 16384) & ~t.latest].meets.any()   # missed (0.90) with the reference timed once
    assert (t.fwd_bwd > t.before_fwd_bwd).all()


def test_committed_overhead_results_load():
    rows = server_bench.server_overhead()
    if rows.empty:
        pytest.skip("no committed attention-server overhead results")
    summ = server_bench.server_overhead_summary(rows)
    assert (summ.step_fwd_bwd_tflops > 0).all() and np.isfinite(summ.overhead_fwd_bwd).all()


def test_bytes_heatmap_and_grouped_bars():
    m = np.array([[0, 2000, 0], [1000, 0, 3000], [0, 0, 0]])
    fig = plots.bytes_heatmap(m, unit="KB")
    assert np.allclose(fig.data[0].z, m / 1e3)
    assert list(fig.data[0].y) == ["rank 0", "rank 1", "rank 2"]
    with pytest.raises(ValueError, match="unit"):
        plots.bytes_heatmap(m, unit="KiB")
    df = pd.DataFrame({"case": ["a", "b"], "x1": [1.0, 2.0], "x2": [3.0, 4.0]})
    fig = plots.grouped_bars(df, "case", {"one": "x1", "two": "x2"}, "t")
    assert [t.name for t in fig.data] == ["one", "two"] and list(fig.data[1].y) == [3.0, 4.0]

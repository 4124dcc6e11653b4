"""Result files as tables: the committed benchmark JSON reshaped for the notebooks' plots."""
import json

import numpy as np
import pandas as pd
import pytest

from cadlib import plots, results


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
    rows = results.server_overhead(tmp_path)
    assert len(rows) == 4 and set(rows.file) == {"bench_attention_server_overhead_2gpu.json"}
    assert list(rows.columns[:len(results.OVERHEAD_COLUMNS)]) == list(results.OVERHEAD_COLUMNS)
    assert rows.device.unique().tolist() == ["1x H200"]
    summ = results.server_overhead_summary(rows).set_index("dist")
    assert summ.loc["pretrain", "case"] == "fa4 pretrain 64K x2"
    assert summ.loc["pretrain", "step_fwd_bwd_tflops"] == 400.0        # the slowest rank
    assert summ.loc["pretrain", "raw_fwd_bwd_tflops"] == 480.0
    assert summ.loc["pretrain", "overhead_fwd_bwd"] == pytest.approx(500 / 400 - 1)   # worst rank
    assert summ.loc["prolong", "overhead_fwd"] == pytest.approx(330 / 300 - 1)


def test_empty_results_give_empty_frames(tmp_path):
    rows = results.server_overhead(tmp_path)
    assert rows.empty and "step_fwd_tflops" in rows.columns
    assert results.server_overhead_summary(rows).empty
    assert results.composability(tmp_path).empty


def test_composability_rows(tmp_path):
    _write(tmp_path / "bench_attention_server_composability_1gpu_lpt_16k.json",
           [{"backend": "fa4", "doc_len": 16384, "shard": 512, "fwd_tflops": 590.0, "fwd_vs_unsplit": 0.95,
             "fwd_bwd_tflops": 430.0, "fwd_bwd_vs_unsplit": 0.77},
            {"backend": "fa4", "doc_len": 16384, "shard": 128, "fwd_tflops": 560.0, "fwd_vs_unsplit": 0.9,
             "fwd_bwd_tflops": None, "fwd_bwd_vs_unsplit": None}])
    df = results.composability(tmp_path)
    assert len(df) == 3 and sorted(df["mode"].unique()) == ["fwd", "fwd_bwd"]
    row = df[(df.shard == 512) & (df["mode"] == "fwd_bwd")].iloc[0]
    assert row.tflops == 430.0 and row.ratio == 0.77 and row.device == "1x H200"


def test_committed_overhead_results_load():
    rows = results.server_overhead()
    if rows.empty:
        pytest.skip("no committed attention-server overhead results")
    summ = results.server_overhead_summary(rows)
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

"""LongCA-bench's tables and claims in the analysis: the kernel files (sparse study, MHA rows, draws), the CP
balance file and the volume check's rows, and how the claims read them (measured, computed, not yet)."""
import pandas as pd
import pytest

from cadlib.analysis.lessons import claims as lesson_claims
from cadlib.analysis.report import claims, metrics
from cadlib.analysis.runs import cp_balance, kernels
from cadlib.core import paper
from cadlib.infra.results import save_result


def _sparse(kernel, block, sparsity, seqlen, heads, fwd_tf, bwd_tf, status="ok"):
    base = {"kernel": kernel, "family": "uniform_block_sparse", "block": block, "sparsity": sparsity,
            "seqlen": seqlen, "heads": heads}
    recs = []
    for d, tf in (("fwd", fwd_tf), ("bwd", bwd_tf)):
        r = {**base, "direction": d, "status": status}
        if status == "ok":
            r["tflops"] = tf
        else:
            r["error"] = "CUDA out of memory"
        if d == "fwd" and status == "ok":
            r["check"] = {"check_len": 2048, "max_err": 1e-3, "grad_err": 2e-3}
        recs.append(r)
    return recs


@pytest.fixture
def sparse_dir(tmp_path):
    rows = (_sparse("flex", 64, 0.5, 16384, "64:8", 300.0, 150.0) + _sparse("flex", 64, 0.5, 32768, "64:8", 320.0, 160.0)
            + _sparse("fa4", 128, 0.5, 32768, "64:64", 500.0, 400.0) + _sparse("flex", 128, 0.9, 32768, "64:64", 0, 0, "E"))
    save_result(tmp_path / kernels.SPARSE_FILE, {"smoke": False}, rows)
    return tmp_path


def test_kernel_files_read_as_frames_or_not_at_all(sparse_dir, tmp_path):
    assert kernels.load_rows(kernels.SPARSE_FILE, tmp_path / "none") == (None, "")
    rows, device = kernels.load_rows(kernels.SPARSE_FILE, sparse_dir)
    assert len(rows) == 8 and device
    ratios = kernels.bwd_over_fwd(rows)
    assert len(ratios) == 3 and sorted(ratios.ratio.round(3)) == [0.5, 0.5, 0.8]
    per = kernels.ratio_summary(ratios)
    assert per.loc["flex", "cells"] == 2 and per.loc["fa4", "median bwd/fwd"] == pytest.approx(0.8)
    assert (per["share below 1"] == 1).all()
    table = kernels.sparse_table(rows)                      # the longest length: 32K
    assert table.loc[("uniform_block_sparse", 128, "64:64", 0.9), ("bwd", "flex")] == "E"
    assert table.loc[("uniform_block_sparse", 64, "64:8", 0.5), ("fwd", "flex")] == "320"
    assert list(table.columns.get_level_values(0).unique()) == ["fwd", "bwd"]
    checks = kernels.sparse_checks(rows)
    assert len(checks) == 3 and checks.grad_err.max() == 2e-3


def test_draw_bands_and_mha_beside_gqa():
    rows = pd.DataFrame([
        {"backend": "fa4", "mask": "causal_document", "heads": "64:8", "seqlen": 16384, "direction": "fwd",
         "status": "ok", "draws": 30, "tflops": 500.0, "tflops_q20": 450.0, "tflops_q80": 550.0},
        {"backend": "fa4", "mask": "causal", "heads": "64:8", "seqlen": 16384, "direction": "fwd", "status": "ok",
         "draws": 1, "tflops": 600.0, "tflops_q20": 600.0, "tflops_q80": 600.0}])
    bands = kernels.draw_bands(rows)
    assert len(bands) == 1 and bands.band.iloc[0] == pytest.approx(0.2)
    gqa = pd.DataFrame([{"backend": "fa4", "mask": "causal", "seqlen": 4096, "direction": "fwd", "status": "ok",
                         "tflops": 600.0},
                        {"backend": "sdpa_math", "mask": "causal", "seqlen": 4096, "direction": "fwd", "status": "ok",
                         "tflops": 10.0}])                   # written before records had heads
    mha = pd.DataFrame([{"backend": "fa4", "mask": "causal", "seqlen": 4096, "direction": "fwd", "status": "E",
                         "heads": "64:64"}])
    both = kernels.mha_beside_gqa(gqa, mha)
    assert both.loc["causal", ("fwd", "fa4", "64:8")] == "600" and both.loc["causal", ("fwd", "fa4", "64:64")] == "E"
    assert "sdpa_math" not in both.columns.get_level_values(1)


def test_sparse_claim_reads_the_file_or_says_it_is_not_measured(sparse_dir):
    rows, device = kernels.load_rows(kernels.SPARSE_FILE, sparse_dir)
    got = lesson_claims.sparse_backward(rows, device).iloc[0]
    assert got.metric == "longca.sparse_bwd_bottleneck" and got.ours == "0.5" and got.note.startswith("holds")
    assert "not measured: 2 E" in got.note
    slow = rows.assign(tflops=rows.tflops.where(rows.direction == "fwd", rows.tflops * 3))
    assert lesson_claims.sparse_backward(slow, device).iloc[0].note.startswith("not reproduced: ours does not")
    none = lesson_claims.sparse_backward(None).iloc[0]
    assert none.ours == claims.NOT_MEASURED and "scripts/device/longca_1gpu.sh" in none.note
    assert none.note.startswith("not reproduced: not measured yet: no results/bench_sparse_h200.json")
    with pytest.raises(ValueError, match="why must say"):
        claims.record_not_measured("longca.sparse_bwd_bottleneck", " ", how="", kind="measured")


def test_balance_file_and_heads_first():
    rows, meta = cp_balance.load()
    assert rows is not None and meta["config"]["draws"] == 30
    assert {"max_mean", "max_mean_q20", "max_mean_q80", "bytes_bwd_max"} <= set(rows.columns)
    one = cp_balance.case(rows, 8, 32768)
    table = cp_balance.metric_table(one)
    assert list(table.columns) == ["allgather", "ring", "ulysses", "usp", "loongtrain", "cad"]
    assert table.loc["causal", "ring"] == "1" and "[" in table.loc["causal_document", "ring"]
    assert pd.isna(table.loc["full", "cad"])                       # CAD serves causal masks only
    vol = cp_balance.volume_table(one)
    assert vol.loc["causal", ("bwd", "loongtrain")] > vol.loc["causal", ("bwd", "usp")]   # its accumulators' hops
    hf = cp_balance.heads_first(rows)
    assert len(hf) == 8 and hf.monotone.all() and (hf.ulysses == 1).all() and (hf.ring >= hf.usp).all()
    ring = cp_balance.draw_spread(rows)
    assert (ring[ring["mask"] == "causal"].max_mean == 1).all()
    doc = ring[ring["mask"] == "causal_document"]
    assert (doc.max_mean_q80 > doc.max_mean_q20).all()


def test_heads_first_fails_where_more_heads_balance_worse():
    rows = pd.DataFrame([{"mechanism": m, "mask": "causal_document", "world": 8, "tokens_per_gpu": 8192, "status": "ok",
                          "ulysses_size": u, "max_mean": v} for m, u, v in (("ring", 1, 1.5), ("usp", 2, 1.7),
                                                                             ("ulysses", 8, 1.0))])
    assert not cp_balance.heads_first(rows).monotone.iloc[0]


def test_measured_volumes_rank_by_rank():
    case = {"suite": "volume", "mechanism": "ring", "mask": "causal", "total": 32, "sent": {"fwd": 10, "bwd": 30},
            "per_rank": {"fwd": [10, 12], "bwd": [30, 36]}, "equal_shard": {"fwd": 10, "bwd": 30}}
    results = [{"rank": 0, "cases": [case, {"suite": "volume", "skipped": "CAD serves causal masks only"}]},
               {"rank": 1, "cases": [{**case, "sent": {"fwd": 12, "bwd": 35}}, {"suite": "protocol"}]}]
    got = cp_balance.measured_volumes(results)
    assert got["closed form fwd"].tolist() == [10, 12] and got["sent bwd"].tolist() == [30, 35]
    assert (got["sent fwd"] == got["closed form fwd"]).all() and not (got["sent bwd"] == got["closed form bwd"]).all()


def test_cp_findings_and_the_claims_table(tmp_path, monkeypatch):
    monkeypatch.setenv("CADLIB_REPORT_DIR", str(tmp_path / "run"))
    rows, _ = cp_balance.load()
    frame = lesson_claims.cp_findings(rows)
    got = frame.set_index("metric")
    assert got.loc["longca.heads_first", "ours"] == "1" and got.loc["longca.heads_first", "note"].startswith("holds")
    for cid in ("longca.hybrid_cp_best", "longca.ring_fluctuates_docs"):
        assert got.loc[cid, "ours"] == claims.NOT_MEASURED
        assert got.loc[cid, "note"].startswith("not reproduced: not at this scale: needs several GPUs, only one is lent")
    assert "20-80% over 30 draws" in got.loc["longca.ring_fluctuates_docs", "note"]
    table = {r["claim"]: r for r in claims.claims_table(metrics.load_metrics(tmp_path / "run"), "cpu", tmp_path)}
    assert table["longca.heads_first"]["verdict"] == "reproduced" and table["longca.heads_first"]["direction"] == "holds" and table["longca.heads_first"]["value"] == 1.0
    ring = table["longca.ring_fluctuates_docs"]
    assert ring["ours"] == claims.NOT_MEASURED and ring["verdict"] == "not at this scale"
    assert ring["why"].startswith("not at this scale") and "max/mean area spans" in ring["why"]
    bare = {r["claim"]: r for r in claims.claims_table([], "cpu", tmp_path)}     # nothing recorded: the gap
    assert bare["longca.hybrid_cp_best"]["why"] == paper.CLAIMS["longca.hybrid_cp_best"].gap
    assert bare["longca.hybrid_cp_best"]["why"].startswith("not at this scale: needs several GPUs, only one is lent")
    assert bare["longca.sparse_bwd_bottleneck"]["verdict"] == "not reproduced"


def test_the_sparse_table_shows_the_longest_length_measured(sparse_dir):
    rows, _ = kernels.load_rows(kernels.SPARSE_FILE, sparse_dir)
    late = pd.DataFrame([{"kernel": "flex", "family": "uniform_block_sparse", "block": 64, "sparsity": 0.5,
                          "seqlen": 131072, "heads": "64:8", "direction": d, "status": "-"} for d in ("fwd", "bwd")])
    table = kernels.sparse_table(pd.concat([rows, late], ignore_index=True))
    assert table.loc[("uniform_block_sparse", 64, "64:8", 0.5), ("fwd", "flex")] == "320"        # 32K, not 128K
    assert kernels.sparse_table(late).loc[("uniform_block_sparse", 64, "64:8", 0.5), ("bwd", "flex")] == "-"

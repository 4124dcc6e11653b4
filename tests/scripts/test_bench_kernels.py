"""scripts/bench/bench_kernels.py: what it decides without running a kernel (support, and merging runs)."""
import importlib.util
import json
import pathlib

import pytest

from cadlib.data.masks import make_mask

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bk():
    path = ROOT / "scripts" / "bench" / "bench_kernels.py"
    spec = importlib.util.spec_from_file_location("bench_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("backend,mask,unsupported", [
    ("sdpa_flash", "causal", False), ("sdpa_cudnn", "causal_document", True),
    ("torch_flash", "causal_document", False), ("torch_flash", "share_question", True),
    ("fa4", "sliding_window", False), ("torch_flash", "sliding_window", True),
    ("sdpa_math", "share_question", False), ("flex", "global_sliding_window", False)])
def test_static_support(bk, backend, mask, unsupported):
    why = bk.statically_unsupported(backend, make_mask(mask, 4096, 0))
    assert (why is not None) == unsupported


def test_combine_keeps_measured_cells_and_marks_unreachable_ones(bk, tmp_path):
    def rec(backend, mask, status, **kw):
        return {"backend": backend, "mask": mask, "seqlen": 4096, "direction": "fwd", "status": status, **kw}
    first = {"meta": {"device": "gpu"}, "config": {},
             "results": [rec("torch_flash", "causal", "ok", tflops=1.0)]}
    later = {"meta": {"device": "gpu"}, "config": {}, "results": [
        rec("torch_flash", "causal", "-"),              # not reached later: the measured cell stays
        rec("torch_flash", "share_question", "-"),      # not reached, and no varlen form: X
        rec("torch_flash", "causal_document", "-")]}    # not reached, could run: stays '-'
    paths = []
    for i, res in enumerate((first, later)):
        paths.append(tmp_path / f"p{i}.json")
        paths[-1].write_text(json.dumps(res))
    rows = {(r["mask"]): r for r in bk.combine([str(p) for p in paths], tmp_path / "out.json")}
    assert rows["causal"]["status"] == "ok" and rows["causal"]["tflops"] == 1.0
    assert rows["share_question"]["status"] == "X" and "without running" in rows["share_question"]["error"]
    assert rows["causal_document"]["status"] == "-"


def test_heads_pairs_and_the_older_form(bk):
    assert bk.parse_heads("64:8,64:64") == [(64, 8), (64, 64)]
    assert bk.parse_heads("64,8") == [(64, 8)]
    with pytest.raises(SystemExit):
        bk.parse_args(["--heads", "64:7"])
    rows = bk._with_heads([{"backend": "fa4", "mask": "causal", "seqlen": 8}], {"heads": "64,8"})
    assert rows[0]["heads"] == "64:8"                       # files written before records carried heads


def test_mha_rows_and_draws_of_the_document_masks(bk, tmp_path):
    """GQA and MHA rows side by side; a document mask over 3 draws gives the median and 20/80% quantiles
    across the draws (each draw's own median), a mask without drawn documents one draw."""
    out = tmp_path / "k.json"
    bk.main(["--smoke", "--backends", "sdpa_math", "--masks", "causal,causal_document", "--heads", "4:2,4:4",
             "--draws", "3", "--draw-reps", "2", "--out", str(out)])
    rows = {(r["mask"], r["heads"], r["direction"]): r for r in json.loads(out.read_text())["results"]}
    assert len(rows) == 2 * 2 * 2 and all(r["status"] == "ok" for r in rows.values())
    doc = rows[("causal_document", "4:4", "bwd")]
    assert doc["draws"] == 3 and [d["seed"] for d in doc["per_draw"]] == [0, 1, 2]
    ms = sorted(d["median_ms"] for d in doc["per_draw"])
    assert doc["median_ms"] == ms[1] and ms[0] <= doc["q20_ms"] <= doc["median_ms"] <= doc["q80_ms"] <= ms[2]
    assert len({d["area"] for d in doc["per_draw"]}) > 1        # independent draws of the documents
    assert "draws" not in rows[("causal", "4:2", "fwd")]

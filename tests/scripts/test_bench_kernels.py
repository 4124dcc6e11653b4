"""scripts/bench_kernels.py: what it decides without running a kernel (support, and merging runs)."""
import importlib.util
import json
import pathlib

import pytest

from cadlib.data.masks import make_mask

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bk():
    spec = importlib.util.spec_from_file_location("bench_kernels", ROOT / "scripts" / "bench_kernels.py")
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

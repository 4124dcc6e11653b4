"""scripts/bench/bench_linear.py at CPU smoke sizes: a record per block, direction, implementation,
token count and TP degree, each beside its GEMM-only time, the layer rows added up from them, the
optimizer's two steps, what is installed, and --merge measuring nothing twice."""
import importlib.util
import json
import pathlib

import pytest

from cadlib.runtime import fused

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bl():
    path = ROOT / "scripts" / "bench" / "bench_linear.py"
    spec = importlib.util.spec_from_file_location("bench_linear", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_smoke_records_every_block_beside_its_gemms(bl, tmp_path, capsys):
    out = tmp_path / "lin.json"
    assert bl.main(["--smoke", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    rows, cfg = res["results"]["records"], res["config"]
    assert cfg["device"] == "cpu" and "flash-attn-4" in cfg["kernels"] and cfg["peak_tflops"] == 790.0
    impls = ["reference"] + (["fused"] if fused.INTERPRET else [])
    assert cfg["fused_available"] == fused.INTERPRET
    by = {tuple(r[k] for k in bl.KEY): r for r in rows}
    for tp in (1, 2):
        for block in ("pre", "post", "head"):
            for d in ("fwd", "bwd"):
                g = by[(block, d, "gemm", "none", 128, tp, False)]
                for impl in impls:
                    for rc in (("none", "mlp") if block == "post" else ("none",)):
                        r = by[(block, d, impl, rc, 128, tp, False)]
                        assert r["ms"] > 0 and r["gemm_ms"] == g["ms"] and r["of_gemm"] == g["ms"] / r["ms"]
                        assert r["flops"] == g["flops"] and r["tflops"] > 0
        pre = by[("pre", "fwd", "gemm", "none", 128, tp, False)]
        assert pre["flops"] == 2 * 128 * 64 * (4 // tp + 2 * (2 // tp)) * 16   # tiny: h 64, heads 4:2 x 16
        assert by[("pre", "bwd", "gemm", "none", 128, tp, False)]["flops"] == 2 * pre["flops"]
        for impl in impls:
            lay = by[("layer", "fwd+bwd", impl, "none", 128, tp, False)]
            parts = [by[(b, d, impl, "none", 128, tp, False)]
                     for b in ("pre", "post") for d in ("fwd", "bwd")]
            assert lay["ms"] == pytest.approx(sum(p["ms"] for p in parts)) and 0 < lay["of_gemm"]
        for impl in [*impls, "torch"]:
            assert by[("norm", "fwd+bwd", impl, "none", 128, tp, False)]["gbps"] > 0
        for impl in ("foreach", "fused"):
            assert by[("optimizer", "step", impl, "none", 0, tp, False)]["ms"] > 0
    capsys.readouterr()
    assert bl.main(["--smoke", "--out", str(out), "--merge"]) == 0      # nothing measured again
    assert " ms" not in capsys.readouterr().out.split("records ->")[0]
    assert len(json.loads(out.read_text())["results"]["records"]) == len(rows)


def test_bad_flags(bl):
    with pytest.raises(SystemExit):
        bl.parse_args(["--tokens", "100", "--tps", "8"])
    with pytest.raises(SystemExit):
        bl.parse_args(["--iters", "0"])

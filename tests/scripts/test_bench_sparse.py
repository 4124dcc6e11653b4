"""scripts/bench/bench_sparse.py at CPU smoke sizes: every cell a record (measured, or a status with its
reason), FlexAttention's forward and SDPA's forward and backward checked against the dense reference, the
priority order of the cells, and --merge continuing a run without measuring a cell twice."""
import importlib.util
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load(name: str):
    """``scripts/bench/<name>.py`` as module ``name`` (bench_sparse imports bench_kernels, its sibling, by
    that name, as Python finds a script's siblings when it runs as a file)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bs():
    load("bench_kernels")
    return load("bench_sparse")


def test_smoke_run_records_every_cell_and_checks_against_the_reference(bs, tmp_path, capsys):
    out = tmp_path / "sparse.json"
    assert bs.main(["--smoke", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = res["results"]
    assert res["meta"]["torch"] and res["config"]["device"] == "cpu"
    cells = {(r["kernel"], r["family"], r["heads"], r["direction"]): r for r in rows}
    assert len(cells) == len(rows) == 3 * 2 * 2 * 2           # kernels x families x heads x directions
    for heads in ("4:2", "4:4"):
        flex = cells[("flex", "uniform_block_sparse", heads, "fwd")]
        assert flex["status"] == "ok" and flex["check"]["max_err"] < 1e-5 and flex["tflops"] > 0
        assert cells[("flex", "uniform_block_sparse", heads, "bwd")]["status"] == "X"     # no CPU backward
        sd = cells[("sdpa", "variable_block_sparse", heads, "bwd")]
        assert sd["status"] == "ok" and sd["check"]["grad_err"] < 1e-5
        assert sd["flops"] == 2.5 * cells[("sdpa", "variable_block_sparse", heads, "fwd")]["flops"]
    fa4 = cells[("fa4", "uniform_block_sparse", "4:2", "fwd")]
    assert fa4["status"] == "X" and "CUDA" in fa4["error"]
    # --merge keeps what was measured and runs nothing again
    capsys.readouterr()
    assert bs.main(["--smoke", "--out", str(out), "--merge"]) == 0
    assert "TF/s" not in capsys.readouterr().out.split("fwd TF/s at")[0]
    assert len(json.loads(out.read_text())["results"]) == len(rows)


def test_cells_come_in_priority_order(bs):
    args = bs.parse_args(["--sparsities", "0.5,0.1", "--seqlens", "1024,2048", "--heads", "8:2",
                          "--blocks", "64,128", "--avg-blocks", "256"])
    order = bs.cells(args)
    assert order[0] == ("uniform_block_sparse", 64, 0.5, (8, 2), 1024)
    first_other = next(i for i, c in enumerate(order) if c[2] == 0.1)
    assert all(c[2] == 0.5 for c in order[:first_other]) and len(order) == 2 * (2 * 2 + 2)
    assert order[-1][0] == "variable_block_sparse"
    with pytest.raises(SystemExit):
        bs.parse_args(["--kernels", "flash"])

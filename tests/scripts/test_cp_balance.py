"""scripts/analyses/cp_balance.py at tiny sizes: a row per (mechanism, mask, world, tokens per GPU) with the
balance metrics and bytes over the draws, and CAD's full-mask rows saying why it does not serve them."""
import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_tiny_table(tmp_path):
    path = ROOT / "scripts" / "analyses" / "cp_balance.py"
    spec = importlib.util.spec_from_file_location("cp_balance", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "b.json"
    assert mod.main(["--worlds", "4", "--tokens-per-gpu", "512", "--draws", "3", "--min-shard", "16",
                     "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert len(rows) == 6 * 4
    by = {(r["mechanism"], r["mask"]): r for r in rows}
    assert by[("cad", "full")]["status"] == "X" and "causal" in by[("cad", "full")]["error"]
    ring = by[("ring", "causal_document")]
    mm = ring["max_mean"]
    assert ring["draws"] == 3 and mm["q20"] <= mm["median"] <= mm["q80"]
    assert by[("ring", "causal")]["max_mean"]["median"] == 1.0
    assert by[("ulysses", "causal_document")]["max_mean"]["median"] == 1.0
    for r in rows:
        if r["status"] == "ok":
            assert 0 <= r["area_entropy"]["median"] <= 1 and 0.25 <= r["max_total"]["median"] <= 1
            assert r["bytes_total"]["median"] > 0 or r["mechanism"] in ("cad", "allgather")

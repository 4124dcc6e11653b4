"""scripts/probes/probe_warmup.py: the comparison against the warmed-up pass (hand-made numbers), and the
five passes on the CPU smoke setting."""
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

PATH = Path(__file__).resolve().parents[2] / "scripts" / "probes" / "probe_warmup.py"
spec = importlib.util.spec_from_file_location("probe_warmup", PATH)
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)


def test_a_pass_is_compared_with_the_warmed_up_one_per_direction():
    ref = np.array([[10.0, 20.0], [30.0, 40.0]])
    x = np.array([[11.0, 20.0], [30.0, 44.0]])
    r = probe.compare(x, ref)
    assert r["fwd"]["sum_ratio"] == pytest.approx(41 / 40) and r["bwd"]["sum_ratio"] == pytest.approx(64 / 60)
    assert r["fwd"]["median_ratio"] == pytest.approx((1.1 + 1.0) / 2)
    assert r["bwd"]["median_diff_ms"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="must both be"):
        probe.compare(x[:1], ref)


def test_the_cache_is_compared_only_where_it_holds_every_call():
    raw = {"a": {p: [1.0, 2.0] for p in "ABCD"}, "b": {p: [3.0, 4.0] for p in "ABCD"}}
    assert probe.summarise(raw)["passes"].keys() == {"A", "B", "C"}
    assert "cache" not in probe.summarise(raw, {"a": {"fwd_ms": 1.0, "bwd_ms": 2.0}})["passes"]
    both = {"a": {"fwd_ms": 2.0, "bwd_ms": 2.0}, "b": {"fwd_ms": 3.0, "bwd_ms": 4.0}}
    assert probe.summarise(raw, both)["passes"]["cache"]["fwd"]["sum_ratio"] == pytest.approx(5 / 4)


def test_the_cpu_smoke_run_times_every_call_in_five_passes(tmp_path):
    out = tmp_path / "w.json"
    assert probe.main(["--device", "cpu", "--smoke", "--calls", "2", "--out", str(out)]) == 0
    r = json.loads(out.read_text())["results"]
    assert r["calls"] >= 2 and set(r["passes"]) == {"A", "B", "C", "E"}
    assert all(set(v) == set("ABCDE") and min(min(t) for t in v.values()) > 0 for v in r["raw"].values())
    with pytest.raises(SystemExit):
        probe.main(["--device", "cpu", "--smoke", "--calls", "0", "--out", str(out)])
    with pytest.raises(SystemExit):
        probe.main(["--device", "cpu", "--smoke", "--reserve-gib", "-1", "--out", str(out)])

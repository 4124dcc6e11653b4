"""cadlib.calibrate's CPU smoke run (tiny shapes, sdpa_ref, two gloo processes for the all-to-all) makes a
table that cadlib.analysis.whatif.gpu_table loads and prices with; the loader rejects a table of another
model or kernel and a malformed file in one line naming the file; the check compares entry by entry."""
import copy
import json

import numpy as np
import pytest

from cadlib import calibrate
from cadlib.analysis.replay.times import head_key, interp, linear_key
from cadlib.analysis.whatif import gpu_table
from cadlib.analysis.whatif.gpu_table import GpuTableError


@pytest.fixture(scope="module")
def table_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("cal") / "cpu.json"
    assert calibrate.main(["--smoke", "--quiet", "--a2a-procs", "2", "--out", str(path)]) == 0
    return path


def test_smoke_run_makes_a_loadable_table(table_path):
    t = gpu_table.load(table_path, model="tiny", backend="sdpa_ref")
    assert (t.model, t.tp, t.backend, t.linear) == ("tiny", 1, "sdpa_ref", ("",))
    assert "CPU" in t.device or "cpu" in t.device.lower()
    cost = t.measured_cost()                       # the kernel grid prices a task
    assert cost.task_seconds(32, 64) > 0 and cost.n_heads == 4
    keys = t.linear_keys("")
    assert [n for n, _, _ in keys] == list(calibrate.SMOKE_LINEAR_GRID)
    s = t.spec                                     # the replay's interpolation reads the times as its cache
    sec = interp(t.times, lambda n: linear_key(s, t.backend, n), [4096, 6144, 8192], "post_ms")
    assert np.all(sec > 0) and sec[0] <= sec[2] * 1.5
    assert interp(t.times, lambda n: head_key(s, t.backend, n), [6144], "ms")[0] > 0
    rows = t.all_to_all["rows"]
    assert t.all_to_all["gpus"] == 2 and [r["mib_per_rank"] for r in rows] == list(calibrate.SMOKE_A2A_MIB)
    assert t.link_gbps() > 0
    meta = json.loads(table_path.read_text())["meta"]
    assert {"device", "torch", "commit"} <= set(meta)


def _one_line(exc_info, path):
    msg = str(exc_info.value)
    assert "\n" not in msg and msg.startswith(str(path))
    return msg


def test_rejects_another_model_or_kernel(table_path):
    with pytest.raises(GpuTableError) as e:
        gpu_table.load(table_path, model="llama3-8b")
    assert "calibrated for model 'tiny', not 'llama3-8b'" in _one_line(e, table_path)
    with pytest.raises(GpuTableError) as e:
        gpu_table.load(table_path, backend="fa4")
    assert "'sdpa_ref' attention kernel, not 'fa4'" in _one_line(e, table_path)
    assert issubclass(GpuTableError, ValueError)


@pytest.mark.parametrize("break_it, says", [
    (lambda o: "{not json", "not a JSON calibration file"),
    (lambda o: json.dumps([1, 2]), "not a calibration file"),
    (lambda o: json.dumps({**o, "config": {**o["config"], "format": "other"}}), "config.format"),
    (lambda o: json.dumps({**o, "config": {k: v for k, v in o["config"].items() if k != "tp"}}),
     "missing tp"),
    (lambda o: json.dumps({**o, "results": {**o["results"], "kernel": {"config": {}, "results": []}}}),
     "malformed kernel table"),
    (lambda o: json.dumps({**o, "results": {**o["results"], "times": {}}}), "fewer than two token counts"),
    (lambda o: json.dumps({**o, "config": {**o["config"], "model": "gpt-9"}}), "malformed calibration"),
])
def test_rejects_a_malformed_file(table_path, tmp_path, break_it, says):
    obj = json.loads(table_path.read_text())
    bad = tmp_path / "bad.json"
    bad.write_text(break_it(copy.deepcopy(obj)))
    with pytest.raises(GpuTableError) as e:
        gpu_table.load(bad)
    assert says in _one_line(e, bad)
    with pytest.raises(GpuTableError) as e:
        gpu_table.load(tmp_path / "missing.json")
    assert "no such file" in str(e.value)


def test_compare_against_a_reference_entry_by_entry(table_path):
    t = gpu_table.load(table_path)
    kernel_ref = copy.deepcopy(t.kernel)
    for r in kernel_ref["results"]:                 # the reference: the same grid, 1.02x and 1.2x slower
        r["fwd_ms"], r["fwd_bwd_ms"] = r["fwd_ms"] * 1.02, r["fwd_bwd_ms"] * 1.2
    times_ref = {k: {f: v * 1.5 if f.endswith("ms") else v for f, v in e.items()} for k, e in t.times.items()}
    res = gpu_table.compare(t, kernel_ref, times_ref)
    k = res["summary"]["kernel"]
    assert k["entries"] == 2 * len(t.kernel["results"]) and k["fraction_within"] == pytest.approx(0.5)
    lin = res["summary"]["linear"]
    assert lin["within"] == 0 and lin["median_ratio"] == pytest.approx(1 / 1.5)
    assert res["summary"]["all"]["entries"] == len(res["rows"])
    other = copy.deepcopy(kernel_ref)
    other["config"]["n_heads"] = 32                 # other heads: kernel rows are not comparable
    assert gpu_table.compare(t, other, {})["summary"]["kernel"]["entries"] == 0

"""The memory model against every committed measured peak (recomputed here, on CPU), the committed
check file against the code, and the rows read off layouts and dispatches."""
import pytest

from cadlib.analysis.runs import memory_check as mc
from cadlib.analysis.runs.e2e import load_committed
from cadlib.core.layout import layout_from_lists
from cadlib.core.memory import OURS, Rows, estimate
from cadlib.dispatch.build import build_dispatch
from cadlib.infra.results import load_result
from cadlib.scheduling import scheduler


@pytest.fixture(scope="module")
def items():
    return load_committed("bench_e2e_*.json")


@pytest.fixture(scope="module")
def rows(items):
    return [r for item in items for r in mc.check_item(item)]


def test_every_measured_peak_within_target(items, rows):
    # every (file, method) with a measured peak is checked: 18 files, 78 of them today
    measured = {(i["file"], m) for i in items
                for m, gib in (i["results"]["summary"].get("peak_mem_gib") or {}).items() if gib}
    assert len(items) >= 18 and measured == {(r["file"], r["method"]) for r in rows}
    bad = [(r["file"], r["method"], r["batch"], r["rank"], round(r["err"], 3)) for r in rows
           if abs(r["err"]) > mc.TARGET]
    assert not bad, bad


def test_committed_check_is_what_the_code_computes(rows):
    committed = load_result("memory_model_check.json")["results"]
    mine = {(s["file"], s["method"]): s for s in mc.summarise(rows)}
    assert {(s["file"], s["method"]) for s in committed["summary"]} == set(mine)
    for s in committed["summary"]:
        assert s["model_peak_gib"] == pytest.approx(mine[s["file"], s["method"]]["model_peak_gib"], rel=1e-9)
        assert s["measured_peak_gib"] == pytest.approx(mine[s["file"], s["method"]]["measured_peak_gib"])
    assert committed["within_target"] and committed["max_abs_record_err"] <= mc.TARGET


def test_wlb_divergence_of_the_runs_is_reproduced(rows):
    div = mc.measured_divergence(rows)
    assert div and max(d["measured"] for d in div) > 1.15       # pretrain 128K: one rank at 1.25x tokens
    assert all(abs(d["model"] - d["measured"]) < 0.01 for d in div)


def test_cp_rows_by_hand():
    # doc 0 (6 tokens) cut over both ranks, doc 1 (2 tokens) whole on rank 1
    lay = layout_from_lists([[(0, 0, 4)], [(0, 4, 6), (1, 0, 2)]], [6, 2])
    assert mc.cp_rows(lay, 0) == Rows(4, call_kv=4, regather=4 + 2 * 4)    # n + world * max shared rows
    assert mc.cp_rows(lay, 1) == Rows(4, call_kv=6 + 2, regather=4 + 2 * 4)
    solo = layout_from_lists([[(0, 0, 3)], [(1, 0, 2)]], [3, 2])
    assert mc.cp_rows(solo, 0) == Rows(3)               # nothing shared: nothing gathered


def test_dispatch_rows_colocated_plan_keeps_views():
    lay = layout_from_lists([[(0, 0, 4)], [(1, 0, 4)]], [4, 4])
    m = build_dispatch(scheduler.colocated(lay), 0)
    r = mc.dispatch_rows(m)
    assert (r.tokens, r.q, r.kv, r.out, r.home_o) == (4, 4, 4, 4, 0)     # every buffer a view
    spec = "llama3-8b"
    assert estimate(spec, [r], profile=OURS)["peak"] == estimate(spec, [Rows(4)], profile=OURS)["peak"]


def test_method_rows_rejects_unknown_method():
    with pytest.raises(ValueError, match="method"):
        mc.method_rows({}, "ring", 0)

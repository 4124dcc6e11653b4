"""The paper's protocol and our variants as a waterfall (cadlib.analysis.report.fidelity), on a summary
written in the format of ``bench_replay.py compose --suite paper3d,changes3d,waterfall3d``."""
import json

import pandas as pd
import pytest

from cadlib.analysis.replay.protocol import VARIANTS
from cadlib.analysis.report import fidelity

BASE = "3d_pretrain_128k_dp32"


def _row(setting, speedup, method="cad-pingpong"):
    return {"setting": setting, "method": method, "speedup_over_wlb": speedup, "speedup_over_wlb_sem": 0.01,
            "dp": 32, "max_doc_len": 131072, "batches": 5}


def _summary(one, cum):
    """paper3d, then changes3d (one at a time, <base>@<v>), then waterfall3d (cumulative, <base>@upto-<v>)."""
    rows = [_row(BASE, 1.20), _row(BASE, 1.0, "wlb")]
    rows += [_row(f"{BASE}@{v.name}", s) for v, s in zip(VARIANTS, one)]
    rows += [_row(f"{BASE}@upto-{v.name}", s) for v, s in zip(VARIANTS, cum)]
    return pd.DataFrame(rows)


def test_waterfall_steps_add_up_to_the_whole_difference():
    n = len(VARIANTS)
    one = [1.20 - 0.01 * (i + 1) for i in range(n)]
    cum = [1.20 - 0.02 * (i + 1) for i in range(n)]
    w = fidelity.steps(BASE, _summary(one, cum))
    assert w.variant.tolist() == ["paper"] + [v.name for v in VARIANTS]
    assert w.speedup.tolist() == pytest.approx([1.20] + cum)
    assert w.delta.iloc[1:].tolist() == pytest.approx([-0.02] * n)
    assert w.delta.sum() == pytest.approx(w.speedup.iloc[-1] - w.speedup.iloc[0])
    o = fidelity.steps(BASE, _summary(one, cum), cumulative=False)
    assert o.speedup.iloc[1:].tolist() == pytest.approx(one)
    assert o.delta.iloc[1:].tolist() == pytest.approx([s - 1.20 for s in one])
    fig = fidelity.waterfall_figure(w)
    assert len(fig.data[0].x) == n + 2


def test_names_tell_the_two_apart_in_any_order():
    rows = _summary([1.1] * len(VARIANTS), [1.0] * len(VARIANTS)).iloc[::-1]
    assert fidelity.steps(BASE, rows).speedup.iloc[1:].tolist() == pytest.approx([1.0] * len(VARIANTS))
    assert fidelity.steps(BASE, rows, cumulative=False).speedup.iloc[1:].tolist() == pytest.approx(
        [1.1] * len(VARIANTS))


def test_bad_names_are_refused():
    with pytest.raises(ValueError, match="no protocol row for '3d_x'"):
        fidelity.steps("3d_x", _summary([1.1], [1.1]))
    with pytest.raises(ValueError, match="unknown variants"):
        fidelity.steps(BASE, pd.DataFrame([_row(BASE, 1.2), _row(f"{BASE}@nope", 1.1)]))


def test_missing_fidelity_files_read_as_none(tmp_path):
    assert fidelity.waterfall(BASE, tmp_path) is None
    (tmp_path / fidelity.FIDELITY_SUMMARY).write_text(json.dumps(
        {"meta": {}, "config": {}, "results": _summary([1.1], [1.05]).to_dict("records")}))
    assert fidelity.waterfall(BASE, tmp_path).speedup.tolist() == pytest.approx([1.20, 1.05])


def test_the_committed_protocol_replay():
    p = fidelity.paper_speedups()
    assert len(p) == 18 and (p.batches == 15).all() and (p.speedup_sem > 0).all()
    assert set(p.dist) == {"pretrain", "prolong"} and p.wlb_cp.notna().all()
    o = fidelity.oracle_wlb("3d_prolong_256k_dp8")
    assert o["degrees"] == [4, 8] and o["oracle"] <= o["protocol"]
    setting = p.set_index("setting").speedup_over_wlb["3d_prolong_256k_dp8"]
    assert o["protocol"] == pytest.approx(float(setting))

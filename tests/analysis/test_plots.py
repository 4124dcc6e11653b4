"""Plot helpers: the figures carry the data they were given (bars, bases, widths, colours)."""
import numpy as np
import pandas as pd
import pytest

from cadlib.analysis.figures import plots


def _frame():
    return pd.DataFrame({
        "rank": [0, 0, 0, 1, 1],
        "lane": ["compute", "comm", "compute", "compute", "comm"],
        "phase": ["linear", "all-to-all", "attention", "linear", "all-to-all"],
        "start_ms": [0.0, 1.0, 2.5, 0.0, 0.5],
        "end_ms": [2.0, 2.0, 4.0, 1.5, 3.0],
    })


def test_timeline_bars_have_the_given_bases_and_widths():
    df = _frame()
    fig = plots.timeline(df)
    assert [t.type for t in fig.data] == ["bar"] * 3           # one trace per phase
    assert [t.name for t in fig.data] == ["linear", "all-to-all", "attention"]
    got = {}
    for t in fig.data:
        assert t.orientation == "h"
        for y, b, x in zip(t.y, t.base, t.x):
            got.setdefault((t.name, y), []).append((b, x))
    want = {}
    for r in df.itertuples():
        want.setdefault((r.phase, r.lane), []).append((r.start_ms, r.end_ms - r.start_ms))
    assert {k: sorted(v) for k, v in got.items()} == {k: sorted(v) for k, v in want.items()}
    assert fig.layout.xaxis.title.text == "time (ms)"


def test_timeline_colours_are_stable_per_phase_and_overridable():
    df = _frame()
    fig = plots.timeline(df, colors={"attention": "#000000"})
    col = {t.name: t.marker.color for t in fig.data}
    assert col["linear"] == plots.PALETTE[0] and col["all-to-all"] == plots.PALETTE[1]
    assert col["attention"] == "#000000"
    # the same phase keeps its colour in another frame where it appears in the same order
    again = plots.timeline(df.iloc[::-1].sort_values("start_ms", kind="stable"))
    assert {t.name: t.marker.color for t in again.data}["linear"] == plots.PALETTE[0]


def test_timeline_facets_into_one_subplot_per_value_with_one_legend_entry_per_phase():
    df = _frame()
    fig = plots.timeline(df, facet="rank", title="two ranks", hover=["rank"])
    axes = {t.yaxis for t in fig.data}
    assert axes == {"y", "y2"}
    assert [a.text for a in fig.layout.annotations] == ["rank 0", "rank 1"]
    assert sum(t.showlegend for t in fig.data) == 3
    on_rank1 = [t for t in fig.data if t.yaxis == "y2"]
    bases = sorted(b for t in on_rank1 for b in t.base)
    assert bases == [0.0, 0.5]
    assert np.allclose(sorted(x for t in on_rank1 for x in t.x), [1.5, 2.5])
    assert fig.layout.title.text == "two ranks"


def test_timeline_rejects_missing_columns_and_negative_durations():
    df = _frame()
    with pytest.raises(ValueError, match="stage"):
        plots.timeline(df, lane="stage")
    bad = df.assign(end_ms=df.start_ms - 1)
    with pytest.raises(ValueError, match="end_ms >= start_ms"):
        plots.timeline(bad)


def test_grouped_bars_from_a_base_keep_the_values():
    df = pd.DataFrame({"batch": ["b0", "b1"], "cad": [1.10, 0.97], "wlb": [1.02, 1.0]})
    fig = plots.grouped_bars(df, "batch", {"CAD": "cad", "WLB": "wlb"}, title="t", base=1.0)
    cad = fig.data[0]
    assert np.allclose(np.asarray(cad.y) + np.asarray(cad.base), df.cad)     # bars from 1 to the value
    assert np.allclose([c[0] for c in cad.customdata], df.cad)              # hover shows the value
    flat = plots.grouped_bars(df, "batch", {"CAD": "cad"}, title="t")
    assert flat.data[0].base is None and np.allclose(flat.data[0].y, df.cad)

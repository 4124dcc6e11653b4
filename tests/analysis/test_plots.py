"""Plot helpers: the figures carry the data they were given (bars, bases, widths, colours)."""
import numpy as np
import pandas as pd
import plotly.graph_objects as go
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


def test_one_palette_bands_and_simulator_lines():
    from cadlib.analysis import figures
    from cadlib.analysis.figures import plots
    from cadlib.core.methods import METHODS

    for name, m in METHODS.items():                       # every method, by name and label, one colour
        assert figures.COLOURS[name] == figures.colour(m.label)
    assert figures.COLOURS["wlb"] != figures.COLOURS["cad-pingpong"] != figures.COLOURS["colocated"]
    with pytest.raises(ValueError, match="no colour for 'nope'; choose one of: colocated"):
        figures.colour("nope")
    bars = plots.grouped_bars(pd.DataFrame({"x": ["a"], "wlb": [1.0], "cad-pingpong": [1.1]}), "x",
                              {"wlb": "wlb", "cad-pingpong": "cad-pingpong"}, title="")
    assert [t.marker.color for t in bars.data] == [figures.COLOURS["wlb"], figures.COLOURS["cad-pingpong"]]
    fig = plots.add_simulator(plots.add_band(go.Figure(), 1.07, 1.2), [1, 2], [1.1, 1.2])
    (band,) = fig.layout.shapes
    assert band.fillcolor == figures.COLOURS["paper"] and band.opacity == figures.BAND_OPACITY > 0
    assert [t.name for t in fig.data] == ["paper", "simulator"] and fig.data[1].line.dash == "dash"
    with pytest.raises(ValueError, match="y0 must be <= y1"):
        plots.add_band(go.Figure(), 2, 1)


def test_hero_axis_writes_its_ticks_out():
    from cadlib.analysis.figures import plots

    fig = plots.claims_chart([{"claim": "a", "ratio": 0.45, "verdict": "not reproduced", "label": ""},
                              {"claim": "b", "ratio": 1.3, "verdict": "partly", "label": ""}])
    assert fig.layout.xaxis.type == "log" and "0.5x" in fig.layout.xaxis.ticktext
    assert all(t.endswith("x") for t in fig.layout.xaxis.ticktext) and fig.layout.xaxis.tickvals[0] >= 0.39


def test_shared_stylesheet_moves_the_heads_styles_to_one_file(tmp_path):
    from cadlib.analysis.figures.static import shared_stylesheet
    page = ("<html><head><style>a{color:red}</style><script src='plotly.min.js'></script>"
            "<style type='text/css'>b{margin:0}</style></head><body><style>.cell{x:1}</style>body</body></html>")
    out = shared_stylesheet(page, tmp_path / "notebook.css", "notebook.css")
    assert (tmp_path / "notebook.css").read_text() == "a{color:red}\nb{margin:0}"
    assert '<link rel="stylesheet" href="notebook.css">' in out and "a{color:red}" not in out
    assert "<style>.cell{x:1}</style>" in out and "plotly.min.js" in out       # the body's own styles stay
    assert shared_stylesheet("<p>no head</p>", tmp_path / "x.css", "x.css") == "<p>no head</p>"

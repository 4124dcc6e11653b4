"""Plotly figures the notebooks show. Each function takes plain data (arrays, DataFrames, Plans) and
returns a ``plotly.graph_objects.Figure``; none computes anything a module of its own should own."""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from ...core.plan import Plan
from .palette import BAND_OPACITY, COLOURS, PIPELINE_COLOURS, SIMULATOR_DASH  # noqa: F401 (re-exported)

PALETTE = [  # categorical series that are not methods (ranks, stages, distributions); methods: COLOURS
"#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#EECA3B", "#B279A2", "#FF9DA6",
           "#9D755D", "#BAB0AC",
           # beyond ten series (a ping-pong timeline has 11 stages): ColorBrewer Dark2, cyan, olive
           "#1B9E77", "#D95F02", "#7570B3", "#E7298A", "#66A61E", "#E6AB02", "#A6761D", "#666666",
           "#17BECF", "#BCBD22"]


def _go():
    import plotly.graph_objects as go
    return go


def _color(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def doc_length_cdfs(curves: Mapping[str, tuple[np.ndarray, np.ndarray]], title="Document lengths"):
    """``curves[name] = (lengths, cdf)``: one CDF line per distribution on a log length axis."""
    go = _go()
    fig = go.Figure()
    for i, (name, (x, y)) in enumerate(curves.items()):
        fig.add_trace(go.Scatter(x=x, y=y, mode="lines", name=name, line=dict(color=_color(i))))
    fig.update_layout(title=title, xaxis=dict(title="document length (tokens)", type="log"),
                      yaxis=dict(title="fraction of documents ≤ length"), height=380)
    return fig


def rank_loads(values: Mapping[str, Sequence[float]], title: str, yaxis: str = "FLOPs", normalise=False):
    """Grouped bars per rank, one group member per entry of ``values`` (e.g. linear vs attention).
    With ``normalise`` each series is divided by its mean, so imbalance reads off the y axis."""
    go = _go()
    fig = go.Figure()
    for i, (name, v) in enumerate(values.items()):
        v = np.asarray(v, dtype=float)
        if normalise and v.mean() > 0:
            v = v / v.mean()
        fig.add_trace(go.Bar(x=list(range(len(v))), y=v, name=name, marker_color=_color(i)))
    if normalise:
        fig.add_hline(y=1.0, line_dash="dot", annotation_text="mean")
    fig.update_layout(title=title, barmode="group", xaxis=dict(title="rank / server", dtick=1),
                      yaxis=dict(title=("÷ mean" if normalise else yaxis)), height=380)
    return fig


def server_loads_before_after(before: Plan, after: Plan, tolerance: float | None = None,
                              title="Per-server core-attention load"):
    """Per-server attention pairs (÷ mean) for two plans, with the tolerance band."""
    fig = rank_loads({f"before (max/mean {before.imbalance():.2f})": before.server_pairs(),
                      f"after (max/mean {after.imbalance():.2f})": after.server_pairs()},
                     title, normalise=True)
    if tolerance is not None:
        fig.add_hline(y=1 + tolerance, line_dash="dash", line_color="gray",
                      annotation_text=f"1 + ε = {1 + tolerance:.2f}")
    return fig


def ca_tasks_picture(doc_len: int, tasks: Sequence, title: str | None = None):
    """A document's causal attention triangle cut into CA-tasks.

    Query tokens run down the y axis, KV tokens along x. Task ``[a, b)`` covers the trapezoid of rows
    ``a..b-1`` left of the diagonal and needs the KV prefix ``[0, b)`` (dotted box). Colour = server."""
    go = _go()
    fig = go.Figure()
    seen = set()
    for t in sorted(tasks, key=lambda t: t.q_start):
        a, b = t.q_start, t.q_end
        name = f"server {t.server}"
        fig.add_trace(go.Scatter(x=[0, a, b, 0, 0], y=[a, a, b, b, a], fill="toself", mode="lines",
                                 line=dict(color=_color(t.server), width=1), name=name,
                                 legendgroup=name, showlegend=name not in seen,
                                 hovertext=f"queries [{a}, {b}) · KV [0, {b}) · home {t.home} → {name}",
                                 hoverinfo="text"))
        seen.add(name)
        fig.add_shape(type="rect", x0=0, x1=b, y0=a, y1=b, line=dict(dash="dot", color="gray", width=1))
    fig.update_layout(title=title or f"A {doc_len}-token document as {len(tasks)} CA-tasks",
                      xaxis=dict(title="KV token", range=[0, doc_len]),
                      yaxis=dict(title="query token", range=[doc_len, 0]), height=420, width=520)
    return fig


def tradeoff_curve(df, x="imbalance", y="gbytes", label="tolerance", title="Bytes vs imbalance",
                   baselines: Mapping[str, tuple[float, float]] | None = None):
    """One line through the rows of ``df`` (e.g. one per tolerance ε), labelled by ``label``."""
    go = _go()
    fig = go.Figure(go.Scatter(x=df[x], y=df[y], mode="lines+markers+text", name="CAD scheduler",
                               text=[f"ε={v:g}" for v in df[label]], textposition="top right"))
    for i, (name, (bx, by)) in enumerate((baselines or {}).items()):
        fig.add_trace(go.Scatter(x=[bx], y=[by], mode="markers", name=name,
                                 marker=dict(size=12, symbol="x", color=_color(i + 1))))
    fig.update_layout(title=title, xaxis=dict(title="max / mean attention load"),
                      yaxis=dict(title=y), height=380)
    return fig


def lines(df, x: str, y: str, color: str, title: str, xlog=False, ylabel=None, xlabel=None):
    """A line per value of ``color``: the general sweep plot (idle fraction vs DP size, TF/s vs shard).
    A value that names a method (:data:`COLOURS`) keeps the method's colour."""
    go = _go()
    fig = go.Figure()
    for i, (key, g) in enumerate(df.groupby(color, sort=True)):
        g = g.sort_values(x)
        fig.add_trace(go.Scatter(x=g[x], y=g[y], mode="lines+markers", name=f"{color}={key}",
                                 line=dict(color=COLOURS.get(str(key), _color(i)))))
    fig.update_layout(title=title, xaxis=dict(title=xlabel or x, type="log" if xlog else "linear"),
                      yaxis=dict(title=ylabel or y), height=380)
    return fig


def timeline(df, *, lane: str = "lane", phase: str = "phase", start: str = "start_ms", end: str = "end_ms",
             facet: str | None = None, title: str | None = None, colors: Mapping[str, str] | None = None,
             hover: Sequence[str] = (), xlabel: str | None = None):
    """A Gantt chart: one horizontal bar per row of ``df``, from ``df[start]`` to ``df[end]`` on lane
    ``df[lane]`` (y axis), coloured by ``df[phase]``.

    Built from ``go.Bar(orientation="h", base=start, x=end - start)``, one trace per phase, so numeric
    times (ms, s, ticks) work as they are (``px.timeline`` wants dates). Phases keep a stable colour:
    the palette in order of first appearance, unless ``colors`` maps a phase to one. With ``facet``
    (a column such as ``rank``) the rows are split into vertically stacked subplots sharing the time
    axis, one per value of that column (titled "<facet> <value>", or the value if it is a string).
    ``hover`` names extra columns shown on hover; ``xlabel`` replaces the time axis' title. Lanes keep
    their order of first appearance, top to bottom."""
    go = _go()
    from plotly.subplots import make_subplots

    missing = [c for c in (lane, phase, start, end, facet, *hover) if c is not None and c not in df.columns]
    if missing:
        raise ValueError(f"timeline: column(s) {missing} not in the frame; it has {list(df.columns)}")
    if len(df) and (df[end] < df[start]).any():
        raise ValueError(f"timeline: every row needs {end} >= {start}")
    phases = list(dict.fromkeys(df[phase]))
    cmap = {p: (colors or {}).get(p, _color(i)) for i, p in enumerate(phases)}
    groups = list(df.groupby(facet, sort=True)) if facet is not None else [(None, df)]
    titles = [k if isinstance(k, str) else f"{facet} {k}" for k, _ in groups] if facet is not None else None
    height = 110 + sum(30 * g[lane].nunique() + 70 for _, g in groups)
    fig = make_subplots(rows=len(groups), cols=1, shared_xaxes=True, subplot_titles=titles,
                        vertical_spacing=min(0.3, 60 / height) if len(groups) > 1 else 0.0)
    seen: set = set()
    extra = "".join(f"<br>{c}: %{{customdata[{k}]}}" for k, c in enumerate(hover))
    for row, (_, g) in enumerate(groups, start=1):
        lanes = [str(v) for v in dict.fromkeys(g[lane])]
        for p in phases:
            s = g[g[phase] == p]
            if s.empty:
                continue
            fig.add_trace(go.Bar(
                orientation="h", y=s[lane].astype(str), base=s[start], x=s[end] - s[start], name=str(p),
                marker_color=cmap[p], legendgroup=str(p), showlegend=p not in seen,
                customdata=s[list(hover)].to_numpy() if hover else None,
                hovertemplate=f"{p}<br>{start}: %{{base:.4g}}<br>duration: %{{x:.4g}}{extra}"
                              "<extra>%{y}</extra>"), row=row, col=1)
            seen.add(p)
        fig.update_yaxes(categoryorder="array", categoryarray=lanes[::-1], title_text=lane, row=row, col=1)
    unit = end.rsplit("_", 1)[-1] if "_" in end else ""
    fig.update_xaxes(title_text=xlabel or (f"time ({unit})" if unit else "time"), row=len(groups), col=1)
    fig.update_layout(title=title, barmode="overlay", height=max(260, height), legend_title_text=phase)
    return fig


def bytes_heatmap(matrix, title: str = "Bytes sent, sender x receiver", unit: str = "KB",
                  labels: Sequence[str] | None = None):
    """A ``[src, dst]`` matrix (bytes) as a heatmap: senders down, receivers across, each cell
    annotated in ``unit`` (B, KB, MB, GB; powers of 1000)."""
    go = _go()
    scale = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}
    if unit not in scale:
        raise ValueError(f"unknown unit {unit!r}; choose one of: {', '.join(scale)}")
    m = np.asarray(matrix, dtype=np.float64) / scale[unit]
    if m.ndim != 2:
        raise ValueError(f"matrix must be 2-D [src, dst], got shape {m.shape}")
    ys = list(labels) if labels is not None else [f"rank {i}" for i in range(m.shape[0])]
    xs = list(labels) if labels is not None else [f"rank {j}" for j in range(m.shape[1])]
    fig = go.Figure(go.Heatmap(z=m, x=xs, y=ys, colorscale="Blues", colorbar=dict(title=unit),
                               text=[[f"{v:.3g}" for v in row] for row in m], texttemplate="%{text}",
                               hovertemplate="from %{y} to %{x}: %{z:.4g} " + unit + "<extra></extra>"))
    fig.update_layout(title=title, xaxis=dict(title="receiver", side="top"),
                      yaxis=dict(title="sender", autorange="reversed"), height=120 + 60 * m.shape[0],
                      width=260 + 80 * m.shape[1])
    return fig


def grouped_bars(df, x: str, series: Mapping[str, str], title: str, yaxis: str = "",
                 hover: Sequence[str] = (), base: float | None = None):
    """Grouped bars: one group per row of ``df`` (labelled by column ``x``), one bar per entry of
    ``series`` (legend name -> column; a name that is a method's keeps its :data:`COLOURS` colour).
    ``hover`` names extra columns shown on hover. ``base``: bars
    start there instead of at 0 (e.g. 1 for ratios: a speedup rises above it, a slowdown falls below),
    so that differences of a few percent are visible."""
    go = _go()
    fig = go.Figure()
    extra = "".join(f"<br>{c}: %{{customdata[{k + 1}]}}" for k, c in enumerate(hover))
    for i, (name, col) in enumerate(series.items()):
        val = df[col].to_numpy(dtype=float)
        custom = np.column_stack([val, *(df[c].to_numpy() for c in hover)]).astype(object)
        fig.add_trace(go.Bar(x=df[x], y=val if base is None else val - base,
                             base=None if base is None else [base] * len(val), name=name,
                             marker_color=COLOURS.get(name, _color(i)), customdata=custom,
                             hovertemplate=f"{name}: %{{customdata[0]:.4g}}{extra}<extra>%{{x}}</extra>"))
    fig.update_layout(title=title, barmode="group", yaxis=dict(title=yaxis), height=400)
    if base is not None:
        fig.add_hline(y=base, line=dict(color="gray", width=1))
    return fig


STAGE_COLORS = {"linear": "#4C78A8", "send": "#F58518", "attn": "#54A24B", "return": "#E45756",
                "head": "#B279A2", "cp": "#72B7B2", "attention": "#54A24B"}
"""One colour per stage of a step, whatever the method and the nano-batch (``send A`` and ``send' B`` are
both ``send``), so that the timelines of one stream and of ping-pong read alike."""
VERDICT_COLORS = {"reproduced": "#2E7D32", "partly": "#1F5FA8", "not at this scale": "#C25E00",
                  "not reproduced": "#888888"}
"""One colour per answer of the claims table (:data:`cadlib.analysis.report.verdicts.ANSWERS`)."""
_RATIO_TICKS = (0.1, 0.2, 0.3, 0.5, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)


def claims_chart(points: Sequence[Mapping], title: str = "Ours against the paper"):
    """One marker per claim (``claim``, ``ratio``, ``verdict``, ``label``): ours over the paper's figure,
    1 = the paper (within its range), coloured by the answer. The axis is logarithmic (0.5x and 2x lie
    as far from 1), its ticks written out in full (``0.5x``, ``0.9x``), never plotly's abbreviated
    minor labels (which print 0.4-0.9 as 4-9)."""
    go = _go()
    fig = go.Figure()
    for v, color in VERDICT_COLORS.items():
        pts = [p for p in points if p["verdict"] == v]
        if pts:
            fig.add_trace(go.Scatter(x=[p["ratio"] for p in pts], y=[p["claim"] for p in pts], mode="markers",
                                     name=v, marker=dict(size=12, color=color),
                                     hovertext=[p["label"] for p in pts], hoverinfo="text+y"))
    ratios = [p["ratio"] for p in points if p["ratio"] > 0] or [1.0]
    lo, hi = min(min(ratios), 1.0) / 1.15, max(max(ratios), 1.0) * 1.15
    ticks = [t for t in _RATIO_TICKS if lo <= t <= hi]
    fig.add_vline(x=1.0, line=dict(color="gray", dash="dot"), annotation_text="the paper")
    fig.update_layout(title=title, height=140 + 26 * len(points), margin=dict(l=230),
                      xaxis=dict(title="ours ÷ the paper's figure (its nearer end for a range)", type="log",
                                 range=[float(np.log10(lo)), float(np.log10(hi))], tickmode="array",
                                 tickvals=ticks, ticktext=[f"{t:g}x" for t in ticks],
                                 minor=dict(showgrid=False)),
                      yaxis=dict(autorange="reversed"), legend=dict(orientation="h", y=-0.25))
    return fig


def owner_strip(owners: Mapping[str, Sequence[int]], doc_lens: Sequence[int], title: str):
    """Which rank holds every token, one row per layout: one categorical colour per rank (a legend entry
    each), white lines between documents."""
    go = _go()
    fig = go.Figure()
    names = list(owners)
    ranks = sorted({int(r) for o in owners.values() for r in o})
    for r in ranks:
        xs, ys = [], []
        for name in names:
            for t, o in enumerate(owners[name]):
                if int(o) == r:
                    xs.append(t)
                    ys.append(name)
        fig.add_trace(go.Bar(x=[1] * len(xs), base=xs, y=ys, orientation="h", name=f"rank {r}",
                             marker=dict(color=_color(r), line=dict(width=0)), width=0.8,
                             hovertemplate="token %{base}<extra>rank " + str(r) + "</extra>"))
    for b in np.cumsum(doc_lens)[:-1]:
        fig.add_vline(x=float(b), line=dict(color="white", width=3))
    fig.update_layout(title=title, barmode="overlay", bargap=0, height=170 + 70 * len(names),
                      xaxis=dict(title="token (documents separated by white lines)",
                                 range=[0, sum(doc_lens)]),
                      yaxis=dict(autorange="reversed"))
    return fig


def mask_grid(pictures: Mapping[str, np.ndarray], cols: int = 5, title: str = ""):
    """Dense masks (queries down, keys across) as small pictures, ``cols`` per row, titled by name."""
    go = _go()
    from plotly.subplots import make_subplots

    names = list(pictures)
    rows = -(-len(names) // cols)
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=names, horizontal_spacing=0.02,
                        vertical_spacing=0.08)
    for i, name in enumerate(names):
        fig.add_trace(go.Heatmap(z=np.asarray(pictures[name], dtype=int), showscale=False, zmin=0, zmax=1,
                                 colorscale=[[0, "#f4f4f4"], [1, "#4C78A8"]]),
                      row=i // cols + 1, col=i % cols + 1)
    fig.update_xaxes(showticklabels=False)
    fig.update_yaxes(showticklabels=False, autorange="reversed")
    fig.update_layout(height=60 + 200 * rows, title=title)
    return fig


def with_picker(figures: Mapping[str, object], title: str = ""):
    """Several figures of the same layout (e.g. one timeline per setting) as one figure with a dropdown
    that shows one of them at a time (the first to begin with); works in static HTML too."""
    go = _go()
    labels = list(figures)
    if not labels:
        raise ValueError("with_picker: figures must name at least one figure")
    first = figures[labels[0]]
    fig = go.Figure(layout=first.layout)
    spans = []
    for label in labels:
        start = len(fig.data)
        for tr in figures[label].data:
            fig.add_trace(tr)
            fig.data[-1].visible = label == labels[0]
        spans.append((start, len(fig.data)))
    buttons = []
    for label, (a, b) in zip(labels, spans):
        vis = [a <= i < b for i in range(len(fig.data))]
        buttons.append(dict(label=label, method="update",
                            args=[{"visible": vis}, {"height": figures[label].layout.height}]))
    fig.update_layout(title=title or first.layout.title.text, margin=dict(t=120),
                      updatemenus=[dict(buttons=buttons, direction="down", x=1.0, xanchor="right", y=1.02,
                                        yanchor="bottom", showactive=True, pad=dict(b=30))])
    return fig


def add_band(fig, y0: float, y1: float, name: str = "paper", colour: str | None = None, *, row=None, col=None,
             showlegend: bool = True):
    """A filled horizontal band ``[y0, y1]`` (the paper's range, a ±3% tolerance) on ``fig`` (in subplot
    ``row``, ``col`` when given), in ``colour`` (default :data:`COLOURS` ``[name]``, else the paper's)
    at :data:`BAND_OPACITY`, with a legend entry ``name`` (a shape has none of its own; draw it once per
    figure: ``showlegend=False`` on the other subplots). Returns ``fig``."""
    go = _go()
    if not y0 <= y1:
        raise ValueError(f"add_band: y0 must be <= y1, got {y0} and {y1}")
    colour = colour or COLOURS.get(name, COLOURS["paper"])
    where = {} if row is None else {"row": row, "col": col}
    fig.add_hrect(y0=y0, y1=y1, fillcolor=colour, opacity=BAND_OPACITY, line_width=0, layer="below", **where)
    if showlegend:
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=name, legendgroup=name,
                                 marker=dict(symbol="square", size=14, color=colour, opacity=0.4)), **where)
    return fig


def add_simulator(fig, x, y, name: str = "simulator", colour: str | None = None, *, row=None, col=None,
                  showlegend: bool = True):
    """The simulator's prediction as a dashed line (:data:`SIMULATOR_DASH`) named ``name`` in the legend
    (once per figure: ``showlegend=False`` on the other subplots), in ``colour`` (default the
    simulator's). Returns ``fig``."""
    go = _go()
    where = {} if row is None else {"row": row, "col": col}
    fig.add_trace(go.Scatter(x=list(x), y=list(y), mode="lines", name=name, legendgroup=name,
                             showlegend=showlegend,
                             line=dict(dash=SIMULATOR_DASH, color=colour or COLOURS["simulator"])), **where)
    return fig

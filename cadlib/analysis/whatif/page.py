"""A what-if (:func:`cadlib.analysis.whatif.planner.plan`) for its reader: the terminal table, plotly figures and
a self-contained HTML page (plotly.js packed inside, :mod:`cadlib.analysis.figures.static`)."""
from __future__ import annotations

import html

from ...core.memory import GIB
from ..figures.palette import COLOURS
from ..figures.static import plotly_div_deferred, plotlyjs_packed_tag
from .verdict import LABELS, ROWS, pct
from .ring import KEY as RING

MARK = {"pays": "", "unsure": "?", "loses": "!"}


def _k(n: float) -> str:
    """A token count as 128K / 1M."""
    n = int(n)
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}M"
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else f"{n:,}"


def _rate(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.0f}K"


def _band(b, fmt) -> str:
    return f"{fmt(b[0])}-{fmt(b[1])}" if b else "no band"


def headline(res: dict) -> str:
    """What was planned, in two lines."""
    i = res["inputs"]
    m, c, t, d = i["model"], i["cluster"], i["training"], i["documents"]
    nodes = -(-c["gpus"] // c["gpus_per_node"])
    docs = d["source"] + (f" ({d['n_lengths']:,} lengths)" if d.get("n_lengths") else "")
    pr = res["pricing"]
    kern = (f"your GPU's tables ({pr['gpu_table']['label']})" if pr.get("gpu_table") else
            "a kernel table of your own" if c["kernels"] else f"the H200 tables ({pr['backend']})") + \
        (", linear layers from the cost model (no timed grid)" if pr["fallback"] else "")
    return (f"{m['name']} on {c['gpus']} GPUs ({nodes} nodes x {c['gpus_per_node']}), TP {c['tp']}, "
            f"PP {c['pp']} -> DP {c['dp']}; context {_k(t['context'])}, {_k(t['tokens_per_group'])} tokens "
            f"per DP group x {t['micro_batches']} micro-batch{'es' if t['micro_batches'] > 1 else ''}; "
            f"documents: {docs}\n"
            f"{t['steps']} sampled step{'s' if t['steps'] > 1 else ''}, seed {t['seed']}; {kern}; links per "
            f"GPU: in-node {c['intra_node_gbps']:.0f} GB/s, between DP groups {c['dp_gbps']:.0f} GB/s")


def table_rows(res: dict) -> list[dict]:
    """One row per method, the terminal table's cells as strings."""
    mem = res["memory"]["gpu_memory_bytes"]

    def times(x):
        return f"{x:.2f}"

    rows = []
    for key in _rows(res):
        r = res["methods"][key]
        cp = max(set(r["cp"]), key=r["cp"].count) if key in ("wlb", RING) else None
        name = LABELS[key] if cp is None else \
            f"{LABELS[key]} (CP {cp})" if key == "wlb" else f"{LABELS[key][:-1]}, CP {cp})"
        rows.append({
            "method": name,
            "step s": f"{r['step_s']:.2f} ({_band(r['step_s_band'], times)})",
            "tokens/s": f"{_rate(r['tokens_per_s'])} ({_band(r['tokens_per_s_band'], _rate)})",
            "idle": f"{100 * r['idle_fraction']:.0f}%",
            "x colocated": "1" if key == "colocated" else
            f"{r['speedup_over_colocated']:.2f} ({_band(r['speedup_over_colocated_band'], times)})",
            "x WLB-ideal": "1" if key == "wlb" else
            f"{r['speedup_over_wlb']:.2f} ({_band(r['speedup_over_wlb_band'], times)})",
            "GB sent/GPU": f"{r['sent_bytes_mean'] / 1e9:.1f}",
            "act. GiB/GPU": f"{r['activation_bytes_max'] / GIB:.0f} "
                           f"({100 * r['activation_bytes_max'] / mem:.0f}%)",
        })
    return rows


def _rows(res: dict) -> list[str]:
    """The methods a what-if priced, in the table's order (the CP ring only when it was priced)."""
    return [k for k in ROWS if k in res["methods"]]


def ring_text(res: dict) -> str:
    """The CP ring's degree, why, and CAD against it (no band: no replay of the ring measured the
    composition's error), or nothing when the ring was not priced."""
    rg = res.get("ring") or {}
    if rg.get("chosen") is None:
        return ""
    steps = ", ".join(f"CP {c} {t:.3g} s" for c, t in rg["mean_step_s"].items())
    cad = res["methods"]["cad-pingpong"].get(f"speedup_over_{RING}")
    return (f"CP ring (zigzag over the packed sequence): CP {rg['chosen']}, the fastest of the degrees "
            f"priced "
            f"({steps}; {rg['why']}); CAD (ping-pong) is {cad:.2f}x its speed (no band: no replay of the "
            f"ring measured the composition's error).\n")


def _grid(rows: list[dict]) -> str:
    cols = list(rows[0])
    w = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
    line = lambda r: "  ".join(str(r[c]).ljust(w[c]) for c in cols).rstrip()   # noqa: E731
    return "\n".join([line({c: c for c in cols})] + [line(r) for r in rows])


def sweep_text(res: dict) -> str:
    """The sweep as a DP x context grid of CAD's saving against the faster baseline."""
    pts = res["sweep"]
    if not pts:
        return "No sweep."
    c = res["inputs"]["cluster"]
    t = res["inputs"]["training"]
    v = res["verdict"]
    cells = {(p["dp"], p["context"]): f"{pct(p['saving'])}{MARK[p['class']]}" for p in pts}
    cells[(c["dp"], t["context"])] = f"[{pct(v['saving'])}{MARK[v['class']]}]"
    dps = sorted({d for d, _ in cells})
    ctxs = sorted({x for _, x in cells})
    rows = [{"DP \\ context": str(d), **{_k(x): cells.get((d, x), "") for x in ctxs}} for d in dps]
    flips = res["flips"]
    said = ("the answer flips at: " + "; ".join(
        f"DP {p['dp']} x context {_k(p['context'])} ({pct(p['saving'])}, {p['class']})" for p in flips)
        if flips else "the answer does not flip in this sweep")
    return (f"Where the answer flips: CAD's saving against the faster baseline, one sampled step each "
            f"(context scales the tokens per group with it; [ ] this plan, ? band includes no gain, "
            f"! CAD slower):\n{_grid(rows)}\n{said}")


def band_text(res: dict) -> str:
    """The saving's band, error by error."""
    v = res["verdict"]
    parts = ", ".join(f"{k} {100 * x:.1f}" for k, x in v["parts"].items())
    return (f"The band on CAD's saving: +-{100 * v['half_width']:.1f} points = sqrt of the squares of "
            f"{parts} (widest: {v['dominant']}).")


def text(res: dict) -> str:
    """The terminal output: headline, table, verdict, the band's parts, sweep, where the numbers come from."""
    band = res["band"]
    notes = "".join(f"\nnote: {n}" for n in band["notes"])
    ms = res["timing"]["plan_ms"]
    return (f"{headline(res)}\n\n{_grid(table_rows(res))}\n\n{res['verdict']['line']}\n"
            f"{band_text(res)}\n{ring_text(res)}\n{sweep_text(res)}\n\n"
            f"Durations: {res['pricing']['source']}. Bands: {band['source']}."
            f"{notes}\nCAD scheduler: {max(ms):.0f} ms per batch at most "
            f"({len(ms)} batch{'es' if len(ms) > 1 else ''}); "
            f"planned in {res['timing']['wall_s']:.1f} s.")


# ---------------------------------------------------------------------------------------------------
# Figures and the page
# ---------------------------------------------------------------------------------------------------

def _err(vals, bands):
    return {"type": "data", "symmetric": False, "visible": True,
            "array": [b[1] - v if b else 0 for v, b in zip(vals, bands)],
            "arrayminus": [v - b[0] if b else 0 for v, b in zip(vals, bands)]}


def figures(res: dict) -> dict[str, dict]:
    """Plotly figure dicts: step times with their bands, the first step's attention per rank, the sweep,
    activation memory against the GPU's, and the document lengths when they came from a file."""
    keys = _rows(res)
    names = [LABELS[k] for k in keys]
    ms = [res["methods"][k] for k in keys]
    colours = [COLOURS[k] for k in keys]
    figs = {"steps": {"data": [
        {"type": "bar", "x": names, "y": [r["step_s"] for r in ms], "name": "estimate (band)",
         "marker": {"color": colours},
         "error_y": _err([r["step_s"] for r in ms], [r["step_s_band"] for r in ms])}],
        "layout": {"title": {"text": f"Step time: {res['verdict']['line'].split(';')[0]}"},
                   "yaxis": {"title": {"text": "seconds per step"}}}}}
    figs["ranks"] = {"data": [
        {"type": "bar", "name": LABELS[k], "x": list(range(len(res["ranks"][k]["attention_s"]))),
         "y": res["ranks"][k]["attention_s"], "marker": {"color": COLOURS[k]}} for k in keys],
        "layout": {"title": {"text": "Core attention per rank, first micro-batch (the straggler is the "
                                     "tallest)"},
                   "barmode": "group", "xaxis": {"title": {"text": "DP rank (attention server)"}},
                   "yaxis": {"title": {"text": "seconds per step, forward + backward"}}}}
    mem = res["memory"]["gpu_memory_bytes"] / GIB
    figs["memory"] = {"data": [
        {"type": "bar", "x": names, "y": [r["activation_bytes_max"] / GIB for r in ms],
         "name": "activations", "marker": {"color": colours}},
        {"type": "scatter", "mode": "lines", "x": names, "y": [mem] * len(names), "name": "GPU memory"}],
        "layout": {"title": {"text": "Activation memory of the fullest GPU"},
                   "yaxis": {"title": {"text": "GiB"}}}}
    if res["sweep"]:
        c, t, v = res["inputs"]["cluster"], res["inputs"]["training"], res["verdict"]
        pts = res["sweep"] + [{"dp": c["dp"], "context": t["context"], "saving": v["saving"]}]
        dps = sorted({p["dp"] for p in pts})
        ctxs = sorted({p["context"] for p in pts})
        z = {(p["dp"], p["context"]): 100 * p["saving"] for p in pts}
        figs["sweep"] = {"data": [{
            "type": "heatmap", "x": [_k(x) for x in ctxs], "y": [str(d) for d in dps],
            "z": [[z.get((d, x)) for x in ctxs] for d in dps], "colorscale": "RdBu", "zmid": 0,
            "colorbar": {"title": {"text": "saving %"}}}],
            "layout": {"title": {"text": "CAD's saving against the faster baseline (estimate)"},
                       "xaxis": {"title": {"text": "context (MaxDocLen)"}, "type": "category"},
                       "yaxis": {"title": {"text": "DP groups"}, "type": "category"}}}
    q = res["inputs"]["documents"].get("quantiles")
    if q:
        src = res["inputs"]["documents"]["source"]
        figs["lengths"] = {"data": [{"type": "scatter", "mode": "lines", "x": q,
                                     "y": [i / (len(q) - 1) for i in range(len(q))], "name": "documents"}],
                           "layout": {"title": {"text": f"Document lengths: {src}"},
                                      "xaxis": {"title": {"text": "tokens"}, "type": "log"},
                                      "yaxis": {"title": {"text": "fraction of documents"}}}}
    return figs


def _html_table(rows: list[dict]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in r.values()) + "</tr>"
                   for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def page(res: dict) -> str:
    """A self-contained HTML page: the headline, table and verdict, every figure, the sweep and the band."""
    figs = "\n".join(plotly_div_deferred(f, f"whatif-{k}") for k, f in figures(res).items())
    v = res["verdict"]
    decision = {"pays": "Yes", "loses": "No", "unsure": "Not decided"}[v["class"]]
    notes = "".join(f"<p class='note'>{html.escape(n)}</p>" for n in res["band"]["notes"])
    esc = lambda s: html.escape(s).replace("\n", "<br>")   # noqa: E731
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>cadlib what-if</title>"
            "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto}"
            "table{border-collapse:collapse}"
            "td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}pre{background:#f6f6f6;padding:8px}"
            "</style></head><body>" + plotlyjs_packed_tag() +
            f"<h1>Does CAD pay off here? {decision}</h1><h2>{html.escape(v['line'])}</h2>"
            f"<p>{html.escape(band_text(res))}</p><p>{esc(headline(res))}</p>{_html_table(table_rows(res))}"
            f"<p>{html.escape(ring_text(res))}</p>"
            f"{figs}<pre>{html.escape(sweep_text(res))}</pre>"
            f"<p>Durations: {html.escape(res['pricing']['source'])}. Bands: "
            f"{html.escape(res['band']['source'])}.</p>{notes}</body></html>")

"""Step timelines of ``cadlib.train``: spans per rank and method, how much communication compute
overlapped (per pass, per stage), and checks that a step ran DistCA's tick order.

Spans and their arithmetic are :mod:`cadlib.core.spans`; here the tables and the per-stage views.
"""
from __future__ import annotations

import pandas as pd

from ...core.spans import (
    ONE_STREAM_STAGES,
    PINGPONG_STAGES,
    intersection,
    is_backward,
    last_step,
    overlap,
    union,
)


def records(rows) -> list[dict]:
    """Spans as a list of dicts, from a list or a :func:`timeline_frame`."""
    return rows.to_dict(orient="records") if isinstance(rows, pd.DataFrame) else list(rows)


def timeline_frame(timelines) -> pd.DataFrame:
    """All spans as one frame: ``rank, method, lane, phase, start_ms, end_ms, direction`` (forward,
    backward or step). ``timelines``: ``{"rank0": {method: rows}, ...}`` (a result file's) or the rank
    results of a run (each with ``rank`` and ``timelines``). A method's rows may be a list of steps:
    the last one is taken."""
    if isinstance(timelines, list):
        timelines = {f"rank{r['rank']}": r["timelines"] for r in timelines}
    out = []
    for key, by_method in timelines.items():
        rank = int(str(key).removeprefix("rank"))
        for method, rows in by_method.items():
            for r in last_step(rows):
                out.append({"rank": rank, "method": method, **r,
                            "direction": "step" if r["lane"] == "step" else
                            "backward" if is_backward(r["phase"]) else "forward"})
    return pd.DataFrame(out, columns=["rank", "method", "lane", "phase", "start_ms", "end_ms", "direction"])


def exposed_by_stage(rows) -> pd.DataFrame:
    """Where one rank's communication waited in the open: per comm phase (``"send B"``, ``"send' B"``,
    ...), how many spans, their time, and the part of it no compute span covered (``exposed_ms``), most
    exposed first. The spans of one phase are summed over layers; a phase's exposed time counts the
    comm time not covered by any compute span (spans of other comm phases do not count)."""
    rows = records(rows)
    comp = union([(r["start_ms"], r["end_ms"]) for r in rows if r["lane"] == "compute"])
    out: dict[str, list[float]] = {}
    for r in rows:
        if r["lane"] != "comm":
            continue
        span = [(r["start_ms"], r["end_ms"])]
        dur = r["end_ms"] - r["start_ms"]
        acc = out.setdefault(r["phase"], [0, 0.0, 0.0])
        acc[0] += 1
        acc[1] += dur
        acc[2] += dur - intersection(span, comp)
    df = pd.DataFrame([{"phase": k, "spans": n, "comm_ms": c, "exposed_ms": e}
                       for k, (n, c, e) in out.items()], columns=["phase", "spans", "comm_ms", "exposed_ms"])
    return df.sort_values("exposed_ms", ascending=False, kind="stable").reset_index(drop=True)


def overlap_table(tf: pd.DataFrame, methods=None) -> pd.DataFrame:
    """:func:`overlap` per (method, rank, direction) of a :func:`timeline_frame`."""
    rows = []
    for (m, r), g in tf.groupby(["method", "rank"], sort=False):
        if methods is not None and m not in methods:
            continue
        for d in ("forward", "backward"):
            rows.append({"method": m, "rank": r, "direction": d, **overlap(records(g), d)})
    return pd.DataFrame(rows, columns=["method", "rank", "direction", "comm_ms", "overlapped_ms",
                                       "overlap_ratio"])


def layer_window(rows, layer: int, direction: str = "forward") -> pd.DataFrame:
    """One layer's ticks of one rank's step, times from the layer's start: the spans that overlap
    ``[start of the layer's first stage, start of the next layer's)`` (forward: A's send; backward:
    B's return, whose primed span opens each layer of the mirror order), clipped to it."""
    df = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(rows)
    if direction not in ("forward", "backward"):
        raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
    df = df[df.lane != "step"]
    df = df[df.phase.map(is_backward) == (direction == "backward")]
    names = df.phase.str.replace("'", "").str.split().str.join(" ")
    pingpong = names.isin(PINGPONG_STAGES).any()
    stages = PINGPONG_STAGES if pingpong else ONE_STREAM_STAGES
    first = stages[0] if direction == "forward" else stages[-1]
    starts = sorted(df.start_ms[names == first])
    if not 0 <= layer < len(starts):
        raise ValueError(f"layer must be in [0, {len(starts)}) for this timeline, got {layer}")
    a = starts[layer]
    b = starts[layer + 1] if layer + 1 < len(starts) else float(df.end_ms.max())
    w = df[(df.end_ms > a) & (df.start_ms < b)].copy()
    w["start_ms"], w["end_ms"] = w.start_ms.clip(lower=a) - a, w.end_ms.clip(upper=b) - a
    return w


# ---------------------------------------------------------------------------------------------------
# The same stages for every method, and the tick table as a timeline
# ---------------------------------------------------------------------------------------------------

def stage_frame(tf: pd.DataFrame) -> pd.DataFrame:
    """``tf`` (a :func:`timeline_frame`, or rows of it) without the step lane, with ``stage`` (``linear``,
    ``send``, ``attn``, ``return``, ``head``, ``cp``: the phase without its prime and nano-batch, so one
    stream and ping-pong share colours) and ``nano`` (``A``, ``B`` or ``""``); rows in time order, the
    compute lane's first, so that every method's chart puts its lanes in the same order."""
    df = tf[tf.lane != "step"].copy()
    df = df.assign(_c=df.lane != "compute").sort_values(["_c", "start_ms"], kind="stable").drop(columns="_c")
    words = df.phase.str.replace("'", "", regex=False).str.split()
    df["stage"] = words.str[0]
    df["nano"] = [w[1] if len(w) > 1 else "" for w in words]
    return df


def with_linear_gaps(tf: pd.DataFrame, pass_lanes=("forward", "backward"),
                     min_gap_ms: float = 0.1) -> pd.DataFrame:
    """For each (rank, method) that records no ``linear`` spans (``cad`` on one stream records only its
    CA stages and the LM head), the gaps inside each pass between its recorded spans, as ``linear`` spans
    on the compute lane (``linear'`` backward) marked ``inferred``: what ran there is the linear layers
    (gaps shorter than ``min_gap_ms``, a launch between two stages, are left out).
    Methods that record their linear layers are returned as they are (``inferred`` False)."""
    out = [tf.assign(inferred=False)]
    for (rank, method), g in tf.groupby(["rank", "method"], sort=False):
        if g.phase.str.startswith("linear").any():
            continue
        for d in pass_lanes:
            window = g[(g.lane == "step") & (g.phase == d)]
            if window.empty:
                continue
            a, b = float(window.start_ms.iloc[0]), float(window.end_ms.iloc[0])
            inside = g[(g.lane != "step") & (g.direction == d)]
            spans = union([(r.start_ms, r.end_ms) for r in inside.itertuples()])
            t, gaps = a, []
            for s, e in spans + [(b, b)]:
                if s - t >= min_gap_ms:
                    gaps.append((t, s))
                t = max(t, e)
            out.append(pd.DataFrame([{"rank": rank, "method": method, "lane": "compute",
                                      "phase": "linear" + ("'" if d == "backward" else ""), "start_ms": s,
                                      "end_ms": e, "direction": d, "inferred": True} for s, e in gaps]))
    return pd.concat(out, ignore_index=True)


def ideal_timeline(n_layers: int = 2, linear: float = 1.0, attention: float = 1.0, comm: float = 0.5,
                   pingpong: bool = True) -> pd.DataFrame:
    """One forward pass laid out from the tick table, in units of time: ``linear``, ``attention`` and
    ``comm`` are one nano-batch's durations per layer (its linear layers, its attention, each all-to-all).
    One stream runs the whole batch (twice each) in sequence: linear, send, attention, return. Ping-pong
    runs DistCA's ticks, each as long as the longer of its compute and its communication (the two-way
    barrier after each): linear A; linear B | send A; attention A | send B; attention B | return A;
    linear A | return B; ... the last layer ends with B's linear. Rows: ``lane``, ``phase``, ``start_ms``,
    ``end_ms`` (in units), ``method``."""
    if n_layers < 1 or min(linear, attention, comm) <= 0:
        raise ValueError("n_layers must be >= 1 and linear, attention, comm > 0, got "
                         f"{n_layers}, {linear}, {attention}, {comm}")
    rows, t = [], 0.0

    def tick(compute, comm_phase=None, comp_d=0.0):
        nonlocal t
        end = t + max(comp_d, comm if comm_phase else 0.0)
        if compute:
            rows.append({"lane": "compute", "phase": compute, "start_ms": t, "end_ms": t + comp_d})
        if comm_phase:
            rows.append({"lane": "comm", "phase": comm_phase, "start_ms": t, "end_ms": t + comm})
        t = end

    if not pingpong:
        for _ in range(n_layers):
            for phase, d, lane in (("linear", 2 * linear, "compute"), ("send", 2 * comm, "comm"),
                                   ("attn", 2 * attention, "compute"), ("return", 2 * comm, "comm")):
                rows.append({"lane": lane, "phase": phase, "start_ms": t, "end_ms": t + d})
                t += d
        rows.append({"lane": "compute", "phase": "linear", "start_ms": t, "end_ms": t + 2 * linear})
    else:
        tick("linear A", None, linear)
        for _ in range(n_layers):
            tick("linear B", "send A", linear)
            tick("attn A", "send B", attention)
            tick("attn B", "return A", attention)
            tick("linear A", "return B", linear)
        tick("linear B", None, linear)
    return pd.DataFrame(rows).assign(method="cad-pingpong" if pingpong else "cad")

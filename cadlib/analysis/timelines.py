"""Step timelines of ``cadlib.train``: spans per rank and method, how much communication compute
overlapped (per pass, per stage), and checks that a step ran DistCA's tick order.

Spans and their arithmetic are :mod:`cadlib.core.spans`; here the tables and the per-stage views.
"""
from __future__ import annotations

import pandas as pd

from ..core.spans import (
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

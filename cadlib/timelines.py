"""Step timelines of ``cadlib.train``: spans per rank and method, how much communication compute
overlapped (per pass, per stage), and checks that a step ran DistCA's tick order.

A span is ``{"lane": "compute" | "comm" | "step", "phase", "start_ms", "end_ms"}``; backward spans carry
a prime (``"attn' A"``, ``"send' B"``). :mod:`cadlib.e2e` re-exports everything here.
"""
from __future__ import annotations

import pandas as pd

PINGPONG_STAGES = ("send A", "send B", "attn A", "return A", "attn B", "return B")
"""DistCA's tick order of one layer's CA stages (:mod:`cadlib.pingpong`): ticks 1-4 start with
A's send, B's send, A's return and B's return on the comm stream, beside B's linear, A's attention,
B's attention and A's linear on the compute stream."""
ONE_STREAM_STAGES = ("send", "attn", "return")
"""CAD without ping-pong: one nano-batch, its stages in sequence."""
_STAGES = ("send", "attn", "return")


def is_backward(phase: str) -> bool:
    """Backward spans carry a prime: ``"attn' A"``, ``"send' B"``, ``"linear A'"``, ``"head'"``."""
    return "'" in phase


def _last_step(rows) -> list[dict]:
    """A method's timeline: one step's rows, or a list of steps (then the last)."""
    return rows[-1] if rows and isinstance(rows[0], list) else list(rows)


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
            for r in _last_step(rows):
                out.append({"rank": rank, "method": method, **r,
                            "direction": "step" if r["lane"] == "step" else
                            "backward" if is_backward(r["phase"]) else "forward"})
    return pd.DataFrame(out, columns=["rank", "method", "lane", "phase", "start_ms", "end_ms", "direction"])


def _union(spans) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _intersection(x, y) -> float:
    """Length of the intersection of two sorted, disjoint interval lists (one merge pass)."""
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        total += max(0.0, min(x[i][1], y[j][1]) - max(x[i][0], y[j][0]))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap(rows, direction: str | None = None) -> dict:
    """Communication time and the part of it overlapped by compute, one rank's step.

    ``comm = |U comm spans|``, ``overlapped = |U comm spans ∩ U compute spans|`` and
    ``overlap_ratio = overlapped / comm`` (NaN without communication). ``direction`` ("forward" or
    "backward") keeps that pass's spans only (backward spans carry a prime)."""
    if isinstance(rows, pd.DataFrame):
        rows = rows.to_dict(orient="records")
    if direction not in (None, "forward", "backward"):
        raise ValueError(f"direction must be None, 'forward' or 'backward', got {direction!r}")
    keep = [r for r in rows if r["lane"] in ("comm", "compute")
            and (direction is None or is_backward(r["phase"]) == (direction == "backward"))]
    comm = _union([(r["start_ms"], r["end_ms"]) for r in keep if r["lane"] == "comm"])
    comp = _union([(r["start_ms"], r["end_ms"]) for r in keep if r["lane"] == "compute"])
    c = float(sum(b - a for a, b in comm))
    o = _intersection(comm, comp)
    return {"comm_ms": c, "overlapped_ms": o, "overlap_ratio": o / c if c > 0 else float("nan")}


def exposed_by_stage(rows) -> pd.DataFrame:
    """Where one rank's communication waited in the open: per comm phase (``"send B"``, ``"send' B"``,
    ...), how many spans, their time, and the part of it no compute span covered (``exposed_ms``), most
    exposed first. The spans of one phase are summed over layers; a phase's exposed time counts the
    comm time not covered by any compute span (spans of other comm phases do not count)."""
    if isinstance(rows, pd.DataFrame):
        rows = rows.to_dict(orient="records")
    comp = _union([(r["start_ms"], r["end_ms"]) for r in rows if r["lane"] == "compute"])
    out: dict[str, list[float]] = {}
    for r in rows:
        if r["lane"] != "comm":
            continue
        span = [(r["start_ms"], r["end_ms"])]
        dur = r["end_ms"] - r["start_ms"]
        acc = out.setdefault(r["phase"], [0, 0.0, 0.0])
        acc[0] += 1
        acc[1] += dur
        acc[2] += dur - _intersection(span, comp)
    df = pd.DataFrame([{"phase": k, "spans": n, "comm_ms": c, "exposed_ms": e}
                       for k, (n, c, e) in out.items()], columns=["phase", "spans", "comm_ms", "exposed_ms"])
    return df.sort_values("exposed_ms", ascending=False, kind="stable").reset_index(drop=True)


def overlap_ratio(rows, direction: str | None = None) -> float:
    """Share of the communication time overlapped by compute (see :func:`overlap`)."""
    return overlap(rows, direction)["overlap_ratio"]


def overlap_table(tf: pd.DataFrame, methods=None) -> pd.DataFrame:
    """:func:`overlap` per (method, rank, direction) of a :func:`timeline_frame`."""
    rows = []
    for (m, r), g in tf.groupby(["method", "rank"], sort=False):
        if methods is not None and m not in methods:
            continue
        for d in ("forward", "backward"):
            rows.append({"method": m, "rank": r, "direction": d, **overlap(g, d)})
    return pd.DataFrame(rows, columns=["method", "rank", "direction", "comm_ms", "overlapped_ms",
                                       "overlap_ratio"])


def stage_sequence(rows, direction: str = "forward") -> list[str]:
    """The CA stages (send, attn, return, with their nano-batch) in the order the host recorded
    them; backward primes dropped, so a backward sequence reads in the forward's names."""
    if isinstance(rows, pd.DataFrame):
        rows = rows.to_dict(orient="records")
    out = []
    for r in rows:
        if r["lane"] == "step" or is_backward(r["phase"]) != (direction == "backward"):
            continue
        words = r["phase"].replace("'", "").split()
        if words and words[0] in _STAGES:
            out.append(" ".join(words))
    return out


def check_tick_order(rows, n_layers: int, pingpong: bool = True) -> None:
    """Raise ValueError unless one rank's step ran DistCA's tick order: every layer's forward CA
    stages in :data:`PINGPONG_STAGES` order (:data:`ONE_STREAM_STAGES` without ping-pong), and the
    backward the mirror image, layer by layer in reverse."""
    if n_layers < 1:
        raise ValueError(f"n_layers must be >= 1, got {n_layers}")
    layer = list(PINGPONG_STAGES if pingpong else ONE_STREAM_STAGES)
    want = {"forward": layer * n_layers, "backward": layer[::-1] * n_layers}
    for d, w in want.items():
        got = stage_sequence(rows, d)
        if got != w:
            bad = next((i for i, (a, b) in enumerate(zip(got, w)) if a != b), min(len(got), len(w)))
            raise ValueError(f"{d} stages differ from the tick order at position {bad} (layer "
                             f"{bad // len(layer)}): got {got[bad:bad + 3]}, expected {w[bad:bad + 3]} "
                             f"({len(got)} stages recorded, {len(w)} expected)")


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

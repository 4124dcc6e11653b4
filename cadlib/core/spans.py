"""A step's timeline as spans, and what they say without pandas: the union and intersection of
intervals, how much communication compute overlapped, and DistCA's tick order.

A span is ``{"lane": "compute" | "comm" | "step", "phase", "start_ms", "end_ms"}`` (what
:class:`cadlib.runtime.streams.Timeline` records); backward spans carry a prime (``"attn' A"``,
``"send' B"``). ``python -m cadlib.train`` computes its per-step metrics from here;
:mod:`cadlib.analysis.runs.timelines` builds tables and figures on top.
"""
from __future__ import annotations

PINGPONG_STAGES = ("send A", "send B", "attn A", "return A", "attn B", "return B")
"""DistCA's tick order of one layer's CA stages (:mod:`cadlib.runtime.pingpong`): ticks 1-4 start with
A's send, B's send, A's return and B's return on the comm stream, beside B's linear, A's attention,
B's attention and A's linear on the compute stream."""
ONE_STREAM_STAGES = ("send", "attn", "return")
"""CAD without ping-pong: one nano-batch, its stages in sequence."""
_STAGES = ("send", "attn", "return")


def is_backward(phase: str) -> bool:
    """Backward spans carry a prime: ``"attn' A"``, ``"send' B"``, ``"linear A'"``, ``"head'"``."""
    return "'" in phase


def last_step(rows) -> list[dict]:
    """A method's timeline: one step's rows, or a list of steps (then the last)."""
    return rows[-1] if rows and isinstance(rows[0], list) else list(rows)


def union(spans) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def intersection(x, y) -> float:
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
    rows = rows.to_dict(orient="records") if hasattr(rows, "to_dict") else rows    # a DataFrame's rows
    if direction not in (None, "forward", "backward"):
        raise ValueError(f"direction must be None, 'forward' or 'backward', got {direction!r}")
    keep = [r for r in rows if r["lane"] in ("comm", "compute")
            and (direction is None or is_backward(r["phase"]) == (direction == "backward"))]
    comm = union([(r["start_ms"], r["end_ms"]) for r in keep if r["lane"] == "comm"])
    comp = union([(r["start_ms"], r["end_ms"]) for r in keep if r["lane"] == "compute"])
    c = float(sum(b - a for a, b in comm))
    o = intersection(comm, comp)
    return {"comm_ms": c, "overlapped_ms": o, "overlap_ratio": o / c if c > 0 else float("nan")}


def overlap_ratio(rows, direction: str | None = None) -> float:
    """Share of the communication time overlapped by compute (see :func:`overlap`)."""
    return overlap(rows, direction)["overlap_ratio"]


def stage_sequence(rows, direction: str = "forward") -> list[str]:
    """The CA stages (send, attn, return, with their nano-batch) in the order the host recorded
    them; backward primes dropped, so a backward sequence reads in the forward's names."""
    rows = rows.to_dict(orient="records") if hasattr(rows, "to_dict") else rows    # a DataFrame's rows
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

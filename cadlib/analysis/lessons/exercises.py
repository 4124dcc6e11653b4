"""Exercises whose answers a cell can check: :func:`check` tells a reader whether an answer is right,
:func:`solve` runs the reference solutions through the same check (the notebooks' last cell, so that CI
checks every exercise's expected answer too)."""

from __future__ import annotations

import math
from typing import Mapping


def _same(answer, expected, rel: float) -> bool:
    if isinstance(expected, bool) or isinstance(answer, bool):
        return bool(answer) == bool(expected) and isinstance(answer, bool)
    if isinstance(expected, (int, float)) and isinstance(answer, (int, float)):
        return math.isclose(float(answer), float(expected), rel_tol=rel, abs_tol=0 if rel else 1e-9)
    return answer == expected


def check(answer, expected, *, what: str, hint: str = "", rel: float = 0.0) -> bool | None:
    """Say whether ``answer`` (a number, a bool or a string) equals ``expected`` (numbers within ``rel``
    relative tolerance); ``None``: not answered yet, the hint is shown. Returns True, False or None;
    never raises on a wrong answer, so a notebook saved with one still runs."""
    if answer is None:
        print(
            f"{what}: not answered yet. Put your answer in `answer` above and run the cell again."
            + (f" Hint: {hint}" if hint else "")
        )
        return None
    ok = _same(answer, expected, rel)
    print(
        f"{what}: {'correct' if ok else 'not yet'} ({answer!r})."
        + ("" if ok or not hint else f" Hint: {hint}")
    )
    return ok


def solve(solutions: Mapping[str, tuple]) -> None:
    """``{what: (reference answer, expected)}``: every reference answer, computed the way a reader would
    (by hand, or with another cadlib call than the one that gives ``expected``), must pass :func:`check`.
    Raises AssertionError naming the first that does not."""
    for what, (answer, expected, *rel) in solutions.items():
        if not _same(answer, expected, rel[0] if rel else 0.0):
            raise AssertionError(
                f"exercise {what!r}: the reference answer {answer!r} does not match {expected!r}"
            )
    print(f"{len(solutions)} reference solutions checked")

"""The answer a reader gets to "does this claim reproduce?", in four words.

:func:`cadlib.analysis.report.claims.judge` compares ours with the paper's figure in the words of a
comparison (:data:`DIRECTIONS`: ``holds``, ``within``, ``below``, ``above``, ``not reproduced``). The
claims table and the report's answer block answer the question instead (:data:`ANSWERS`), and move the
comparison's direction into ``why`` (:func:`answer`):

* ``reproduced``: a qualitative claim holds, or ours is within the paper's range (10% of a point);
* ``partly``: ours misses the paper's figure by at most :data:`PARTLY` of it (a percentage: one
  point), or of several settings
  one reproduces and another does not (:func:`combine`);
* ``not at this scale``: the evidence (2 GPUs, a smaller model) cannot speak for the paper's scale, as
  its reason says (:data:`SCALE_REASONS`, or the claim's ``gap``);
* ``not reproduced``: ours misses by more, or nothing here checks it.
"""
from __future__ import annotations

import re

from ...core.paper import CLAIMS

DIRECTIONS = ("holds", "within", "below", "above", "not reproduced")
"""The words :func:`cadlib.analysis.report.claims.judge` compares in (its ``VERDICTS``)."""
ANSWERS = ("reproduced", "partly", "not at this scale", "not reproduced")
"""The only verdicts the claims table and the answer block give."""
PARTLY = 0.25
"""Ours within this share of the paper's figure (its nearer end for a range), or for a percentage
within one point of it, counts as ``partly``."""
SCALE_REASONS = re.compile(r"\b(2 GPUs|more GPUs than|needs (several|more) GPUs|a 34B model)")
"""Phrases of a ``why`` that say the evidence is too small for the paper's scale (``2 GPUs``, not
``512 GPUs``)."""
DIRECTION = {"below": "below the paper", "above": "above the paper"}


def answer(direction: str, why: str, claim_id: str, value: float | None = None) -> tuple[str, str]:
    """``(answer, why)``: :func:`cadlib.analysis.report.claims.judge`'s ``direction`` (holds, within,
    below, above, not reproduced) and its ``why`` turned into one of :data:`ANSWERS`, ``why`` starting
    with the direction where ours misses (``"below the paper: 0.0165x under 1.05x"``)."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {', '.join(DIRECTIONS)}, got {direction!r}")
    c = CLAIMS[claim_id]
    small = bool(SCALE_REASONS.search(why)) or bool(c.gap and c.gap.split(" (")[0] in why)
    if direction in ("holds", "within"):
        return "reproduced", why
    if direction == "not reproduced":
        return ("not at this scale" if small else "not reproduced"), why
    why = f"{DIRECTION[direction]}: {why}" if why else DIRECTION[direction]
    if small:
        return "not at this scale", why
    ref = c.high if direction == "above" else c.low
    if value is not None and ref and (abs(value / ref - 1) <= PARTLY
                                      or (c.unit == "%" and abs(value - ref) <= 1)):
        return "partly", why
    return "not reproduced", why


def combine(answers: list[str]) -> str:
    """One answer for a question several claims answer (Pretrain and ProLong): all alike gives that
    one; a mix with at least one ``reproduced`` or ``partly`` gives ``partly``."""
    if len(set(answers)) == 1:
        return answers[0]
    return "partly" if {"reproduced", "partly"} & set(answers) else "not reproduced"

"""The fortification of the CAD greedy's rollout (:mod:`cadlib.scheduling.rollout`): go back to a move
not taken when it was known to end better than what the greedy then did.

When 2 to ``MULTI_DONORS`` servers have excess, the rollout plays each of its two moves out for every
donor: the move, then ``equal_flops`` from there (every donor peeling, the most loaded first). That is
a complete, feasible continuation with exact bytes, but the rollout compares only its excess: as a
guess of the greedy's own continuation its bytes mislead (comparing them made the grid's plans worse).
Once the greedy has finished, its own continuation from each of those decisions is known: where it
ended and what it moved from there. So, in the order they were made, at the first decision where the
move not taken, followed by ``equal_flops``, ends strictly better than both the greedy's own
continuation and the committed move followed by ``equal_flops``, the greedy goes back to the state
before it, takes that move and runs on from there (the decisions before it stand, and it may go back
again, to later decisions only). "Better": ``(not reached, the largest excess left, the total excess
left, bytes from there)`` lower; the total matters where the tolerance is not reached, since the
play-out's donors stop with more excess than the greedy's, which has more moves than peeling.

This is Bertsekas' *fortified* rollout, evaluated lazily: each decision stands against the best
complete continuation known for it. Where every state at which the greedy's move differs from
``equal_flops``' is such a decision (2 to ``MULTI_DONORS`` donors, each with a peeling move), the
greedy alone so ends no worse than ``equal_flops`` from the first of them; elsewhere (more donors, a
donor with greedy moves but no peeling move) this is not guaranteed. On 40,000 random tiny layouts it
went back in 614 and every time ended strictly better than its first run.

A state is kept (:func:`snapshot`) only where the move not taken ended better in its every-donor
play-out than the committed one (:func:`cadlib.scheduling.rollout.decide`): elsewhere the greedy would
not go back. None is kept on the scale cases at 64 servers; on tiny layouts a few, cheaply.
"""
from __future__ import annotations

from typing import NamedTuple

from .views import DonorView

_ARRAYS = ("a", "b", "server", "pairs", "load", "has_shard", "over_key", "over_end")


class Check(NamedTuple):
    """A move the greedy may go back to: the state before donor ``s`` moved, the move it did not take,
    that move's every-donor play-out ``(not cleared, the largest excess left, the total excess left,
    bytes)``, and the bytes the greedy had moved."""

    state: dict
    s: int
    move: object
    play: tuple
    moved: int


def snapshot(g) -> dict:
    """The greedy ``g``'s state (:class:`cadlib.scheduling.engine.Greedy`), copied where moves change it
    in place (the index and each document's cache never change)."""
    st = dict(g.__dict__)
    for k in _ARRAYS:
        st[k] = st[k].copy()
    st["shards"] = g.shards[:]
    st["shard_servers"] = {d: set(x) for d, x in g.shard_servers.items()}
    st["live"], st["need_at"], st["rollout_donors"] = dict(g.live), dict(g.need_at), dict(g.rollout_donors)
    st["stuck"] = set(g.stuck)
    st["views"] = {s: _copy(v) for s, v in g.views.items()}
    del st["n_rollouts"]                                       # (counts every rollout, kept or not)
    return st


def _copy(v: DonorView) -> DonorView:
    w = DonorView(v.tasks, v.cols.copy())
    w.rep, w.chunk, w.holder = v.rep, v.chunk, v.holder
    return w


def restore(g, state: dict) -> None:
    """Put the greedy ``g`` back in ``state`` (a :func:`snapshot`, used once)."""
    g.__dict__.update(state)


def back_to(g, checks: list[Check]) -> Check | None:
    """The first of ``checks`` whose move not taken ended better than what the greedy ``g`` did from
    there (it has finished), or None. (A check is kept only where that move also ended better than
    the committed one.)"""
    load = g.load.tolist()
    over = max(max(load) - g.U, 0.0)
    total = sum(max(x - g.U, 0.0) for x in load)               # (in server order, as the play-outs)
    for c in checks:
        if c.play < (over > 0, over, total, g.moved_bytes - c.moved):
            return c
    return None

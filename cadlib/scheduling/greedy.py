"""The CAD scheduler's algorithm, written plainly, one candidate at a time: the reference that
:mod:`cadlib.scheduling.engine` (the vectorised engine) equals move for move, and in its ``flops`` mode
the reference of ``equal_flops`` (:mod:`cadlib.scheduling.water_fill`); and the arguments every planner
of :mod:`cadlib.scheduling` takes."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..core.cost import causal_pairs
from ..core.layout import Layout
from ..core.plan import check_n_servers
from . import rollout as scheduler_rollout
from .shards import cut_shards


def check_args(layout: Layout, n_servers, tolerance, min_shard, dtype: str = "bf16") -> tuple[int, float, int]:
    """Validate the scheduler's arguments: ``(n_servers, tolerance, min_shard)`` as int, float, int."""
    if not isinstance(layout, Layout):
        raise ValueError(f"layout must be a cadlib.core.layout.Layout, got {type(layout).__name__}")
    S = check_n_servers(n_servers, layout.n_ranks)
    if isinstance(tolerance, bool) or not isinstance(tolerance, numbers.Real) or not tolerance >= 0 \
            or not math.isfinite(tolerance):
        raise ValueError(f"tolerance must be a finite number >= 0 (max load <= (1 + tolerance) * mean), "
                         f"got {tolerance!r}")
    if isinstance(min_shard, bool) or not isinstance(min_shard, numbers.Integral) or min_shard < 1:
        raise ValueError(f"min_shard must be an integer >= 1 token, got {min_shard!r}")
    return S, float(tolerance), int(min_shard)


def reference_greedy(chunks: np.ndarray, n_servers: int, tolerance: float, min_shard: int,
                     q_bytes: int, kv_bytes: int, mode: str = "bytes") -> tuple[list[list[int]], bool]:
    """The scheduler, one candidate at a time. ``chunks``: ``Layout.chunk_array()`` rows
    ``(doc, start, end, rank)``. Returns the tasks ``[doc, q_start, q_end, home, server]`` and whether
    every server ended at most ``U``.

    A candidate moves ``k`` query tokens of task ``t`` (doc ``d``, ``[a, b)``, home ``h``) from donor
    ``s`` to receiver ``r``: the end shard ``[b-k, b)`` or the start shard ``[a, a+k)``, which needs the
    KV prefix ``[0, e)`` (``e = b`` or ``a + k``). A server ``g`` serving tasks of ``d`` up to
    ``need_g(d) = max q_end`` fetches ``kv_g(d) = need_g(d) - owned_g(d)`` KV tokens, where
    ``owned_g(d)`` counts the tokens of ``[0, need_g(d))`` that rank ``g`` holds. The move's **bytes**
    (forward dispatch, exact, with the state as it is now)::

        bytes = q_bytes * k * ([h != r] - [h != s])
              + kv_bytes * (kv_r(d) after - kv_r(d) before + kv_s(d) after - kv_s(d) before)

    Two things make a move's bytes mislead a greedy that looks one move ahead, and its **cost** corrects
    them. (1) The KV prefix a receiver fetches is paid once and then shared by every later shard of
    ``d`` it gets: ``kv_r`` is spread over the pairs of ``d`` it could take, ``B = max(P, min(room_r,
    A_d))`` with ``A_d = sum over chunks of d on donors of min(pairs, the donor's excess)``::

        cost = max(bytes - kv_bytes * kv_r * (1 - P / B), min(bytes, 0))

    (a shared prefix is a promise: it never makes a move look as if it saved bytes).

    (2) A move that leaves part of the donor's excess ``X = load_s - U`` needs another move, which
    pays a prefix again. The **priority** (lower first)::

        priority = cost / P                  if P >= X, or if no candidate clears X
                 = (cost + C) / X            otherwise, C = the lowest cost of a clearing candidate

    (3) Even so, a donor that needs several moves can spend its cheapest material first (start
    shards, small tasks) and be left with a tail that costs more to move or fits no room. So a
    **rollout** checks each move against peeling (``equal_flops``' move for this donor, ``mp``): when
    they differ, both are played out for this donor alone, against the receivers as they are, the
    move then peeling, and peeling, until its excess is cleared or it has no move. ``mp`` is committed
    if its play-out is strictly better: ``(not cleared, excess left, bytes)`` is lower. (Against
    unchanged receivers the donor so ends no worse than peeling would from where it started.) Other
    donors take rooms too: when 2 to ``scheduler_rollout.MULTI_DONORS`` (4) servers have excess, each
    is also played out for every donor (the move, then peeling, the most loaded donor first, as
    ``equal_flops`` would), and that play-out's ``(not cleared, the largest excess left)`` leads the
    key; the bytes compared stay the donor's own play-out's.

    (4) Those every-donor play-outs are complete, feasible plans from there, with exact bytes; once the
    loop ends, what the greedy did from each such decision is known too. At the first decision where
    the move not taken, then peeling, ends strictly better than both the committed move, then peeling,
    and what the greedy did (``(not reached, the largest excess left, the total excess left, bytes
    from there)`` lower), the greedy goes back to that state, takes that move and runs on (the
    **fortification**, :mod:`cadlib.scheduling.fortify`).

    ``mode="flops"`` is ``equal_flops`` written plainly (the plans
    :class:`cadlib.scheduling.water_fill.WaterFill` makes): bytes-blind, it takes the largest ``P``,
    end shards to the emptiest receiver only. Receivers tried: those that hold or serve part of ``d``,
    and the emptiest receiver, which stands for all others (a receiver with nothing of ``d`` pays ``e``
    KV tokens whatever it is; only its room differs, and more room never gives a worse move). Ties:
    larger ``P``, then task, receiver, end before start."""
    S, m = n_servers, int(min_shard)
    tasks = [Task(int(d), int(a), int(b), int(h), int(h) % S) for d, a, b, h in chunks]
    held: dict[tuple[int, int], list[tuple[int, int]]] = {}    # (rank, doc) -> its token ranges
    for t in tasks:
        held.setdefault((t.home, t.doc), []).append((t.a, t.b))
    holders = {d: {h for h, d2 in held if d2 == d and h < S} for d in {t.doc for t in tasks}}
    load = [0] * S
    for t in tasks:
        load[t.server] += causal_pairs(t.a, t.b)
    U = (1.0 + tolerance) * sum(load) / S

    def kv(tasks, g, d, skip=None, end=0):
        """KV tokens server ``g`` fetches for ``d``: its tasks' prefix (task ``skip`` replaced by one
        ending at ``end``) minus what rank ``g`` holds of it."""
        e = max([end] + [t.b for t in tasks if t.doc == d and t.server == g and t is not skip])
        return e - sum(max(0, min(hi, e) - lo) for lo, hi in held.get((g, d), ()))

    def candidates(tasks, load, s, flops):
        """Donor ``s``'s moves, scored; ``flops``: end shards to the emptiest receiver only."""
        receivers = [r for r in range(S) if load[r] < U]
        g = max(receivers, key=lambda i: (U - load[i], -i)) if receivers else None
        out: list[Candidate] = []
        for ti, t in enumerate(tasks):
            if t.server != s:
                continue
            d, a, b, h = t.doc, t.a, t.b, t.home
            mine = [t2 for t2 in tasks if t2.doc == d]
            near = {t2.server for t2 in mine} | holders[d]     # servers serving or holding part of d
            avail = sum(min(causal_pairs(t2.a, t2.b), load[t2.server] - U) for t2 in mine
                        if load[t2.server] > U)                 # pairs of d that donors could shed
            for r in [g] * (g is not None) if flops else [r for r in receivers if r in near or r == g]:
                room = U - load[r]
                x, y = max(1, math.ceil(min(load[s] - U, room))), math.floor(room)
                k, p = cut_shards([a], [b], [x], [y], m)
                for side, from_end in enumerate((True, False)):
                    kk, P = int(k[side, 0]), int(p[side, 0])
                    if kk == 0 or P > y or (flops and not from_end):
                        continue
                    e = b if from_end else a + kk                      # the shard's KV prefix end
                    left = b - kk if from_end else b                   # end of what s keeps of t
                    kv_r = kv(tasks, r, d, end=e) - kv(tasks, r, d)
                    kv_s = kv(tasks, s, d, skip=t, end=0 if kk == b - a else left) - kv(tasks, s, d)
                    byt = q_bytes * kk * ((h != r) - (h != s)) + kv_bytes * (kv_r + kv_s)
                    bundle = max(min(room, avail), P)
                    cost = max(byt - kv_bytes * kv_r + kv_bytes * kv_r * P / bundle, min(byt, 0))
                    out.append(Candidate(cost, P, ti, r, kk, side, byt))
        return out

    def best(cands, excess, flops):
        """The lowest-priority candidate (None if there is none)."""
        clear = min((c.cost for c in cands if c.pairs >= excess), default=None)
        key = None
        for c in cands:
            if flops:
                prio = -c.pairs
            elif clear is None or c.pairs >= excess:
                prio = c.cost / c.pairs
            else:
                prio = (c.cost + clear) / excess
            if key is None or (prio, -c.pairs, c.index, c.receiver, c.side) < key:
                key, out = (prio, -c.pairs, c.index, c.receiver, c.side), c
        return out if key is not None else None

    def apply(tasks, load, c):
        """Commit move ``c`` of the donor serving ``tasks[c.index]``."""
        t = tasks[c.index]
        s, a, b = t.server, t.a, t.b
        if c.k == b - a:
            t.server = c.receiver
        else:
            tasks.append(Task(t.doc, b - c.k, b, t.home, c.receiver) if c.side == 0
                         else Task(t.doc, a, a + c.k, t.home, c.receiver))
            t.a, t.b = (a, b - c.k) if c.side == 0 else (a + c.k, b)
        load[s] -= c.pairs
        load[c.receiver] += c.pairs

    def play_out(s, first, every):
        """``first``, then peeling, on a copy of the state: donor ``s`` alone, or (``every``) every
        donor, the most loaded first, as ``equal_flops`` would. ``(not cleared, the largest excess
        left, the total excess left, bytes)``."""
        ts, ld = [Task(t.doc, t.a, t.b, t.home, t.server) for t in tasks], load[:]
        apply(ts, ld, first)
        total, wait = first.bytes, set()
        while True:
            live = [i for i in (range(S) if every else [s]) if ld[i] > U and i not in wait]
            if not live:
                break
            i = max(live, key=lambda j: (ld[j], -j))
            c = best(candidates(ts, ld, i, True), ld[i] - U, True)
            if c is None:
                wait.add(i)
                continue
            apply(ts, ld, c)
            total += c.bytes
            if ld[i] < U:
                wait.clear()
        mine = range(S) if every else [s]
        left = max(max(ld[i] for i in mine) - U, 0.0)
        return left > 0, left, sum(max(ld[i] - U, 0.0) for i in mine), total

    def score(s, first, every):
        """The rollout's key of ``first`` (lower is better): donor ``s``'s play-out, led (``every``)
        by every donor's ``(not cleared, the largest excess left)``; and that every-donor play-out."""
        one = play_out(s, first, False)
        if not every:
            return one, None
        full = play_out(s, first, True)
        return full[:2] + one, full

    stuck: set[int] = set()
    checks = []                  # (state, donor, the move not taken, its every-donor play-out, bytes)
    moved = 0                    # the bytes the committed moves moved
    while True:
        donors = [s for s in range(S) if load[s] > U and s not in stuck]
        if not donors:           # the fortification: back to the first move not taken that ended better
            over, excess = max(max(load) - U, 0.0), sum(max(v - U, 0.0) for v in load)
            back = [ck for ck in checks if ck[3] < (over > 0, over, excess, moved - ck[4])]
            if not back:
                break
            (tasks, load, stuck, moved), s, c = back[0][:3]
            checks = []
        else:
            s = max(donors, key=lambda i: (load[i], -i))      # the most loaded donor moves
            cands = candidates(tasks, load, s, mode == "flops")
            c = best(cands, load[s] - U, mode == "flops")
            if c is None:
                stuck.add(s)
                continue
            if mode == "bytes":                                # the rollout
                g = max(range(S), key=lambda i: (U - load[i], -i))
                mp = best([x for x in cands if x.receiver == g and x.side == 0], load[s] - U, True)
                every = 1 < sum(v > U for v in load) <= scheduler_rollout.MULTI_DONORS
                if mp is not None and mp[2:6] != c[2:6]:
                    (kp, fp), (kc, fc) = score(s, mp, every), score(s, c, every)
                    other, fo, c, fc = (c, fc, mp, fp) if kp < kc else (mp, fp, c, fc)
                    if every and fo < fc:                      # it ended better: a state to go back to
                        state = ([Task(t.doc, t.a, t.b, t.home, t.server) for t in tasks], load[:],
                                 set(stuck), moved)
                        checks.append((state, s, other, fo, moved))
        apply(tasks, load, c)
        moved += c.bytes
        if load[s] < U:
            stuck.clear()                                      # a new receiver: retry stuck donors
    return [[t.doc, t.a, t.b, t.home, t.server] for t in tasks], all(v <= U for v in load)


@dataclass(eq=False)
class Task:
    """A CA-task of ``reference_greedy``: query tokens ``[a, b)`` of ``doc``, homed on ``home``,
    served on ``server`` (``a``, ``b``, ``server`` change as it moves or is cut)."""

    doc: int
    a: int
    b: int
    home: int
    server: int


class Candidate(NamedTuple):
    """A scored move of ``reference_greedy``: ``k`` query tokens of the ``index``-th task to
    ``receiver``, from its end (``side`` 0) or its start (1), moving ``pairs`` at ``cost`` (its forward
    bytes: ``bytes``)."""

    cost: float
    pairs: int
    index: int
    receiver: int
    k: int
    side: int
    bytes: int

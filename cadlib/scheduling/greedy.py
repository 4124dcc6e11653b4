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
from .shards import cut_shards


def check_args(layout: Layout, n_servers, tolerance, min_shard,
               dtype: str = "bf16") -> tuple[int, float, int]:
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

    ``mode="flops"`` is ``equal_flops`` written plainly (the plans
    :class:`cadlib.scheduling.water_fill.WaterFill` makes): bytes-blind, it takes the largest ``P``,
    end shards to the emptiest receiver only. Receivers tried: those that hold or serve part of ``d``,
    and the emptiest receiver, which stands for all others (a receiver with nothing of ``d`` pays ``e``
    KV tokens whatever it is; only its room differs, and more room never gives a worse move). Ties:
    larger ``P``, then task, receiver, end before start."""
    S, m, flops = n_servers, int(min_shard), mode == "flops"
    tasks = [Task(int(d), int(a), int(b), int(h), int(h) % S) for d, a, b, h in chunks]
    held: dict[tuple[int, int], list[tuple[int, int]]] = {}    # (rank, doc) -> its token ranges
    for t in tasks:
        held.setdefault((t.home, t.doc), []).append((t.a, t.b))
    holders = {d: {h for h, d2 in held if d2 == d and h < S} for d in {t.doc for t in tasks}}
    load = [0] * S
    for t in tasks:
        load[t.server] += causal_pairs(t.a, t.b)
    U = (1.0 + tolerance) * sum(load) / S

    def kv(g, d, skip=None, end=0):
        """KV tokens server ``g`` fetches for ``d``: its tasks' prefix (task ``skip`` replaced by one
        ending at ``end``) minus what rank ``g`` holds of it."""
        e = max([end] + [t.b for t in tasks if t.doc == d and t.server == g and t is not skip])
        return e - sum(max(0, min(hi, e) - lo) for lo, hi in held.get((g, d), ()))

    def candidates(s):
        """Donor ``s``'s moves, scored (``flops``: end shards to the emptiest receiver only)."""
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
                    kv_r = kv(r, d, end=e) - kv(r, d)
                    kv_s = kv(s, d, skip=t, end=0 if kk == b - a else left) - kv(s, d)
                    byt = q_bytes * kk * ((h != r) - (h != s)) + kv_bytes * (kv_r + kv_s)
                    bundle = max(min(room, avail), P)
                    cost = max(byt - kv_bytes * kv_r + kv_bytes * kv_r * P / bundle, min(byt, 0))
                    out.append(Candidate(cost, P, ti, r, kk, side))
        return out

    def best(cands, excess):
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

    def apply(c):
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

    stuck: set[int] = set()
    while True:
        donors = [s for s in range(S) if load[s] > U and s not in stuck]
        if not donors:
            break
        s = max(donors, key=lambda i: (load[i], -i))          # the most loaded donor moves
        c = best(candidates(s), load[s] - U)
        if c is None:
            stuck.add(s)                                       # it waits for a new receiver
            continue
        apply(c)
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
    ``receiver``, from its end (``side`` 0) or its start (1), moving ``pairs`` at ``cost``."""

    cost: float
    pairs: int
    index: int
    receiver: int
    k: int
    side: int

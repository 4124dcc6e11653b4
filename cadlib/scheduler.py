"""The CAD scheduler: place CA-tasks on attention servers so that core-attention FLOPs are balanced
while as few bytes as possible cross the network (DistCA's communication-aware greedy).

Start from the colocated placement: every chunk of the linear layout is one CA-task, served by
server ``home % n_servers`` (``home`` itself when there are as many servers as ranks). With
``mean = total pairs / n_servers`` and the ceiling ``U = (1 + tolerance) * mean``, servers above ``U``
are **donors**, servers below ``U`` **receivers**. Repeatedly, the most loaded donor ``s`` makes its
best move: it sheds ``x = min(load_s - U, U - load_r)`` pairs (at least) to a receiver ``r``, as a
whole task or as a query shard cut from its end or its start (``shards.cut_shards``), never filling
``r`` above ``U``. A donor with no valid move is skipped until a new receiver appears; the loop ends
when no donor can move. Every move lowers ``sum(max(0, load - U))``, so it ends.

``schedule`` picks the move with the fewest bytes per pair moved (the priority in
``reference_greedy``); ``equal_flops`` is the bytes-blind baseline (the largest end shard to the
emptiest receiver). Both run on the vectorised engine of :mod:`cadlib.scheduler_engine`;
:func:`reference_greedy` below is the same algorithm written plainly, one candidate at a time. The
guard of :func:`place` computes ``equal_flops``' moves with :mod:`cadlib.scheduler_fill` (a few scalar
steps per move, the same plan as the engine's).
"""
from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .cost import MIN_SHARD_TOKENS, as_model, causal_pairs
from . import scheduler_rollout
from .plan import Layout, Plan
from .shards import cut_shards

METHODS = ("cad", "equal_flops", "colocated", "distca")


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
    **fortification**, :mod:`cadlib.scheduler_fortify`).

    ``equal_flops`` (``mode="flops"``) instead takes the largest ``P``, end shards to the emptiest
    receiver only. Receivers tried: those that hold or serve part of ``d``, and the emptiest receiver,
    which stands for all others (a receiver with nothing of ``d`` pays ``e`` KV tokens whatever it is;
    only its room differs, and more room never gives a worse move). Ties: larger ``P``, then task,
    receiver, end before start."""
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


# ---------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------

def _check(layout: Layout, n_servers, tolerance, min_shard, dtype: str = "bf16") -> tuple[int, float, int]:
    """Validate the scheduler's arguments: ``(n_servers, tolerance, min_shard)`` as int, float, int."""
    if not isinstance(layout, Layout):
        raise ValueError(f"layout must be a cadlib.plan.Layout, got {type(layout).__name__}")
    if n_servers is None:
        S = layout.n_ranks
    elif isinstance(n_servers, bool) or not isinstance(n_servers, numbers.Integral) or n_servers < 1:
        raise ValueError(f"n_servers must be an integer >= 1 (or None for one server per rank), "
                         f"got {n_servers!r}")
    else:
        S = int(n_servers)
    if isinstance(tolerance, bool) or not isinstance(tolerance, numbers.Real) or not tolerance >= 0 \
            or not math.isfinite(tolerance):
        raise ValueError(f"tolerance must be a finite number >= 0 (max load <= (1 + tolerance) * mean), "
                         f"got {tolerance!r}")
    if isinstance(min_shard, bool) or not isinstance(min_shard, numbers.Integral) or min_shard < 1:
        raise ValueError(f"min_shard must be an integer >= 1 token, got {min_shard!r}")
    return S, float(tolerance), int(min_shard)


def place(layout: Layout, method: str = "cad", n_servers: int | None = None, model=None,
          tolerance: float = 0.1, min_shard: int | None = None, dtype: str = "bf16",
          chunks: np.ndarray | None = None, guard: bool = True, cost_model=None) -> Plan:
    """Run ``method`` (``cad``, ``equal_flops``, ``colocated`` or ``distca``: DistCA's released planner,
    :func:`cadlib.distca_planner.distca_plan`) and return its :class:`Plan`, built
    from arrays in O(chunks + tasks) (call ``plan.validate()`` to check coverage). ``chunks`` (from
    ``Layout.chunk_array``) may be passed to skip the layout conversion. ``meta['seconds']`` is the
    planning time including that conversion; ``meta['loop_seconds']`` the greedy alone.

    ``guard`` (``cad`` only): if the bytes-blind ``equal_flops`` plan reaches the tolerance while this
    one does not, or both reach it and it moves fewer bytes (neither: a lower peak load), return it
    instead (``meta['guard']`` records it). The greedy is built to need this rarely; the benchmark
    reports how often. ``equal_flops``' plan is computed by :class:`cadlib.scheduler_fill.WaterFill`
    (its arrays only when it is returned).
    ``meta['moved_bytes']``: the forward bytes the moves added to the colocated placement's, exact
    (tracked move by move; ``plan.forward_bytes(model)`` gives the total); ``meta['n_rollouts']``: the
    greedy's moves checked against peeling by a rollout (:mod:`cadlib.scheduler_rollout`);
    ``meta['n_backtracks']``: the times it went back to a move not taken (:mod:`cadlib.scheduler_fortify`).

    ``min_shard`` None: ``MIN_SHARD_TOKENS``, or with ``cost_model`` (a
    :class:`cadlib.measured.MeasuredCost`) its :meth:`~cadlib.measured.MeasuredCost.min_shard`; the
    plan then records ``meta['measured_imbalance']``, the max/mean of its servers' modelled times (the
    greedy itself still balances pairs)."""
    from .scheduler_engine import Greedy
    from .scheduler_fill import WaterFill

    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
    if cost_model is not None and not hasattr(cost_model, "min_shard"):
        raise ValueError(f"cost_model must be a cadlib.measured.MeasuredCost (or None), got "
                         f"{type(cost_model).__name__}")
    if min_shard is None:
        min_shard = cost_model.min_shard() if cost_model is not None else MIN_SHARD_TOKENS
    S, tol, m = _check(layout, n_servers, tolerance, min_shard)
    if method == "distca":
        from .distca_planner import distca_plan
        return distca_plan(layout, S, model, tol, m, dtype, chunks)
    spec = as_model(model)
    qb, kvb = spec.q_bytes(dtype), spec.kv_bytes(dtype)
    t0 = time.perf_counter()
    ch = layout.chunk_array() if chunks is None else chunks
    mode = "flops" if method == "equal_flops" else "bytes"
    g = Greedy(ch, layout.n_docs, S, tol, m, qb, kvb, mode)
    load0 = g.load.copy() if method == "cad" and guard else None
    t1 = time.perf_counter()
    reached = g.run() if method != "colocated" else g.reached()
    t2 = time.perf_counter()
    meta = {"method": method, "n_moves": g.n_moves, "n_splits": g.n_splits, "n_rollouts": g.n_rollouts,
            "n_backtracks": g.n_backtracks, "tolerance": tol,
            "reached": reached, "min_shard": m, "n_servers": S, "model": spec.name, "dtype": dtype,
            "imbalance_before": g.imbalance_before, "imbalance_after": g.imbalance(),
            "moved_bytes": g.moved_bytes, "guard": False}
    if method == "cad" and guard and g.n_moves:                # no move: equal_flops makes none either
        e = WaterFill(g, load0)                                 # equal_flops' moves, cheaply
        e_reached = e.run()
        if reached != e_reached:
            better = e_reached
        elif reached:                                           # both balanced: fewer bytes
            better = e.moved_bytes < g.moved_bytes
        else:                                                   # neither: lower peak, then fewer bytes
            better = (e.load.max(), e.moved_bytes) < (g.load.max(), g.moved_bytes)
        if better:
            g, meta["guard"], meta["reached"] = e, True, e_reached
            meta.update(n_moves=e.n_moves, n_splits=e.n_splits, imbalance_after=e.imbalance(),
                        moved_bytes=e.moved_bytes)
    cols = g.task_arrays()
    meta["loop_seconds"] = t2 - t1
    meta["seconds"] = time.perf_counter() - t0
    plan = Plan.from_arrays(layout, cols.doc, cols.q_start, cols.q_end, cols.home, cols.server,
                            n_servers=S, meta=meta, chunks=ch, check=False)
    if cost_model is not None:
        from .cost import imbalance
        plan.meta["measured_imbalance"] = imbalance(cost_model.server_seconds(plan, model=spec))
    return plan


def schedule(layout: Layout, n_servers: int | None = None, model=None, tolerance: float = 0.1,
             min_shard: int | None = None, dtype: str = "bf16", cost_model=None) -> Plan:
    """DistCA's communication-aware greedy (see :func:`reference_greedy` for the priority of a move).
    ``plan.meta`` records ``n_moves, n_splits, seconds, tolerance, reached`` (all servers
    ``<= (1 + tolerance) * mean``). End vs start shard: an end shard has the most pairs per query token
    (token ``i`` carries ``i+1``), so it sends the fewest queries but needs the full prefix ``[0, b)``; a
    start shard sends more queries but only ``[0, a+k)``. For a receiver holding nothing of ``d`` and a
    small amount the start shard wins; for one that already holds the prefix (a neighbouring rank
    under sequential packing) the end shard wins. Both are scored, per candidate. ``cost_model``: see
    :func:`place`."""
    return place(layout, "cad", n_servers, model, tolerance, min_shard, dtype, cost_model=cost_model)


def equal_flops(layout: Layout, n_servers: int | None = None, tolerance: float = 0.1,
                min_shard: int = MIN_SHARD_TOKENS) -> Plan:
    """Baseline water-filling that ignores bytes: the most loaded donor sends its largest end shard
    (priority ``-P``) to the emptiest receiver; same donor/receiver rules and shard sizes."""
    return place(layout, "equal_flops", n_servers, None, tolerance, min_shard)


def colocated(layout: Layout, n_servers: int | None = None) -> Plan:
    """Every task on server ``home % n_servers`` (on its own rank when ``n_servers == n_ranks``)."""
    return place(layout, "colocated", n_servers, None, 0.0, 1)

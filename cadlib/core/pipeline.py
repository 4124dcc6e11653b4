"""Pipeline schedules: which microbatch each stage runs when, and what the stages send each other.

``pp`` stages hold contiguous blocks of the decoder's layers (:func:`split_layers`); a step runs
``n_micro`` microbatches through them. Stage ``s`` runs a forward ``F(m)`` of microbatch ``m`` after
stage ``s - 1``'s, and a backward ``B(m)`` after stage ``s + 1``'s (the last stage right after its own
forward). Two orders:

* **1F1B** (:func:`one_f_one_b`, Megatron-LM's non-interleaved schedule): stage ``s`` runs
  ``w_s = min(pp - 1 - s, n_micro)`` warm-up forwards, then alternates one forward and one backward,
  then drains the remaining backwards. Each stage keeps at most ``w_s + 1`` microbatches' activations.
* **Lock-step ticks** (:func:`lockstep`, DistCA's schedule, paper section 4.1 and Figure 8): the same
  2 ``n_micro`` + 2 (``pp`` - 1) slots, but in every tick ALL stages run the same phase (all forward or
  all backward), so one attention all-to-all per layer can serve every stage at once. ``pp - 1``
  forward ticks of warm-up, then ``n_micro`` pairs (a forward tick, a backward tick), then ``pp - 1``
  backward ticks of drain. A stage with nothing to run in a tick (warm-up, drain, and backwards that
  1F1B would have run earlier and are deferred to the bubbles at the end) runs a **dummy**: no layer of
  its own, but its GPU still serves attention for the others.

What stages send: the forward's output activations to the next stage, the backward's input gradient
to the previous one, point to point (:func:`p2p_1f1b`, :func:`p2p_lockstep`). The exchanges are
grouped the way the runtime posts them (one batched ``isend``/``irecv`` per boundary), and
:func:`check_deadlock_free` plays them under the strictest rule (a batch completes only once every
peer has posted the matching half, and nothing else runs meanwhile). Host-only; no torch.
"""
from __future__ import annotations

import numbers
from typing import NamedTuple


class Op(NamedTuple):
    """One slot of a stage: ``kind`` ``"F"`` or ``"B"`` of microbatch ``micro`` (None: a dummy)."""

    kind: str
    micro: int | None


class Tick(NamedTuple):
    """One lock-step tick: its ``phase`` (``"F"`` or ``"B"``) and, per stage, the microbatch it runs
    (None: a dummy, serving attention only)."""

    phase: str
    micro: tuple


class Msg(NamedTuple):
    """A point-to-point message: ``kind`` ``"act"`` (an activation, stage ``src`` to ``src + 1``) or
    ``"grad"`` (a gradient, ``src`` to ``src - 1``), of microbatch ``micro``."""

    kind: str
    micro: int
    src: int
    dst: int


def _count(name: str, value, lo: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")
    return int(value)


def split_layers(n_layers: int, pp: int) -> list[range]:
    """The contiguous layer blocks of ``pp`` stages; ``pp`` must divide ``n_layers`` (every stage then
    holds as many layers, so lock-step ticks are balanced in their linear layers)."""
    n_layers, pp = _count("n_layers", n_layers), _count("pp", pp)
    if n_layers % pp:
        raise ValueError(f"pp={pp} must divide the model's {n_layers} layers (stages of equal depth)")
    per = n_layers // pp
    return [range(s * per, (s + 1) * per) for s in range(pp)]


def one_f_one_b(pp: int, n_micro: int) -> list[list[Op]]:
    """Per stage, its 1F1B order: ``w`` warm-up forwards, ``F(w + k), B(k)`` pairs, then the drain."""
    pp, n_micro = _count("pp", pp), _count("n_micro", n_micro)
    orders = []
    for s in range(pp):
        w = min(pp - 1 - s, n_micro)
        ops = [Op("F", i) for i in range(w)]
        for k in range(n_micro - w):
            ops += [Op("F", w + k), Op("B", k)]
        orders.append(ops + [Op("B", i) for i in range(n_micro - w, n_micro)])
    return orders


def lockstep(pp: int, n_micro: int) -> list[Tick]:
    """DistCA's lock-step ticks (``distca/runtime/megatron/forward_backward_func.py``): with
    ``w_s = pp - 1 - s``, warm-up tick ``i < pp - 1`` runs ``F(i - s)``; steady pair ``i`` runs
    ``F(i + w_s)`` then ``B(i - w_s)``; drain tick ``i`` runs ``B(n_micro - w_s + i)``. A microbatch
    outside ``[0, n_micro)`` is a dummy; so any ``n_micro >= 1`` works (with fewer microbatches than
    stages, more of the ticks are dummies, as 1F1B has more bubbles)."""
    pp, n_micro = _count("pp", pp), _count("n_micro", n_micro)

    def tick(phase, micro_of):
        return Tick(phase, tuple(m if 0 <= m < n_micro else None for m in map(micro_of, range(pp))))

    ticks = [tick("F", lambda s, i=i: i - s) for i in range(pp - 1)]
    for i in range(n_micro):
        ticks.append(tick("F", lambda s, i=i: i + pp - 1 - s))
        ticks.append(tick("B", lambda s, i=i: i - (pp - 1 - s)))
    ticks += [tick("B", lambda s, i=i: n_micro - (pp - 1 - s) + i if i < pp - 1 - s else -1)
              for i in range(pp - 1)]
    return ticks


def lockstep_orders(ticks: list[Tick]) -> list[list[Op]]:
    """Per stage, its slots in the lock-step schedule (dummies included)."""
    return [[Op(t.phase, t.micro[s]) for t in ticks] for s in range(len(ticks[0].micro))]


def check_order(orders: list[list[Op]], n_micro: int) -> None:
    """Raise ValueError unless every stage runs ``F(m)`` and ``B(m)`` exactly once for every ``m`` and
    a global order exists that respects the dependencies (F after the previous stage's F, B after
    the next stage's B and after its own F)."""
    pp = len(orders)
    for s, ops in enumerate(orders):
        real = sorted((o.kind, o.micro) for o in ops if o.micro is not None)
        if real != sorted([("F", m) for m in range(n_micro)] + [("B", m) for m in range(n_micro)]):
            raise ValueError(f"stage {s} does not run every microbatch's F and B exactly once")
    done, ptr = set(), [0] * pp
    while any(p < len(o) for p, o in zip(ptr, orders)):
        moved = False
        for s in range(pp):
            while ptr[s] < len(orders[s]):
                kind, m = orders[s][ptr[s]]
                if m is not None:
                    dep = ((s - 1, "F", m) if s else None) if kind == "F" else \
                        ((s + 1, "B", m) if s < pp - 1 else (s, "F", m))
                    if dep is not None and dep not in done:
                        break
                    done.add((s, kind, m))
                ptr[s] += 1
                moved = True
        if not moved:
            waiting = [orders[s][p] if p < len(orders[s]) else None for s, p in enumerate(ptr)]
            raise ValueError(f"the order deadlocks: stages wait at {waiting}")


def _needs(s: int, op: Op, pp: int) -> Msg | None:
    """The message stage ``s`` must receive before ``op``."""
    if op.micro is None:
        return None
    if op.kind == "F":
        return Msg("act", op.micro, s - 1, s) if s > 0 else None
    return Msg("grad", op.micro, s + 1, s) if s < pp - 1 else None


def _makes(s: int, op: Op, pp: int) -> Msg | None:
    """The message ``op`` on stage ``s`` produces for a neighbour."""
    if op.micro is None:
        return None
    if op.kind == "F":
        return Msg("act", op.micro, s, s + 1) if s < pp - 1 else None
    return Msg("grad", op.micro, s, s - 1) if s > 0 else None


def p2p_1f1b(orders: list[list[Op]]) -> list[list[list[Msg]]]:
    """Per stage, the batches it posts: before its op ``k``, one batch with the send of op ``k - 1``'s
    output and the receive of op ``k``'s input (Megatron's ``send_forward_recv_backward`` and
    ``send_backward_recv_forward`` pairings); one last batch after its last op. ``len(orders[s]) + 1``
    batches per stage."""
    pp = len(orders)
    out = []
    for s, ops in enumerate(orders):
        batches, prev = [], None
        for op in ops:
            batches.append([m for m in (prev, _needs(s, op, pp)) if m is not None])
            prev = _makes(s, op, pp)
        batches.append([prev] if prev is not None else [])
        out.append(batches)
    return out


def p2p_lockstep(ticks: list[Tick]) -> list[list[list[Msg]]]:
    """Per stage, per tick, the batch it posts at the boundary before that tick: every message some
    stage needs in that tick, sent then (by a stage that made it in an earlier tick) and received
    then, so that both halves of a message are posted at the same boundary."""
    pp = len(ticks[0].micro)
    out = [[[] for _ in ticks] for _ in range(pp)]
    for t, tick in enumerate(ticks):
        for s in range(pp):
            need = _needs(s, Op(tick.phase, tick.micro[s]), pp)
            if need is not None:
                out[need.dst][t].append(need)
                out[need.src][t].append(need)
    return out


def check_deadlock_free(batches: list[list[list[Msg]]], collectives: bool = False) -> None:
    """Play the stages' batches as NCCL runs them: a stage's batch runs until every message in it has
    met its other half in the peer's running batch (a message completes only while both halves run),
    and the stage posts its next batch only then. ``collectives``: after each batch every stage also
    joins one collective of all stages (a lock-step tick's all-to-alls), so no stage runs ahead of
    another by a batch. Raises ValueError on a deadlock; an empty batch completes at once."""
    pp = len(batches)
    n = [len(b) for b in batches]
    if collectives and len(set(n)) != 1:
        raise ValueError("with collectives every stage must post the same number of batches")
    ptr, done = [0] * pp, set()
    while any(ptr[s] < n[s] for s in range(pp)):
        cur = [set(batches[s][ptr[s]]) if ptr[s] < n[s] else set() for s in range(pp)]
        for s in range(pp):
            for m in cur[s]:
                if m in cur[m.dst if m.src == s else m.src]:
                    done.add(m)
        ready = [s for s in range(pp) if ptr[s] < n[s] and cur[s] <= done]
        if collectives:
            ready = ready if len(set(ptr)) == 1 and len(ready) == pp else []
        if not ready:
            raise ValueError(f"the point-to-point batches deadlock at {ptr}")
        for s in ready:
            ptr[s] += 1

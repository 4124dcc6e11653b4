"""The plumbing of notebook 3.2 (pipeline parallelism), so that its cells stay a few lines: the 1F1B
schedule and DistCA's lock-step ticks as tables a reader can fill in by hand, the step of both in unit
costs, the simulator's 1F1B with one long-document microbatch, and the real run's timeline.

* :func:`one_f_one_b_grid`: Megatron's 1F1B, one column per time unit (a forward lasts ``fwd`` units,
  a backward ``bwd``), and its bubble: with ``p`` stages and ``m`` equal microbatches a stage idles
  ``(p - 1)(f + b)`` of the step's ``(m + p - 1)(f + b)``, a share ``(p - 1) / (m + p - 1)``;
* :func:`lockstep_grid`: DistCA's ticks (:func:`cadlib.core.pipeline.lockstep`), ``·`` for a dummy;
* :func:`unit_steps`: both schedules' steps when each microbatch costs ``linear + attention[i]`` per
  stage (backward ``bwd`` x that): in 1F1B a stage runs its own attention; in a lock-step tick the
  active stages' attention is spread over the GPUs of ALL stages (dummies serve), so a tick lasts
  ``linear + sum(attention of the active stages) / p``;
* :func:`pp_cases`: the same picture at realistic sizes from the simulator's H200 rates;
* :func:`run_losses`, :func:`served_while_idle`: what the real run (``python -m cadlib.train --pp``)
  reports.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd

from ...core.layout import Layout
from ...core.pipeline import lockstep
from ..model import compose, sim
from ..model.idle import pp_timeline
from .toys import check_params


def _schedule(pp: int, n_micro: int) -> None:
    check_params(pp=(pp, isinstance(pp, int) and pp >= 1, "an integer >= 1"),
                 n_micro=(n_micro, isinstance(n_micro, int) and n_micro >= 1, "an integer >= 1"))


def one_f_one_b_grid(pp: int, n_micro: int, fwd: int = 1, bwd: int = 2) -> pd.DataFrame:
    """1F1B of ``n_micro`` equal microbatches on ``pp`` stages as a grid: one row per stage, one column
    per time unit, a cell ``F3`` / ``B3`` while microbatch 3's forward / backward runs there, ``""``
    while the stage idles (the bubble). ``attrs``: ``step`` (units), ``busy`` (per stage) and
    ``bubble`` (idle share of the stages' time)."""
    _schedule(pp, n_micro)
    check_params(fwd=(fwd, isinstance(fwd, int) and fwd >= 1, "an integer >= 1"),
                 bwd=(bwd, isinstance(bwd, int) and bwd >= 1, "an integer >= 1"))
    t = pp_timeline(np.full((pp, n_micro), float(fwd)), np.full((pp, n_micro), float(bwd)), unit=1.0)
    step = int(round(t.end_ms.max()))
    grid = pd.DataFrame("", index=pd.Index([f"stage {s}" for s in range(pp)], name="stage"),
                        columns=range(step))
    for r in t.itertuples():
        grid.iloc[r.stage, int(round(r.start_ms)):int(round(r.end_ms))] = f"{r.phase}{r.microbatch}"
    busy = n_micro * (fwd + bwd)
    grid.attrs.update(step=step, busy=busy, bubble=1 - busy / step)
    return grid


def lockstep_grid(pp: int, n_micro: int) -> pd.DataFrame:
    """DistCA's lock-step ticks as a grid: one row per stage, one column per tick (its phase in the
    header, ``0 F``), a cell ``F3`` / ``B3``, or ``·`` for a dummy (the stage runs no layer of its
    own but its GPU serves the others' attention). ``attrs``: ``ticks`` and ``dummies`` (slots)."""
    _schedule(pp, n_micro)
    ticks = lockstep(pp, n_micro)
    grid = pd.DataFrame({f"{k} {t.phase}": [f"{t.phase}{m}" if m is not None else "·" for m in t.micro]
                         for k, t in enumerate(ticks)},
                        index=pd.Index([f"stage {s}" for s in range(pp)], name="stage"))
    grid.attrs.update(ticks=len(ticks), dummies=int((grid == "·").to_numpy().sum()))
    return grid


def unit_steps(pp: int, attention: Sequence[float], linear: float = 1.0, bwd: float = 2.0) -> pd.DataFrame:
    """The step of 1F1B and of lock-step ticks, microbatch ``i`` costing ``linear + attention[i]`` units
    forward on every stage and ``bwd`` times that backward. 1F1B: :func:`compose.one_f_one_b`. Lock-step:
    tick ``k`` with active stages ``S_k`` lasts ``c (linear + sum_{s in S_k} attention[m_s] / pp)``
    (``c`` = 1 forward, ``bwd`` backward): every GPU, a dummy's too, serves an equal share of the tick's
    attention. One row per lock-step tick (``tick``, ``phase``, ``active``, ``attention``, ``seconds``)
    with ``attrs`` ``one_f_one_b`` and ``lockstep`` (the two steps)."""
    a = np.asarray(attention, dtype=np.float64)
    _schedule(pp, len(a))
    check_params(attention=(list(a), a.ndim == 1 and bool(np.all(a >= 0)), "a list of numbers >= 0"),
                 linear=(linear, linear > 0, "a number > 0"), bwd=(bwd, bwd > 0, "a number > 0"))
    f = np.tile(linear + a, (pp, 1))
    one_f_one_b = compose.one_f_one_b(f, bwd * f)[0]
    rows = []
    for k, t in enumerate(lockstep(pp, len(a))):
        active = [m for m in t.micro if m is not None]
        c = 1.0 if t.phase == "F" else bwd
        pooled = float(a[active].sum()) / pp
        rows.append({"tick": k, "phase": t.phase, "active": len(active), "attention": c * pooled,
                     "seconds": c * (linear + pooled) if active else 0.0})
    out = pd.DataFrame(rows)
    out.attrs.update(one_f_one_b=float(one_f_one_b), lockstep=float(out.seconds.sum()))
    return out


def pp_cases(model, pp_stages: int, n_microbatches: int, microbatch_tokens: int):
    """1F1B on ``pp_stages`` stages at the simulator's H200 rates: equal microbatches of eight short
    documents each, against the same step whose microbatch 0 is one whole document of the same tokens.
    Returns ``(timeline, makespans)``: every op of both cases (``lane``, ``phase``, ``start_ms``,
    ``end_ms``, ``microbatch``, ``case``) and each case's step in seconds; the second case is checked
    against the simulator's own PP entry (:func:`sim.simulate_pp`)."""
    check_params(
        pp_stages=(pp_stages, pp_stages >= 1 and model.n_layers % pp_stages == 0,
                   f"a divisor of n_layers={model.n_layers}"),
        n_microbatches=(n_microbatches, n_microbatches >= 2, "an integer >= 2"),
        microbatch_tokens=(microbatch_tokens, microbatch_tokens >= 8, "an integer >= 8"),
    )
    hw, lps, short = sim.Hardware(), model.n_layers // pp_stages, microbatch_tokens // 8
    cases = {
        "equal microbatches": [[(0, short)] * 8] * n_microbatches,
        "microbatch 0 = one long document": [[(0, 8 * short)]] + [[(0, short)] * 8] * (n_microbatches - 1),
    }
    frames, makespans = [], {}
    for name, mbs in cases.items():
        fwd, bwd = (np.tile([sim.linear_seconds(sum(e - s for s, e in mb), model, hw, ph, lps)
                             + sim.attention_seconds(*zip(*mb), model, hw, ph, lps).sum() for mb in mbs],
                            (pp_stages, 1))
                    for ph in ("fwd", "bwd"))
        t = pp_timeline(fwd, bwd)
        long = (t.microbatch == 0) & name.startswith("microbatch 0")
        t["phase"] = np.where(t.phase == "F", "forward", "backward") + np.where(long, " (long document)", "")
        t["lane"] = "stage " + t.stage.astype(str)
        frames.append(t.assign(case=name))
        makespans[name] = compose.one_f_one_b(fwd, bwd)[0]
    ranks, d = [], 0
    for mb in cases["microbatch 0 = one long document"]:
        ranks.append([(d + k, 0, e - s) for k, (s, e) in enumerate(mb)])
        d += len(mb)
    lens = [e - s for mb in cases["microbatch 0 = one long document"] for s, e in mb]
    pp = sim.simulate_pp(Layout(ranks, lens), model, pp_stages=pp_stages)
    np.testing.assert_allclose(pp.step, makespans["microbatch 0 = one long document"], rtol=1e-9)
    return pd.concat(frames, ignore_index=True), makespans


def run_losses(results) -> dict[str, float]:
    """Each method's loss of the first recorded step of a ``cadlib.train --pp`` run (rank 0's records)."""
    losses: dict[str, float] = {}
    for r in results[0]["records"]:
        losses.setdefault(r["method"], float(r["loss"]))
    return losses


def served_while_idle(run: pd.DataFrame) -> int:
    """How many attention calls ran inside a dummy slot (a stage with nothing of its own to run) in a
    timeline of :func:`cadlib.analysis.model.idle.pipeline_run_timeline`."""
    return int((run.phase == "attention served while idle").sum())

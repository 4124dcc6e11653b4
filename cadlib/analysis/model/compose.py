"""A training step composed from per-rank, per-phase durations: the one composition the simulator and
the scale replay share; they differ only in where the durations come from (the cost model, or
kernels timed on a GPU).

A step of ``L`` identical layers is a sequence of **ticks**. In a tick a rank computes for ``c_r``
seconds on its compute stream while, optionally, a collective (an all-to-all or all-gather) of
``d_r`` seconds runs on its communication stream. A collective cannot finish before every rank has
entered it, so with ``s_r`` the time rank ``r`` starts the tick::

    compute only        e_r = s_r + c_r
    collective alone    e_r = max_r' s_r' + max_r' d_r'                  (one stream: compute waits)
    overlapped          e_r = max(s_r + c_r, max_r' s_r' + max_r' d_r')  (two streams, ping-pong)

and ``s_r`` of the next tick is ``e_r``: every rank waits at every collective for the slowest one,
which is how stragglers propagate. A collective's duration is its bytes over the link
(:class:`Link`: ``latency + max(sent, received) / bandwidth``), per rank; the slowest rank's decides.

The methods (:func:`compose`), per layer, forward then backward in mirror order:

* ``colocated`` / ``wlb`` / ``varlen`` (per-document context parallelism where a document is split): linear (pre), the all-gather of shared
  documents' K, V, attention, linear (post); backward: linear (post'), the all-gather again, attention',
  the reduce-scatter of dK, dV, linear (pre'). One stream.
* ``cad``: linear, send (all-to-all), attention on the servers, return, linear; backward: return'
  (dO out), attention', send' (dQ, dK, dV back). One stream.
* ``cad-pingpong`` / ``signal-only``: DistCA's tick order with two nano-batches A and B
  (:mod:`cadlib.runtime.pingpong`): tick 1 linear B beside send A, tick 2 attention A beside send B,
  tick 3 attention B beside return A, tick 4 linear A beside return B; the backward the mirror image.
  ``signal-only`` is the same schedule with every collective cut to its latency.

Then the LM head (forward and backward), the gradient all-reduce and the optimizer step. What this
cannot see is said where its numbers are shown: NCCL kernels slowing the compute beside them (2-4%
measured on 2x H200), host launch gaps, and memory.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...core import pipeline
from ...core.methods import method as find_method


@dataclass(frozen=True)
class Link:
    """A collective's cost per rank: ``latency_s + max(sent, received) / (gbps * 1e9)``."""

    gbps: float
    latency_s: float = 0.0
    name: str = ""

    def __post_init__(self):
        if not self.gbps > 0:
            raise ValueError(f"Link.gbps must be > 0 (GB/s), got {self.gbps}")
        if not self.latency_s >= 0:
            raise ValueError(f"Link.latency_s must be >= 0, got {self.latency_s}")

    def seconds(self, sent, received=None) -> np.ndarray:
        """Per rank; 0 where a rank moves nothing and no rank does (a skipped collective)."""
        s = np.asarray(sent, dtype=np.float64)
        r = s if received is None else np.asarray(received, dtype=np.float64)
        t = np.maximum(s, r) / (self.gbps * 1e9)
        return np.where((s + r).sum() > 0, t + self.latency_s, 0.0)


@dataclass
class Phases:
    """Per-rank durations of one layer, seconds (arrays over ranks; ping-pong's are ``[2, R]``: nano-batch
    A, then B). ``pre``/``post``: the linear layers before and after core attention (forward);
    ``*_bwd`` their backward (recompute included). ``attn``/``attn_bwd``: core attention. ``comm_in`` /
    ``comm_out`` (forward) and ``comm_in_bwd`` / ``comm_out_bwd`` (backward): the collectives before and
    after attention, per rank (already through a :class:`Link`). ``head``: embedding, final norm, LM head
    and loss, forward and backward; ``optimizer``; ``allreduce``: the gradient all-reduce."""

    pre: np.ndarray
    post: np.ndarray
    pre_bwd: np.ndarray
    post_bwd: np.ndarray
    attn: np.ndarray
    attn_bwd: np.ndarray
    comm_in: np.ndarray
    comm_out: np.ndarray
    comm_in_bwd: np.ndarray
    comm_out_bwd: np.ndarray
    head: np.ndarray
    optimizer: np.ndarray | float = 0.0
    allreduce: np.ndarray | float = 0.0

    def __post_init__(self):
        for f in self.__dataclass_fields__:
            v = np.asarray(getattr(self, f), dtype=np.float64)
            if np.any(v < 0) or not np.all(np.isfinite(v)):
                raise ValueError(f"Phases.{f} must be finite and >= 0")
            setattr(self, f, v)

    @property
    def n_ranks(self) -> int:
        return int(self.head.size)


@dataclass
class Composed:
    """A composed step: ``step`` seconds, each rank's ``busy`` time (compute plus the communication
    it could not hide), its ``idle`` time (waiting for others) and where the time went."""

    method: str
    step: float
    busy: np.ndarray
    breakdown: dict[str, float] = field(default_factory=dict)

    @property
    def idle(self) -> np.ndarray:
        return np.maximum(self.step - self.busy, 0.0)

    @property
    def idle_fraction(self) -> float:
        """``sum_r idle_r / (R step)``: the share of the GPUs' time spent waiting."""
        return float(self.idle.sum() / (self.busy.size * self.step)) if self.step > 0 else 0.0


class _Clock:
    """Per-rank clocks advanced tick by tick (see the module docstring), with each rank's busy time
    (its compute, and a collective's time where it exceeds the compute beside it) and the exposed
    communication of the slowest rank."""

    def __init__(self, n: int):
        self.t = np.zeros(n)
        self.busy = np.zeros(n)
        self.exposed = 0.0

    def tick(self, c, d=0.0) -> None:
        """Compute ``c`` per rank, beside a collective of ``d`` per rank (``c = 0``: the collective alone)."""
        c = np.broadcast_to(np.asarray(c, dtype=np.float64), self.t.shape)
        coll = float(np.max(d)) if np.size(d) else 0.0
        if coll <= 0:
            self.t = self.t + c
            self.busy = self.busy + c
            return
        start = float(self.t.max())
        end = np.maximum(self.t + c, start + coll)
        self.exposed += float(max(0.0, end.max() - (self.t + c).max()))
        self.busy = self.busy + np.maximum(c, coll)
        self.t = end


def _ticks(ph: Phases, L: int, pingpong: bool) -> list[tuple]:
    """One step's layers as ticks ``(compute, comm, compute', comm')``: forward in list order, the
    backward in reverse order with the primed entries (each forward tick's mirror)."""
    z = 0.0
    if not pingpong:
        layer = [(ph.pre, z, ph.pre_bwd, z), (z, ph.comm_in, z, ph.comm_in_bwd), (ph.attn, z, ph.attn_bwd, z),
                 (z, ph.comm_out, z, ph.comm_out_bwd), (ph.post, z, ph.post_bwd, z)]
        return layer * L
    a, b = 0, 1
    out = [(ph.pre[a], z, ph.pre_bwd[a], z)]                                   # tick 0
    for i in range(L):
        first, last = i == 0, i + 1 == L
        out += [(ph.pre[b] + (z if first else ph.post[b]), ph.comm_in[a],      # tick 1: linear B | send A
                 ph.pre_bwd[b] + (z if first else ph.post_bwd[b]), ph.comm_in_bwd[a]),
                (ph.attn[a], ph.comm_in[b], ph.attn_bwd[a], ph.comm_in_bwd[b]),  # tick 2: attention A | send B
                (ph.attn[b], ph.comm_out[a], ph.attn_bwd[b], ph.comm_out_bwd[a]),  # tick 3: attention B | return A
                (ph.post[a] + (z if last else ph.pre[a]), ph.comm_out[b],        # tick 4: linear A | return B
                 ph.post_bwd[a] + (z if last else ph.pre_bwd[a]), ph.comm_out_bwd[b])]
    return out + [(ph.post[b], z, ph.post_bwd[b], z)]


def compose(method: str, ph: Phases, n_layers: int) -> Composed:
    """The step time of ``method`` from one layer's per-rank :class:`Phases` over ``n_layers`` layers:
    the forward ticks, the LM head, the backward ticks in mirror order, the all-reduce, the optimizer."""
    pingpong = find_method(method).pingpong            # ValueError naming the methods
    if isinstance(n_layers, bool) or int(n_layers) != n_layers or n_layers < 1:
        raise ValueError(f"n_layers must be an integer >= 1, got {n_layers!r}")
    if pingpong != (ph.attn.ndim == 2):
        raise ValueError(f"method {method!r} needs {'[2, R] (two nano-batches)' if pingpong else '[R]'} "
                         f"phases, got attention of shape {ph.attn.shape}")
    ticks = _ticks(ph, int(n_layers), pingpong)
    clk = _Clock(ph.n_ranks)
    for c, d, _, _ in ticks:
        clk.tick(c, d)
    clk.tick(ph.head)
    for _, _, c, d in reversed(ticks):
        clk.tick(c, d)
    clk.tick(0.0, ph.allreduce)
    clk.tick(ph.optimizer)
    attn = (ph.attn + ph.attn_bwd).sum(0) if pingpong else ph.attn + ph.attn_bwd
    return Composed(method, float(clk.t.max()), clk.busy,
                    {"exposed_comm_s": clk.exposed, "attention_max_s": float(attn.max()) * n_layers,
                     "attention_mean_s": float(attn.mean()) * n_layers})


# ---------------------------------------------------------------------------------------------------
# Pipeline parallelism: 1F1B of per-op durations, and CAD's lock-step ticks
# ---------------------------------------------------------------------------------------------------

def compose_pass(method: str, ph: Phases, n_layers: int, backward: bool = False):
    """One pass (forward or backward) of ``n_layers`` layers from a common start: each rank's end time,
    its busy time and the exposed communication (the ticks of :func:`compose`, without the head,
    the all-reduce and the optimizer)."""
    ticks = _ticks(ph, int(n_layers), find_method(method).pingpong)
    clk = _Clock(ph.n_ranks)
    for c, d, cb, db in (reversed(ticks) if backward else ticks):
        clk.tick(cb, db) if backward else clk.tick(c, d)
    return clk.t, clk.busy, clk.exposed


def one_f_one_b(fwd: np.ndarray, bwd: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """Event simulation of 1F1B (PipeDream-flush) for ``fwd[s, i]``, ``bwd[s, i]`` seconds of
    microbatch ``i`` on stage ``s``. Stage ``s`` runs ``w = min(p-s-1, m)`` warm-up forwards, then
    alternates ``F(w+k), B(k)``, then drains the remaining backwards; an op starts when its stage is
    free and its dependency has ended (``F(s-1, i)`` for a forward, ``B(s+1, i)`` for a backward).
    Returns ``(makespan, f_end, b_end)``."""
    fwd, bwd = np.asarray(fwd, dtype=np.float64), np.asarray(bwd, dtype=np.float64)
    if fwd.ndim != 2 or fwd.shape != bwd.shape or fwd.size == 0:
        raise ValueError(f"fwd and bwd must be equal non-empty [stages, microbatches] arrays, "
                         f"got {fwd.shape} and {bwd.shape}")
    if np.any(fwd < 0) or np.any(bwd < 0):
        raise ValueError("fwd and bwd times must be >= 0")
    p, m = fwd.shape
    orders = [[tuple(op) for op in ops] for ops in pipeline.one_f_one_b(p, m)]
    f_end, b_end = np.full((p, m), np.nan), np.full((p, m), np.nan)
    free, ptr, left = np.zeros(p), [0] * p, 2 * p * m
    while left:
        progressed = False
        for s in range(p):
            while ptr[s] < len(orders[s]):
                kind, i = orders[s][ptr[s]]
                if kind == "F":
                    dep = 0.0 if s == 0 else f_end[s - 1, i]
                else:
                    dep = f_end[s, i] if s == p - 1 else b_end[s + 1, i]
                if np.isnan(dep):
                    break
                start = max(free[s], dep)
                free[s] = start + (fwd if kind == "F" else bwd)[s, i]
                (f_end if kind == "F" else b_end)[s, i] = free[s]
                ptr[s] += 1
                left -= 1
                progressed = True
        if not progressed:  # cannot happen for the 1F1B order; guards against editing mistakes
            raise RuntimeError("1F1B simulation deadlocked")
    return float(b_end[0].max()), f_end, b_end


def compose_lockstep(method: str, ticks, n_layers: int, allreduce, optimizer, p2p=0.0) -> Composed:
    """CAD under pipeline parallelism: lock-step ticks (:func:`cadlib.core.pipeline.lockstep`), each
    ``(phase, Phases, head)`` over EVERY rank of every stage (a dummy stage's ranks with zero linear
    work, serving attention), ``head`` the per-rank LM head of the tick (forward or backward; zero
    but on the last stage). Every layer's all-to-all spans all ranks, so a tick ends for all at
    once; ``p2p`` (per rank) precedes each tick. Then the all-reduce and the optimizer."""
    clk = None
    for phase, ph, head in ticks:
        if clk is None:
            clk = _Clock(ph.n_ranks)
        clk.tick(p2p)
        ts = _ticks(ph, int(n_layers), find_method(method).pingpong)
        if phase == "F":
            for c, d, _, _ in ts:
                clk.tick(c, d)
            clk.tick(head)
        else:
            clk.tick(head)
            for _, _, c, d in reversed(ts):
                clk.tick(c, d)
    clk.tick(0.0, allreduce)
    clk.tick(optimizer)
    return Composed(method, float(clk.t.max()), clk.busy, {"exposed_comm_s": clk.exposed})

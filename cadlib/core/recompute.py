"""Recompute only where memory needs it: the least recompute with which a training run fits its GPU,
by the memory model (:mod:`cadlib.core.memory`; ``python -m cadlib.train --recompute auto``).

Recomputing the MLP in the backward costs its forward again, a third more of the layer's GEMMs. A run
takes it only when the model's peak without it would pass ``HEADROOM`` of the GPU's memory::

    recompute = the first r of ("none", "mlp") with  max_{method, stage} peak(r)  <=  HEADROOM * capacity

(``mlp`` when neither fits: the run may then fail for memory, as it would have). Each method's rows on
one GPU: per-document CP (colocated, WLB) at its worst, a document over every rank, its K and V
re-gathered for the backward; CAD's servers keep received rows, ``call_kv`` KV rows per query row
(:func:`cadlib.core.memory.method_rows`), two nano-batches under ping-pong; pipeline stages with their
micro-batches in flight (1F1B, or DistCA's lock-step ticks for the CAD methods).
"""
from __future__ import annotations

from .cost import ModelSpec, as_model
from .memory import GIB, OURS, OURS_FUSED, Rows, estimate, method_rows
from .methods import METHODS

CHOICES = ("none", "mlp")
"""What our trainer can recompute, least first (:data:`cadlib.runtime.model.RECOMPUTE`)."""
HEADROOM = 0.9
"""The share of the GPU's memory the modelled peak may take. The model's largest error against the
committed measured peaks is 5.5% (``results/memory_model_check.json``, ``max_abs_record_err``) and it
counts allocated bytes, not the caching allocator's reserve; 10% covers both."""
def method_nanos(method: str, tokens: int, world: int, profile) -> list[Rows]:
    """The (nano-)batches of ``method`` (:data:`cadlib.core.methods.METHODS`) on one GPU holding ``tokens``
    of a step over ``world`` GPUs."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from: {', '.join(METHODS)}")
    m = METHODS[method]
    if m.cad:
        return method_rows("cad", tokens, profile=profile, pingpong=m.pingpong)
    return [Rows.per_doc_cp(tokens, (world - 1) * tokens, profile)]


def least_recompute(spec: "ModelSpec | str", methods, tokens: int, world: int, capacity: float | None, *,
                    pp: int = 1, n_micro: int = 1, ce_chunk: int = 8192, fused: bool = True,
                    headroom: float = HEADROOM) -> dict:
    """The least of :data:`CHOICES` whose peak fits ``headroom * capacity`` bytes for every method and
    pipeline stage (``capacity`` None: no device memory to fit, ``none``). ``fused``: the fused blocks'
    profile (:data:`cadlib.core.memory.OURS_FUSED`), else the references' (``OURS``). Returns
    ``{"recompute", "fits", "capacity_gib", "headroom", "profile", "peak_gib": {choice: {method: GiB}}}``."""
    spec, profile = as_model(spec), OURS_FUSED if fused else OURS
    if not 0 < headroom <= 1:
        raise ValueError(f"headroom must be in (0, 1]; got {headroom}")
    out = {"capacity_gib": None if capacity is None else capacity / GIB, "headroom": headroom,
           "profile": profile.name, "peak_gib": {}}
    if capacity is None:
        return {**out, "recompute": "none", "fits": True}
    dp = world // pp
    for rc in CHOICES:
        peaks = {}
        for m in methods:
            nanos = method_nanos(m, tokens, dp, profile)
            sched = "lockstep" if METHODS[m].cad and pp > 1 else "1f1b"
            peaks[m] = max(estimate(spec, nanos, recompute=rc, profile=profile, pp=pp, stage=s,
                                    n_micro=n_micro, dp=dp, ce_chunk=ce_chunk, schedule=sched)["peak"]
                           for s in range(pp)) / GIB
        out["peak_gib"][rc] = peaks
        if max(peaks.values()) <= headroom * capacity / GIB:
            return {**out, "recompute": rc, "fits": True}
    return {**out, "recompute": CHOICES[-1], "fits": False}

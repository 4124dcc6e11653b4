"""How the replay prices a server call nobody timed, and how well it does: the calls a cache holds as
timed (:func:`timed_calls`), the kernel latency table's error on them, as one scale
(:func:`kernel_model_check`) or per call (:func:`call_model`), the calls priced that way
(:func:`modelled_calls`; with one scale, :func:`cadlib.analysis.replay.times.model_attention_times`),
and the screen for calls timed without a warm-up whose time is a first-run outlier
(:func:`unwarmed_outliers`).

The per-call model, per direction (forward, backward)::

    t_bwd = a x table + b + c x rows / 1000
    t_fwd = a x table + b + c x rows / 1000 + d x longest_kv / 1000

with ``table`` the kernel table's time of the call's merged segments (ms), ``b`` what a served call
pays beside its kernel (its stage's launches), ``rows`` the rows it copies out of its buffers
(:meth:`cadlib.dispatch.meta.Dispatch.gathered_rows`) and ``longest_kv`` the KV length of its longest
segment: the forward's critical path, since the query tile at the end of that segment reads the whole
prefix in one thread block, however many other segments the call holds (the table, a sum over
segments, prices the segments' work, not the tail they leave). Fitted by least squares on the timed
calls. What the term buys is measured with the what-if against the replay (:func:`_call_rows`).
The replay prices its untimed calls with it (``bench_replay.py compose --model-missing``), the what-if
every call (:mod:`cadlib.analysis.whatif.price`)."""
from __future__ import annotations

import numpy as np

from ...core.measured import MeasuredCost
from .phases import batch_work
from .times import attention_jobs, model_attention_times


def table_ms(d, spec, cost: MeasuredCost, direction: str = "fwd_bwd") -> float:
    """The kernel table's time (ms) of dispatch ``d``'s merged call, in ``direction``."""
    sh = d.shared()
    return cost.fused_seconds(np.diff(sh.cu_q), np.diff(sh.cu_k), direction, spec) * 1e3


def timed_calls(settings_, times: dict, backend: str, rates: dict, batches: int = 2, per_work: bool = False):
    """The server calls of the first ``batches`` batches of each setting that ``times`` holds as timed (not
    ``"modelled"``), as ``(setting, work key, dispatch, timing)``: each distinct call of a batch once, or
    with ``per_work`` once per work that makes it (its method's, ``work key``; else None)."""
    for s in settings_:
        for b in range(min(batches, s.batches)):
            works = batch_work(s, b, rates)
            groups = [(key, [w]) for key, w in works.items()] if per_work else [(None, works.values())]
            for key, ws in groups:
                for k, d in attention_jobs(ws, s.spec, backend).items():
                    t = times.get(k)
                    if t is not None and not t.get("modelled"):
                        yield s, key, d, t


def kernel_model_check(settings_, times: dict, cost, backend: str, rates: dict, batches: int = 2) -> dict:
    """How well the kernel table predicts the calls the replay timed, over the timed calls of the first
    ``batches`` batches of each setting: measured / predicted (forward + backward), time-weighted (the
    ``scale`` :func:`cadlib.analysis.replay.times.model_attention_times` applies), its median, 10th and
    90th percentiles, the calls."""
    meas, pred = [], []
    for s, _, d, t in timed_calls(settings_, times, backend, rates, batches):
        meas.append(t["fwd_ms"] + t["bwd_ms"])
        pred.append(table_ms(d, s.spec, cost))
    m, p = np.array(meas), np.array(pred)
    if not m.size:
        raise ValueError(f"no timed {backend} call among these settings to check the kernel table against")
    r = m / p
    return {"calls": int(m.size), "scale": float(m.sum() / p.sum()), "median": float(np.median(r)),
            "p10": float(np.percentile(r, 10)), "p90": float(np.percentile(r, 90)), "backend": backend}


UNWARMED_LIMIT = 1.6
"""A call timed without a warm-up (``bench_replay.py time --warmup 0``) whose time is over this many times
the kernel table's is a first-run outlier, not the kernel: the warmed-up calls of the paper's protocol
reach at most 1.33x the table (1,108 calls), while unwarmed ones that caught an allocation or a cold start
reached 1.8-30x. :func:`unwarmed_outliers` screens them; the merge drops them, so the replay prices those
calls as it prices the untimed ones."""


def unwarmed_outliers(settings_, times: dict, cost, backend: str, rates: dict,
                      limit: float = UNWARMED_LIMIT) -> list[str]:
    """The keys of every batch's calls timed without a warm-up (``"warmup": 0``) whose forward plus
    backward exceeds ``limit`` times the kernel table's."""
    out = set()
    for s in settings_:
        for b in range(s.batches):
            for k, d in attention_jobs(batch_work(s, b, rates).values(), s.spec, backend).items():
                t = times.get(k)
                if t is None or t.get("modelled") or t.get("warmup", 1) != 0 or k in out:
                    continue
                if t["fwd_ms"] + t["bwd_ms"] > limit * table_ms(d, s.spec, cost):
                    out.add(k)
    return sorted(out)


def _call_rows(d, spec, cost: MeasuredCost, direction: str) -> list[float]:
    """A server call's regressors in :func:`call_model`: the table's time (ms), 1, gathered rows / 1000,
    and in the forward the longest segment's KV length / 1000. That last term, measured with the what-if
    against the replay (the worst setting's speedup of CAD with ping-pong over WLB-ideal; each family's
    model fitted on all its timed calls): the paper protocol's fully timed batches 0.025 -> 0.017, FA4
    under our earlier protocol 0.017 -> 0.014, FA2 there 0.023 -> 0.023 (on its first timings; with its
    calls timed again with the pool, 0.0199 with the term). In the backward the same kind of term (the
    longest query run) made FA2 worse (0.025 against 0.023, fitted on two batches), so the backward has
    none."""
    x = [table_ms(d, spec, cost, direction), 1.0, sum(d.gathered_rows()) / 1e3]
    if direction == "fwd":
        x.append(float(np.diff(d.shared().cu_k).max()) / 1e3)
    return x


def _lstsq(xs, ys) -> list[float]:
    return [float(c) for c in np.linalg.lstsq(np.asarray(xs), np.asarray(ys), rcond=None)[0]]


def call_model(settings_, times: dict, cost: MeasuredCost, backend: str, rates: dict,
               batches: int = 2) -> dict:
    """The kernel table's error per server call, fitted by least squares over the timed calls of the
    first ``batches`` batches of ``settings_``, per direction: ``t = a x table + b + c x rows / 1000``
    (the module docstring; the forward has a fourth term). The table prices the kernel alone; a served
    call also launches its stage and gathers its shards' buffers, which one scale per method only stood
    in for (on the committed FA2 timings it underpriced 5-20 ms calls by 17% and 300 ms ones by 1%). One
    fit for every method: fitted per method instead, the what-if's speedups over WLB-ideal moved further
    from the replay's (0.036 against 0.023 at most, FA2, 18 settings). Returns ``{"fwd": [a, b, c, d],
    "bwd": [a, b, c], "calls": n}``."""
    xs: dict = {"fwd": [], "bwd": []}
    ys: dict = {"fwd": [], "bwd": []}
    for s, _, d, t in timed_calls(settings_, times, backend, rates, batches):
        for f in ("fwd", "bwd"):
            xs[f].append(_call_rows(d, s.spec, cost, f))
            ys[f].append(t[f"{f}_ms"])
    if not ys["fwd"]:
        raise ValueError(f"no timed {backend} call among these settings to fit the kernel table to")
    return {**{f: _lstsq(xs[f], ys[f]) for f in ("fwd", "bwd")}, "calls": len(ys["fwd"])}


def modelled_calls(works, spec, backend: str, cost: MeasuredCost, model: dict) -> dict:
    """Every server call of ``works`` priced by :func:`call_model`'s ``model`` (never below 0)."""
    out = {}
    for k, d in attention_jobs(works, spec, backend).items():
        t = {}
        for f in ("fwd", "bwd"):
            x = _call_rows(d, spec, cost, f)
            coef = model[f]                 # a forward fitted before its fourth term prices with three
            t[f"{f}_ms"] = max(0.0, float(np.dot(coef, x[:len(coef)])))
        out[k] = {**t, "modelled": True}
    return out


def price_untimed(works: dict, spec, backend: str, cost: MeasuredCost, model,
                  times: dict | None = None) -> dict:
    """The server calls of ``works`` (by method) that ``times`` lacks or holds as modelled, priced from
    the kernel table: by :func:`call_model`'s ``model`` (a dict) or scaled by one number (``model`` a float,
    :func:`cadlib.analysis.replay.times.model_attention_times`). Each marked ``"modelled"``."""
    ws = works.values()
    got = (modelled_calls(ws, spec, backend, cost, model) if isinstance(model, dict)
           else model_attention_times(ws, spec, backend, cost, float(model)))
    return {k: t for k, t in got.items() if times is None or k not in times or times[k].get("modelled")}

"""What the scale replay times, and how its cache becomes durations (:mod:`cadlib.analysis.replay.settings`).

Every timed quantity has a key made of the call's shape: the model's widths and the kernel
(:func:`spec_key`), then a server's fused call by its merged segments (:func:`attention_key`), or a
token count for the linear layers, the head and the optimizer (:func:`linear_key`, :func:`head_key`,
:func:`optimizer_key`; the linear layers and the head also by how they were computed, one of
:data:`LINEAR_VARIANTS`). Identical shapes are timed once. The linear layers and the head are timed on
``LINEAR_GRID`` and interpolated (:func:`interp`); a backend that was not timed is derived from one
that was by their fitted ratio (:func:`derive_backend`), and server calls nobody timed can be priced
from a kernel latency table (:func:`model_attention_times`).
"""
from __future__ import annotations

import hashlib

import numpy as np

from ...core.cost import ModelSpec
from ...dispatch.meta import Dispatch

DTYPE = "bf16"

LINEAR_GRID = (4096, 8192, 16384, 32768, 49152, 65536, 81920, 98304, 114688, 131072, 147456, 163840,
               196608, 262144)
"""Token counts at which the linear layers and the LM head are timed; other counts are interpolated
linearly between the two nearest (their time is linear in tokens above a few thousand)."""


def _digest(*parts) -> str:
    h = hashlib.sha1()
    for p in parts:
        a = np.ascontiguousarray(np.asarray(p, dtype=np.int64))
        h.update(str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()[:20]


def spec_key(spec: ModelSpec, backend: str, dtype: str = DTYPE) -> str:
    """The part of a key the model's shapes and the kernel give: heads, head_dim, widths, backend."""
    return (f"{backend}|{dtype}|h{spec.n_heads}/{spec.n_kv_heads}x{spec.head_dim}|d{spec.hidden}"
            f"|f{spec.ffn}|v{spec.vocab}")


def attention_key(d: Dispatch, spec: ModelSpec, backend: str) -> str | None:
    """The key of a server's fused call: its merged segments, whether it reads its buffers in place,
    and their sizes (identical shapes are timed once); None for a server with no task."""
    if d.n_tasks == 0:
        return None
    sh = d.shared()
    flags = [int(d.q_identity), int(sh.kv_identity), int(sh.all_once), d.q_keep + d.n_recv_q,
             d.n_local + d.n_recv_kv, int(d.cu_q[-1]), *d.gathered_rows()]
    return "attn|" + spec_key(spec, backend) + "|" + _digest(sh.cu_q, sh.cu_k, flags)


def attention_jobs(works, spec: ModelSpec, backend: str) -> dict[str, Dispatch]:
    """Every distinct server call of some works: ``{key: dispatch}``."""
    jobs = {}
    for w in works:
        for ds in w.dispatch:
            for d in ds:
                k = attention_key(d, spec, backend)
                if k is not None and k not in jobs:
                    jobs[k] = d
    return jobs


LINEAR_VARIANTS = {
    "": "the reference blocks (cadlib.runtime.blocks), every token of the TP group through the norms "
        "and residuals: the committed timings",
    "fused-sp": "the fused blocks (cadlib.runtime.fused, fused_head) under Megatron's sequence "
                "parallelism: norms and residuals on tokens / tp, GEMMs on the group's tokens "
                "(cadlib.bench.shard.LocalSP)",
}
"""How a timed layer and head computed: the key's variant. Both recompute the MLP, as DistCA's runs do."""


def _variant(variant: str, tp: int) -> str:
    if variant not in LINEAR_VARIANTS:
        raise ValueError(f"unknown linear variant {variant!r}; choose one of: "
                         f"{', '.join(repr(v) for v in LINEAR_VARIANTS)}")
    return f"@{variant}/tp{int(tp)}" if variant else ""


def linear_key(spec: ModelSpec, backend: str, n: int, variant: str = "", tp: int = 1) -> str:
    """The key of one layer's linear parts at ``n`` tokens (of a TP group of ``tp``) computed the
    ``variant`` way; ``variant=""`` gives the committed keys, ``linear|<spec>|<n>``."""
    return f"linear{_variant(variant, tp)}|{spec_key(spec, backend)}|{int(n)}"


def head_key(spec: ModelSpec, backend: str, n: int, variant: str = "", tp: int = 1) -> str:
    """The key of the embedding, final norm, LM head and loss at ``n`` tokens (as :func:`linear_key`)."""
    return f"head{_variant(variant, tp)}|{spec_key(spec, backend)}|{int(n)}"


def optimizer_key(spec: ModelSpec, backend: str) -> str:
    return f"optimizer|{spec_key(spec, backend)}|L{spec.n_layers}"


def grid_points(tokens) -> list[int]:
    """The points of ``LINEAR_GRID`` that interpolating (or extrapolating, past its end) every token
    count of ``tokens`` needs."""
    t = np.asarray(tokens, dtype=np.int64).ravel()
    g = np.asarray(LINEAR_GRID)
    lo = np.clip(np.searchsorted(g, t, side="right") - 1, 0, g.size - 2)
    return sorted({int(x) for x in np.concatenate([g[lo], g[lo + 1]])})


def interp(cache: dict, key_of, tokens, field_: str) -> np.ndarray:
    """A timed quantity (``field_`` of ``cache[key_of(n)]``, ms) at every token count, seconds: linear
    between the grid points that were timed (past the last, along the last segment), proportional to
    the tokens below the first one."""
    t = np.asarray(tokens, dtype=np.float64)
    g = np.array([n for n in LINEAR_GRID if key_of(n) in cache], dtype=np.float64)
    if g.size < 2:
        raise ValueError(f"fewer than two grid points timed for {key_of(0).rsplit('|', 1)[0]}")
    val = np.array([cache[key_of(int(n))][field_] for n in g])
    lo = np.clip(np.searchsorted(g, t, side="right") - 1, 0, g.size - 2)
    w = (t - g[lo]) / (g[lo + 1] - g[lo])
    v = np.where(t < g[0], val[0] * t / g[0], val[lo] + w * (val[lo + 1] - val[lo]))
    return np.where(t > 0, v * 1e-3, 0.0)


def scaled(times: dict, factor: float) -> dict:
    """``times`` with every duration (``ms`` and ``*_ms`` fields) multiplied by ``factor``: the same
    shapes on a GPU that computes ``factor`` times slower."""
    if not factor > 0:
        raise ValueError(f"factor must be > 0, got {factor!r}")
    return {k: {f: v * factor if (f == "ms" or f.endswith("_ms")) and isinstance(v, (int, float)) else v
                for f, v in e.items()} for k, e in times.items()}


def compile_suspects(times: dict, min_ms: float = 20.0) -> list[str]:
    """Timed attention calls whose times look like a kernel compile rather than the kernel: a call's
    backward takes 2-3.5x its forward (median 2.5 over the cache), and a compile adds seconds to whichever
    pass triggered it, so the screen is a pass over ``min_ms`` with the backward under 1.6x the forward
    or over 5x it. A screen, not a verdict: ``scripts/bench/bench_replay.py time --retime`` times them again."""
    out = []
    for k, e in times.items():
        if not e or "fwd_ms" not in e or e.get("modelled") or e.get("warmup"):
            continue
        f, b = e["fwd_ms"], e["bwd_ms"]
        if (f > min_ms and b < 1.6 * f) or (b > min_ms and b > 5 * f):
            out.append(k)
    return sorted(out)


def derive_backend(times: dict, target: str, source: str) -> tuple[dict, dict]:
    """``times`` completed for backend ``target`` from ``source`` where ``target`` was not timed: the
    linear layers, the head and the optimizer copied (they do not depend on the attention kernel), each
    attention call scaled by the time ratio ``target / source`` fitted over the calls timed with both
    (forward and backward apart, weighted by time). Returns the completed times and the fit:
    ``{"shapes_both", "ratio_fwd", "ratio_bwd", "derived"}``."""
    tag_s, tag_t = f"|{source}|", f"|{target}|"
    both = [(times[k], times[k.replace(tag_s, tag_t, 1)]) for k in times
            if k.startswith("attn" + tag_s) and k.replace(tag_s, tag_t, 1) in times]
    if not both:
        raise ValueError(f"no attention shape is timed with both {source!r} and {target!r}: nothing to fit")
    rf = sum(t["fwd_ms"] for _, t in both) / sum(s_["fwd_ms"] for s_, _ in both)
    rb = sum(t["bwd_ms"] for _, t in both) / sum(s_["bwd_ms"] for s_, _ in both)
    out, derived = dict(times), 0
    for k, v in times.items():
        if tag_s not in k:
            continue
        kt = k.replace(tag_s, tag_t, 1)
        if kt in times:
            continue
        if k.startswith("attn|"):
            out[kt] = {"fwd_ms": v["fwd_ms"] * rf, "bwd_ms": v["bwd_ms"] * rb, "derived_from": source}
            derived += 1
        else:
            out[kt] = dict(v)
    return out, {"shapes_both": len(both), "ratio_fwd": rf, "ratio_bwd": rb, "derived": derived,
                 "source": source, "target": target}


def model_attention_times(works, spec: ModelSpec, backend: str, cost, scale: float = 1.0,
                          times: dict | None = None) -> dict:
    """Times for the server calls of ``works`` that ``times`` lacks, from a kernel latency table
    (:class:`cadlib.core.measured.MeasuredCost`, on the merged segments) times ``scale`` (measured over
    predicted on the calls the replay timed, :func:`cadlib.analysis.replay.calls.kernel_model_check`);
    each marked ``"modelled"``."""
    out = {}
    for k, d in attention_jobs(works, spec, backend).items():
        if times is not None and k in times:
            continue
        sh = d.shared()
        q, kv = np.diff(sh.cu_q), np.diff(sh.cu_k)
        out[k] = {"fwd_ms": cost.fused_seconds(q, kv, "fwd", spec) * 1e3 * scale,
                  "bwd_ms": cost.fused_seconds(q, kv, "bwd", spec) * 1e3 * scale, "modelled": True}
    return out


def segments_key(q, kv, spec: ModelSpec, backend: str) -> str:
    """The key of a fused call given by its merged segments alone (query and KV lengths, causal,
    bottom-right aligned): the pipeline replay's server calls (:mod:`cadlib.analysis.replay.pipelined`)."""
    return "seg|" + spec_key(spec, backend) + "|" + _digest(q, kv)


def key_for_backend(key: str, backend: str) -> str:
    """A :func:`segments_key` recorded for FA4 (the sample's backend) as the same call on ``backend``."""
    return key.replace("|fa4|", f"|{backend}|", 1)


class SegmentPrice:
    """Forward and backward seconds of a fused call on its merged segments: timed where ``times``
    holds the call's :func:`segments_key`, else the kernel latency table ``cost`` times ``scale``
    (measured over predicted on timed calls). Counts how many calls were priced each way; with
    ``record``, keeps every distinct call's segments and modelled seconds in ``shapes`` (what
    ``scripts/bench/bench_replay.py shapes4d`` samples for timing)."""

    def __init__(self, spec: ModelSpec, backend: str, cost, scale: float = 1.0, times: dict | None = None,
                 record: bool = False):
        self.spec, self.backend, self.cost, self.scale = spec, backend, cost, float(scale)
        self.times = times or {}
        self.record = record
        self.shapes: dict[str, dict] = {}
        self.timed = self.modelled = 0

    def seconds(self, q, kv) -> tuple[float, float]:
        k = segments_key(q, kv, self.spec, self.backend)
        t = self.times.get(k)
        if t is not None and not t.get("modelled"):
            self.timed += 1
            return t["fwd_ms"] * 1e-3, t["bwd_ms"] * 1e-3
        self.modelled += 1
        f = float(self.cost.fused_seconds(q, kv, "fwd", self.spec))
        b = float(self.cost.fused_seconds(q, kv, "bwd", self.spec))
        if self.record and k not in self.shapes:
            self.shapes[k] = {"q": np.asarray(q, dtype=np.int64).tolist(),
                              "kv": np.asarray(kv, dtype=np.int64).tolist(), "model_ms": (f + b) * 1e3}
        return f * self.scale, b * self.scale


def segment_model_check(times: dict, shapes: dict, cost, spec: ModelSpec, backend: str) -> dict | None:
    """The kernel table against the sampled pipeline-replay calls that were timed (``shapes``: key ->
    ``{"q", "kv"}``, as ``scripts/bench/bench_replay.py shapes4d`` writes them): measured / predicted, forward
    + backward, time-weighted (the ``scale`` for the calls not timed), its median, 10th and 90th
    percentiles and the calls; None when none of them was timed."""
    meas, pred = [], []
    for k, sh in shapes.items():
        t = times.get(key_for_backend(k, backend))
        if t is None or t.get("modelled"):
            continue
        meas.append(t["fwd_ms"] + t["bwd_ms"])
        pred.append(cost.fused_seconds(np.asarray(sh["q"]), np.asarray(sh["kv"]), "fwd_bwd", spec) * 1e3)
    if not meas:
        return None
    m, p = np.array(meas), np.array(pred)
    r = m / p
    return {"calls": int(m.size), "scale": float(m.sum() / p.sum()), "median": float(np.median(r)),
            "p10": float(np.percentile(r, 10)), "p90": float(np.percentile(r, 90)), "backend": backend,
            "shapes": "sampled 4D calls"}

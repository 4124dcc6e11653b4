"""The replay's durations: a batch's :class:`~cadlib.analysis.replay.settings.Work` and the timed shapes (ms, keyed
by :mod:`cadlib.analysis.replay.times`) as per-rank durations of every phase of a layer
(:func:`phases`), over the setting's :class:`Links`, composed into each method's step
(:func:`compose_work`, :func:`cadlib.analysis.model.compose.compose`). :func:`model_phases` gives the
simulator's durations for the same work (the cost model instead of timings), which also ranks WLB's CP
degrees before any is timed (:func:`batch_work`)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ...core.cost import ModelSpec
from ...core.measured import MeasuredCost
from ...core.methods import METHODS
from ...core.precision import DTYPE_BYTES
from ..model.compose import Composed, Link, Phases, compose
from ..model.sim import Hardware, attention_seconds, linear_seconds
from .settings import Setting, Work, batch_lengths, method_work
from .times import DTYPE, attention_key, head_key, interp, linear_key, optimizer_key

NCCL_LATENCY_S = 25e-6
"""A collective's fixed cost in the link model: an assumption (NCCL's small-message latency is tens of
microseconds), not measured here; it matters only for the signal-only control."""


@dataclass(frozen=True)
class Links:
    """The links of a setting: ``dp`` between data-parallel groups (CAD's all-to-alls, per-document
    CP's all-gathers, the gradient all-reduce), ``tp`` inside a tensor-parallel group."""

    dp: Link
    tp: Link
    cad: Link

    @classmethod
    def of(cls, s: Setting, rates: dict) -> "Links":
        """From ``rates`` (:func:`link_rates`): the inter-node link at the paper's bandwidth (``ib``, or
        ``ib-low``) when a data-parallel group is a node, else the measured 2x H200 NVLink (CAD's
        all-to-alls at the NCCL thread blocks the run used)."""
        nvl = Link(rates["nvlink"], NCCL_LATENCY_S, "nvlink")
        if s.link in ("ib", "ib-low"):
            ib = Link(rates[s.link], NCCL_LATENCY_S, s.link)
            return cls(ib, nvl, ib)
        base = Link(rates[s.link], NCCL_LATENCY_S, s.link)
        ctas = (s.config or {}).get("comm_ctas")
        cad = Link(rates.get(f"{s.link}@{ctas}", base.gbps), NCCL_LATENCY_S, f"{s.link}@{ctas}") if ctas \
            else base
        return cls(base, nvl, cad)


def link_rates(probe_nvlink: dict, probe_inter: dict | None = None, ib_gbps: float = 50.0,
               ib_low_gbps: float = 40.0) -> dict[str, float]:
    """Link bandwidths in GB/s: NVLink and the inter-node-like link from the committed 2x H200 all-to-all
    probes (``results/comm_overlap_probe_2xh200_*.json``: NCCL's own thread blocks, and ``<link>@<n>``
    at ``n`` blocks), the inter-node network at the given rates."""
    out = {"ib": float(ib_gbps), "ib-low": float(ib_low_gbps)}
    for name, probe in (("nvlink", probe_nvlink), ("inter-node-like", probe_inter)):
        if probe is None:
            continue
        for row in probe["results"]:
            if row["ctas"] == "nccl default":
                out[name] = float(row["a2a_gbps"])
            else:
                out[f"{name}@{row['ctas']}"] = float(row["a2a_gbps"])
    return out


def collective_seconds(w: Work, links: Links, signal_only: bool = False) -> dict[str, np.ndarray]:
    """Per collective of ``w`` (``in``, ``out``, ``in_bwd``, ``out_bwd``) its seconds per rank (per
    nano-batch and rank for ping-pong) over CAD's link or the data-parallel one; ``signal_only``: every
    collective that moves bytes cut to its latency."""
    link = links.cad if METHODS[w.method].cad else links.dp
    out = {}
    for name, (sent, recv) in w.bytes.items():
        t = link.seconds(sent, recv) if not w.pingpong else \
            np.stack([link.seconds(*x) for x in zip(sent, recv)])
        out[name] = np.where(t > 0, link.latency_s, 0.0) if signal_only else t
    return out


def phases(s: Setting, w: Work, times: dict, links: Links, backend: str, signal_only: bool = False) -> Phases:
    """Per-rank durations of one layer of ``w`` from the timed shapes ``times`` (ms) and the links."""
    spec = s.spec
    attn_f = np.zeros(w.tokens.shape)
    attn_b = np.zeros(w.tokens.shape)
    for i, ds in enumerate(w.dispatch):
        for r, d in enumerate(ds):
            k = attention_key(d, spec, backend)
            if k is not None:
                idx = (i, r) if w.pingpong else r
                attn_f[idx], attn_b[idx] = times[k]["fwd_ms"] * 1e-3, times[k]["bwd_ms"] * 1e-3
    lin = {f: interp(times, lambda n: linear_key(spec, backend, n, s.linear, s.tp), w.tokens, f)
           for f in ("pre_ms", "post_ms", "pre_bwd_ms", "post_bwd_ms")}
    tp = tp_seconds(s, w.tokens, links.tp)
    coll = collective_seconds(w, links, signal_only)
    total = w.tokens.sum(0) if w.pingpong else w.tokens
    head = interp(times, lambda n: head_key(spec, backend, n, s.linear, s.tp), total, "ms")
    return Phases(pre=lin["pre_ms"] + tp["pre"], post=lin["post_ms"] + tp["post"],
                  pre_bwd=lin["pre_bwd_ms"] + tp["pre_bwd"], post_bwd=lin["post_bwd_ms"] + tp["post_bwd"],
                  attn=attn_f, attn_bwd=attn_b, comm_in=coll["in"], comm_out=coll["out"],
                  comm_in_bwd=coll["in_bwd"], comm_out_bwd=coll["out_bwd"], head=head,
                  optimizer=times[optimizer_key(spec, backend)]["ms"] * 1e-3 if s.optimizer else 0.0,
                  allreduce=allreduce_seconds(s, links.dp))


TP_COLLECTIVES = {"pre": 1, "post": 3, "pre_bwd": 1, "post_bwd": 4}
"""Megatron's sequence-parallel all-gathers and reduce-scatters of a layer's activations, per part:
before QKV; after the O projection, before and after the MLP; the backward's mirrors, and the MLP's
input gathered again for its recompute."""


def tp_seconds(s: Setting, tokens, link: Link) -> dict[str, np.ndarray]:
    """Tensor parallelism's activation collectives, taken as exposed: ``tokens x hidden`` in bf16, of
    which each GPU sends and receives ``(tp - 1) / tp`` per collective."""
    t = np.asarray(tokens, dtype=np.float64)
    if s.tp == 1:
        return dict.fromkeys(TP_COLLECTIVES, np.zeros_like(t))
    b = t * s.spec.hidden * DTYPE_BYTES[DTYPE] * (s.tp - 1) / s.tp
    one = np.where(b > 0, b / (link.gbps * 1e9) + link.latency_s, 0.0)
    return {k: n * one for k, n in TP_COLLECTIVES.items()}


def shard_params(spec: ModelSpec) -> int:
    """Parameters one GPU holds: its layers, two norms per layer, the final norm, embedding and head."""
    return spec.n_layers * (spec.linear_params_per_layer() + 2 * spec.hidden) + spec.hidden \
        + 2 * spec.vocab * spec.hidden


def allreduce_seconds(s: Setting, link: Link) -> float:
    """The gradient all-reduce of a GPU's parameters (bf16) over the ``dp`` groups: a ring, ``2 (dp - 1)
    / dp`` of the bytes sent and received; none when the step skips the optimizer (``s.optimizer``
    False: DistCA's timed iterations zero the gradients instead of reducing and applying them)."""
    if s.dp == 1 or not s.optimizer:
        return 0.0
    b = shard_params(s.spec) * DTYPE_BYTES[DTYPE] * 2 * (s.dp - 1) / s.dp
    return float(link.seconds(np.array([b]))[0])


def compose_work(s: Setting, works: dict[str, Work], times: dict, links: Links, backend: str
                 ) -> dict[str, Composed]:
    """Every method of a batch composed (WLB: its best CP degree, with the others under ``wlb/c``)."""
    L = s.spec.n_layers
    out = {}
    for key, w in works.items():
        out[key] = compose("cad-pingpong" if key == "signal-only" else w.method,
                           phases(s, w, times, links, backend, signal_only=key == "signal-only"), L)
        if key == "signal-only":
            out[key] = replace(out[key], method="signal-only")
    return _best_wlb(out)


def _best_wlb(out: dict[str, Composed]) -> dict[str, Composed]:
    """WLB-ideal: the fastest of the composed CP degrees (``wlb/c``), as ``wlb``."""
    wl = {k: v for k, v in out.items() if k.startswith("wlb/")}
    if wl:
        best = min(wl, key=lambda k: wl[k].step)
        out["wlb"] = replace(wl[best], breakdown={**wl[best].breakdown, "cp": int(best.split("/")[1])})
    return out


# ---------------------------------------------------------------------------------------------------
# The simulator's durations for the same work
# ---------------------------------------------------------------------------------------------------

def model_phases(s: Setting, w: Work, links: Links, hw: Hardware | None = None,
                 signal_only: bool = False, cost: MeasuredCost | None = None) -> Phases:
    """:func:`phases` with every compute duration from the cost model instead of a timing (the
    simulator: :mod:`cadlib.analysis.model.sim`'s rates): linear layers at ``hw``'s matmul rate (pre and post
    in proportion to their parameters; the MLP's recompute added to the backward), CA-tasks at the
    measured rate of their query length (or, with ``cost``, a server's tasks as one fused call of a
    kernel latency table, :meth:`MeasuredCost.fused_seconds`), the LM head's matmuls, no optimizer time."""
    hw = hw or Hardware(attn_kernel="fa4", dtype=DTYPE)
    spec = s.spec
    qkv = spec.hidden * (spec.q_dim + 2 * spec.kv_dim)
    mlp = 3 * spec.hidden * spec.ffn
    total = spec.linear_params_per_layer()
    t = w.tokens.astype(np.float64)
    fwd = linear_seconds(t, spec, hw, "fwd", layers=1)
    bwd = linear_seconds(t, spec, hw, "bwd", layers=1)
    attn_f, attn_b = np.zeros(t.shape), np.zeros(t.shape)
    for i, per in enumerate(w.served):
        for r, (a, b) in enumerate(per):
            idx = (i, r) if w.pingpong else r
            if cost is not None:
                attn_f[idx] = cost.fused_seconds(b - a, b, "fwd", spec)
                attn_b[idx] = cost.fused_seconds(b - a, b, "bwd", spec)
                continue
            attn_f[idx] = attention_seconds(a, b, spec, hw, "fwd", 1).sum()
            attn_b[idx] = attention_seconds(a, b, spec, hw, "bwd", 1).sum()
    tp = tp_seconds(s, w.tokens, links.tp)
    coll = collective_seconds(w, links, signal_only)
    n = w.tokens.sum(0) if w.pingpong else w.tokens
    head = 3 * 2.0 * spec.hidden * spec.vocab * n / hw.linear_flops_per_s
    return Phases(pre=fwd * qkv / total + tp["pre"], post=fwd * (total - qkv) / total + tp["post"],
                  pre_bwd=bwd * qkv / total + tp["pre_bwd"],
                  post_bwd=(bwd + fwd * mlp / total) * (total - qkv) / total + tp["post_bwd"],
                  attn=attn_f, attn_bwd=attn_b, comm_in=coll["in"], comm_out=coll["out"],
                  comm_in_bwd=coll["in_bwd"], comm_out_bwd=coll["out_bwd"], head=head,
                  allreduce=allreduce_seconds(s, links.dp))


def model_compose(s: Setting, works: dict[str, Work], links: Links) -> dict[str, Composed]:
    """The simulator's steps of a batch (as :func:`compose_work`, durations from the cost model)."""
    L = s.spec.n_layers
    out = {}
    for key, w in works.items():
        sig = key == "signal-only"
        ph = model_phases(s, w, links, signal_only=sig)
        out[key] = replace(compose("cad-pingpong" if sig else w.method, ph, L), method=key)
    return _best_wlb(out)


def batch_work(s: Setting, b: int, rates: dict | None = None) -> dict[str, Work]:
    """Every method's work for batch ``b``, WLB once per CP degree (keyed ``wlb/c``): with ``rates``
    (:func:`link_rates`), only the ``wlb_top`` degrees the simulator ranks fastest on this batch
    (:func:`model_compose`), the ones worth timing. ``signal-only`` shares ``cad-pingpong``'s work
    (its collectives cut to their latency by :func:`phases`)."""
    docs = batch_lengths(s, b)
    out = {}
    for m in s.methods:
        if m == "wlb":
            wl = {f"wlb/{c}": method_work(s, docs, "wlb", c) for c in s.cp_degrees()}
            if rates is not None and len(wl) > s.wlb_top:
                sim = model_compose(s, wl, Links.of(s, rates))
                wl = {k: wl[k] for k in sorted(wl, key=lambda k: sim[k].step)[:s.wlb_top]}
            out.update(wl)
        elif m != "signal-only":
            out[m] = method_work(s, docs, m)
    if "signal-only" in s.methods:
        out["signal-only"] = out.get("cad-pingpong") or method_work(s, docs, "cad-pingpong")
    return out

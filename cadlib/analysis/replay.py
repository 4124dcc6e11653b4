"""The paper's scale on one GPU: every rank's work in a step, as kernels of known shapes to time on one
GPU, composed into a step with a link model (:mod:`cadlib.analysis.compose`).

A rank's work in one layer is a fixed set of kernel calls: its linear layers at its token count, and its
attention server's one fused call over the CA-tasks its dispatch gives it. So one GPU can time every
rank of a 256-GPU run, one after another; only the network is modelled. This module builds that work
for a :class:`Setting` (host only, numpy): for each sampled batch and each method the layout and plans
(:mod:`cadlib.scheduling`), every rank's token counts, its attention-server dispatch and the bytes its
collectives move. ``scripts/bench_replay.py`` times what the durations need on a GPU, caching every
timed shape under a key of the call's shape (:mod:`cadlib.analysis.replay_times`); :func:`phases`
turns work and times into per-rank durations, and :func:`compose_work` composes the steps
(:mod:`cadlib.analysis.replay4d`: the same with pipeline parallelism).

Tensor parallelism: a DistCA node is one tensor-parallel group of ``tp`` GPUs (Megatron's cut), so each
GPU runs ``1/tp`` of every layer's heads and MLP on all of its group's tokens
(:meth:`cadlib.core.cost.ModelSpec.shard`), and the layer's tensor-parallel all-gathers and
reduce-scatters cross NVLink. The replay times that shard: per-GPU times, not a whole group's.

Methods: ``colocated`` (sequential packing, per-document CP for documents split between ranks), ``wlb``
(WLB-ideal: balanced packing over ``dp / c`` replicas with per-document CP of degree ``c`` inside
each, the best ``c`` of ``wlb_cp``), ``cad``, ``cad-pingpong`` and ``signal-only`` (ping-pong with every
collective cut to its latency). The per-document all-gather is counted among the ranks that hold a
document (:func:`cadlib.data.packing.per_doc_gather_tokens`), which favours the baselines over an
all-gather of the whole group.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import numpy as np

from ..core.cost import DTYPE_BYTES, ModelSpec, as_model
from ..core.defaults import DEFAULT_NANO_SPLIT, DEFAULT_TOLERANCE
from ..core.layout import Layout
from ..core.measured import MeasuredCost
from ..core.paper import DISTCA_TABLE3_8B, DISTCA_TP
from ..data.packing import pack, per_doc_gather_tokens, wlb_layout
from ..data.workload import sample_docs, sample_kwargs, sample_lengths
from ..dispatch.build import build_dispatch
from ..dispatch.meta import Dispatch
from ..infra.results import load_result
from ..scheduling import scheduler
from ..scheduling.recipes import batch_docs, cad_plan, nano_plans
from .compose import Composed, Link, Phases, compose
from .replay_times import (DTYPE, LINEAR_GRID, attention_jobs, attention_key, grid_points, head_key, interp,
                           linear_key, optimizer_key)
from .idle import varlen_chunking
from .sim import Hardware, attention_seconds, linear_seconds

TOKENS_PER_GROUP = 131072
"""Tokens per data-parallel group in the paper's 3D settings: a batch size of ``B`` MaxDocLen-long
sequences over ``N`` GPUs of TP=8 is ``B x MaxDocLen / (N / 8)`` = 128K tokens in every row of Table 3."""
METHODS = ("colocated", "wlb", "varlen", "cad", "cad-pingpong", "signal-only")
NCCL_LATENCY_S = 25e-6
"""A collective's fixed cost in the link model: an assumption (NCCL's small-message latency is tens of
microseconds), not measured here; it matters only for the signal-only control."""


@dataclass(frozen=True)
class Setting:
    """One replayed configuration: ``dp`` data-parallel groups of ``tp`` GPUs, ``tokens`` tokens per
    group, ``batches`` sampled batches. ``dist`` is a workload name or preset; lengths are stretched by
    ``elongate`` and clipped to ``max_doc_len``. ``lengths``: a user's document lengths, sampled instead
    of ``dist`` (:func:`cadlib.data.workload.sample_lengths`, the same seeds). ``model``: a name or a
    :class:`ModelSpec`. ``config``: a committed end-to-end run's configuration, whose batches
    (:func:`cadlib.scheduling.recipes.batch_docs`) are replayed instead of sampled."""

    name: str
    dist: str
    dp: int
    tokens: int = TOKENS_PER_GROUP
    max_doc_len: int | None = None
    elongate: float = 1.0
    tp: int = DISTCA_TP
    model: str | ModelSpec = "llama3-8b"
    n_layers: int | None = None
    batches: int = 5
    seed: int = 0
    methods: tuple[str, ...] = ("colocated", "wlb", "cad", "cad-pingpong", "signal-only")
    wlb_cp: tuple[int, ...] = (1, 2, 4, 8)
    wlb_top: int = 2
    link: str = "ib"
    tolerance: float = DEFAULT_TOLERANCE
    min_shard: int = 512
    nano_split: str = DEFAULT_NANO_SPLIT
    config: dict | None = field(default=None, hash=False, compare=False)
    source: str | None = None
    lengths: np.ndarray | None = field(default=None, hash=False, compare=False, repr=False)

    def __post_init__(self):
        for f in ("dp", "tokens", "tp", "batches"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Setting.{f} must be an integer >= 1, got {v!r}")
        bad = [m for m in self.methods if m not in METHODS]
        if bad:
            raise ValueError(f"unknown method(s) {bad}; choose from: {', '.join(METHODS)}")
        if self.link not in LINK_NAMES:
            raise ValueError(f"unknown link {self.link!r}; choose one of: {', '.join(LINK_NAMES)}")

    @property
    def spec(self) -> ModelSpec:
        """The model of one GPU: the tensor-parallel shard of ``model`` with ``n_layers`` layers."""
        m = as_model(self.model, **({"n_layers": self.n_layers} if self.n_layers else {}))
        return m.shard(self.tp)

    def cp_degrees(self) -> tuple[int, ...]:
        return tuple(c for c in self.wlb_cp if self.dp % c == 0)

    def recipe_args(self) -> SimpleNamespace:
        """The fields :mod:`cadlib.scheduling.recipes` reads, as ``python -m cadlib.train`` has them."""
        base = {"dist": self.dist, "tokens_per_rank": self.tokens, "seed": self.seed, "doc_len": None,
                "max_doc_len": self.max_doc_len, "tolerance": self.tolerance, "min_shard": self.min_shard,
                "nano_balance": "tokens", "nano_split": self.nano_split, "sent_last": False}
        return SimpleNamespace(**{**base, **(self.config or {})})


LINK_NAMES = ("ib", "ib-low", "nvlink", "inter-node-like")


def paper_3d_settings(batches: int = 5, dists=("distca-pretrain", "prolong")) -> list[Setting]:
    """The paper's 3D runs of Llama-8B (Table 3) as replay settings: MaxDocLen 128K / 256K / 512K at
    64 / 128 / 256 GPUs, TP=8, so DP 8 / 16 / 32, and 128K tokens per DP group (``TOKENS_PER_GROUP``).
    Pretrain is DistCA's (``distca-pretrain``: documents of at least 64K drawn twice as often) and both
    distributions are stretched by ``MaxDocLen / 128K`` and clipped to MaxDocLen, as DistCA elongates its
    samples for longer contexts."""
    out = []
    for dist in dists:
        for ctx, sizes, gpus in DISTCA_TABLE3_8B:
            for b, g in zip(sizes, gpus):
                dp = g // DISTCA_TP
                if b * ctx != dp * TOKENS_PER_GROUP:
                    raise ValueError(f"Table 3 row {ctx}: batch {b} x {ctx} is not {dp} x {TOKENS_PER_GROUP}")
                short = "pretrain" if dist == "distca-pretrain" else dist
                out.append(Setting(f"3d_{short}_{ctx // 1024}k_dp{dp}", dist, dp, max_doc_len=ctx,
                                   elongate=ctx / TOKENS_PER_GROUP, batches=batches))
    return out


def e2e_setting(item: dict) -> Setting:
    """A committed end-to-end run (an item of :func:`cadlib.analysis.e2e.load_committed`) as a setting:
    its batches, model, layers, tolerance and link, at TP=1 on its GPUs."""
    cfg = item["config"]
    n = int(cfg.get("nproc") or 2)
    return Setting(f"e2e_{item['file'].removeprefix('bench_e2e_').removesuffix('.json')}", cfg["dist"], n,
                   tokens=int(cfg["tokens_per_rank"]), max_doc_len=cfg.get("max_doc_len"), tp=1,
                   model=cfg["model"], n_layers=cfg.get("layers"),
                   batches=len(item["results"]["per_batch"]), seed=int(cfg.get("seed", 0)),
                   methods=tuple(m for m in cfg["methods"] if m in METHODS), wlb_cp=(1,),
                   link=cfg.get("link") or "nvlink", tolerance=float(cfg.get("tolerance", DEFAULT_TOLERANCE)),
                   min_shard=int(cfg.get("min_shard", 512)), nano_split=cfg.get("nano_split", "whole"),
                   config=cfg, source=item["file"])


# ---------------------------------------------------------------------------------------------------
# A batch's work, rank by rank (host only)
# ---------------------------------------------------------------------------------------------------

def batch_lengths(s: Setting, b: int) -> list[int]:
    """Document lengths of batch ``b``: the committed run's (its seeds) or sampled for the setting."""
    if s.config is not None:
        return batch_docs(s.recipe_args(), b, s.dp)
    if s.lengths is not None:
        return sample_lengths(s.lengths, s.dp * s.tokens, seed=s.seed * 100_003 + b, elongate=s.elongate,
                              max_doc_len=s.max_doc_len)
    kw = sample_kwargs(s.dist)
    return sample_docs(kw.pop("dist"), s.dp * s.tokens, seed=s.seed * 100_003 + b, elongate=s.elongate,
                       max_doc_len=s.max_doc_len, **kw)


@dataclass
class Work:
    """One method's work in one layer of one batch. ``tokens``: per rank (``[2, R]`` for ping-pong's
    nano-batches); ``dispatch``: per nano-batch, per rank, the attention server's :class:`Dispatch`;
    ``bytes``: per collective (``in``, ``out``, ``in_bwd``, ``out_bwd``) ``(sent, received)`` per rank;
    ``served``: per nano-batch, per rank, the ``(q_start, q_end)`` of the tasks it serves."""

    method: str
    tokens: np.ndarray
    dispatch: list[list[Dispatch]]
    bytes: dict[str, tuple[np.ndarray, np.ndarray]]
    served: list[list[tuple[np.ndarray, np.ndarray]]]
    meta: dict = field(default_factory=dict)

    @property
    def pingpong(self) -> bool:
        return self.tokens.ndim == 2


def _served(plan, rank: int):
    sel = plan.server == rank
    return plan.q_start[sel], plan.q_end[sel]


def _cad_bytes(ds: list[Dispatch], spec: ModelSpec) -> dict:
    """The all-to-alls of CAD's stages per rank, bytes: send (Q and deduplicated KV), return (O),
    return' (dO out) and send' (dQ, dK, dV back)."""
    qb, kvb = spec.q_bytes(DTYPE), spec.kv_bytes(DTYPE)
    qs, qr = (np.array([d.n_send_q for d in ds]), np.array([d.n_recv_q for d in ds]))
    ks, kr = (np.array([d.n_send_kv for d in ds]), np.array([d.n_recv_kv for d in ds]))
    send = (qs * qb + ks * kvb, qr * qb + kr * kvb)
    back = (qr * qb + kr * kvb, qs * qb + ks * kvb)
    return {"in": send, "out": (qr * qb, qs * qb), "out_bwd": (qs * qb, qr * qb), "in_bwd": back}


def gather_bytes(layout: Layout, spec: ModelSpec) -> dict:
    """Per-document CP: the all-gather of shared documents' K, V before attention (and again before its
    backward), and the return of their dK, dV after it."""
    sent, recv = per_doc_gather_tokens(layout)
    kvb = spec.kv_bytes(DTYPE)
    g = (sent * kvb, recv * kvb)
    zero = (np.zeros_like(g[0]), np.zeros_like(g[0]))
    return {"in": g, "out": zero, "out_bwd": g, "in_bwd": (g[1], g[0])}


def _colocated_work(method: str, layout: Layout, spec: ModelSpec, meta: dict) -> Work:
    plan = scheduler.colocated(layout)
    R = layout.n_ranks
    ds = [build_dispatch(plan, r) for r in range(R)]
    return Work(method, layout.tokens_per_rank().astype(np.int64), [ds], gather_bytes(layout, spec),
                [[_served(plan, r) for r in range(R)]], {**meta, "imbalance": plan.imbalance()})


def method_work(s: Setting, docs: list[int], method: str, cp: int = 1) -> Work:
    """``method``'s work for a batch of documents ``docs`` (``cp``: WLB's context-parallel degree)."""
    spec, R, args = s.spec, s.dp, s.recipe_args()
    if method == "colocated":
        return _colocated_work(method, pack(docs, R, s.tokens), spec, {})
    if method == "wlb":
        return _colocated_work(method, wlb_layout(docs, R, cp, s.tokens, s.model), spec, {"cp": cp})
    if method == "varlen":
        lay = varlen_chunking(docs, R, s.tokens, as_model(s.model), Hardware(attn_kernel="fa4"))
        return _colocated_work(method, lay, spec, {})
    layout = pack(docs, R, s.tokens)
    if method == "cad":
        plan = cad_plan(layout, args, spec)
        ds = [build_dispatch(plan, r) for r in range(R)]
        return Work(method, layout.tokens_per_rank().astype(np.int64), [ds], _cad_bytes(ds, spec),
                    [[_served(plan, r) for r in range(R)]], {"imbalance": plan.imbalance()})
    nanos, plans = nano_plans(layout, args, spec)
    ds = [[build_dispatch(p, r) for r in range(R)] for p in plans]
    per = [_cad_bytes(d, spec) for d in ds]
    byts = {k: tuple(np.stack([p[k][i] for p in per]) for i in range(2)) for k in per[0]}
    tokens = np.array([[len(nb.rows[r]) for r in range(R)] for nb in nanos], dtype=np.int64)
    return Work(method, tokens, ds, byts, [[_served(p, r) for r in range(R)] for p in plans],
                {"imbalance": [p.imbalance() for p in plans]})


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


# ---------------------------------------------------------------------------------------------------
# The times as per-rank durations
# ---------------------------------------------------------------------------------------------------

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
    lin = {f: interp(times, lambda n: linear_key(spec, backend, n), w.tokens, f)
           for f in ("pre_ms", "post_ms", "pre_bwd_ms", "post_bwd_ms")}
    tp = tp_seconds(s, w.tokens, links.tp)
    link = links.cad if w.method in ("cad", "cad-pingpong", "signal-only") else links.dp

    def coll(name):
        sent, recv = w.bytes[name]
        t = link.seconds(sent, recv) if not w.pingpong else np.stack([link.seconds(*x) for x in zip(sent, recv)])
        return np.where(t > 0, link.latency_s, 0.0) if signal_only else t

    total = w.tokens.sum(0) if w.pingpong else w.tokens
    head = interp(times, lambda n: head_key(spec, backend, n), total, "ms")
    return Phases(pre=lin["pre_ms"] + tp["pre"], post=lin["post_ms"] + tp["post"],
                  pre_bwd=lin["pre_bwd_ms"] + tp["pre_bwd"], post_bwd=lin["post_bwd_ms"] + tp["post_bwd"],
                  attn=attn_f, attn_bwd=attn_b, comm_in=coll("in"), comm_out=coll("out"),
                  comm_in_bwd=coll("in_bwd"), comm_out_bwd=coll("out_bwd"), head=head,
                  optimizer=times[optimizer_key(spec, backend)]["ms"] * 1e-3,
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
    / dp`` of the bytes sent and received."""
    if s.dp == 1:
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


# ---------------------------------------------------------------------------------------------------
# The simulator's durations for the same work, and a setting's results
# ---------------------------------------------------------------------------------------------------

def model_phases(s: Setting, w: Work, links: Links, hw: Hardware | None = None,
                 signal_only: bool = False, cost: MeasuredCost | None = None) -> Phases:
    """:func:`phases` with every compute duration from the cost model instead of a timing (the
    simulator: :mod:`cadlib.analysis.sim`'s rates): linear layers at ``hw``'s matmul rate (pre and post
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
    link = links.cad if w.method in ("cad", "cad-pingpong", "signal-only") else links.dp

    def coll(name):
        sent, recv = w.bytes[name]
        x = link.seconds(sent, recv) if not w.pingpong else np.stack([link.seconds(*v) for v in zip(sent, recv)])
        return np.where(x > 0, link.latency_s, 0.0) if signal_only else x

    n = w.tokens.sum(0) if w.pingpong else w.tokens
    head = 3 * 2.0 * spec.hidden * spec.vocab * n / hw.linear_flops_per_s
    return Phases(pre=fwd * qkv / total + tp["pre"], post=fwd * (total - qkv) / total + tp["post"],
                  pre_bwd=bwd * qkv / total + tp["pre_bwd"],
                  post_bwd=(bwd + fwd * mlp / total) * (total - qkv) / total + tp["post_bwd"],
                  attn=attn_f, attn_bwd=attn_b, comm_in=coll("in"), comm_out=coll("out"),
                  comm_in_bwd=coll("in_bwd"), comm_out_bwd=coll("out_bwd"), head=head,
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


def missing_times(s: Setting, works: dict[str, Work], times: dict, backend: str) -> list[str]:
    """The keys :func:`phases` needs for these works that ``times`` lacks."""
    spec = s.spec
    keys = set(attention_jobs(works.values(), spec, backend))
    toks = np.concatenate([np.concatenate([w.tokens.ravel(), (w.tokens.sum(0) if w.pingpong else w.tokens)])
                           for w in works.values()])
    for key_of in (lambda n: linear_key(spec, backend, n), lambda n: head_key(spec, backend, n)):
        have = [n for n in LINEAR_GRID if key_of(n) in times]
        if len(have) < 2:               # linear in tokens: two timed points interpolate and extrapolate
            keys |= {key_of(n) for n in grid_points(toks)}
    keys.add(optimizer_key(spec, backend))
    return sorted(k for k in keys if k not in times)


def _measured_steps(s: Setting) -> dict:
    """``{(method, batch): slowest rank's step in seconds}`` of the committed run a setting replays."""
    if s.source is None:
        return {}
    from_file = load_result(s.source)["results"]["records"]
    out: dict = {}
    for r in from_file:
        k = (r["method"], int(r["batch"]))
        out[k] = max(out.get(k, 0.0), r["step_ms"] * 1e-3)
    return out


def replay_setting(s: Setting, times: dict, rates: dict, backend: str) -> dict | None:
    """Every batch of ``s`` composed from the timed shapes (None when some are missing): per batch and
    method the step, its idle fraction, the slowest and mean rank's attention, the exposed
    communication, the simulator's step for the same work and, for a replayed committed run, the
    measured step; per rank its tokens and attention; the summary per method."""
    links = Links.of(s, rates)
    measured = _measured_steps(s)
    rows, ranks = [], []
    for b in range(s.batches):
        works = batch_work(s, b, rates)
        if missing_times(s, works, times, backend):
            return None
        got, sim = compose_work(s, works, times, links, backend), model_compose(s, works, links)
        for key, c in got.items():
            w = works.get(key) or works[f"wlb/{c.breakdown['cp']}"]
            ph = phases(s, w, times, links, backend, signal_only=key == "signal-only")
            attn = (ph.attn + ph.attn_bwd).sum(0) if w.pingpong else ph.attn + ph.attn_bwd
            row = {"batch": b, "method": key, "step_s": c.step, "idle_fraction": c.idle_fraction,
                   "attention_max_s": c.breakdown["attention_max_s"],
                   "attention_mean_s": c.breakdown["attention_mean_s"],
                   "exposed_comm_s": c.breakdown["exposed_comm_s"], "sim_step_s": sim[key].step,
                   "sim_idle_fraction": sim[key].idle_fraction}
            if "cp" in c.breakdown:
                row["cp"] = c.breakdown["cp"]
            if (key, b) in measured:
                row["measured_step_s"] = measured[(key, b)]
            rows.append(row)
            if not key.startswith("wlb/"):
                ranks.append({"batch": b, "method": key, "tokens": np.asarray(w.tokens).tolist(),
                              "attention_ms_per_layer": (attn * 1e3).round(3).tolist()})
    return {"per_batch": rows, "ranks": ranks, "summary": summarise(s, rows)}


def summarise(s: Setting, rows: list[dict]) -> list[dict]:
    """Per method: mean (and per-batch) speedup over colocated and over WLB-ideal, the simulator's,
    the replay's error against a measured run, the batch count."""
    by = {(r["method"], r["batch"]): r for r in rows}
    methods = sorted({r["method"] for r in rows if "/" not in r["method"]}, key=METHODS.index)
    batches = sorted({r["batch"] for r in rows})
    out = []
    for m in methods:
        rec = {"setting": s.name, "dist": s.dist, "max_doc_len": s.max_doc_len, "dp": s.dp, "tp": s.tp,
               "tokens_per_group": s.tokens, "method": m, "batches": len(batches),
               "ranks": s.dp, "step_s_mean": float(np.mean([by[(m, b)]["step_s"] for b in batches])),
               "idle_fraction_mean": float(np.mean([by[(m, b)]["idle_fraction"] for b in batches]))}
        for base in ("colocated", "wlb"):
            if (base, batches[0]) in by:
                sp = [by[(base, b)]["step_s"] / by[(m, b)]["step_s"] for b in batches]
                spm = [by[(base, b)]["sim_step_s"] / by[(m, b)]["sim_step_s"] for b in batches]
                rec[f"speedup_over_{base}"] = float(np.mean(sp))
                rec[f"speedup_over_{base}_per_batch"] = [float(x) for x in sp]
                rec[f"sim_speedup_over_{base}"] = float(np.mean(spm))
        sim_err = [by[(m, b)]["sim_step_s"] / by[(m, b)]["step_s"] - 1 for b in batches]
        rec["sim_vs_replay_step_err_mean"] = float(np.mean(sim_err))
        if all("measured_step_s" in by[(m, b)] for b in batches):
            err = [by[(m, b)]["step_s"] / by[(m, b)]["measured_step_s"] - 1 for b in batches]
            rec["replay_vs_measured_err_per_batch"] = [float(x) for x in err]
            rec["replay_vs_measured_err_of_mean"] = float(
                np.mean([by[(m, b)]["step_s"] for b in batches])
                / np.mean([by[(m, b)]["measured_step_s"] for b in batches]) - 1)
        if m == "wlb":
            rec["cp_chosen"] = [by[(m, b)].get("cp") for b in batches]
        out.append(rec)
    return out


def setting_config(s: Setting, rates: dict, backend: str, times_meta: dict) -> dict:
    """A setting's full configuration for its result file."""
    cfg = {k: getattr(s, k) for k in s.__dataclass_fields__ if k not in ("config", "lengths")}
    return {**cfg, "spec": s.spec._asdict() if hasattr(s.spec, "_asdict") else vars(s.spec),
            "links": {k: vars(v) for k, v in vars(Links.of(s, rates)).items()}, "backend": backend,
            "nccl_latency_s": NCCL_LATENCY_S, "tp_collectives_per_layer": TP_COLLECTIVES,
            "times_device": times_meta.get("device"), "times_commit": times_meta.get("commit"),
            "replayed_run": s.config}


def summary_line(s: Setting, res: dict) -> str:
    parts = []
    for r in res["summary"]:
        if r["method"] in ("cad-pingpong", "wlb") or r["method"] == "colocated":
            sp = r.get("speedup_over_wlb")
            parts.append(f"{r['method']} {r['step_s_mean'] * 1e3:.0f} ms" + (f" ({sp:.3f}x wlb)" if sp else ""))
    return f"{s.name}: " + ", ".join(parts)


def kernel_model_check(settings_, times: dict, cost, backend: str, rates: dict, batches: int = 2) -> dict:
    """How well the kernel table predicts the calls the replay timed, over the timed calls of the first
    ``batches`` batches of each setting: measured / predicted (forward + backward), time-weighted (the
    ``scale`` :func:`model_attention_times` applies), its median, 10th and 90th percentiles, the calls."""
    meas, pred = [], []
    for s in settings_:
        for b in range(min(batches, s.batches)):
            for k, d in attention_jobs(batch_work(s, b, rates).values(), s.spec, backend).items():
                if k in times and not times[k].get("modelled"):
                    sh = d.shared()
                    meas.append(times[k]["fwd_ms"] + times[k]["bwd_ms"])
                    pred.append(cost.fused_seconds(np.diff(sh.cu_q), np.diff(sh.cu_k), "fwd_bwd", s.spec) * 1e3)
    m, p = np.array(meas), np.array(pred)
    if not m.size:
        raise ValueError(f"no timed {backend} call among these settings to check the kernel table against")
    r = m / p
    return {"calls": int(m.size), "scale": float(m.sum() / p.sum()), "median": float(np.median(r)),
            "p10": float(np.percentile(r, 10)), "p90": float(np.percentile(r, 90)), "backend": backend}


def idle_settings(batches: int = 5) -> list[Setting]:
    """The motivation's idle figure (Figure 4b): 8B, TP=8, 512K-token data chunks per DP group (DP 1,
    2, 4, 8), DistCA's Pretrain at MaxDocLen 512K: variable-length chunking of whole documents under a
    cap of the group's tokens (:func:`cadlib.analysis.idle.varlen_chunking`, the paper's baseline),
    WLB's balanced packing (documents may be cut) and CAD with ping-pong."""
    return [Setting(f"idle_512k_dp{dp}", "distca-pretrain", dp, tokens=524288, max_doc_len=524288,
                    elongate=4.0, batches=batches, methods=("varlen", "wlb", "cad-pingpong"), wlb_cp=(1,))
            for dp in (1, 2, 4, 8)]


def allgather_settings(nodes=(2, 4, 8, 16, 32), tokens_per_node: int = TOKENS_PER_GROUP) -> list[Setting]:
    """Per-document CP's all-gather at scale (Figure 3): 8B, TP=8, every document 32K tokens,
    context parallelism over all ``nodes`` (one CP group), ``tokens_per_node`` tokens each."""
    return [Setting(f"allgather_{n}nodes", "uniform", n, tokens=tokens_per_node, batches=1,
                    methods=("wlb",), wlb_cp=(n,), config={"doc_len": 32768, "dist": "uniform"})
            for n in nodes]

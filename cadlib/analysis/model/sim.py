"""Straggler simulator: the step time of one training step (all layers, forward + backward) under
data parallel (DP), pipeline parallel with 1F1B (PP), per-document context parallel (CP) and core
attention disaggregation (CAD), from the cost model in :mod:`cadlib.core.cost` and a :class:`Hardware`.

Time of work (``Hardware`` gives the rates; ``L`` layers):

* linear layers of ``n`` tokens: ``t = n * 2 * P_layer * L * (1 fwd | 2 bwd) / (matmul_tflops * mfu * 1e12)``;
* a causal CA-task over query tokens ``[a, b)`` (KV prefix ``[0, b)``) runs at the measured rate of
  fused query shards of its length ``n_q = b - a`` (:func:`cadlib.core.cost.attention_tflops`):
  ``t_fwd = F / (R_fwd(n_q) 1e12)``, ``t_fwd+bwd = 3.5 F / (R_fwd+bwd(n_q) 1e12)``,
  ``t_bwd = t_fwd+bwd - t_fwd``, with ``F = 4 * pairs * n_heads * head_dim * L``;
* bytes over a link: ``t = max(send, receive) / (GB/s * 1e9)`` per GPU, NVLink inside a node and the
  per-GPU inter-node link across nodes, both running at once (the slower one decides).

How the ranks wait for each other:

* **DP**: ranks run independently and meet at the gradient all-reduce: ``step = max_r busy_r``.
* **PP (1F1B)**: an exact event simulation of the 1F1B order per stage with its dependencies
  (``F(s, i)`` after ``F(s-1, i)``; ``B(s, i)`` after ``B(s+1, i)``); bubbles and stragglers both
  come out of it. Pipelines of a DP x PP grid meet at the all-reduce.
* **CAD and CP**: every layer has an all-to-all (CAD) or all-gather (CP) between the linear phase and
  the attention phase, forward and backward, which no rank leaves before the slowest has entered it.
  The step is composed as the scale replay composes it (:mod:`cadlib.analysis.model.compose`): one stream,
  or with ``overlap`` DistCA's ping-pong ticks over two equal nano-batches (one nano-batch's
  collective beside the other's linear layers or attention).

Variable-length chunking (WLB-LLM, the baseline the paper's idle-time figure is about) is
:func:`cadlib.analysis.model.idle.varlen_chunking`: whole documents balanced by estimated time under a token cap per rank;
:func:`cadlib.analysis.model.idle.straggler_idle` sweeps its idle time against fixed-length packing. :func:`cadlib.analysis.model.idle.pp_timeline` turns
a 1F1B schedule into a table for a Gantt chart.

``busy_g`` is what GPU ``g`` would need if it never waited for another GPU (its compute plus its own
exposed communication); ``idle_g = step - busy_g`` and ``idle_fraction = sum_g idle_g / (G * step)``.
Not modelled: the gradient all-reduce itself (the same for every method), pipeline p2p sends,
the LM head and embeddings (not in :class:`cadlib.core.cost.ModelSpec`'s linear FLOPs).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ...core.cost import (
    ATTN_BWD_MULT,
    H200_MATMUL_TFLOPS,
    H200_NVLINK_ALL_TO_ALL_GBPS,
    IB_GBPS_PER_GPU,
    LINEAR_BWD_MULT,
    ModelSpec,
    as_model,
    attention_tflops,
    causal_pairs,
)
from ...core.layout import Layout
from ...core.plan import Plan
from ...core.precision import DTYPE_BYTES
from ...data.packing import per_doc_zigzag_layout
from ...scheduling.scheduler import schedule
from .compose import Phases, compose, one_f_one_b

DEFAULT_MFU_LINEAR = 0.7
"""Fraction of the measured large-matmul rate (``H200_MATMUL_TFLOPS``) that a layer's projections and
MLP keep, norms, activations and launch gaps included. An assumption, not measured here."""

PHASES = ("fwd", "bwd", "fwd_bwd")
METHODS = ("dp", "pp", "cp", "cad")


@dataclass(frozen=True)
class Hardware:
    """Rates of one GPU and its links. Bandwidths are in GB/s (1e9 bytes/s); ``math.inf`` is allowed
    (free communication). Defaults: the H200 numbers in :mod:`cadlib.core.cost`."""

    matmul_tflops: float = H200_MATMUL_TFLOPS
    mfu_linear: float = DEFAULT_MFU_LINEAR
    attn_kernel: str = "fa2"
    link_gbps: float = H200_NVLINK_ALL_TO_ALL_GBPS
    inter_node_gbps: float = IB_GBPS_PER_GPU
    gpus_per_node: int = 8
    dtype: str = "bf16"

    def __post_init__(self):
        for f in ("matmul_tflops", "link_gbps", "inter_node_gbps"):
            if not getattr(self, f) > 0:
                raise ValueError(f"Hardware.{f} must be > 0 (math.inf is allowed), got {getattr(self, f)}")
        if not 0 < self.mfu_linear <= 1:
            raise ValueError(f"Hardware.mfu_linear must be in (0, 1], got {self.mfu_linear}")
        if int(self.gpus_per_node) != self.gpus_per_node or self.gpus_per_node < 1:
            raise ValueError(f"Hardware.gpus_per_node must be an integer >= 1, got {self.gpus_per_node}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of: {', '.join(DTYPE_BYTES)}")
        attention_tflops(1024, self.attn_kernel)  # raises ValueError for an unknown kernel

    @property
    def linear_flops_per_s(self) -> float:
        return self.matmul_tflops * self.mfu_linear * 1e12


@dataclass
class StepTimes:
    """Per-GPU busy seconds, the step time, and where the time went (``breakdown``: per-GPU arrays
    ``linear``, ``attention``, ``comm`` (all traffic) and ``comm_exposed`` (not hidden))."""

    method: str
    busy: np.ndarray
    step: float
    breakdown: dict[str, np.ndarray]
    meta: dict = field(default_factory=dict)
    idle: np.ndarray = field(init=False)
    idle_fraction: float = field(init=False)

    def __post_init__(self):
        self.busy = np.asarray(self.busy, dtype=np.float64)
        self.step = float(self.step)
        if self.step < self.busy.max() * (1 - 1e-9):
            raise ValueError(f"step {self.step} is shorter than the busiest GPU ({self.busy.max()})")
        self.idle = np.maximum(self.step - self.busy, 0.0)
        self.idle_fraction = float(self.idle.sum() / (self.busy.size * self.step)) if self.step > 0 else 0.0

    @property
    def n_ranks(self) -> int:
        return int(self.busy.size)

    def summary(self) -> dict:
        """One flat row for a results table."""
        row = {"method": self.method, "n_ranks": self.n_ranks, "step_s": self.step,
               "idle_fraction": self.idle_fraction, "busy_max_s": float(self.busy.max()),
               "busy_mean_s": float(self.busy.mean())}
        row.update({f"{k}_mean_s": float(np.mean(v)) for k, v in self.breakdown.items()})
        return row


# ---------------------------------------------------------------------------------------------------
# Time of work
# ---------------------------------------------------------------------------------------------------

def _check_phase(phase: str) -> None:
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}; choose one of: {', '.join(PHASES)}")


def linear_seconds(tokens, model: ModelSpec, hw: Hardware, phase: str = "fwd_bwd", layers=None):
    """``tokens * 2 * P_layer * layers * m / (matmul_tflops * mfu * 1e12)``, ``m`` = 1 (fwd), 2 (bwd),
    3 (fwd_bwd). Works elementwise on arrays."""
    _check_phase(phase)
    mult = {"fwd": 1.0, "bwd": LINEAR_BWD_MULT, "fwd_bwd": 1.0 + LINEAR_BWD_MULT}[phase]
    t = np.asarray(tokens, dtype=np.float64) * model.linear_flops_per_token(False, layers) * mult
    t = t / hw.linear_flops_per_s
    return float(t) if t.ndim == 0 else t


def attention_seconds(q_start, q_end, model: ModelSpec, hw: Hardware, phase: str = "fwd_bwd", layers=None):
    """Seconds of causal CA-tasks ``[q_start, q_end)`` (arrays, one entry per task), each at the
    measured rate of its query length: ``t_fwd = F / R_fwd(n_q)``, ``t_fwd_bwd = 3.5 F / R_fwd_bwd(n_q)``,
    ``t_bwd = t_fwd_bwd - t_fwd``, ``F = 4 * pairs * n_heads * head_dim * layers``."""
    _check_phase(phase)
    a = np.atleast_1d(np.asarray(q_start, dtype=np.int64))
    b = np.atleast_1d(np.asarray(q_end, dtype=np.int64))
    if a.size == 0:
        return np.zeros(0)
    fwd_flops = model.attention_flops(causal_pairs(a, b), backward=False, layers=layers)
    n_q, inv = np.unique(b - a, return_inverse=True)

    def rate(backward: bool) -> np.ndarray:
        r = np.array([attention_tflops(n, hw.attn_kernel, backward) for n in n_q])
        return r[inv.reshape(-1)] * 1e12

    t_fwd = fwd_flops / rate(False) if phase != "fwd_bwd" else 0.0
    if phase == "fwd":
        return t_fwd
    t_fb = fwd_flops * (1.0 + ATTN_BWD_MULT) / rate(True)
    return t_fb if phase == "fwd_bwd" else np.maximum(t_fb - t_fwd, 0.0)


def _per_gpu_attention(chunks_per_gpu: Sequence[Sequence[tuple[int, int]]], model, hw, phase, layers=None):
    """Sum of :func:`attention_seconds` over each GPU's list of ``(q_start, q_end)``."""
    return np.array([attention_seconds([c[0] for c in cs], [c[1] for c in cs], model, hw, phase,
                                       layers).sum() for cs in chunks_per_gpu], dtype=np.float64)


def comm_seconds(bytes_matrix: np.ndarray, hw: Hardware) -> np.ndarray:
    """Per GPU ``g`` of a square ``[src, dst]`` byte matrix:
    ``max( max(send, recv)_intra / link_gbps, max(send, recv)_inter / inter_node_gbps ) / 1e9``,
    GPU ``g`` living on node ``g // gpus_per_node``."""
    m = np.asarray(bytes_matrix, dtype=np.float64)
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise ValueError(f"bytes_matrix must be square [src, dst], got shape {m.shape}")
    node = np.arange(m.shape[0]) // int(hw.gpus_per_node)
    same = node[:, None] == node[None, :]
    m = m * (1 - np.eye(m.shape[0]))      # a GPU does not send to itself
    intra = np.maximum((m * same).sum(1), (m * same).sum(0))
    inter = np.maximum((m * ~same).sum(1), (m * ~same).sum(0))
    return np.maximum(intra / (hw.link_gbps * 1e9), inter / (hw.inter_node_gbps * 1e9))


# ---------------------------------------------------------------------------------------------------
# Data parallel
# ---------------------------------------------------------------------------------------------------

def _need(obj, cls, what: str):
    if not isinstance(obj, cls):
        raise ValueError(f"{what} must be a {cls.__name__}, got {type(obj).__name__}")
    return obj


def simulate_dp(layout: Layout, model, hw: Hardware | None = None) -> StepTimes:
    """DP: rank ``r`` runs the linear layers of its tokens and the colocated core attention of its
    chunks (chunk ``(doc, s, e)`` = CA-task ``[s, e)`` with KV prefix ``[0, e)``), then waits at the
    gradient all-reduce: ``busy_r = linear_r + attention_r``, ``step = max_r busy_r``."""
    layout, model, hw = _need(layout, Layout, "layout"), as_model(model), hw or Hardware()
    lin = linear_seconds(layout.tokens_per_rank(), model, hw)
    attn = _per_gpu_attention([[(c.start, c.end) for c in r] for r in layout.ranks], model, hw, "fwd_bwd")
    busy = lin + attn
    zero = np.zeros_like(busy)
    return StepTimes("dp", busy, busy.max(), {"linear": lin, "attention": attn, "comm": zero,
                                              "comm_exposed": zero})


# ---------------------------------------------------------------------------------------------------
# Pipeline parallel, 1F1B
# ---------------------------------------------------------------------------------------------------

def simulate_pp(microbatches, model, hw: Hardware | None = None, *, pp_stages: int,
                n_microbatches: int | None = None) -> StepTimes:
    """PP with 1F1B. ``microbatches`` is either a :class:`Layout` whose ranks are read as microbatches
    (``n_ranks = dp * n_microbatches``: rank ``r`` is microbatch ``r % m`` of pipeline ``r // m``;
    ``n_microbatches`` defaults to ``n_ranks``, one pipeline), or a list of Layouts, one microbatch
    each, for one pipeline. Each stage holds ``n_layers / pp_stages`` layers; ``fwd[s, i]`` and
    ``bwd[s, i]`` are the linear + colocated attention time of microbatch ``i`` on those layers.
    GPU ``(pipeline j, stage s)`` is index ``j * pp_stages + s``; ``step`` = slowest pipeline."""
    model, hw = as_model(model), hw or Hardware()
    if isinstance(microbatches, Layout):
        mbs = list(microbatches.ranks)
    elif isinstance(microbatches, (list, tuple)) and microbatches:
        mbs = [[c for r in _need(x, Layout, "each microbatch").ranks for c in r] for x in microbatches]
        if n_microbatches is not None and int(n_microbatches) != len(mbs):
            raise ValueError(f"n_microbatches={n_microbatches} but {len(mbs)} microbatch layouts were given")
    else:
        raise ValueError("microbatches must be a Layout (ranks read as microbatches) or a non-empty "
                         f"list of Layouts (one per microbatch), got {type(microbatches).__name__}")
    m = len(mbs) if n_microbatches is None else int(n_microbatches)
    if m < 1 or len(mbs) % m:
        raise ValueError(f"n_microbatches={n_microbatches} must be >= 1 and divide the {len(mbs)} "
                         "microbatches given (rank count of the layout)")
    if int(pp_stages) != pp_stages or pp_stages < 1 or model.n_layers % pp_stages:
        raise ValueError(f"pp_stages={pp_stages} must be an integer >= 1 that divides "
                         f"n_layers={model.n_layers} of {model.name}")
    lps = model.n_layers // int(pp_stages)
    tokens = np.array([sum(c.length for c in mb) for mb in mbs])
    spans = [[(c.start, c.end) for c in mb] for mb in mbs]
    per = {ph: linear_seconds(tokens, model, hw, ph, lps) + _per_gpu_attention(spans, model, hw, ph, lps)
           for ph in ("fwd", "bwd")}
    dp, p = len(mbs) // m, int(pp_stages)
    makespans, stage_busy = [], np.zeros((dp, p))
    for j in range(dp):
        f = np.tile(per["fwd"][j * m:(j + 1) * m], (p, 1))
        b = np.tile(per["bwd"][j * m:(j + 1) * m], (p, 1))
        makespans.append(one_f_one_b(f, b)[0])
        stage_busy[j] = f.sum(1) + b.sum(1)
    lin = np.repeat([linear_seconds(tokens[j * m:(j + 1) * m].sum(), model, hw, "fwd_bwd", lps)
                     for j in range(dp)], p)
    busy = stage_busy.reshape(-1)
    zero = np.zeros_like(busy)
    return StepTimes("pp", busy, max(makespans), {"linear": lin, "attention": busy - lin, "comm": zero,
                                                  "comm_exposed": zero},
                     {"pp_stages": p, "n_microbatches": m, "dp": dp, "stage_busy": stage_busy,
                      "pipeline_makespan": np.array(makespans)})


# ---------------------------------------------------------------------------------------------------
# Barrier-per-layer methods: CAD and per-document CP
# ---------------------------------------------------------------------------------------------------

def _phased(method: str, lin: dict, attn: dict, comm: dict, overlap: bool, meta: dict,
            n_layers: int) -> StepTimes:
    """The step from per-rank totals over the ``n_layers`` layers (``fwd``, ``bwd``), through the
    composition the replay uses (:func:`cadlib.analysis.model.compose.compose`): one stream (each layer's
    collective, before its attention, waits for the slowest rank) or, with ``overlap``, DistCA's
    ping-pong ticks over two equal nano-batches (each half of a rank's work), the collective of one
    beside the other's compute."""
    L = int(n_layers)
    z = np.zeros_like(lin["fwd"])
    per = {k: v / L for k, v in (("lf", lin["fwd"]), ("lb", lin["bwd"]), ("af", attn["fwd"]),
                                  ("ab", attn["bwd"]), ("cf", comm["fwd"]), ("cb", comm["bwd"]))}
    if overlap:
        h = {k: np.stack([v / 2, v / 2]) for k, v in per.items()}
        zz = np.zeros_like(h["lf"])
        ph = Phases(pre=h["lf"], post=zz, pre_bwd=h["lb"], post_bwd=zz, attn=h["af"], attn_bwd=h["ab"],
                    comm_in=h["cf"], comm_out=zz, comm_in_bwd=zz, comm_out_bwd=h["cb"], head=z)
        c = compose("cad-pingpong", ph, L)
    else:
        ph = Phases(pre=per["lf"], post=z, pre_bwd=per["lb"], post_bwd=z, attn=per["af"], attn_bwd=per["ab"],
                    comm_in=per["cf"], comm_out=z, comm_in_bwd=z, comm_out_bwd=per["cb"], head=z)
        c = compose("cad", ph, L)
    tot = {"linear": lin["fwd"] + lin["bwd"], "attention": attn["fwd"] + attn["bwd"],
           "comm": comm["fwd"] + comm["bwd"],
           "comm_exposed": np.maximum(c.busy - lin["fwd"] - lin["bwd"] - attn["fwd"] - attn["bwd"], 0.0)}
    return StepTimes(method, c.busy, c.step, tot, {"overlap": overlap, **meta})


def simulate_cad(plan: Plan, model, hw: Hardware | None = None, overlap: bool = True,
                 cost=None, resend: bool = False) -> StepTimes:
    """CAD: linear layers on the home ranks (the plan's layout), each CA-task on its server at the
    rate of its query length, all-to-all bytes from ``Plan.bytes_matrix`` (forward, and the backward:
    dO out and the gradients back; with ``resend``, DistCA's stateless servers, the LSE back with O and
    dO, O, LSE, Q and K, V out again) times ``n_layers``. Servers are the ranks themselves (in place,
    ``n_servers == n_ranks``).
    See the module docstring for the per-layer barrier and the ping-pong ``overlap``. ``cost`` (a
    :class:`cadlib.core.measured.MeasuredCost`): each server's fused call priced by the measured kernel
    table instead (contiguous shards merged, as the server runs them), times ``n_layers``."""
    plan, model, hw = _need(plan, Plan, "plan"), as_model(model), hw or Hardware()
    G = plan.layout.n_ranks
    if plan.n_servers != G:
        raise ValueError(f"simulate_cad needs in-place attention servers, n_servers == n_ranks ({G}); got "
                         f"n_servers={plan.n_servers}: linear layers and servers share the GPUs here")
    tokens = plan.layout.tokens_per_rank().astype(np.float64)
    per_server = [[] for _ in range(G)]
    for t in plan.tasks:
        per_server[t.server].append((t.q_start, t.q_end))
    lin = {p: linear_seconds(tokens, model, hw, p) for p in ("fwd", "bwd")}
    attn = {p: _per_gpu_attention(per_server, model, hw, p) if cost is None
            else cost.server_seconds(plan, p, model) * model.n_layers for p in ("fwd", "bwd")}
    fwd = plan.bytes_matrix(model, hw.dtype, backward=False, resend=resend) * model.n_layers
    both = plan.bytes_matrix(model, hw.dtype, backward=True, resend=resend) * model.n_layers
    comm = {"fwd": comm_seconds(fwd, hw), "bwd": comm_seconds(both - fwd, hw)}
    return _phased("cad", lin, attn, comm, overlap, {"total_bytes": float(both.sum())}, model.n_layers)


def simulate_cp(layout: Layout, model, hw: Hardware | None = None, overlap: bool = False) -> StepTimes:
    """Per-document CP over all ``R`` ranks of ``layout`` (its documents, re-laid by
    :func:`cadlib.data.packing.per_doc_zigzag_layout`). Each layer all-gathers every document's K,V (ring: each rank sends and
    receives ``sum_d (n_d - own_{r,d}) * kv_bytes``); backward all-gathers again and reduce-scatters
    dK,dV (2x). The ring runs at NVLink speed inside a node, at the inter-node link beyond."""
    layout, model, hw = _need(layout, Layout, "layout"), as_model(model), hw or Hardware()
    R = layout.n_ranks
    zz = per_doc_zigzag_layout(layout.doc_lens, R)
    tokens = zz.tokens_per_rank().astype(np.float64)
    spans = [[(c.start, c.end) for c in r] for r in zz.ranks]
    lin = {p: linear_seconds(tokens, model, hw, p) for p in ("fwd", "bwd")}
    attn = {p: _per_gpu_attention(spans, model, hw, p) for p in ("fwd", "bwd")}
    gbps = hw.link_gbps if R <= hw.gpus_per_node else min(hw.link_gbps, hw.inter_node_gbps)
    fwd = (layout.total_tokens - tokens) * model.kv_bytes(hw.dtype) * model.n_layers / (gbps * 1e9)
    return _phased("cp", lin, attn, {"fwd": fwd, "bwd": 2 * fwd}, overlap, {"layout": zz}, model.n_layers)


# ---------------------------------------------------------------------------------------------------
# Dispatcher and sweep
# ---------------------------------------------------------------------------------------------------

def simulate(method: str, source, model, hw: Hardware | None = None, **options) -> StepTimes:
    """``simulate("dp" | "cp", layout, ...)``, ``simulate("pp", layout, pp_stages=..., ...)``,
    ``simulate("cad", plan, overlap=...)``; ``"cad"`` with a Layout schedules it first with
    ``scheduler.schedule(layout, n_servers (default n_ranks), model, tolerance (default 0.1))``."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
    allowed = {"dp": set(), "pp": {"pp_stages", "n_microbatches"}, "cp": {"overlap"},
               "cad": {"overlap", "n_servers", "tolerance", "cost", "resend"}}[method]
    extra = sorted(set(options) - allowed)
    if extra:
        raise ValueError(f"method {method!r} takes no option(s) {extra}; valid: {sorted(allowed) or 'none'}")
    model = as_model(model)
    if method == "dp":
        return simulate_dp(source, model, hw)
    if method == "pp":
        if "pp_stages" not in options:
            raise ValueError("method 'pp' needs pp_stages=<number of pipeline stages>")
        return simulate_pp(source, model, hw, **options)
    if method == "cp":
        return simulate_cp(source, model, hw, **options)
    if isinstance(source, Layout):
        source = schedule(source, options.pop("n_servers", source.n_ranks), model,
                          options.pop("tolerance", 0.1), cost_model=options.get("cost"))
    elif {"n_servers", "tolerance"} & set(options):
        raise ValueError("n_servers and tolerance apply only when 'cad' is given a Layout to schedule")
    return simulate_cad(source, model, hw, **options)


def calibrated_cad_step(step: float, attention, attention_flops, server_flops) -> float:
    """CAD's step predicted from a measured colocated step, calibrated on its own kernel rate.

    The ranks meet at every layer and at the all-reduce, so the colocated ``step`` follows the slowest
    rank's attention: ``step = rest + max_r attention_r``. The measured rate ``rho = sum_r attention_r
    / sum_r attention_flops_r`` (seconds per attention FLOP, forward and backward) gives each server's
    attention under a plan, ``rho * server_flops_s``; communication is taken as hidden (ping-pong)::

        step_cad = step - max_r attention_r + max_s rho * server_flops_s
    """
    attention = np.asarray(attention, dtype=np.float64)
    rank_flops = np.asarray(attention_flops, dtype=np.float64)
    if attention.shape != rank_flops.shape or attention.size == 0:
        raise ValueError(f"attention and attention_flops need one value per rank; got {attention.shape} "
                         f"and {rank_flops.shape}")
    rho = attention.sum() / max(rank_flops.sum(), 1.0)
    return float(step - attention.max() + rho * np.max(np.asarray(server_flops, dtype=np.float64)))


"""The paper's 4D runs (Table 4: DP x PP x CP x TP, Llama-8B) replayed on one GPU's timings.

A step's documents (``batch`` sequences of MaxDocLen tokens' worth, sampled as the 3D replay samples
them) run as ``n_micro`` microbatches of ``dp x micro_tokens`` tokens through ``pp`` stages of
``n_layers / pp`` layers each; every stage is a node of TP=8 GPUs, so ``dp x pp`` nodes. A
microbatch is a group of whole documents of exactly ``dp x micro_tokens`` tokens, sampled as a 3D
batch is (:func:`step_groups`); no document crosses microbatches, so every method attends the same
documents. Per configuration ``(pp, dp)`` and method:

* ``colocated`` and ``wlb`` (WLB-ideal: the step's documents re-binned whole over the microbatches by
  WLB-LLM's variable-length packing, then balanced over each microbatch's replicas with per-document
  CP of degree ``c``, :func:`wlb_micro_layouts`): Megatron's 1F1B (:func:`cadlib.analysis.model.compose.one_f_one_b`) of
  per-(stage, microbatch) op durations, each the composition of the stage's layers over its
  data-parallel ranks (:func:`~cadlib.analysis.model.compose.compose_pass`), plus the point-to-point
  activation (forward) or gradient (backward) of the op, the LM head on the last stage. WLB as DistCA's
  4D driver runs it is a choice of :class:`Setting4D` (:data:`WLB_CHOICES_4D`: its packer over all
  replicas and micro-batches, the whole-replica all-gather, its sweep's admissible CP degrees).
* ``cad-pingpong`` and ``signal-only``: DistCA's lock-step ticks (:func:`cadlib.core.pipeline.lockstep`),
  each tick's CA-tasks of all stages' current microbatches scheduled together over all GPUs
  (:mod:`cadlib.scheduling.pipeline`); a dummy stage's GPUs serve. The servers are stateless
  (:mod:`cadlib.runtime.resend`; ``Setting4D.backward = "resend"``): O and the LSE return in the
  forward, the backward resends Q, O, dO, LSE and K, V to the backward tick's servers.

Durations: the linear layers, LM head and optimizer from the H200 timings of the 3D replay
(``results/replay/times_h200.json``, the same TP=8 shard); core attention from the measured kernel
table (:class:`cadlib.core.measured.MeasuredCost`, FA4, on each server's merged segments), except
for the calls timed on an H200 (:class:`cadlib.analysis.replay.times.SegmentPrice`): a batch has
500-8,600 distinct calls, more than a session's device time can time, so ``scripts/bench/bench_replay.py
shapes4d`` samples 40 per setting by modelled time, those are timed, and the others take the table
times the sample's measured / predicted (:func:`cadlib.analysis.replay.times.segment_model_check`);
four settings were also timed call by call (``shapes4d --all``), which checks the sample
(:func:`cadlib.analysis.report.scale.sample_check_4d`); the network at 50 GB/s per GPU between nodes. As the
paper sweeps configurations, each method's step is that of its best ``pp`` (and ``c`` for WLB) over the
setting's batches. Not modelled: memory (the paper's WLB runs out of memory at high
CP or DP degrees; here every configuration is allowed, which favours the baseline), the LM head
split between the forward and backward ticks (a third forward, as its matmuls are), p2p overlapping
compute.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...core.cost import CAD_A2A_TO_SERVERS, ModelSpec, as_model
from ...core.defaults import DEFAULT_NANO_SPLIT, DEFAULT_TOLERANCE
from ...core.layout import Layout
from ...core.methods import METHODS, names
from ...core.paper import DISTCA_4D_BUFFER_GIB, DISTCA_4D_TOLERANCE_FACTORS, DISTCA_TABLE4_8B, DISTCA_TP
from ...core.pipeline import lockstep
from ...core.precision import DTYPE_BYTES
from ...data.packing import pack, per_doc_cp_layout, wlb_distca_buckets, wlb_layout
from ...scheduling import scheduler
from ...scheduling.pipeline import fitted_tick_plans, micro_nanos, tick_plans
from ..model.compose import Phases, compose_lockstep, compose_pass, one_f_one_b
from ..model.idle import varlen_chunking
from ..model.sim import Hardware
from .phases import Links, shard_params, tp_seconds
from .settings import TOKENS_PER_GROUP, Setting, batch_lengths, gather_bytes
from .times import DTYPE, SegmentPrice, head_key, interp, linear_key, optimizer_key

HEAD_FWD_SHARE = 1 / 3
"""The LM head's forward share of its timed forward + backward (its matmuls: one forward, two backward);
the fused head (variant ``fused-sp``) makes its gradient in the forward: all of it there."""
MEMORY_SLACK = 0.01
"""How far over the microbatch's tokens per rank a configuration may go in the ``budget`` view (ceil
rounding of WLB's bins)."""
PP_DEGREES = (1, 2, 4, 8)
METHODS_4D = names(lambda m: m.headline or m.signal_only)
"""The methods of Table 4: the headline's (colocated, WLB-ideal, CAD with ping-pong) and the signal-only
control (:mod:`cadlib.core.methods`)."""


@dataclass(frozen=True)
class Setting4D:
    """One Table 4 row and GPU count: ``gpus`` GPUs in nodes of ``tp``, ``batch`` sequences of
    ``max_doc_len`` tokens per step, microbatches of ``micro_tokens`` tokens per node; ``linear`` as
    :class:`~cadlib.analysis.replay.settings.Setting`'s. The protocol's choices
    (:data:`WLB_CHOICES_4D`; :func:`cadlib.analysis.replay.protocol.paper_4d` sets the paper's):
    ``sequence_len`` (DistCA's sequence batches, :mod:`cadlib.analysis.replay.sweep4d`),
    ``cad_planner``, ``tolerance_rule`` (``"buffer"``: DistCA's 4D rule per tick,
    :func:`cadlib.scheduling.pipeline.fitted_tick_plans`, with ``buffer_gib``), ``optimizer`` (whether a
    step ends with the gradient all-reduce and the optimizer) as the 3D Setting's; ``schedule``:
    ``"ops"`` (each 1F1B op the slowest of its stage's DP ranks: replicas in lock-step) or
    ``"replica"`` (Megatron: each DP replica, a CP group under WLB, runs its own 1F1B until the
    gradient all-reduce; the step is the slowest replica's)."""

    name: str
    dist: str
    gpus: int
    batch: int
    max_doc_len: int
    elongate: float = 1.0
    tp: int = DISTCA_TP
    model: str = "llama3-8b"
    micro_tokens: int = TOKENS_PER_GROUP
    batches: int = 3
    seed: int = 0
    pps: tuple[int, ...] = PP_DEGREES
    wlb_cp: tuple[int, ...] = (1, 2, 4, 8)
    link: str = "ib"
    tolerance: float = DEFAULT_TOLERANCE
    min_shard: int = 512
    nano_split: str = DEFAULT_NANO_SPLIT
    linear: str = ""
    wlb_packer: str = "cut"
    wlb_gather: str = "sharing"
    wlb_choice: str = "batch"
    backward: str = "resend"
    sequence_len: int | None = None
    cad_planner: str = "ours"
    tolerance_rule: str = "fixed"
    buffer_gib: float = DISTCA_4D_BUFFER_GIB
    optimizer: bool = True
    schedule: str = "ops"

    def __post_init__(self):
        for f, valid in WLB_CHOICES_4D.items():
            if getattr(self, f) not in valid:
                raise ValueError(f"Setting4D.{f} must be one of {', '.join(map(repr, valid))}, "
                                 f"got {getattr(self, f)!r}")
        if self.backward != "resend":
            raise ValueError(f"Setting4D.backward must be 'resend', got {self.backward!r}: a microbatch's "
                             "forward and backward run in different lock-step ticks with different plans, so "
                             "no server can keep its inputs for the backward (cadlib.runtime.resend)")

    @property
    def nodes(self) -> int:
        return self.gpus // self.tp

    @property
    def total_tokens(self) -> int:
        return self.batch * self.max_doc_len

    @property
    def spec(self) -> ModelSpec:
        return as_model(self.model).shard(self.tp)

    def configs(self) -> list[tuple[int, int, int]]:
        """``(pp, dp, n_micro)``: ``pp`` divides the layers and the nodes, a microbatch (``dp x
        micro_tokens``) holds the longest document, and the step's tokens are whole microbatches."""
        out = []
        L = as_model(self.model).n_layers
        for pp in self.pps:
            if L % pp or self.nodes % pp:
                continue
            dp = self.nodes // pp
            per = dp * self.micro_tokens
            if per < self.max_doc_len or self.total_tokens % per:
                continue
            out.append((pp, dp, self.total_tokens // per))
        return out

    def wlb_degrees(self, dp: int, n_micro: int) -> tuple[int, ...]:
        """WLB-ideal's CP degrees at a configuration of ``dp`` nodes per stage and ``n_micro``
        micro-batches: every degree of ``wlb_cp`` dividing ``dp``; with ``wlb_choice="setting"`` only
        those DistCA's 4D sweep admits (``9bcf02a:benchmarks/_250923_test_pp_34b/zconfig_gen.py:79-84``:
        ``nodes // cp`` at most the sequences of a micro-batch, ``batch / n_micro``; its ``nodes``
        counts every stage). Both then take each method's configuration of least mean step
        (:func:`summarise_4d`), as the paper does."""
        out = tuple(c for c in self.wlb_cp if dp % c == 0)
        if self.wlb_choice == "setting":
            out = tuple(c for c in out if (self.nodes // c) * n_micro <= self.batch)
        return out

    def base(self, dp: int) -> Setting:
        """The 3D setting whose helpers (durations, links) one stage's ``dp`` ranks use."""
        return Setting(f"{self.name}_dp{dp}", self.dist, dp, tokens=self.micro_tokens,
                       max_doc_len=self.max_doc_len, elongate=self.elongate, tp=self.tp, model=self.model,
                       batches=self.batches, seed=self.seed, link=self.link, tolerance=self.tolerance,
                       min_shard=self.min_shard, nano_split=self.nano_split, linear=self.linear,
                       sequence_len=self.sequence_len, cad_planner=self.cad_planner,
                       tolerance_rule=self.tolerance_rule, buffer_gib=self.buffer_gib, backward="resend",
                       optimizer=self.optimizer)


WLB_CHOICES_4D = {"wlb_packer": ("cut", "distca", "distca-4d"), "wlb_gather": ("sharing", "replica"),
                  "wlb_choice": ("batch", "setting"), "cad_planner": ("ours", "distca"),
                  "tolerance_rule": ("fixed", "buffer"), "optimizer": (True, False),
                  "schedule": ("ops", "replica")}
"""The values of a 4D setting's WLB choices (the first of each: what the replay did before them).
``wlb_packer``: ``"cut"`` ours (:func:`wlb_micro_layouts`), ``"distca"`` WLB-LLM's packer over all of a
step's replicas and micro-batches with ``Lmax`` = the mean, ``"distca-4d"`` the same as DistCA's 4D
driver calls it, ``Lmax`` = the mean over the micro-batches (spec: its 3D ``Lmax`` with ``dp x
micro-batches`` buckets). ``wlb_gather`` and ``wlb_choice``: as the 3D :class:`Setting`'s (the choice:
:meth:`Setting4D.wlb_degrees`). The others: :class:`Setting4D`'s docstring."""


def paper_4d_settings(batches: int = 3, dists=("distca-pretrain", "prolong")) -> list[Setting4D]:
    """Table 4's Llama-8B rows (``DISTCA_TABLE4_8B``), lengths stretched by ``MaxDocLen / 128K`` and
    clipped to MaxDocLen as in the 3D replay."""
    out = []
    for dist in dists:
        short = "pretrain" if dist == "distca-pretrain" else dist
        for ctx, sizes, gpus in DISTCA_TABLE4_8B:
            for b, g in zip(sizes, gpus):
                out.append(Setting4D(f"4d_{short}_{ctx // 1024}k_{g}gpus", dist, g, b, ctx,
                                     elongate=ctx / TOKENS_PER_GROUP, batches=batches))
    return out


def step_groups(s: Setting4D, b: int, dp: int, n_micro: int) -> list[list[int]]:
    """Step ``b``'s documents as ``n_micro`` groups of exactly ``dp x micro_tokens`` tokens, each
    sampled like a 3D batch (:func:`cadlib.analysis.replay.settings.batch_lengths`; its own seed): the
    microbatches of ``colocated`` and CAD, whole documents each."""
    out = []
    for m in range(n_micro):
        g = Setting(s.name, s.dist, dp, tokens=s.micro_tokens, max_doc_len=s.max_doc_len,
                    elongate=s.elongate, seed=s.seed * 7_919 + m)
        out.append(batch_lengths(g, b))
    return out


def micro_layouts(s: Setting4D, groups, dp: int) -> list[Layout]:
    """Each group packed in order over the microbatch's ``dp`` ranks (documents cut between ranks)."""
    return [pack(g, dp, s.micro_tokens) for g in groups]


def wlb_micro_layouts(s: Setting4D, groups, dp: int, cp: int) -> list[Layout]:
    """WLB-ideal's microbatches: ALL the step's documents, whole, re-binned over the microbatches by
    WLB-LLM's variable-length packing (longest first to the least-loaded microbatch under a cap of
    ``dp x micro_tokens`` tokens, :func:`cadlib.analysis.model.idle.varlen_chunking`), then each microbatch
    balanced over its replicas with per-document CP of degree ``cp`` (:func:`wlb_layout`); a
    microbatch over its cap holds more tokens per rank (the memory the paper's WLB runs out of)."""
    docs = [n for g in groups for n in g]
    if s.wlb_packer != "cut":
        return wlb_distca_micro_layouts(s, docs, len(groups), dp, cp)
    bins = varlen_chunking(docs, len(groups), dp * s.micro_tokens, as_model(s.model), Hardware(attn_kernel="fa4"))
    out = []
    for chunks in bins.ranks:
        lens = [bins.doc_lens[c.doc] for c in chunks]
        per = -(-sum(lens) // dp)
        out.append(wlb_layout(lens, dp, cp, per, s.model))
    return out


def wlb_distca_micro_layouts(s: Setting4D, docs: list[int], n_micro: int, dp: int, cp: int) -> list[Layout]:
    """WLB-LLM's micro-batches as DistCA's 4D driver forms them (``tests/test_wlb_e2e.py:503-523``): the
    step's documents whole over ``n_micro x dp / cp`` buckets (:func:`cadlib.data.packing.wlb_distca_buckets`,
    ``Lmax`` = the mean, or for ``"distca-4d"`` the mean over ``n_micro`` as that driver passes it),
    bucket ``j`` the replica ``j mod (dp / cp)`` of micro-batch ``j // (dp / cp)`` (L511), each
    replica with per-document CP of degree ``cp`` (:func:`cadlib.data.packing.per_doc_cp_layout`)."""
    n_rep = dp // cp
    cap = sum(docs) // (n_micro * n_rep)
    buckets, lens = wlb_distca_buckets(docs, n_micro * n_rep, cap // n_micro if s.wlb_packer == "distca-4d"
                                       else cap, s.model)
    out = []
    for m in range(n_micro):
        mine = buckets[m * n_rep:(m + 1) * n_rep]
        ids = [d for b in mine for d in b]
        pos = {d: i for i, d in enumerate(ids)}
        out.append(per_doc_cp_layout([[pos[d] for d in b] for b in mine], [lens[d] for d in ids], cp))
    return out


# ---------------------------------------------------------------------------------------------------
# Durations
# ---------------------------------------------------------------------------------------------------

def _segments(plan, server: int):
    """A server's merged segments ``(q_len, kv_len)``: its tasks of one document with contiguous query
    ranges are one segment (as :mod:`cadlib.dispatch.kvshare` merges them)."""
    sel = plan.server == server
    doc, a, b = plan.doc[sel], plan.q_start[sel], plan.q_end[sel]
    if not doc.size:
        return np.zeros(0), np.zeros(0)
    o = np.lexsort((a, doc))
    doc, a, b = doc[o], a[o], b[o]
    new = np.ones(doc.size, dtype=bool)
    new[1:] = (doc[1:] != doc[:-1]) | (a[1:] != b[:-1])
    start = np.flatnonzero(new)
    end = b[np.r_[start[1:] - 1, doc.size - 1]]
    return (end - a[start]).astype(np.float64), end.astype(np.float64)


def _attention(plans, price, R: int) -> tuple[np.ndarray, np.ndarray]:
    """Per plan (nano-batch) and server: the forward and backward seconds of its fused call
    (:class:`cadlib.analysis.replay.times.SegmentPrice`: timed, or the kernel table scaled)."""
    f, bk = np.zeros((len(plans), R)), np.zeros((len(plans), R))
    for i, p in enumerate(plans):
        for r in range(R):
            q, kv = _segments(p, r)
            if q.size:
                f[i, r], bk[i, r] = price.seconds(q, kv)
    return f, bk


def _cad_bytes(plans, spec, backward: bool, resend: bool = True):
    """Per nano-batch and rank ``(sent, received)`` of the collectives before and after attention, with
    stateless servers (``resend``, :meth:`cadlib.core.cost.ModelSpec.cad_a2a_bytes`): forward Q and KV
    out, O and LSE back; backward Q, O, dO, LSE and KV out, dQ and dKV back."""
    per = spec.cad_a2a_bytes(resend, DTYPE)
    pre, post = [], []
    for p in plans:
        q, kv = p.token_matrices()
        qs, qr, ks, kr = q.sum(1), q.sum(0), kv.sum(1), kv.sum(0)
        for name, acc in zip(("out_bwd", "in_bwd") if backward else ("in", "out"), (pre, post)):
            bq, bkv = per[name]
            home, server = qs * bq + ks * bkv, qr * bq + kr * bkv
            acc.append((home, server) if name in CAD_A2A_TO_SERVERS else (server, home))
    return pre, post


def _linear(base: Setting, tokens, times: dict, links: Links, backend: str) -> dict:
    spec = base.spec
    lin = {f: interp(times, lambda n: linear_key(spec, backend, n, base.linear, base.tp), tokens, f)
           for f in ("pre_ms", "post_ms", "pre_bwd_ms", "post_bwd_ms")}
    tp = tp_seconds(base, tokens, links.tp)
    return {"pre": lin["pre_ms"] + tp["pre"], "post": lin["post_ms"] + tp["post"],
            "pre_bwd": lin["pre_bwd_ms"] + tp["pre_bwd"], "post_bwd": lin["post_bwd_ms"] + tp["post_bwd"]}


def _coll(link, pairs, signal_only: bool):
    t = np.stack([link.seconds(s, r) for s, r in pairs])
    return np.where(t > 0, link.latency_s, 0.0) if signal_only else t


def p2p_seconds(s: Setting4D, tokens, link) -> np.ndarray:
    """A stage's activation (or its gradient) to the next node: its tokens x hidden in bf16, each GPU
    of the tensor-parallel group sending its sequence-parallel share."""
    b = np.asarray(tokens, dtype=np.float64) * s.spec.hidden * DTYPE_BYTES[DTYPE] / s.tp
    return link.seconds(b)


def stage_params(s: Setting4D, pp: int) -> float:
    """Parameters of the largest stage's GPU: its layers and the embedding or LM head (one of them)."""
    spec = s.spec
    per_layer = spec.linear_params_per_layer() + 2 * spec.hidden
    return spec.n_layers // pp * per_layer + spec.vocab * spec.hidden * (1 if pp > 1 else 2)


def _allreduce(s: Setting4D, pp: int, dp: int, link) -> float:
    if dp == 1:
        return 0.0
    b = stage_params(s, pp) * DTYPE_BYTES[DTYPE] * 2 * (dp - 1) / dp
    return float(link.seconds(np.array([b]))[0])


def _ends(s: Setting4D, pp: int, times: dict, backend: str):
    """The optimizer of a stage, the LM head as a function of tokens (forward, backward)."""
    spec = s.spec
    opt = times[optimizer_key(spec, backend)]["ms"] * 1e-3 * stage_params(s, pp) / shard_params(spec)

    share = 1.0 if s.linear == "fused-sp" else HEAD_FWD_SHARE

    def head(tokens):
        h = interp(times, lambda n: head_key(spec, backend, n, s.linear, s.tp), tokens, "ms")
        return h * share, h * (1 - share)
    return opt, head


# ---------------------------------------------------------------------------------------------------
# One configuration's step, per method
# ---------------------------------------------------------------------------------------------------

def pipeline_1f1b(s: Setting4D, lays: list[Layout], pp: int, dp: int, times, links: Links, price,
                  backend: str, method: str, gather_cp: int | None = None, replica: int = 1) -> dict:
    """Colocated or WLB under 1F1B: each op is its stage's layers over the microbatch's ``dp`` ranks
    (``gather_cp``: per-document CP's all-gather over whole CP groups of that degree,
    :func:`cadlib.analysis.replay.settings.gather_bytes`); ``replica``: ranks per DP replica (WLB's CP
    degree), each replica its own 1F1B under ``s.schedule == "replica"``."""
    base, spec = s.base(dp), s.spec
    L = spec.n_layers // pp
    opt, head = _ends(s, pp, times, backend)
    group = replica if s.schedule == "replica" else dp     # ranks that run one 1F1B together
    n_rep = dp // group
    f, bk = np.zeros((n_rep, pp, len(lays))), np.zeros((n_rep, pp, len(lays)))
    busy = 0.0                                    # GPU-seconds of work, all stages
    for m, lay in enumerate(lays):
        tok = lay.tokens_per_rank().astype(np.float64)
        plan = scheduler.colocated(lay)
        af, ab = _attention([plan], price, dp)
        g = gather_bytes(lay, spec, gather_cp)
        lin = _linear(base, tok, times, links, backend)
        ph = Phases(**lin, attn=af[0], attn_bwd=ab[0], comm_in=links.dp.seconds(*g["in"]),
                    comm_out=links.dp.seconds(*g["out"]), comm_in_bwd=links.dp.seconds(*g["in_bwd"]),
                    comm_out_bwd=links.dp.seconds(*g["out_bwd"]), head=np.zeros(dp))
        hf, hb = head(tok)
        p2p = p2p_seconds(s, tok, links.dp) if pp > 1 else np.zeros(dp)
        fe, fb, _ = compose_pass("colocated", ph, L)
        be, bb, _ = compose_pass("colocated", ph, L, backward=True)
        top = lambda x: np.asarray(x, dtype=np.float64).reshape(n_rep, group).max(1)   # noqa: E731
        f[:, :, m] = (top(fe) + top(p2p))[:, None]
        bk[:, :, m] = (top(be) + top(p2p))[:, None]
        f[:, -1, m] += top(hf)
        bk[:, -1, m] += top(hb)
        busy += pp * float((fb + bb + 2 * p2p).sum()) + float((hf + hb).sum())
    makespan = max(one_f_one_b(f[r], bk[r])[0] for r in range(n_rep))
    step = makespan + (_allreduce(s, pp, dp, links.dp) + opt if s.optimizer else 0.0)
    return {"step_s": step, "pipeline_s": makespan, "idle_fraction": 1 - busy / (pp * dp * makespan)}


def pipeline_lockstep(s: Setting4D, lays: list[Layout], pp: int, dp: int, times, links: Links, price,
                      backend: str, signal_only: bool = False) -> dict:
    """CAD with ping-pong in DistCA's lock-step ticks, every tick's plans over all ``pp x dp`` nodes."""
    base, spec, R = s.base(dp), s.spec, pp * dp
    L = spec.n_layers // pp
    opt, head = _ends(s, pp, times, backend)
    recipe = base.recipe()
    ticks = lockstep(pp, len(lays))
    nanos = micro_nanos(lays, recipe)
    fits = []
    if s.tolerance_rule == "buffer":
        plans, fits = fitted_tick_plans(ticks, lays, recipe, spec, nanos, s.buffer_gib,
                                        DISTCA_4D_TOLERANCE_FACTORS, resend=True, dtype=DTYPE)
    else:
        plans = tick_plans(ticks, lays, recipe, spec, nanos)
    composed, imb = [], []
    for tick, ps in zip(ticks, plans):
        bwd = tick.phase == "B"
        tok = np.array([[len(r) for r in _stack_rows(tick, [n[j] for n in nanos], dp)] for j in range(2)],
                       dtype=np.float64)
        af, ab = _attention(ps, price, R)
        pre, post = _cad_bytes(ps, spec, bwd, resend=s.backward == "resend")
        lin = _linear(base, tok, times, links, backend)
        zero = np.zeros((2, R))
        c_pre, c_post = _coll(links.cad, pre, signal_only), _coll(links.cad, post, signal_only)
        ph = Phases(**lin, attn=zero if bwd else af, attn_bwd=ab if bwd else zero,
                    comm_in=zero if bwd else c_pre, comm_out=zero if bwd else c_post,
                    comm_in_bwd=c_post if bwd else zero, comm_out_bwd=c_pre if bwd else zero,
                    head=np.zeros(R))
        last = tick.micro[-1]
        hd = np.zeros(R)
        if last is not None:
            hf, hb = head(tok.sum(0)[-dp:])
            hd[-dp:] = hb if bwd else hf
        composed.append((tick.phase, ph, hd))
        imb.append(max(p.imbalance() for p in ps))
    p2p = p2p_seconds(s, s.micro_tokens, links.dp) if pp > 1 else 0.0
    ar, opt = (_allreduce(s, pp, dp, links.dp), opt) if s.optimizer else (0.0, 0.0)
    c = compose_lockstep("signal-only" if signal_only else "cad-pingpong", composed, L, ar, opt,
                         float(np.max(p2p)))
    fit = {} if not fits else {"tolerance_max": max(f.tolerance for f in fits),
                               "buffer_need_gib_max": max(f.need for f in fits) / 2 ** 30,
                               "buffer_failed_ticks": sum(f.grown for f in fits)}
    return {"step_s": c.step, "pipeline_s": c.step - ar - opt,
            "idle_fraction": c.idle_fraction, "exposed_comm_s": c.breakdown["exposed_comm_s"],
            "plan_imbalance_max": float(max(imb)), **fit}


def _stack_rows(tick, parts, dp: int):
    """Per rank of the tick, its rows of its stage's nano-batch (none on a dummy stage)."""
    out = []
    for m in tick.micro:
        out += [np.zeros(0)] * dp if m is None else list(parts[m].rows)
    return out


def replay_setting_4d(s: Setting4D, times: dict, rates: dict, backend: str, price: SegmentPrice,
                      progress=None) -> dict:
    """Every configuration and method of every batch, and per method its best configuration; ``price``
    gives the server calls' durations (and counts how many were timed)."""
    links = Links.of(s.base(1), rates)
    rows = []
    for b in range(s.batches):
        for pp, dp, n_micro in s.configs():
            groups = step_groups(s, b, dp, n_micro)
            base = micro_layouts(s, groups, dp)
            common = dict(batch=b, pp=pp, dp=dp, n_micro=n_micro)
            rows.append({**common, "method": "colocated", "cp": 1, "max_tokens_per_rank": s.micro_tokens,
                         **pipeline_1f1b(s, base, pp, dp, times, links, price, backend, "colocated")})
            for c in s.wlb_degrees(dp, n_micro):
                lays = wlb_micro_layouts(s, groups, dp, c)
                top = int(max(lay.tokens_per_rank().max() for lay in lays))
                rows.append({**common, "method": "wlb", "cp": c, "max_tokens_per_rank": top,
                             **pipeline_1f1b(s, lays, pp, dp, times, links, price, backend, "wlb",
                                             c if s.wlb_gather == "replica" else None)})
            for m in names(pingpong=True):
                rows.append({**common, "method": m, "cp": 1, "max_tokens_per_rank": s.micro_tokens,
                             **pipeline_lockstep(s, base, pp, dp, times, links, price, backend,
                                                 signal_only=METHODS[m].signal_only)})
            if progress is not None:
                progress(f"{s.name} batch {b} pp={pp}")
    return {"per_config": rows, "summary": summarise_4d(s, rows),
            "attention_calls": {"timed": price.timed, "modelled": price.modelled}}


def summarise_4d(s: Setting4D, rows: list[dict]) -> list[dict]:
    """Per method and view its best configuration (the lowest mean step over the batches) and the
    speedups over WLB-ideal's and colocated's best in the same view (mean steps, as the paper averages
    durations). Views: ``any`` (every configuration), ``budget`` (only those whose ranks all hold at
    most ``micro_tokens x (1 + MEMORY_SLACK)`` tokens: the paper sets the batch where the baseline
    just fits in memory) and ``pp=<n>`` (at that pipeline degree)."""
    import collections
    by = collections.defaultdict(list)
    top = collections.defaultdict(int)
    for r in rows:
        k = (r["method"], r["pp"], r["dp"], r["cp"])
        by[k].append(r["step_s"])
        top[k] = max(top[k], r["max_tokens_per_rank"])
    views = {"any": lambda k: True,
             "budget": lambda k: top[k] <= s.micro_tokens * (1 + MEMORY_SLACK),
             **{f"pp={pp}": (lambda k, pp=pp: k[1] == pp) for pp, _, _ in s.configs()}}
    out = []
    for view, keep in views.items():
        best = {}
        for k, steps in by.items():
            if not keep(k):
                continue
            mean = float(np.mean(steps))
            if k[0] not in best or mean < best[k[0]]["step_s_mean"]:
                best[k[0]] = {"setting": s.name, "dist": s.dist, "max_doc_len": s.max_doc_len, "gpus": s.gpus,
                              "batch": s.batch, "view": view, "method": k[0], "pp": k[1], "dp": k[2], "cp": k[3],
                              "batches": len(steps), "step_s_mean": mean, "max_tokens_per_rank": top[k]}
        for r in best.values():
            for base in ("wlb", "colocated"):
                if base in best:
                    r[f"speedup_over_{base}"] = best[base]["step_s_mean"] / r["step_s_mean"]
        out += [best[m] for m in METHODS_4D if m in best]
    return out

"""The paper's scale on one GPU: every rank's work in a step, as kernels of known shapes to time on one
GPU, composed into a step with a link model (:mod:`cadlib.analysis.model.compose`).

A rank's work in one layer is a fixed set of kernel calls: its linear layers at its token count, and its
attention server's one fused call over the CA-tasks its dispatch gives it. So one GPU can time every
rank of a 256-GPU run, one after another; only the network is modelled. The replay is three modules,
each using the one before it:

* this one, what is replayed (host only, numpy): a :class:`Setting` and the paper's settings, and for
  each sampled batch and method the layout and plans (:mod:`cadlib.scheduling`), every rank's token
  counts, its attention-server dispatch and the bytes its collectives move (:class:`Work`);
* :mod:`cadlib.analysis.replay.phases`: the links, and work plus timed shapes as per-rank durations of
  each phase (or the simulator's durations for the same work), composed into steps;
* :mod:`cadlib.analysis.replay.results`: a setting's batches replayed, summarised and checked against
  the committed runs they replay.

``scripts/bench/bench_replay.py`` times what the durations need on a GPU, caching every timed shape under a
key of the call's shape (:mod:`cadlib.analysis.replay.times`); :mod:`cadlib.analysis.replay.pipelined` is the
same with pipeline parallelism.

Tensor parallelism: a DistCA node is one tensor-parallel group of ``tp`` GPUs (Megatron's cut), so each
GPU runs ``1/tp`` of every layer's heads and MLP on all of its group's tokens
(:meth:`cadlib.core.cost.ModelSpec.shard`), and the layer's tensor-parallel all-gathers and
reduce-scatters cross NVLink. The replay times that shard: per-GPU times, not a whole group's.

Methods: ``colocated`` (sequential packing, per-document CP for documents split between ranks), ``wlb``
(WLB-ideal: balanced packing over ``dp / c`` replicas with per-document CP of degree ``c`` inside
each, at the degrees of :meth:`Setting.wlb_degrees`), ``cad``, ``cad-pingpong`` and ``signal-only``
(ping-pong with every collective cut to its latency). By default the per-document all-gather is
counted among the ranks that hold a document (:func:`cadlib.data.packing.per_doc_gather_tokens`) and
repeated before the backward; WLB-LLM's code gathers its CP group's whole K, V once and keeps them for
the backward (``wlb_gather="replica"``). WLB's per-document CP puts a piece of nearly every document on
every rank of its group, so the two gather the same bytes: what differs is the backward's second gather.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from ...core.cost import CAD_A2A_TO_SERVERS, ModelSpec, as_model
from ...core.defaults import DEFAULT_NANO_SPLIT, DEFAULT_TOLERANCE
from ...core.layout import Layout
from ...core.methods import METHODS, names
from ...core.paper import DISTCA_TABLE3_8B, DISTCA_TP
from ...data.packing import pack, per_doc_gather_tokens, replica_gather_tokens, wlb_distca_layout, wlb_layout
from ...data.workload import sample_docs, sample_kwargs, sample_lengths
from ...dispatch.build import build_all
from ...dispatch.meta import Dispatch
from ...scheduling import scheduler
from ...scheduling.buffer import fit_buffer
from ...scheduling.recipes import Recipe, batch_docs, cad_plan, method_layout, nano_plans
from ..model.idle import varlen_chunking
from ..model.sim import Hardware
from .times import DTYPE, LINEAR_VARIANTS

TOKENS_PER_GROUP = 131072
"""Tokens per data-parallel group in the paper's 3D settings: a batch size of ``B`` MaxDocLen-long
sequences over ``N`` GPUs of TP=8 is ``B x MaxDocLen / (N / 8)`` = 128K tokens in every row of Table 3."""



@dataclass(frozen=True)
class Setting:
    """One replayed configuration: ``dp`` data-parallel groups of ``tp`` GPUs, ``tokens`` tokens per
    group, ``batches`` sampled batches. ``dist`` is a workload name or preset; lengths are stretched by
    ``elongate`` and clipped to ``max_doc_len``. ``lengths``: a user's document lengths, sampled instead
    of ``dist`` (:func:`cadlib.data.workload.sample_lengths`, the same seeds). ``model``: a name or a
    :class:`ModelSpec`. ``config``: a committed end-to-end run's configuration, whose batches
    (:func:`cadlib.scheduling.recipes.batch_docs`) are replayed instead of sampled.

    The protocol's choices (:mod:`cadlib.analysis.replay.protocol` names the paper's and our variants):

    * ``sequence_len``: DistCA's batches, sequences of that many tokens (MaxDocLen) from one document
      stream (:mod:`cadlib.data.sequences`); ``nano_split="distca"`` then forms ping and pong from
      separate sequences. None: each batch sampled on its own, as our end-to-end runs do.
    * WLB-ideal: ``wlb_packer`` ``"distca"`` (WLB-LLM's packer as DistCA runs it: whole documents,
      longest first, capped at the mean) or ``"cut"`` (ours: a 1.25x token cap, costly documents cut
      into pieces); ``wlb_gather`` ``"replica"`` (per-document CP all-gathers its replica's whole K, V,
      as DistCA's) or ``"sharing"`` (only among the ranks that share a document); ``wlb_choice``
      ``"setting"`` (one CP degree per setting, the best mean over the batches, as the paper reports)
      or ``"batch"`` (ours: the best degree of each batch, an oracle).
    * CAD: ``cad_planner`` ``"distca"`` (DistCA's released planner) or ``"ours"``; ``tolerance_rule``
      ``"buffer"`` (DistCA's: the first of its tolerances from ``tolerance`` up, 0.05 in its runs, whose
      plans' all-to-alls fit a ``buffer_gib`` communication buffer per GPU, else 1.0 and a larger buffer;
      :func:`cad_plans`) or ``"fixed"`` (``tolerance``); ``backward`` ``"resend"``
      (DistCA's stateless servers: O and LSE return in the forward, dO, O, LSE, Q, K, V go out again in
      the backward) or ``"stateful"`` (ours: servers keep their inputs, the backward sends dO).
    * ``optimizer``: whether a step ends with the gradient all-reduce and the optimizer (DistCA's timed
      iterations skip the optimizer step)."""

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
    methods: tuple[str, ...] = names(trainable=True)
    wlb_cp: tuple[int, ...] = (1, 2, 4, 8)
    wlb_top: int = 2
    link: str = "ib"
    tolerance: float = DEFAULT_TOLERANCE
    min_shard: int = 512
    nano_split: str = DEFAULT_NANO_SPLIT
    sequence_len: int | None = None
    wlb_packer: str = "cut"
    wlb_gather: str = "sharing"
    wlb_choice: str = "batch"
    cad_planner: str = "ours"
    tolerance_rule: str = "fixed"
    buffer_gib: float = 2.0
    backward: str = "stateful"
    optimizer: bool = True
    linear: str = ""
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
        if isinstance(self.buffer_gib, bool) or not (isinstance(self.buffer_gib, (int, float))
                                                     and 0 < self.buffer_gib < float("inf")):
            raise ValueError(f"Setting.buffer_gib must be a finite number > 0 (GiB), got {self.buffer_gib!r}")
        for f, valid in CHOICES.items():
            if getattr(self, f) not in valid:
                raise ValueError(f"Setting.{f} must be one of {', '.join(map(repr, valid))}, "
                                 f"got {getattr(self, f)!r}")

    @property
    def spec(self) -> ModelSpec:
        """The model of one GPU: the tensor-parallel shard of ``model`` with ``n_layers`` layers."""
        m = as_model(self.model, **({"n_layers": self.n_layers} if self.n_layers else {}))
        return m.shard(self.tp)

    def cp_degrees(self) -> tuple[int, ...]:
        return tuple(c for c in self.wlb_cp if self.dp % c == 0)

    def sequences_per_step(self) -> int:
        """MaxDocLen-long sequences in a step (Table 3's batch size): ``dp x tokens`` over
        ``sequence_len`` (DistCA's batches) or else ``max_doc_len``; ``dp`` when neither is set."""
        n = self.sequence_len or self.max_doc_len
        return self.dp * self.tokens // n if n else self.dp

    def wlb_degrees(self) -> tuple[int, ...]:
        """The CP degrees WLB-ideal is composed at. ``wlb_choice="batch"``: every degree of ``wlb_cp``
        dividing ``dp`` (:meth:`cp_degrees`; the replay times the simulator's ``wlb_top`` of each batch).
        ``"setting"``, DistCA's 3D sweep (``9bcf02a:benchmarks/_250918_large_scale_v11_dpcp/
        salloc_srun.sweep-bigbatch-pretrain-8b.sh:121-146``: CP from 32 down, skipped if above the
        nodes or if ``nodes / CP`` exceeds the step's sequences, stopped after two runs): the
        ``wlb_top`` largest of those degrees with ``dp / c <= sequences_per_step()``, at least one
        sequence per replica (without sequences, a replica holds at least ``max_doc_len`` tokens)."""
        if self.wlb_choice == "batch":
            return self.cp_degrees()
        ok = sorted((c for c in self.cp_degrees() if self.dp // c <= self.sequences_per_step()), reverse=True)
        if not ok:
            raise ValueError(f"Setting.wlb_cp={self.wlb_cp} holds no CP degree dividing dp={self.dp} with "
                             f"dp / cp <= {self.sequences_per_step()} sequences per step; add larger degrees")
        return tuple(ok[:self.wlb_top])

    def recipe(self) -> Recipe:
        """How its batches are sampled and planned (:mod:`cadlib.scheduling.recipes`): a committed
        run's ``config`` where it says, else this setting's fields."""
        return Recipe.from_config(self.config or {}, dist=self.dist, tokens_per_rank=self.tokens,
                                  seed=self.seed, max_doc_len=self.max_doc_len, tolerance=self.tolerance,
                                  min_shard=self.min_shard, nano_split=self.nano_split,
                                  sequence_len=self.sequence_len, planner=self.cad_planner)


LINK_NAMES = ("ib", "ib-low", "nvlink", "inter-node-like")
CHOICES = {"wlb_packer": ("cut", "distca"), "wlb_gather": ("sharing", "replica"),
           "wlb_choice": ("batch", "setting"), "cad_planner": ("ours", "distca"),
           "tolerance_rule": ("fixed", "buffer"), "backward": ("stateful", "resend"),
           "optimizer": (True, False), "linear": tuple(LINEAR_VARIANTS)}
"""The values of a setting's protocol choices (the first of each: what the replay did before them)."""


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
    """A committed end-to-end run (an item of :func:`cadlib.analysis.runs.e2e.load_committed`) as a setting:
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


def idle_settings(batches: int = 5) -> list[Setting]:
    """The motivation's idle figure (Figure 4b): 8B, TP=8, 512K-token data chunks per DP group (DP 1,
    2, 4, 8), DistCA's Pretrain at MaxDocLen 512K: variable-length chunking of whole documents under a
    cap of the group's tokens (:func:`cadlib.analysis.model.idle.varlen_chunking`, the paper's baseline),
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


def smoke_settings() -> list[Setting]:
    """A CPU smoke setting: the tiny model on 4 ranks, 1,024 tokens each, two batches, with the
    reference kernel (``sdpa_ref``): what the replay's tools run in CI."""
    return [Setting("smoke_pretrain_dp4", "pretrain", 4, tokens=1024, max_doc_len=1024, tp=1, model="tiny",
                    batches=2, wlb_cp=(1, 2), min_shard=32, link="nvlink")]


# ---------------------------------------------------------------------------------------------------
# A batch's work, rank by rank (host only)
# ---------------------------------------------------------------------------------------------------

def batch_lengths(s: Setting, b: int) -> list[int]:
    """Document lengths of batch ``b``: the committed run's (its seeds) or sampled for the setting."""
    if s.config is not None or s.sequence_len is not None:
        return batch_docs(s.recipe(), b, s.dp)
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


def _cad_bytes(ds: list[Dispatch], spec: ModelSpec, resend: bool = False) -> dict:
    """The all-to-alls of CAD's stages per rank, ``(sent, received)`` bytes: send (Q and deduplicated
    KV), return (O), return' (dO out) and send' (dQ, dK, dV back); ``resend``: DistCA's stateless
    servers (O and LSE return; dO, O, LSE, Q and the KV again out in the backward), the bytes per token
    of :meth:`cadlib.core.cost.ModelSpec.cad_a2a_bytes`."""
    qs, qr = (np.array([d.n_send_q for d in ds]), np.array([d.n_recv_q for d in ds]))
    ks, kr = (np.array([d.n_send_kv for d in ds]), np.array([d.n_recv_kv for d in ds]))
    out = {}
    for name, (bq, bkv) in spec.cad_a2a_bytes(resend, DTYPE).items():
        home, server = qs * bq + ks * bkv, qr * bq + kr * bkv
        out[name] = (home, server) if name in CAD_A2A_TO_SERVERS else (server, home)
    return out


def gather_bytes(layout: Layout, spec: ModelSpec, cp: int | None = None) -> dict:
    """Per-document CP's collectives. ``cp`` None (``wlb_gather="sharing"``): the all-gather of shared
    documents' K, V among the ranks that share them before attention (and again before its backward),
    and the return of their dK, dV after it. ``cp`` (``"replica"``, WLB-LLM's code): every rank of a
    CP group gathers the K, V of all its group's documents, with WLB-LLM's packer the whole group's
    tokens (:func:`cadlib.data.packing.replica_gather_tokens`,
    ``baseline/wlbllm_original/wlbllm/per_doc_cp_attn.py:126-153``), saved for the backward (L326-335,
    so no second gather), and dK, dV are reduce-scattered after the backward's attention (L468-475)."""
    sent, recv = per_doc_gather_tokens(layout) if cp is None else replica_gather_tokens(layout, cp)
    kvb = spec.kv_bytes(DTYPE)
    g = (sent * kvb, recv * kvb)
    zero = (np.zeros_like(g[0]), np.zeros_like(g[0]))
    return {"in": g, "out": zero, "out_bwd": g if cp is None else zero, "in_bwd": (g[1], g[0])}


def _colocated_work(method: str, layout: Layout, spec: ModelSpec, meta: dict, gather_cp: int | None = None
                    ) -> Work:
    plan = scheduler.colocated(layout)
    ds = build_all(plan)
    return Work(method, layout.tokens_per_rank().astype(np.int64), [ds],
                gather_bytes(layout, spec, gather_cp), [[_served(plan, r) for r in range(layout.n_ranks)]], {**meta, "imbalance": plan.imbalance()})


def wlb_work(s: Setting, docs: list[int], cp: int) -> Work:
    """WLB-ideal's work at CP degree ``cp``: the layout of ``s.wlb_packer`` (``"cut"``:
    :func:`cadlib.data.packing.wlb_layout`; ``"distca"``: :func:`cadlib.data.packing.wlb_distca_layout`,
    ``Lmax`` = a replica's ``cp x tokens``) and the all-gather of ``s.wlb_gather`` (:func:`gather_bytes`)."""
    lay_of = wlb_distca_layout if s.wlb_packer == "distca" else wlb_layout
    layout = lay_of(docs, s.dp, cp, s.tokens, s.model)
    return _colocated_work("wlb", layout, s.spec, {"cp": cp}, cp if s.wlb_gather == "replica" else None)


def method_work(s: Setting, docs: list[int], method: str, cp: int = 1) -> Work:
    """``method``'s work for a batch of documents ``docs`` (``cp``: WLB's context-parallel degree)."""
    spec, R, recipe = s.spec, s.dp, s.recipe()
    if method == "colocated":
        return _colocated_work(method, pack(docs, R, s.tokens), spec, {})
    if method == "wlb":
        return wlb_work(s, docs, cp)
    if method == "varlen":
        lay = varlen_chunking(docs, R, s.tokens, as_model(s.model), Hardware(attn_kernel="fa4"))
        return _colocated_work(method, lay, spec, {})
    layout = method_layout(docs, R, recipe, METHODS[method])
    resend = s.backward == "resend"
    nanos, plans, fit = cad_plans(s, layout, recipe, spec, pingpong=method != "cad")
    if method == "cad":
        plan = plans[0]
        ds = build_all(plan)
        return Work(method, layout.tokens_per_rank().astype(np.int64), [ds], _cad_bytes(ds, spec, resend),
                    [[_served(plan, r) for r in range(R)]], {"imbalance": plan.imbalance(), **fit})
    ds = [build_all(p) for p in plans]
    per = [_cad_bytes(d, spec, resend) for d in ds]
    byts = {k: tuple(np.stack([p[k][i] for p in per]) for i in range(2)) for k in per[0]}
    tokens = np.array([[len(nb.rows[r]) for r in range(R)] for nb in nanos], dtype=np.int64)
    return Work(method, tokens, ds, byts, [[_served(p, r) for r in range(R)] for p in plans],
                {"imbalance": [p.imbalance() for p in plans], **fit})


def cad_plans(s: Setting, layout: Layout, recipe: Recipe, spec: ModelSpec, pingpong: bool):
    """CAD's plans of a batch, ``(nano-batches or None, plans, record)``: ping-pong's two or one plan,
    by the setting's planner (``cad_planner``, through the recipe) at its tolerance rule. ``"fixed"``:
    at ``tolerance`` (record empty). ``"buffer"``: DistCA's rule
    (:func:`cadlib.scheduling.buffer.fit_buffer`): the first of DistCA's tolerances from ``tolerance``
    (its ``MIN_TOLERANCE_FACTOR``) up whose plans' four all-to-alls fit ``buffer_gib`` per GPU with the
    bytes of the setting's ``backward``, else tolerance 1.0 and a grown buffer; the record says which
    (``tolerance``, ``buffer_need_gib``, ``buffer_gib``, ``buffer_grown``, ``tolerances_tried``)."""
    def at(tol: float):
        r = recipe if tol == recipe.tolerance else replace(recipe, tolerance=tol)
        return nano_plans(layout, r, spec) if pingpong else (None, [cad_plan(layout, r, spec)])

    if s.tolerance_rule == "fixed":
        return (*at(recipe.tolerance), {})
    fit = fit_buffer(at, spec, s.buffer_gib, resend=s.backward == "resend", min_tolerance=recipe.tolerance,
                     plans=lambda made: made[1], dtype=DTYPE)
    return (*fit.made, fit.meta())

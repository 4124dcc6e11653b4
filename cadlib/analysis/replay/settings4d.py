"""The paper's 4D settings (Table 4: DP x PP x CP x TP, Llama-8B) and their micro-batches, as the 4D
replay (:mod:`cadlib.analysis.replay.pipelined`) composes them.

A step's documents (``batch`` sequences of MaxDocLen tokens' worth, sampled as the 3D replay samples
them) run as ``n_micro`` microbatches of ``dp x micro_tokens`` tokens through ``pp`` stages of
``n_layers / pp`` layers each; every stage is a node of TP=8 GPUs, so ``dp x pp`` nodes. A
microbatch is a group of whole documents of exactly ``dp x micro_tokens`` tokens, sampled as a 3D
batch is (:func:`step_groups`); no document crosses microbatches, so every method attends the same
documents. WLB-ideal re-bins the step's documents whole over the microbatches by WLB-LLM's
variable-length packing, then balances each microbatch's replicas with per-document CP
(:func:`wlb_micro_layouts`; as DistCA's 4D driver runs it, :func:`wlb_distca_micro_layouts`).
"""
from __future__ import annotations

from dataclasses import dataclass

from ...core.cost import ModelSpec, as_model
from ...core.defaults import DEFAULT_NANO_SPLIT, DEFAULT_TOLERANCE
from ...core.layout import Layout
from ...core.paper import DISTCA_4D_BUFFER_GIB, DISTCA_TABLE4_8B, DISTCA_TP
from ...data.packing import pack, per_doc_cp_layout, wlb_distca_buckets, wlb_layout
from ..model.idle import varlen_chunking
from ..model.sim import Hardware
from .settings import TOKENS_PER_GROUP, Setting, batch_lengths

PP_DEGREES = (1, 2, 4, 8)


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
        (:func:`cadlib.analysis.replay.pipelined.summarise_4d`), as the paper does."""
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

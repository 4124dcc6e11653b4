"""The paper's protocol as replay settings, and each of our own choices as a labelled variant of it.

Where the paper's text or DistCA's code fixes a choice, the protocol (:func:`paper_3d`) takes it; where the
two disagree, the code (what ran) is the protocol and the text a variant. Our own choices, the replay's
before it followed the protocol, are :data:`VARIANTS`: one Setting field changed each. Switched one at a
time (:func:`one_change`) each says what that choice alone moves; switched cumulatively in the listed order
(:func:`variant`), they walk from the paper's protocol to our earlier replay (which also ran colocated and
one-stream CAD, methods the paper's figures do not compare): a waterfall whose steps add up to the whole
difference. ``docs/fidelity.md`` tabulates them with their sources.

The protocol (DistCA's code at the paper's runs; ``docs/fidelity.md`` cites file and line):

* batches: DistCA's samplers (:mod:`cadlib.data.sequences`), sequences of MaxDocLen tokens, Table 3's batch
  of sequences per step (128K tokens per node for Llama-8B), :data:`PAPER_BATCHES_3D` steps per setting;
* ping and pong: the first half of a step's sequences and the rest, each laid over all nodes;
* WLB-ideal: WLB-LLM's packer as DistCA runs it (whole documents, longest first, capped at the mean),
  per-document CP that all-gathers its replica's K, V, the two largest admissible CP degrees
  (:func:`wlb_degrees`) and one of them per setting, the best mean;
* CAD: DistCA's planner, the first tolerance from 0.05 up whose plans fit a 2 GiB buffer, stateless
  servers (the backward resends Q, K, V, O, LSE with dO);
* a step is forward and backward: DistCA's timed iterations skip the optimizer step;
* speedup: the mean WLB-ideal step over the mean CAD step (the figures' captions); FA2 kernels.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ...core.paper import (DISTCA_4D_BUFFER_GIB, DISTCA_MIN_TOLERANCE, DISTCA_TABLE3_8B, DISTCA_TABLE4_8B,
                           DISTCA_TP, DISTCA_ZCONFIG)
from .settings4d import Setting4D
from .settings import Setting

PAPER_BATCHES_3D = 15
"""Steps per 3D setting: DistCA's 3D runs took 15 (Pretrain) to 20 (ProLong) samples
(``MAX_SAMPLE_ID``); the text says 30."""
PAPER_BATCHES_4D = 10
"""Steps per 4D setting: DistCA's 8B 4D runs took 3 or 10 samples, its large 34B ones 30."""
WLB_CP_GRID = (32, 16, 8, 4, 2, 1)
"""The CP degrees DistCA's WLB scripts try, largest first (``for CP in 32 16 8 4 2 1``)."""
PAPER_DISTS = {"pretrain": "pretrain-distca", "prolong": "prolong-distca"}
"""The protocol's samplers by the paper's dataset names."""
OURS_DISTS = {"pretrain": "distca-pretrain", "prolong": "prolong"}
"""Our earlier samplers: i.i.d. per batch, stretched by MaxDocLen / 128K and clipped (Pretrain: our reading
of the text, long documents drawn twice as often; ProLong: the raw table)."""

PAPER = {"nano_split": "distca", "wlb_packer": "distca", "wlb_gather": "replica", "wlb_choice": "setting",
         "cad_planner": "distca", "tolerance_rule": "buffer", "backward": "resend", "optimizer": False}
"""The Setting fields the protocol fixes (besides the batches and WLB's degrees, set per setting)."""
PAPER_METHODS = ("wlb", "cad-pingpong", "signal-only")
"""What the paper's Figures 9-11 compare: WLB-ideal, DistCA (CAD with ping-pong) and the signal-only
control; colocated and one-stream CAD are not among its 3D runs."""


def wlb_degrees(nodes: int, sequences: int, top: int = 2) -> tuple[int, ...]:
    """The CP degrees DistCA's scripts run WLB-ideal with: the ``top`` largest of :data:`WLB_CP_GRID` with
    ``c <= nodes`` and at most one replica per sequence (``nodes / c <= sequences``)."""
    ok = [c for c in WLB_CP_GRID if c <= nodes and nodes % c == 0 and nodes // c <= sequences]
    if not ok:
        raise ValueError(f"no CP degree of {WLB_CP_GRID} fits {nodes} nodes and {sequences} sequences")
    return tuple(ok[:top])


def paper_3d(dataset: str, batches: int = PAPER_BATCHES_3D) -> list[Setting]:
    """Table 3's Llama-8B rows (MaxDocLen 128K-512K, 64-256 GPUs, TP=8) under the paper's protocol."""
    if dataset not in PAPER_DISTS:
        raise ValueError(f"unknown dataset {dataset!r}; choose one of: {', '.join(PAPER_DISTS)}")
    out = []
    for ctx, sizes, gpus in DISTCA_TABLE3_8B:
        for seqs, g in zip(sizes, gpus):
            dp = g // DISTCA_TP
            out.append(Setting(f"3d_{dataset}_{ctx // 1024}k_dp{dp}", PAPER_DISTS[dataset], dp,
                               tokens=seqs * ctx // dp, max_doc_len=ctx, sequence_len=ctx, batches=batches,
                               wlb_cp=wlb_degrees(dp, seqs), wlb_top=2, tolerance=0.05, methods=PAPER_METHODS,
                               **PAPER))
    return out


@dataclass(frozen=True)
class Variant:
    """One of our choices: its name, what it says, and the Setting fields it changes (a callable of the
    setting for the samplers, whose fields depend on the MaxDocLen)."""

    name: str
    label: str
    fields: dict
    why: str

    def apply(self, s: Setting) -> Setting:
        f = self.fields(s) if callable(self.fields) else self.fields
        return replace(s, name=f"{s.name}@{self.name}", **f)


def _ours_samplers(s: Setting) -> dict:
    ctx = s.sequence_len or s.max_doc_len
    dataset = next(k for k, v in PAPER_DISTS.items() if v == s.dist) if s.dist in PAPER_DISTS.values() else None
    if dataset is None:
        raise ValueError(f"the samplers variant applies to the protocol's samplers, not {s.dist!r}")
    return {"dist": OURS_DISTS[dataset], "sequence_len": None, "max_doc_len": ctx, "elongate": ctx / 131072,
            "nano_split": "docs" if s.nano_split == "distca" else s.nano_split}


VARIANTS = (
    Variant("nano", "nano-batches: per-rank halves that may cut documents",
            {"nano_split": "docs"},
            "ours cut each rank's tokens in two, a cut document's head in A and its tail (with its long KV "
            "prefix) in B; DistCA forms ping and pong from separate sequences"),
    Variant("samplers", "samplers: i.i.d. per batch from the tables",
            _ours_samplers,
            "ours drew each batch on its own from the length tables (Pretrain: long documents twice as "
            "often; ProLong: the raw table), stretched by MaxDocLen / 128K; DistCA's code repeats long "
            "documents x4 by raw length, keeps half the short ones, and puts ProLong's long ones first"),
    Variant("wlb_choice", "WLB-ideal: the best CP degree of each batch",
            {"wlb_choice": "batch", "wlb_cp": (1, 2, 4, 8)},
            "ours let WLB-ideal pick its CP degree batch by batch (an oracle) among 1-8; the paper runs one "
            "degree per setting, the best mean of the two largest"),
    Variant("wlb_packer", "WLB-ideal: packing that cuts costly documents, 1.25x cap",
            {"wlb_packer": "cut"},
            "ours cut costly documents into equal-cost pieces under a 1.25x token cap; WLB-LLM as DistCA runs "
            "it places whole documents, longest first, capped at the mean"),
    Variant("wlb_gather", "WLB-ideal: all-gathers among the ranks sharing a document",
            {"wlb_gather": "sharing"},
            "ours gathered a document's K, V only among the ranks holding it; DistCA's per-document CP "
            "all-gathers the whole replica's"),
    Variant("planner", "CAD: our scheduler",
            {"cad_planner": "ours"},
            "ours picks moves by bytes per pair with a guard against equal-FLOPs; DistCA's planner"),
    Variant("tolerance", "CAD: tolerance 0.02",
            {"tolerance_rule": "fixed", "tolerance": 0.02},
            "ours balanced to 2%; DistCA takes the first tolerance from 0.05 whose plans fit 2 GiB"),
    Variant("backward", "CAD: stateful attention servers",
            {"backward": "stateful"},
            "ours keep each server's inputs until the backward, which sends dO only; DistCA's resend"),
    Variant("optimizer", "a step includes the gradient all-reduce and the optimizer",
            {"optimizer": True},
            "DistCA's timed iterations skip the optimizer step"),
)
"""Our choices, in the waterfall's order (a later one may need an earlier: the samplers need per-rank
nano-batches). The kernel (FA2, the paper's, against FA4) is a choice of the composition, not the setting."""

_BY_NAME = {v.name: v for v in VARIANTS}


def one_change(s: Setting, name: str) -> Setting:
    """``s`` with only variant ``name`` applied (the samplers variant brings its nano-batches along)."""
    if name not in _BY_NAME:
        raise ValueError(f"unknown variant {name!r}; choose one of: {', '.join(_BY_NAME)}")
    return _BY_NAME[name].apply(s)


def variant(s: Setting, upto: str) -> Setting:
    """``s`` with every variant up to and including ``upto`` applied, in :data:`VARIANTS`' order, named
    ``<s.name>@upto-<upto>`` (:func:`one_change`'s are ``<s.name>@<name>``)."""
    if upto not in _BY_NAME:
        raise ValueError(f"unknown variant {upto!r}; choose one of: {', '.join(_BY_NAME)}")
    out = s
    for v in VARIANTS:
        out = replace(v.apply(out), name=f"{s.name}@upto-{v.name}")
        if v.name == upto:
            break
    return out


# ---------------------------------------------------------------------------------------------------
# 4D (Table 4): DistCA's sweep of every configuration that fits in memory, for both methods
# ---------------------------------------------------------------------------------------------------

PAPER_4D = {"nano_split": "distca", "wlb_packer": "distca", "wlb_gather": "replica", "wlb_choice": "setting",
            "cad_planner": "distca", "tolerance_rule": "buffer", "tolerance": DISTCA_MIN_TOLERANCE,
            "buffer_gib": DISTCA_4D_BUFFER_GIB, "optimizer": False, "schedule": "replica",
            "pps": DISTCA_ZCONFIG["pp"], "wlb_cp": DISTCA_ZCONFIG["wlb_cp"]}
"""The Setting4D fields the 4D protocol fixes: the 3D protocol's choices (:data:`PAPER`), DistCA's 4D
tolerance rule (per tick, from 0.05 up, a 4 GiB buffer, a tick that fits at none fails the run), 1F1B per
DP replica, the zconfig grid's PP and CP degrees (:mod:`cadlib.analysis.replay.sweep4d` replays the grid,
each configuration filtered by the memory model, each method's best by mean step)."""


def paper_4d(dataset: str, batches: int = PAPER_BATCHES_4D) -> list[Setting4D]:
    """Table 4's Llama-8B rows (MaxDocLen 128K-512K, 64-256 GPUs, TP=8) under the paper's protocol: a step
    of Table 4's batch of MaxDocLen sequences (its batch counts both ping and pong: section 5 of the
    notes), DistCA's samplers, :data:`PAPER_4D`."""
    if dataset not in PAPER_DISTS:
        raise ValueError(f"unknown dataset {dataset!r}; choose one of: {', '.join(PAPER_DISTS)}")
    return [Setting4D(f"4d_{dataset}_{ctx // 1024}k_{g}gpus", PAPER_DISTS[dataset], g, seqs, ctx,
                      sequence_len=ctx, batches=batches, **PAPER_4D)
            for ctx, sizes, gpus in DISTCA_TABLE4_8B for seqs, g in zip(sizes, gpus)]


VARIANTS_4D = (
    Variant("schedule", "1F1B: a stage's DP replicas in lock-step",
            {"schedule": "ops"},
            "ours took each 1F1B op as the slowest of its stage's DP ranks; Megatron runs each replica's "
            "pipeline on its own until the gradient all-reduce"),
    Variant("nano", "nano-batches: per-rank halves that may cut documents",
            {"nano_split": "docs"}, VARIANTS[0].why),
    Variant("wlb_packer", "WLB-ideal: packing that cuts costly documents, 1.25x cap",
            {"wlb_packer": "cut"}, _BY_NAME["wlb_packer"].why),
    Variant("wlb_packer_4d", "WLB-ideal as DistCA's 4D driver ran it: the cap over the micro-batches",
            {"wlb_packer": "distca-4d"},
            "DistCA's 4D WLB driver passes the step's sequences with dp x micro-batches buckets, so its "
            "packer caps each bucket at the mean over the micro-batches and places most documents uncapped "
            "(tests/test_wlb_e2e.py:503-523): the baseline as run, weaker than WLB-LLM"),
    Variant("wlb_gather", "WLB-ideal: all-gathers among the ranks sharing a document",
            {"wlb_gather": "sharing"}, _BY_NAME["wlb_gather"].why),
    Variant("planner", "CAD: our scheduler", {"cad_planner": "ours"}, _BY_NAME["planner"].why),
    Variant("tolerance", "CAD: tolerance 0.02",
            {"tolerance_rule": "fixed", "tolerance": 0.02},
            "ours balanced to 2%; DistCA's 4D driver takes per tick the first tolerance from 0.05 whose "
            "plans fit its 4 GiB buffer"),
    Variant("optimizer", "a step includes the gradient all-reduce and the optimizer",
            {"optimizer": True}, _BY_NAME["optimizer"].why),
)
"""Our 4D choices, each one Setting4D field (:func:`one_change_4d`). Two more are views of the same runs
(:data:`cadlib.analysis.replay.sweep4d.VIEWS`): ``any`` (no memory limit) and ``oracle`` (WLB-ideal's best
configuration batch by batch). Not a 4D variant: the stateful servers (a micro-batch's forward and backward
run in different ticks with different plans) and the samplers (the sweep forms micro-batches from
sequences)."""

_BY_NAME_4D = {v.name: v for v in VARIANTS_4D}


def one_change_4d(s: Setting4D, name: str) -> Setting4D:
    """4D setting ``s`` with only variant ``name`` of :data:`VARIANTS_4D` applied."""
    if name not in _BY_NAME_4D:
        raise ValueError(f"unknown 4D variant {name!r}; choose one of: {', '.join(_BY_NAME_4D)}")
    return _BY_NAME_4D[name].apply(s)

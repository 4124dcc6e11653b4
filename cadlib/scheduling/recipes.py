"""How an end-to-end run builds the documents and plans of one step: the same on every rank, in
``python -m cadlib.train``, and wherever a committed run's batches are rebuilt (the scale replay, the
what-if, the cost-model checks, the benchmarks). What they read is a :class:`Recipe`: train builds it
from its flags, the replay (and so the what-if) from its setting, a committed run's analysis from the
run's configuration (:meth:`Recipe.from_config`). The functions read only its fields, so anything
that has them (``python -m cadlib.train``'s namespace) works too."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Mapping

from ..core.defaults import DEFAULT_NANO_SPLIT, DEFAULT_SENT_LAST, DEFAULT_TOLERANCE
from ..data.packing import pack
from ..data.sequences import step_sequences
from ..data.workload import sample_docs, sample_kwargs
from . import scheduler
from .nanosplit import distca_layout, halves, schedule_nano, split_nano_batches
from .sentlast import sent_last, sent_last_nanos

NANO_BALANCES = ("tokens", "attention")
NANO_SPLITS = ("whole", "docs", "distca")
CAD_PLANNERS = ("ours", "distca")
"""What places CAD's CA-tasks: our scheduler (:func:`cadlib.scheduling.scheduler.schedule`) or DistCA's
released planner (:func:`cadlib.scheduling.distca.distca_plan`)."""


@dataclass(frozen=True)
class Recipe:
    """How a run samples its batches and plans each one.

    ``dist``: a :mod:`cadlib.data.workload` distribution or preset (``uniform``: documents of
    ``doc_len`` tokens, default an eighth of a rank's); ``tokens_per_rank`` tokens per rank;
    ``seed``: batch ``b`` is sampled with seed ``seed * 100003 + b``; ``max_doc_len`` clips the
    documents. ``sequence_len``: batches are DistCA's instead, sequences of that many tokens from one
    stream of documents (:mod:`cadlib.data.sequences`; ``dist`` may then also be DistCA's samplers
    ``pretrain-distca`` or ``prolong-distca``), step ``b`` the stream's ``b``-th group of ``world x tokens_per_rank /
    sequence_len`` sequences. The scheduler's ``tolerance`` and ``min_shard``; ping-pong's
    nano-batches are per-rank halves of one layout that balance ``nano_balance`` (tokens or attention)
    and may cut documents (``nano_split="docs"``) or not (``"whole"``), or DistCA's (``"distca"``, which
    needs a ``sequence_len``): the first half of the step's sequences and the rest, each laid over all
    ranks; ``sent_last``: CAD's plans re-ordered so that rows sent away come last. ``planner``: what
    places CAD's tasks (:data:`CAD_PLANNERS`): ``"ours"``, or ``"distca"``, DistCA's planner as it
    runs, with no minimum shard (``min_shard`` then does not apply)."""

    dist: str
    tokens_per_rank: int
    seed: int = 0
    doc_len: int | None = None
    max_doc_len: int | None = None
    tolerance: float = DEFAULT_TOLERANCE
    min_shard: int = 512
    nano_balance: str = "tokens"
    nano_split: str = DEFAULT_NANO_SPLIT
    sent_last: bool = DEFAULT_SENT_LAST
    sequence_len: int | None = None
    planner: str = "ours"

    def __post_init__(self):
        for f, lo in (("tokens_per_rank", 1), ("min_shard", 1), ("seed", 0)):
            v = getattr(self, f)
            if isinstance(v, bool) or int(v) != v or v < lo:
                raise ValueError(f"Recipe.{f} must be an integer >= {lo}, got {v!r}")
        if not self.tolerance >= 0:
            raise ValueError(f"Recipe.tolerance must be >= 0, got {self.tolerance!r}")
        if self.nano_balance not in NANO_BALANCES:
            raise ValueError(f"Recipe.nano_balance must be one of {', '.join(NANO_BALANCES)}, "
                             f"got {self.nano_balance!r}")
        if self.nano_split not in NANO_SPLITS:
            raise ValueError(f"Recipe.nano_split must be one of {', '.join(NANO_SPLITS)}, "
                             f"got {self.nano_split!r}")
        if self.planner not in CAD_PLANNERS:
            raise ValueError(f"Recipe.planner must be one of {', '.join(CAD_PLANNERS)}, got {self.planner!r}")
        object.__setattr__(self, "sent_last", bool(self.sent_last))
        s = self.sequence_len
        if s is not None and (isinstance(s, bool) or int(s) != s or s < 1):
            raise ValueError(f"Recipe.sequence_len must be an integer >= 1 or None, got {s!r}")
        if self.nano_split == "distca" and s is None:
            raise ValueError("Recipe.nano_split='distca' forms ping and pong from separate sequences: "
                             "give Recipe.sequence_len (e.g. the MaxDocLen)")

    @classmethod
    def from_config(cls, config: Mapping, **base) -> "Recipe":
        """The recipe of a run's configuration (a committed result's ``config``, or ``vars()`` of
        ``python -m cadlib.train``'s flags): its fields where it has them, else ``base``'s, else those
        of a file written before the field existed (such runs kept ping-pong's documents whole:
        ``nano_split="whole"``; and did not lay out sent-last)."""
        known = {f.name for f in fields(cls)}
        kw = {"nano_split": "whole", "sent_last": False, **base,
              **{k: v for k, v in config.items() if k in known}}
        return cls(**kw)


def batch_docs(recipe: Recipe, b: int, world: int) -> list[int]:
    """Document lengths of batch ``b`` over ``world`` ranks (the same on every rank and for every
    method); with a ``sequence_len``, its sequences' documents in order."""
    if recipe.sequence_len is not None:
        return [n for s in batch_sequences(recipe, b, world) for n in s]
    kw = sample_kwargs(recipe.dist)
    dist_name = kw.pop("dist")
    if dist_name == "uniform":
        kw["length"] = recipe.doc_len or max(1, recipe.tokens_per_rank // 8)
    return sample_docs(dist_name, world * recipe.tokens_per_rank, seed=recipe.seed * 100_003 + b,
                       max_doc_len=recipe.max_doc_len, **kw)


def batch_sequences(recipe: Recipe, b: int, world: int) -> list[list[int]]:
    """The sequences of step ``b`` over ``world`` ranks (:func:`cadlib.data.sequences.step_sequences`):
    ``world x tokens_per_rank / sequence_len`` of them, an even number when ping and pong are DistCA's."""
    if recipe.sequence_len is None:
        raise ValueError("batch_sequences needs a Recipe with a sequence_len")
    total = world * recipe.tokens_per_rank
    n_seq, rem = divmod(total, recipe.sequence_len)
    if rem or n_seq < 1 or (recipe.nano_split == "distca" and n_seq % 2):
        what = "an even number of" if recipe.nano_split == "distca" else "a whole number of"
        raise ValueError(f"world x tokens_per_rank = {total} tokens must be {what} sequences of "
                         f"sequence_len={recipe.sequence_len} tokens")
    return step_sequences(recipe.dist, recipe.sequence_len, n_seq, b, recipe.seed,
                          length=recipe.doc_len)


def method_layout(docs, world: int, recipe: Recipe, method, model=None, cap: int | None = None):
    """The linear layout ``method`` (a :class:`cadlib.core.methods.Method`) gives a batch: WLB-LLM's
    balanced packing (``cap``: its token cap per rank), DistCA's ping and pong laid over all ranks for
    the CAD methods when ``recipe.nano_split == "distca"`` (:func:`cadlib.scheduling.nanosplit.distca_layout`;
    one-stream CAD keeps the same chunks, as DistCA's "Single Stream" ablation does), else sequential."""
    if method.packing == "balanced":
        return pack(docs, world, recipe.tokens_per_rank, method="balanced", model=model, cap=cap)
    if method.cad and recipe.nano_split == "distca":
        return distca_layout(docs, world)
    return pack(docs, world, recipe.tokens_per_rank)


def micro_docs(recipe: Recipe, b: int, m: int, n_micro: int, dp: int) -> list[int]:
    """Document lengths of microbatch ``m`` of batch ``b`` under pipeline parallelism: ``dp`` ranks'
    tokens, sampled like a batch of its own (documents never cross microbatches)."""
    return batch_docs(recipe, b * n_micro + m, dp)


def micro_seed(recipe: Recipe, b: int, m: int) -> int:
    """The synthetic-token seed of microbatch ``m`` of batch ``b`` (its document ids restart at 0,
    so each microbatch needs its own)."""
    return int(recipe.seed) * 1_000_003 + b * 1_009 + m


def _planner(recipe: Recipe, spec) -> tuple[str, dict]:
    """:func:`cadlib.scheduling.scheduler.place`'s method and arguments for the recipe's planner."""
    if recipe.planner == "distca":
        return "distca", {"model": spec, "tolerance": recipe.tolerance, "min_shard": 1}
    return "cad", {"model": spec, "tolerance": recipe.tolerance, "min_shard": recipe.min_shard}


def cad_plan(layout, recipe: Recipe, spec):
    """``cad``'s plan of a batch: the recipe's planner at its tolerance (and minimum shard). With
    ``recipe.sent_last`` the same tasks on a re-ordered layout (``plan.layout``, which the step's
    tokens then follow; :mod:`cadlib.scheduling.sentlast`)."""
    method, kw = _planner(recipe, spec)
    plan = scheduler.schedule(layout, **kw) if method == "cad" else scheduler.place(layout, method, **kw)
    return sent_last(plan).plan if recipe.sent_last else plan


def plan_nano(nb, recipe: Recipe, spec):
    """One nano-batch's plan by the recipe's planner (:func:`cadlib.scheduling.nanosplit.schedule_nano`)."""
    method, kw = _planner(recipe, spec)
    return schedule_nano(nb, method, **kw)


def nano_batches(layout, recipe: Recipe):
    """``cad-pingpong``'s two nano-batches of a layout: DistCA's halves of a
    :func:`method_layout` (``nano_split="distca"``), else per-rank halves
    (:func:`cadlib.scheduling.nanosplit.split_nano_batches`)."""
    if recipe.nano_split == "distca":
        return halves(layout)
    return split_nano_batches(layout, recipe.nano_balance, split_docs=recipe.nano_split == "docs",
                              min_piece=recipe.min_shard)


def nano_plans(layout, recipe: Recipe, spec):
    """``cad-pingpong``'s two nano-batches of a batch and their plans (each scheduled on its own;
    with ``recipe.sent_last`` each re-ordered, :func:`cadlib.scheduling.sentlast.sent_last_nanos`)."""
    nanos = nano_batches(layout, recipe)
    plans = [plan_nano(nb, recipe, spec) for nb in nanos]
    return sent_last_nanos(nanos, plans) if recipe.sent_last else (nanos, plans)

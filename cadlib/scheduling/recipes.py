"""How an end-to-end run builds the documents and plans of one step: the same on every rank, in
``python -m cadlib.train``, and wherever a committed run's batches are rebuilt (the scale replay, the
cost-model checks, the benchmarks). ``args`` is ``python -m cadlib.train``'s namespace (or anything
with its fields: ``dist``, ``tokens_per_rank``, ``seed``, ``doc_len``, ``max_doc_len``, ``tolerance``,
``min_shard``, ``nano_balance``, ``nano_split``, ``sent_last``)."""
from __future__ import annotations

from ..data.workload import sample_docs, sample_kwargs
from . import scheduler
from .nanosplit import schedule_nano, split_nano_batches
from .sentlast import sent_last, sent_last_nanos


def batch_docs(args, b: int, world: int) -> list[int]:
    """Document lengths of batch ``b`` (the same on every rank and for every method)."""
    kw = sample_kwargs(args.dist)
    dist_name = kw.pop("dist")
    if dist_name == "uniform":
        kw["length"] = args.doc_len or max(1, args.tokens_per_rank // 8)
    return sample_docs(dist_name, world * args.tokens_per_rank, seed=args.seed * 100_003 + b,
                       max_doc_len=args.max_doc_len, **kw)


def micro_docs(args, b: int, m: int, n_micro: int, dp: int) -> list[int]:
    """Document lengths of microbatch ``m`` of batch ``b`` under pipeline parallelism: ``dp`` ranks'
    tokens, sampled like a batch of its own (documents never cross microbatches)."""
    return batch_docs(args, b * n_micro + m, dp)


def micro_seed(args, b: int, m: int) -> int:
    """The synthetic-token seed of microbatch ``m`` of batch ``b`` (its document ids restart at 0,
    so each microbatch needs its own)."""
    return int(args.seed) * 1_000_003 + b * 1_009 + m


def cad_plan(layout, args, spec):
    """``cad``'s plan of a batch: the scheduler at the run's tolerance and minimum shard. With
    ``args.sent_last`` the same tasks on a re-ordered layout (``plan.layout``, which the step's tokens
    then follow; :mod:`cadlib.scheduling.sentlast`)."""
    plan = scheduler.schedule(layout, model=spec, tolerance=args.tolerance, min_shard=args.min_shard)
    return sent_last(plan).plan if getattr(args, "sent_last", False) else plan


def nano_plans(layout, args, spec):
    """``cad-pingpong``'s two nano-batches of a batch and their plans (each scheduled on its own;
    with ``args.sent_last`` each re-ordered, :func:`cadlib.scheduling.sentlast.sent_last_nanos`)."""
    nanos = split_nano_batches(layout, args.nano_balance, split_docs=args.nano_split == "docs",
                               min_piece=args.min_shard)
    plans = [schedule_nano(nb, model=spec, tolerance=args.tolerance, min_shard=args.min_shard)
             for nb in nanos]
    return sent_last_nanos(nanos, plans) if getattr(args, "sent_last", False) else (nanos, plans)

"""The options of ``python -m cadlib.train`` (:mod:`cadlib.train`): its argument parser and every check
it makes before a process group starts, each bad value stopped with a usage error that names the flag
and what is valid. The result carries what the options derive: the methods as a list, the model spec,
the recompute choice, whether the step runs the pipeline path, and the :class:`Recipe` (how batches
are sampled and planned) that training, the replay and the what-if share."""
from __future__ import annotations

import argparse
import math

from .core.cost import MODELS, as_model
from .core.defaults import DEFAULT_NANO_SPLIT, DEFAULT_TOLERANCE
from .core.methods import names
from .core.precision import TRAIN_DTYPES
from .core.recompute import CHOICES as RECOMPUTE_CHOICES
from .data.workload import sample_kwargs
from .scheduling.recipes import CAD_PLANNERS, NANO_SPLITS, Recipe

METHODS = names(trainable=True)
"""The methods ``--methods`` takes."""
DESCRIPTION = ("End-to-end training steps of a Llama-style decoder under CAD and its baselines "
               "(a torchrun entry).")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m cadlib.train", description=DESCRIPTION)
    p.add_argument("--methods", default="colocated,cad,cad-pingpong", help=f"comma-separated: {METHODS}")
    p.add_argument("--model", default="tiny", help=f"one of {', '.join(MODELS)}")
    p.add_argument("--layers", type=int, default=None, help="override the model's layer count")
    p.add_argument("--tokens-per-rank", type=int, default=1024)
    p.add_argument("--dist", default="pretrain", help="a cadlib.data.workload distribution or preset")
    p.add_argument("--doc-len", type=int, default=None, help="document length for --dist uniform")
    p.add_argument("--max-doc-len", type=int, default=None)
    p.add_argument("--sequence-len", type=int, default=None,
                   help="DistCA's batches: sequences of this many tokens from one document stream "
                        "(cadlib.data.sequences); needed by --nano-split distca")
    p.add_argument("--steps", type=int, default=5, help="recorded steps (batches) per method")
    p.add_argument("--warmup", type=int, default=1, help="unrecorded steps before them")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="fp32", choices=TRAIN_DTYPES)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                   help="scheduler imbalance tolerance epsilon")
    p.add_argument("--min-shard", type=int, default=512, help="scheduler minimum shard tokens")
    p.add_argument("--planner", default="ours", choices=CAD_PLANNERS,
                   help="what places CAD's tasks: our scheduler (ours) or DistCA's released planner "
                        "(distca: no minimum shard)")
    p.add_argument("--nano-balance", default="tokens", choices=("tokens", "attention"))
    p.add_argument("--nano-split", default=DEFAULT_NANO_SPLIT, choices=NANO_SPLITS,
                   help="cad-pingpong's nano-batches: per-rank halves whose documents may be cut "
                        "between them (docs; pieces >= --min-shard tokens) or stay whole (whole), or "
                        "DistCA's (distca: the first half of the step's sequences and the rest, each "
                        "over all ranks; needs --sequence-len)")
    p.add_argument("--wlb-cap", type=int, default=None, help="balanced packing's token cap per rank")
    p.add_argument("--ce-chunk", type=int, default=8192, help="tokens per chunk of the LM-head loss")
    p.add_argument("--recompute", default="auto", choices=("auto", *RECOMPUTE_CHOICES),
                   help="what the backward computes again: nothing, the MLP, or (auto, the default) the "
                        "least with which the memory model fits this GPU (cadlib.core.recompute); the "
                        "result's config records the choice")
    p.add_argument("--mlp-recompute", action="store_true", help="the same as --recompute mlp")
    p.add_argument("--attn-backend", default=None)
    p.add_argument("--pg-backend", default=None)
    p.add_argument("--comm-ctas", type=int, default=None,
                   help="NCCL thread blocks (SMs) for CAD's all-to-alls, on a group of their own "
                        "(default: NCCL's choice; ignored on gloo): fewer leave the attention and GEMM "
                        "kernels beside them more SMs")
    p.add_argument("--colocated-impl", default="allgather", choices=("allgather", "all-to-all"),
                   help="per-document CP for colocated/wlb: all-gather (default) or CAD's all-to-all "
                        "with the colocated plan")
    p.add_argument("--timeline", action="store_true",
                   help="keep the spans of every recorded step (else of the last one)")
    p.add_argument("--timeline-batches", default="none",
                   help="also keep the spans of these batches: comma-separated indices, 'auto' (the two "
                        "with the most imbalanced colocated attention) or 'none'")
    p.add_argument("--dump-grads", default=None, help="folder: rank 0 saves the first step's gradients")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline stages (cadlib.train_pp): the layers split into this many contiguous "
                        "stages over a DP x PP grid; colocated/wlb run 1F1B, CAD methods lock-step ticks")
    p.add_argument("--dp", type=int, default=None, help="with --pp: data-parallel ranks per stage "
                                                        "(default world / pp; dp x pp must be the world)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="microbatches per step (default 2 x --pp with --pp > 1, else 1); more than 1 runs "
                        "the pipeline path, gradients accumulated over them")
    p.add_argument("--sent-last", action="store_true",
                   help="cad, cad-pingpong, signal-only: each rank's rows sent to other servers last in its "
                        "token order, so that donors' servers read their buffers in place "
                        "(cadlib.scheduling.sentlast)")
    args = p.parse_args(argv)
    methods = args.methods.split(",")
    for m in methods:
        if m not in METHODS:
            p.error(f"unknown method {m!r} in --methods; choose from: {', '.join(METHODS)}")
    args.methods = methods
    if args.mlp_recompute and args.recompute not in ("auto", "mlp"):
        p.error(f"--mlp-recompute contradicts --recompute {args.recompute}; give one of them")
    args.recompute = "mlp" if args.mlp_recompute else args.recompute
    try:
        args.spec = as_model(args.model, **({"n_layers": args.layers} if args.layers else {}))
        sample_kwargs(args.dist)
    except ValueError as e:
        p.error(str(e))
    for flag, val, lo in (("--tokens-per-rank", args.tokens_per_rank, 1), ("--steps", args.steps, 1),
                          ("--warmup", args.warmup, 0), ("--min-shard", args.min_shard, 1),
                          ("--ce-chunk", args.ce_chunk, 1), ("--layers", args.layers, 1),
                          ("--doc-len", args.doc_len, 1), ("--max-doc-len", args.max_doc_len, 1),
                          ("--comm-ctas", args.comm_ctas, 1)):
        if val is not None and val < lo:
            p.error(f"{flag} must be >= {lo}, got {val}")
    if not (args.tolerance >= 0 and math.isfinite(args.tolerance)):
        p.error(f"--tolerance (the scheduler's epsilon) must be a number >= 0, got {args.tolerance}")
    if not args.lr > 0:
        p.error(f"--lr must be > 0, got {args.lr}")
    if args.microbatches is None:
        args.microbatches = 2 * args.pp if args.pp > 1 else 1
    args.pipeline = args.pp > 1 or args.microbatches > 1
    tb = args.timeline_batches
    if tb not in ("none", "auto") and not all(x.strip().isdigit() for x in tb.split(",")):
        p.error(f"--timeline-batches must be 'none', 'auto' or comma-separated batch indices, got {tb!r}")
    try:
        args.recipe = Recipe.from_config(vars(args))        # how batches are sampled and planned
    except ValueError as e:
        p.error(str(e))
    return args

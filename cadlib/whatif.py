"""Does CAD pay off on my data and my cluster? The what-if planner from the command line.

    python -m cadlib.whatif --lengths data/lengths/prolong512k_sample.txt --model llama3-8b --gpus 64 \\
        --gpus-per-node 8 --context 524288 --json out.json --html out.html

Documents come from ``--lengths`` (``.txt``, ``.csv`` / ``.jsonl`` / ``.parquet`` with ``--column``,
``.npy``, or a directory written by ``datasets``' ``save_to_disk``) or a named distribution (``--dist``).
The model is a named spec, its fields overridden by ``--layers``, ``--hidden``, ``--heads``,
``--kv-heads``, ``--head-dim``, ``--ffn``, ``--vocab``. Prints a table of colocated, WLB-ideal, CAD
with ping-pong and the zigzag CP ring over the packed sequence
(step, tokens/s, idle, speedups with the simulator's measured error band, bytes sent and
activation memory per GPU), a verdict and where it flips (:mod:`cadlib.analysis.whatif.planner`); ``--json``
and ``--html`` write the same. ``--gpu-table`` prices with a calibration of the user's own GPU
(``python -m cadlib.calibrate``, :mod:`cadlib.analysis.whatif.gpu_table`). Then, per method, the
configurations that fit in ``--gpu-mem-gib``, one GPU's memory in GiB, which the activation column
and the ring's degrees are measured against too (:mod:`cadlib.analysis.whatif.fit`). Bad input stops it before
any work with exit status 2 and one line naming the input and what is valid.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import numpy as np

from .analysis.replay.settings import TOKENS_PER_GROUP
from .analysis.whatif import fit, gpu_table, page, planner
from .analysis.whatif.gpu_table import GpuTable, GpuTableError
from .analysis.whatif.setup import Cluster, Documents, Training
from .core.cost import DEFAULT_MODEL, H200_NVLINK_ALL_TO_ALL_GBPS, IB_GBPS_PER_GPU, MODELS, as_model
from .core.defaults import DEFAULT_TOLERANCE
from .core.measured import MeasuredCost
from .core.paper import DISTCA_GPUS_PER_NODE
from .data.lengths import read_lengths
from .data.workload import PRESETS, QUANTILE_TABLES

NAMED = (*QUANTILE_TABLES, *PRESETS)
"""The distributions ``--dist`` takes: the tabulated ones and the presets (uniform and lognormal need
parameters, which a lengths file gives better)."""
DIMS = {"layers": "n_layers", "hidden": "hidden", "heads": "n_heads", "kv_heads": "n_kv_heads",
        "head_dim": "head_dim", "ffn": "ffn", "vocab": "vocab"}


class BadInput(Exception):
    """One line for the user: the input and what is valid."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):                      # one line, exit status 2 (argparse's own is two lines)
        raise BadInput(message)


def parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="python -m cadlib.whatif", description=__doc__,
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_argument_group("documents")
    src.add_argument("--lengths", help="a file of document lengths in tokens, or a saved datasets directory")
    src.add_argument("--column", help="the column holding lengths (csv, jsonl, parquet, datasets; a list "
                     "column such as input_ids gives its lengths)")
    src.add_argument("--dist", help=f"a named distribution instead: {', '.join(NAMED)}")
    src.add_argument("--clip", action="store_true", help="cut lengths longer than --context to it")
    src.add_argument("--elongate", type=float, default=1.0, help="stretch every length by this factor")
    mod = ap.add_argument_group("model")
    mod.add_argument("--model", default=DEFAULT_MODEL, help=f"one of {', '.join(MODELS)}")
    for flag in DIMS:
        mod.add_argument(f"--{flag.replace('_', '-')}", type=int, help=f"override the model's {DIMS[flag]}")
    cl = ap.add_argument_group("cluster")
    cl.add_argument("--gpus", type=int, help="GPUs in all (or give --nodes)")
    cl.add_argument("--nodes", type=int, help="nodes (GPUs = nodes x --gpus-per-node)")
    cl.add_argument("--gpus-per-node", type=int, default=DISTCA_GPUS_PER_NODE)
    cl.add_argument("--tp", type=int, help="tensor parallelism (default: one node)")
    cl.add_argument("--pp", type=int, default=1, help="pipeline stages")
    cl.add_argument("--intra-node-gbps", type=float, default=H200_NVLINK_ALL_TO_ALL_GBPS,
                    help="in-node bandwidth per GPU, GB/s (default: the H200 NVLink all-to-all)")
    cl.add_argument("--inter-node-gbps", type=float, default=IB_GBPS_PER_GPU,
                    help="inter-node bandwidth per GPU, GB/s (default: DistCA's InfiniBand)")
    cl.add_argument("--gpu-mem-gib", type=float, default=fit.DEFAULT_GPU_MEM_GIB,
                    help="one GPU's memory in GiB (default %(default)g, an H200 as DistCA counts it): the "
                    "activation column, the CP ring's degrees and the search of configurations that fit "
                    "are measured against it")
    cl.add_argument("--kernels", help="a kernel latency table (scripts/bench/profile_kernels.py's JSON, e.g. "
                    "results/kernel_profile_h200.json; default: the simulator's H200 rates)")
    cl.add_argument("--gpu-table", help="a calibration of your GPU (python -m cadlib.calibrate --out FILE): "
                    "its linear-layer grid and attention kernel table price the batches instead of the "
                    "committed H200 ones; it must be for --model (and --backend when given)")
    cl.add_argument("--backend", help="the attention kernel a --gpu-table must have been calibrated with "
                    "(e.g. torch_flash, fa4; default: whichever it was)")
    tr = ap.add_argument_group("training")
    tr.add_argument("--context", type=int, default=131072, help="MaxDocLen, tokens")
    tr.add_argument("--tokens-per-group", "--tokens-per-rank", dest="tokens_per_group", type=int,
                    default=TOKENS_PER_GROUP, help="tokens per DP group per micro-batch")
    tr.add_argument("--micro-batches", type=int, default=1)
    tr.add_argument("--steps", type=int, default=20, help="sampled steps (their spread is the band's sampling "
                    "error)")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE, help="the CAD scheduler's")
    out = ap.add_argument_group("output")
    out.add_argument("--json", help="write the plan as JSON here")
    out.add_argument("--html", help="write a self-contained HTML page with plotly figures here")
    out.add_argument("--no-sweep", action="store_true", help="skip the DP x context sweep")
    out.add_argument("--no-fit", action="store_true", help="skip the search of configurations that fit")
    out.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap


def _positive(args, names: tuple[str, ...], kind=int) -> None:
    for n in names:
        v = getattr(args, n)
        if v is not None and not v > 0:
            what = "an integer >= 1" if kind is int else "> 0"
            raise BadInput(f"--{n.replace('_', '-')} {v}: must be {what}")


def check(args) -> tuple:
    """Every input checked, in the order a user would fix them; returns ``(model, cluster, training,
    documents)`` or raises :class:`BadInput`."""
    if args.model.lower() not in MODELS:
        raise BadInput(f"--model {args.model}: unknown model; choose one of: {', '.join(MODELS)} "
                       "(and override its fields with --layers, --hidden, --heads, ...)")
    _positive(args, ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab", "gpus", "nodes",
                     "gpus_per_node", "tp", "pp", "context", "tokens_per_group", "micro_batches", "steps"))
    _positive(args, ("intra_node_gbps", "inter_node_gbps", "gpu_mem_gib", "elongate"), float)
    if args.tolerance < 0:
        raise BadInput(f"--tolerance {args.tolerance}: must be >= 0")
    over = {DIMS[k]: getattr(args, k) for k in DIMS if getattr(args, k) is not None}
    if ("hidden" in over or "n_heads" in over) and "head_dim" not in over:
        base = as_model(args.model)
        over["head_dim"] = over.get("hidden", base.hidden) // over.get("n_heads", base.n_heads)
    try:
        model = as_model(args.model, **over)
    except ValueError as e:
        raise BadInput(f"model dimensions: {e}") from None
    if args.gpus is None and args.nodes is None:
        raise BadInput("--gpus: give the GPU count (or --nodes)")
    gpus = args.gpus if args.gpus is not None else args.nodes * args.gpus_per_node
    if args.nodes is not None and args.gpus is not None and gpus != args.nodes * args.gpus_per_node:
        raise BadInput(f"--gpus {gpus}: --nodes {args.nodes} x --gpus-per-node {args.gpus_per_node} is "
                       f"{args.nodes * args.gpus_per_node}; give one of them, or both consistent")
    tp = args.tp if args.tp is not None else min(args.gpus_per_node, gpus)
    if gpus % (tp * args.pp):
        raise BadInput(f"--gpus {gpus}: must be a multiple of --tp x --pp = {tp} x {args.pp} = "
                       f"{tp * args.pp}")
    try:
        model.shard(tp)
    except ValueError:
        raise BadInput(f"--tp {tp}: must divide the model's heads ({model.n_heads}), KV heads "
                       f"({model.n_kv_heads}), FFN ({model.ffn}) and vocabulary ({model.vocab})") from None
    if model.n_layers % args.pp:
        raise BadInput(f"--pp {args.pp}: must divide the model's {model.n_layers} layers")
    if args.gpu_table and args.kernels:
        raise BadInput("--gpu-table: already holds a kernel table; give --gpu-table or --kernels, not both")
    if args.backend and not args.gpu_table:
        raise BadInput(f"--backend {args.backend}: applies to a --gpu-table")
    if args.kernels:
        try:
            MeasuredCost.load(args.kernels)
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
            raise BadInput(f"--kernels {args.kernels}: not a kernel latency table ({e}); give "
                           "scripts/bench/profile_kernels.py's JSON") from None
    cluster = Cluster(gpus=gpus, gpus_per_node=args.gpus_per_node, tp=tp, pp=args.pp,
                             intra_node_gbps=args.intra_node_gbps, inter_node_gbps=args.inter_node_gbps,
                             gpu_mem_gib=args.gpu_mem_gib, kernels=args.kernels)
    training = Training(context=args.context, tokens_per_group=args.tokens_per_group,
                               micro_batches=args.micro_batches, steps=args.steps, seed=args.seed,
                               elongate=args.elongate, tolerance=args.tolerance)
    return model, cluster, training, _documents(args)


def _gpu_table(args, model) -> GpuTable | None:
    """The ``--gpu-table`` checked against the model and kernel asked (its error's one line otherwise)."""
    if not args.gpu_table:
        return None
    try:
        return gpu_table.load(args.gpu_table, model=model.name, backend=args.backend)
    except GpuTableError as e:
        raise BadInput(f"--gpu-table {e}") from None


def _documents(args) -> Documents:
    if (args.lengths is None) == (args.dist is None):
        raise BadInput("--lengths: give a lengths file (--lengths FILE) or a named distribution "
                       "(--dist NAME), one of them")
    if args.dist is not None:
        if args.column:
            raise BadInput("--column: applies to --lengths files, not --dist")
        if args.dist not in NAMED:
            raise BadInput(f"--dist {args.dist}: not one of the named tables; choose one of: "
                           f"{', '.join(NAMED)} (or give a lengths file)")
        return Documents(dist=args.dist)
    try:
        lengths = read_lengths(args.lengths, args.column)
    except ValueError as e:
        flag = "--column" if args.column and "column" in str(e) else "--lengths"
        raise BadInput(f"{flag}: {e}") from None
    longest = np.rint(lengths * args.elongate) if args.elongate != 1 else lengths
    over = int(np.count_nonzero(longest > args.context))
    if over and not args.clip:
        raise BadInput(f"--lengths {args.lengths}: {over:,} of {lengths.size:,} lengths are longer than "
                       f"--context {args.context} (the longest is {int(longest.max()):,}); pass --clip to "
                       "cut them to the context, or raise --context")
    return Documents(lengths=lengths, label=os.path.basename(os.path.normpath(args.lengths)))


def _progress(total: int, quiet: bool):
    """A tqdm bar on stderr (the notebooks extra; none without it or with ``--quiet``)."""
    if quiet:
        return None, None
    try:
        from tqdm import tqdm
    except ImportError:
        return None, None
    bar = tqdm(total=total, desc="sampling and planning batches", unit="batch", file=sys.stderr, leave=False)
    return bar, bar.update


def main(argv=None) -> int:
    try:
        args = parser().parse_args(argv)
        model, cluster, training, docs = check(args)
        table = _gpu_table(args, model)
        for flag in ("json", "html"):
            p = getattr(args, flag)
            if p and not pathlib.Path(p).resolve().parent.is_dir():
                raise BadInput(f"--{flag} {p}: its folder does not exist")
    except BadInput as e:
        print(f"python -m cadlib.whatif: error: {e}", file=sys.stderr)
        return 2
    bar, tick = _progress(planner.work_units(cluster, training, not args.no_sweep), args.quiet)
    try:
        res = planner.plan(model, cluster, training, docs, with_sweep=not args.no_sweep, progress=tick,
                           gpu=table)
    finally:
        if bar is not None:
            bar.close()
    print(page.text(res))
    if not args.no_fit:
        res["fit"] = fit.search(model, cluster.gpus, cluster.gpus_per_node,
                                cluster.dp * training.micro_batches * training.tokens_per_group,
                                training.context, gpu_mem_gib=args.gpu_mem_gib, tp_pref=cluster.tp)
        print("\n" + fit.text(res["fit"]))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(res, indent=1))
        print(f"wrote {args.json}")
    if args.html:
        pathlib.Path(args.html).write_text(page.page(res))
        print(f"wrote {args.html}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

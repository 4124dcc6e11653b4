#!/usr/bin/env python
"""End-to-end training steps: CAD (with and without ping-pong) against colocated, WLB-ideal and the
signal-only control, on the same sampled batches; one JSON per setting under results/.

    python scripts/bench/bench_e2e.py --smoke                           # CPU/gloo, tiny model, seconds
    python scripts/bench/bench_e2e.py --nproc 2 --tokens 65536,131072 --dists pretrain,prolong,uniform
    python scripts/bench/bench_e2e.py --nproc 2 --link inter-node-like  # NCCL_P2P_DISABLE=1: via host memory

Each setting is one ``python -m cadlib.train`` launch (cadlib.infra.launch.run_torchrun) running every
method over the same batches; :func:`cadlib.analysis.runs.e2e.summarise` turns the per-rank records into
per-batch speedups, the saving balancing could bring and how much CAD recovers, exposed communication, the
ping-pong gain and the calibrated prediction. Results record device, torch, commit and configuration.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys

from cadlib.analysis.runs import e2e
from cadlib.core import defaults
from cadlib.core.methods import names
from cadlib.infra import launch
from cadlib.infra.results import RESULTS_DIR, save_result

LINKS = {"nvlink": {}, "inter-node-like": {"NCCL_P2P_DISABLE": "1"}}
METHODS = ",".join(names(trainable=True))


def run_setting(args, tokens: int, dist: str, link: str) -> dict:
    train_args = ["--methods", args.methods, "--model", args.model, "--tokens-per-rank", str(tokens),
                  "--dist", dist, "--steps", str(args.steps), "--warmup", str(args.warmup),
                  "--dtype", args.dtype, "--tolerance", str(args.tolerance),
                  "--min-shard", str(args.min_shard), "--nano-split", args.nano_split,
                  "--seed", str(args.seed), "--lr", str(args.lr)]
    if args.layers:
        train_args += ["--layers", str(args.layers)]
    if dist == "uniform":
        train_args += ["--doc-len", str(args.uniform_len)]
    if args.max_doc_len:
        train_args += ["--max-doc-len", str(args.max_doc_len)]
    if args.recompute:
        train_args += ["--recompute", args.recompute]
    elif args.mlp_recompute:
        train_args += ["--mlp-recompute"]
    if args.sent_last:
        train_args += ["--sent-last"]
    if args.timeline_batches != "none":
        train_args += ["--timeline-batches", args.timeline_batches]
    if args.attn_backend:
        train_args += ["--attn-backend", args.attn_backend]
    ctas = defaults.DEFAULT_COMM_CTAS.get(link) if args.comm_ctas is None else args.comm_ctas
    if ctas:
        train_args += ["--comm-ctas", str(ctas)]
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", **LINKS[link]}
    df = launch.run_torchrun("cadlib.train", args.nproc, train_args, timeout=args.timeout,
                             pg_backend=args.pg_backend, env=env, echo=False, progress=not args.quiet)
    results = list(df.attrs["results"])
    config = dict(results[0]["config"])
    out = e2e.collect(results, args.nproc)
    nccl = {k: v for k, v in sorted({**os.environ, **env}.items()) if k.startswith("NCCL_")}
    return {"config": {**config, "link": link, "nproc": args.nproc, "nccl_env": nccl}, **out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU/gloo, tiny model, 2 ranks, few steps")
    ap.add_argument("--quiet", action="store_true", help="no progress bar (logs, CI)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", default="65536,131072", help="tokens per GPU, comma-separated")
    ap.add_argument("--dists", default="pretrain,prolong,uniform")
    ap.add_argument("--uniform-len", type=int, default=2048, help="document length of 'uniform'")
    ap.add_argument("--max-doc-len", type=int, default=None)
    ap.add_argument("--link", default="nvlink", help=f"comma-separated: {', '.join(LINKS)}")
    ap.add_argument("--methods", default=METHODS)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--tolerance", type=float, default=defaults.DEFAULT_TOLERANCE)
    ap.add_argument("--min-shard", type=int, default=512)
    ap.add_argument("--nano-split", default=defaults.DEFAULT_NANO_SPLIT, choices=("whole", "docs"),
                    help="cad-pingpong's nano-batches: documents cut between them (docs, the default) or "
                         "whole documents ('whole' appends _wholedocs to each file name)")
    ap.add_argument("--mlp-recompute", action="store_true", default=True)
    ap.add_argument("--recompute", default=None, choices=("auto", "none", "mlp"),
                    help="python -m cadlib.train --recompute (instead of --mlp-recompute, which the "
                         "committed runs used): auto takes the least recompute the memory model fits")
    ap.add_argument("--sent-last", action=argparse.BooleanOptionalAction, default=defaults.DEFAULT_SENT_LAST,
                    help="python -m cadlib.train --sent-last: CAD's rows sent to other servers last in each "
                         "rank's token order (cadlib.scheduling.sentlast; a run other than "
                         "defaults.DEFAULT_SENT_LAST appends _sentlast or _nosentlast to each file name)")
    ap.add_argument("--timeline-batches", default="auto",
                    help="batches whose spans are kept besides the last step's: 'auto' (the two most "
                         "imbalanced under colocated), indices, or 'none'")
    ap.add_argument("--attn-backend", default=None)
    ap.add_argument("--pg-backend", default="auto")
    ap.add_argument("--comm-ctas", type=int, default=None,
                    help="NCCL thread blocks for CAD's all-to-alls (python -m cadlib.train --comm-ctas); "
                         f"default per link {defaults.DEFAULT_COMM_CTAS}, 0: NCCL's own choice")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-5,
                    help="AdamW learning rate (timing only needs sane values)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=str(RESULTS_DIR), help="folder for bench_e2e_*.json")
    ap.add_argument("--tag", default="", help="appended to each file name (e.g. _eps0.02 for a tolerance "
                                              "other than the default); letters, digits, '.', '_', '-'")
    args = ap.parse_args(argv)
    if args.comm_ctas is not None and args.comm_ctas < 0:
        ap.error(f"--comm-ctas must be >= 0 (0: NCCL's own choice), got {args.comm_ctas}")
    if args.smoke:
        args.model, args.layers, args.tokens, args.dtype = "tiny", 2, "512", "fp32"
        args.dists, args.steps, args.warmup, args.min_shard = "pretrain", 2, 1, 32
        args.max_doc_len, args.pg_backend, args.mlp_recompute = 700, "gloo", False
    if not all(ch.isalnum() or ch in "._-" for ch in args.tag):
        ap.error(f"--tag {args.tag!r}: use letters, digits, '.', '_' and '-' only")
    for link in args.link.split(","):
        if link not in LINKS:
            ap.error(f"unknown --link {link!r}; choose from: {', '.join(LINKS)}")
    status = 0
    for link in args.link.split(","):
        for dist in args.dists.split(","):
            for tokens in (int(t) for t in args.tokens.split(",")):
                tag = "smoke_" if args.smoke else ""
                cut = "" if args.nano_split == defaults.DEFAULT_NANO_SPLIT else f"_{args.nano_split}docs"
                if args.sent_last != defaults.DEFAULT_SENT_LAST:
                    cut += "_sentlast" if args.sent_last else "_nosentlast"
                name = f"bench_e2e_{tag}{args.nproc}x_{dist}_{tokens // 1024}k_{link}{cut}{args.tag}"
                try:
                    res = run_setting(args, tokens, dist, link)
                except Exception as e:      # one failing setting must not lose the others
                    print(f"{name}: FAILED {e!r}", flush=True)
                    status = 1
                    continue
                path = save_result(pathlib.Path(args.out) / f"{name}.json", res["config"],
                                   {k: v for k, v in res.items() if k != "config"})
                s = res["summary"]
                print(f"{name}: " + ", ".join(f"{k} {v:.3f}" for k, v in s.items() if isinstance(v, float)),
                      f"-> {path}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())

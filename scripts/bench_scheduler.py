"""Benchmark the CAD scheduler against the colocated placement and the bytes-blind equal-FLOPs
water-filling: imbalance (max/mean attention pairs per server) before and after, forward dispatch
bytes (Q + KV, one layer, bf16, llama3-8b), tasks and splits, and planning time (median of runs).

    python scripts/bench_scheduler.py            # 8, 64, 512 servers x 128K, 512K tokens/rank
    python scripts/bench_scheduler.py --quick    # 8, 64 servers x 128K, 1 run

Writes results/bench_scheduler.json atomically and prints a table. Planning time ``plan_ms`` covers
layout -> arrays conversion and the greedy; ``loop_ms`` the greedy alone; ``plan_build_s`` the
O(tokens) ``Plan`` construction + validation, measured only up to ``--validate-max-tokens``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from tqdm import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from cadlib.cost import ModelSpec  # noqa: E402
from cadlib.results import save_result  # noqa: E402
from cadlib.scheduler import place  # noqa: E402
from cadlib.packing import pack  # noqa: E402
from cadlib.workload import sample_docs  # noqa: E402


def run_case(dist, n, tpr, args, model):
    t0 = time.perf_counter()
    docs = sample_docs(dist, n * tpr, seed=args.seed)
    layout = pack(docs, n, tpr, method="sequential")
    ch = layout.chunk_array()
    setup_s = time.perf_counter() - t0
    row = {"dist": dist, "servers": n, "tokens_per_rank": tpr, "total_tokens": n * tpr,
           "n_docs": layout.n_docs, "n_chunks": int(len(ch)), "setup_s": round(setup_s, 3)}
    for method in ("colocated", "equal_flops", "cad"):
        runs = []
        for _ in range(args.runs if method != "colocated" else 1):
            runs.append(place(layout, method, n, model, args.tolerance, args.min_shard, "bf16", chunks=None))
        p = runs[-1]
        r = {"imbalance": p.imbalance(), "n_tasks": int(p.doc.size), "n_moves": p.meta["n_moves"],
             "n_splits": p.meta["n_splits"], "reached": p.meta["reached"],
             "plan_ms": statistics.median(x.meta["seconds"] for x in runs) * 1e3,
             "loop_ms": statistics.median(x.meta["loop_seconds"] for x in runs) * 1e3,
             "dispatch_gb": p.forward_bytes(model) / 1e9}
        if n * tpr <= args.validate_max_tokens:
            t1 = time.perf_counter()
            p.validate()
            r["validate_s"] = round(time.perf_counter() - t1, 3)
        row[method] = r
    row["imbalance_before"] = row["colocated"]["imbalance"]
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 and 64 servers at 128K tokens/rank, one run")
    ap.add_argument("--servers", type=int, nargs="+", default=[8, 64, 512])
    ap.add_argument("--tokens-per-rank", type=int, nargs="+", default=[128 * 1024, 512 * 1024])
    ap.add_argument("--dists", nargs="+", default=["pretrain", "prolong"])
    ap.add_argument("--tolerance", type=float, default=0.1)
    ap.add_argument("--min-shard", type=int, default=512)
    ap.add_argument("--runs", type=int, default=5, help="planning runs per case (median reported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--validate-max-tokens", type=int, default=8 * 1024 * 1024,
                    help="build and validate the Plan (O(tokens)) only up to this many tokens")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results",
                                                  "bench_scheduler.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.servers, args.tokens_per_rank, args.runs = [8, 64], [128 * 1024], 1
    model = ModelSpec.from_name("llama3-8b")
    cases = [(d, n, t) for d in args.dists for n in args.servers for t in args.tokens_per_rank]
    results = []
    t_all = time.perf_counter()
    for d, n, t in tqdm(cases, desc="bench_scheduler"):
        results.append(run_case(d, n, t, args, model))
    config = {k: v for k, v in vars(args).items() if k != "out"} | {
        "model": model.name, "dtype": "bf16", "pack": "sequential"}
    wall_s = round(time.perf_counter() - t_all, 1)
    target = {"servers": 64, "tokens_per_rank": 512 * 1024, "plan_ms": 10.0}
    save_result(args.out, config, results, target=target, wall_s=wall_s)
    hdr = (f"{'dist':9}{'S':>5}{'tok/rank':>9}{'before':>8}{'eq':>7}{'cad':>7}{'eq GB':>9}{'cad GB':>9}"
           f"{'tasks':>8}{'splits':>7}{'moves':>6}{'plan ms':>9}{'loop ms':>9}")
    print(hdr)
    for r in results:
        c, e = r["cad"], r["equal_flops"]
        print(f"{r['dist']:9}{r['servers']:>5}{r['tokens_per_rank'] // 1024:>8}K{r['imbalance_before']:>8.2f}"
              f"{e['imbalance']:>7.3f}{c['imbalance']:>7.3f}{e['dispatch_gb']:>9.2f}{c['dispatch_gb']:>9.2f}"
              f"{c['n_tasks']:>8}{c['n_splits']:>7}{c['n_moves']:>6}{c['plan_ms']:>9.1f}{c['loop_ms']:>9.1f}")
    print(f"wrote {args.out} ({wall_s} s)")


if __name__ == "__main__":
    main()

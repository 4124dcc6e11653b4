"""How often the attention servers' shards of one document merge, on the committed-style batches.

For ``pretrain`` and ``prolong`` batches (sequential packing, ``--tokens-per-rank`` per rank, 2..64
servers, ``cadlib.scheduling.scheduler.schedule`` with its defaults), per plan over all servers
(:func:`cadlib.dispatch.kvshare.sharing_stats`): CA-tasks, (server, document) pairs with several tasks, fused
segments after merging contiguous shards, documents left split on a server (non-contiguous shards,
e.g. DistCA's head/tail pairing: they keep one KV copy per segment), and the KV rows the fused calls
read with one copy per task (``copy``) or merged, against the distinct KV rows the servers hold.
Also DistCA's head/tail layout (``--layouts zigzag``: every document in 2R chunks, rank r holding
chunks r and 2R-1-r), colocated. Host only (CPU).

    python scripts/analyses/kvshare_stats.py                      # results/kvshare_stats.json
    python scripts/analyses/kvshare_stats.py --quick --out /tmp/kvshare_stats.json
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from cadlib.analysis.runs.server_bench import sharing_stats
from cadlib.core.plan import Plan, layout_to_tasks
from cadlib.data.packing import (
    pack,
    per_doc_zigzag_layout,
)
from cadlib.data.workload import sample_docs
from cadlib.infra.results import RESULTS_DIR, save_result
from cadlib.scheduling.scheduler import schedule


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dists", default="pretrain,prolong")
    ap.add_argument("--servers", default="2,4,8,16,32,64")
    ap.add_argument("--tokens-per-rank", type=int, default=65536)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--layouts", default="sequential,zigzag")
    ap.add_argument("--zigzag-max-servers", type=int, default=16,
                    help="zigzag only up to this many servers (its 2R chunks per document make many tasks)")
    ap.add_argument("--quick", action="store_true", help="2 and 4 servers, 8K tokens per rank, seed 0")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.servers, args.tokens_per_rank, args.seeds = "2,4", 8192, "0"
    if args.tokens_per_rank < 1:
        ap.error(f"--tokens-per-rank must be >= 1, got {args.tokens_per_rank}")
    rows = []
    for dist in args.dists.split(","):
        for S in (int(x) for x in args.servers.split(",")):
            for seed in (int(x) for x in args.seeds.split(",")):
                docs = sample_docs(dist, S * args.tokens_per_rank, seed=seed)
                for lay in args.layouts.split(","):
                    if lay == "zigzag" and S > args.zigzag_max_servers:
                        continue
                    t0 = time.perf_counter()
                    if lay == "zigzag":
                        zigzag = per_doc_zigzag_layout(docs, S)
                        plan = Plan(zigzag, layout_to_tasks(zigzag))
                    else:
                        plan = schedule(pack(docs, S, args.tokens_per_rank, method=lay), S)
                    st = sharing_stats(plan)
                    row = {"dist": dist, "n_servers": S, "seed": seed, "layout": lay,
                           "plan": "colocated" if lay == "zigzag" else "cad", **st,
                           "seconds": time.perf_counter() - t0}
                    rows.append(row)
                    print(f"{dist:>8} {lay:>10} S={S:<3} seed {seed}: tasks {st['n_tasks']:>5} "
                          f"segments {st['n_segments']:>5} shared pairs "
                          f"{st['server_doc_pairs_with_several_tasks']:>4} split docs "
                          f"{st['split_docs']:>4} | "
                          f"KV read / unique: copy {st['kv_read_copy_over_unique']:.2f} merged "
                          f"{st['kv_read_merged_over_unique']:.2f}", flush=True)
    path = Path(args.out) if args.out else RESULTS_DIR / "kvshare_stats.json"
    save_result(path, vars(args), rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

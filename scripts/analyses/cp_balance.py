"""The balance metrics and communication volumes of every CP mechanism and CAD on the same layouts (CPU).

For each mask (``causal``, ``full``, ``causal_document``, ``full_document``), world size and tokens per GPU,
the same documents (``make_mask``, seeded; the document masks drawn ``--draws`` times, LongCA-bench's 30)
are laid out by every mechanism of :mod:`cadlib.cp` as it lays them out itself, and per dispatch we compute
:func:`cadlib.cp.balance.balance_metrics` (area entropy, area and range Gini impurity, max/total and
max/mean area) and the bytes each rank sends (:func:`cadlib.cp.volume.per_rank`: the slowest rank's
forward and backward, and the sum over ranks), for ``--heads`` and ``--head-dim`` in bf16. Document masks
report the median and the 20/80% quantiles over the draws. CAD runs its scheduler's plan
(:func:`cadlib.cp.cad.cad_plan`); it serves causal masks only, so its full-mask rows say so. No GPU:
these are properties of the dispatch, not timings (the bytes are pinned to what the implementations send
by ``cadlib.cp.check --suite volume``).

    python scripts/analyses/cp_balance.py --out results/cp_balance.json
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from cadlib.cp import MECHANISMS
from cadlib.cp.balance import METRICS, balance_metrics, rank_work
from cadlib.cp.cad import cad_plan
from cadlib.cp.volume import grid, per_rank
from cadlib.data.masks import make_mask
from cadlib.infra.results import save_result

MASKS = ("causal", "causal_document", "full", "full_document")
BF16 = 2


def _q(values) -> dict:
    v = np.asarray(values, dtype=np.float64)
    return {"median": float(np.median(v)), "q20": float(np.quantile(v, 0.2)),
            "q80": float(np.quantile(v, 0.8))}


def one_dispatch(name, doc_lens, world, causal, heads, head_dim, min_shard) -> dict:
    plan = cad_plan(doc_lens, world, min_shard=min_shard) if name == "cad" else None
    area, tok = rank_work(name, doc_lens, world, causal, plan=plan)
    vol = per_rank(name, doc_lens, world, heads, head_dim, BF16, causal, plan=plan)
    fwd, bwd = np.asarray(vol["fwd"]), np.asarray(vol["bwd"])
    return {**balance_metrics(area, tok), "bytes_fwd_max": float(fwd.max()),
            "bytes_bwd_max": float(bwd.max()), "bytes_total": float(fwd.sum() + bwd.sum())}


def run(args) -> list[dict]:
    rows = []
    heads = tuple(int(x) for x in args.heads.split(":"))
    for mask in args.masks.split(","):
        causal = mask.startswith("causal")
        draws = args.draws if "document" in mask else 1
        for world in (int(x) for x in args.worlds.split(",")):
            for tpg in (int(x) for x in args.tokens_per_gpu.split(",")):
                T = world * tpg
                docs = [make_mask(mask, T, args.seed + i, dist=args.dist if "document" in mask else None)
                        .document_lengths() for i in range(draws)]
                for name in args.mechanisms.split(","):
                    u, R, w = grid(name, world)
                    base = {"mechanism": name, "mask": mask,
                            "dist": args.dist if "document" in mask else None, "world": world,
                            "tokens_per_gpu": tpg, "draws": draws, "heads": args.heads,
                            "head_dim": args.head_dim, "ulysses_size": u, "ring_positions": R,
                            **({"window": w} if name == "loongtrain" else {})}
                    if name == "cad" and not causal:
                        rows.append({**base, "status": "X",
                                     "error": "CAD serves causal masks only: its CA-tasks are causal by "
                                              "construction (KV = the document's prefix [0, q_end))"})
                        continue
                    per = [one_dispatch(name, d, world, causal, heads, args.head_dim, args.min_shard)
                           for d in docs]
                    keys = list(METRICS) + ["bytes_fwd_max", "bytes_bwd_max", "bytes_total"]
                    rows.append({**base, "status": "ok",
                                 "n_docs_median": float(np.median([len(d) for d in docs])),
                                 **{k: _q([p[k] for p in per]) for k in keys}})
                last = rows[-len(args.mechanisms.split(",")):]
                print(f"{mask:>16} W={world:<3} {tpg:>6}/GPU: " + "  ".join(
                    f"{r['mechanism']} {r['max_mean']['median']:.3f}" for r in last if r["status"] == "ok"),
                      flush=True)
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mechanisms", default=",".join(MECHANISMS))
    p.add_argument("--masks", default=",".join(MASKS))
    p.add_argument("--worlds", default="8,16")
    p.add_argument("--tokens-per-gpu", default="8192,32768")
    p.add_argument("--dist", default="prolong64k", help="document lengths of the document masks")
    p.add_argument("--draws", type=int, default=30, help="draws of each document mask (LongCA-bench: 30)")
    p.add_argument("--heads", default="64:8", help="Hq:Hkv")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--min-shard", type=int, default=512, help="CAD scheduler's minimum shard")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/cp_balance.json")
    args = p.parse_args(argv)
    for m in args.mechanisms.split(","):
        if m not in MECHANISMS:
            p.error(f"unknown mechanism {m!r}; choose from: {', '.join(MECHANISMS)}")
    for m in args.masks.split(","):
        if m not in MASKS:
            p.error(f"unknown mask {m!r}; choose from: {', '.join(MASKS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    rows = run(args)
    save_result(args.out, {**vars(args), "elem_bytes": BF16}, rows, wall_s=time.perf_counter() - t0)
    print(f"wrote {args.out} ({len(rows)} rows, {time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

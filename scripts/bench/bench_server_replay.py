"""Each rank's attention-server work in the end-to-end batches, replayed rank by rank on ONE GPU.

``cadlib.train`` times a rank's attention as its ``attn`` spans (the serve stage): the fused forward and
backward over the rows the rank's dispatch gives its server (queries and KV, local and received). This
script builds the same plans for the same batches (``cadlib.train``'s sampler, scheduler and nano-batch
split, at the same flags as ``scripts/bench/bench_e2e.py``), and for every rank of every plan runs exactly
that work, the serve stage's forward + backward for one layer, on random bf16 buffers of the sizes the
dispatch gives. No second GPU and no communication: the per-rank times say how well a method balances
attention, and what the server's own overhead costs (the KV rows it gathers), apart from everything else in
a step.

Methods (``--methods``): ``colocated`` (every rank serves its own chunks: ``scheduler.colocated``),
``cad`` (the scheduler's plan), ``cad-pingpong`` (the two nano-batches' plans, summed per rank); a
``+sl`` suffix takes the ``--sent-last`` layout (:mod:`cadlib.scheduling.sentlast`). Per batch: each method's
slowest rank against colocated's slowest (the straggler) and mean (perfect balance):
``recovered = (colocated max - method max) / (colocated max - colocated mean)``.

    python scripts/bench/bench_server_replay.py --dist pretrain --tokens 65536 --out $OUT/replay.json  # 1 GPU
    python scripts/bench/bench_server_replay.py --smoke --out /tmp/replay.json                        # CPU
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from cadlib import train_args
from cadlib.bench.inputs import ServeCall
from cadlib.bench.timer import time_fn
from cadlib.core import defaults
from cadlib.core.methods import names
from cadlib.data.packing import pack
from cadlib.dispatch.build import build_dispatch
from cadlib.infra.results import save_result
from cadlib.runtime import kernels
from cadlib.runtime.device import to_device
from cadlib.scheduling import (
    recipes,
    scheduler,
)

METHODS = (*names(packing="sequential", signal_only=False),
           *(m + "+sl" for m in names(cad=True, signal_only=False)))          # +sl: sent-last


def plans_of(method: str, layout, args) -> list:
    """The plans whose servers a rank runs for ``method`` in one layer (two for ping-pong)."""
    base, sl = method.removesuffix("+sl"), method.endswith("+sl")
    if base not in ("colocated", "cad", "cad-pingpong") or (sl and base == "colocated"):
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if base == "colocated":
        return [scheduler.colocated(layout)]
    args = argparse.Namespace(**{**vars(args), "sent_last": sl})
    if base == "cad":
        return [recipes.cad_plan(layout, args, args.spec)]
    return list(recipes.nano_plans(layout, args, args.spec)[1])


def replay(args, device, dtype, backend) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for b in range(args.batches):
        docs = recipes.batch_docs(args, b, args.world)
        layout = pack(docs, args.world, args.tokens_per_rank, method="sequential", model=args.model)
        for method in args.replay_methods:
            plans = plans_of(method, layout, args)
            for rank in range(args.world):
                ms, n_q, n_kv, g_q, g_kv = 0.0, 0, 0, 0, 0
                for plan in plans:
                    dd = to_device(build_dispatch(plan, rank), device)
                    if dd.meta.n_tasks == 0:
                        continue
                    call = ServeCall(dd, args.spec, device, dtype, backend, gen)
                    t = time_fn(call.run, device, iters=args.iters, warmup=args.warmup, ahead=True)
                    ms += t["median_ms"]
                    gq, gkv = dd.meta.gathered_rows()
                    n_q, n_kv = n_q + call.served_q_rows, n_kv + call.kv_rows
                    g_q, g_kv = g_q + gq, g_kv + gkv
                rows.append({"batch": b, "method": method, "rank": rank, "ms": ms, "served_q_rows": n_q,
                             "kv_rows": n_kv, "gathered_q_rows": g_q, "gathered_kv_rows": g_kv,
                             "plan_imbalance": [p.imbalance() for p in plans]})
            mx = max(r["ms"] for r in rows[-args.world:])
            print(f"batch {b} {method:>16}: slowest rank {mx:8.2f} ms  "
                  + " ".join(f"{r['ms']:.2f}" for r in rows[-args.world:]), flush=True)
    return rows


def summarise(rows: list[dict], world: int) -> dict:
    """Per batch and method: slowest rank, and the share of colocated's straggler gap it recovers."""
    per_batch, by = [], {}
    for r in rows:
        by.setdefault((r["batch"], r["method"]), []).append(r["ms"])
    batches = sorted({b for b, _ in by})
    for b in batches:
        colo = by.get((b, "colocated"))
        row = {"batch": b}
        if colo:
            row["colocated_max_ms"], row["colocated_mean_ms"] = max(colo), statistics.fmean(colo)
            row["straggler_gap_frac"] = (max(colo) - statistics.fmean(colo)) / max(colo)
        for (bb, method), ms in by.items():
            if bb != b or method == "colocated":
                continue
            row[f"max_ms {method}"] = max(ms)
            if colo and max(colo) > statistics.fmean(colo):
                row[f"recovered {method}"] = (max(colo) - max(ms)) / (max(colo) - statistics.fmean(colo))
        per_batch.append(row)
    methods = sorted({m for _, m in by if m != "colocated"})
    summary = {f"mean_max_ms {m}": statistics.fmean(r[f"max_ms {m}"] for r in per_batch if f"max_ms {m}" in r)
               for m in methods}
    return {"per_batch": per_batch, "summary": summary}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, sdpa_ref, 2 batches")
    ap.add_argument("--dist", default="pretrain")
    ap.add_argument("--tokens", type=int, default=65536, help="tokens per rank")
    ap.add_argument("--world", type=int, default=2, help="ranks (servers) of the replayed plans")
    ap.add_argument("--batches", type=int, default=10)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--tolerance", type=float, default=defaults.DEFAULT_TOLERANCE)
    ap.add_argument("--min-shard", type=int, default=512)
    ap.add_argument("--nano-split", default=defaults.DEFAULT_NANO_SPLIT, choices=("whole", "docs"))
    ap.add_argument("--uniform-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--backend", default=None, help="attention backend (default: the best available)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.smoke:
        a.model, a.tokens, a.batches, a.min_shard, a.device = "tiny", 512, 2, 32, "cpu"
    for flag, val in (("--world", a.world), ("--batches", a.batches), ("--iters", a.iters),
                      ("--tokens", a.tokens)):
        if val < 1:
            ap.error(f"{flag} must be >= 1, got {val}")
    methods = a.methods.split(",")
    for m in methods:
        if m not in METHODS:
            ap.error(f"unknown method {m!r} in --methods; choose from: {', '.join(METHODS)}")
    if "colocated" not in methods:
        methods.insert(0, "colocated")         # the straggler and the balance every other is measured by
    targv = ["--model", a.model, "--tokens-per-rank", str(a.tokens), "--dist", a.dist, "--tolerance",
             str(a.tolerance), "--min-shard", str(a.min_shard), "--nano-split", a.nano_split, "--seed",
             str(a.seed)] + (["--max-doc-len", "700"] if a.smoke else [])
    if a.dist == "uniform":
        targv += ["--doc-len", str(a.uniform_len)]
    args = train_args.parse_args(targv)
    args.world, args.batches, args.replay_methods, args.iters, args.warmup = (a.world, a.batches, methods,
                                                                              a.iters, a.warmup)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = kernels.resolve_backend(a.backend, device, dtype, args.spec.head_dim)
    rows = replay(args, device, dtype, backend)
    out = summarise(rows, a.world)
    for k, v in out["summary"].items():
        print(f"{k}: {v:.2f}")
    for r in out["per_batch"]:
        print(f"batch {r['batch']}: gap {r.get('straggler_gap_frac', 0):.3f} " + " ".join(
            f"{k.split(' ', 1)[1]} {v:.2f}" for k, v in r.items() if k.startswith("recovered")))
    config = {**vars(a), "methods": methods, "backend": backend,
              "dtype": str(dtype), "layer": "one layer's serve stage, forward + backward, per plan"}
    save_result(a.out, config, {"rows": rows, **out})
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

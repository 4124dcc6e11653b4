"""Benchmark the CAD scheduler against the colocated placement and the bytes-blind equal-FLOPs
water-filling, in four parts:

* **scale** (default): imbalance (max/mean attention pairs per server) before and after, forward
  dispatch bytes (Q + KV, one layer, bf16, llama3-8b), tasks, moves and planning time at 8, 64, 512
  servers x 128K, 512K tokens per rank, for ``pretrain``, ``prolong`` and long documents
  (``pretrain-x4``: pretrain elongated 4x, as DistCA's 512K runs), sequentially packed, plus DistCA's
  head/tail chunks (``zigzag``: each document in 2R chunks, rank r holding chunks r and 2R-1-r).
  ``plan_ms`` covers layout -> arrays, the greedy and the equal-FLOPs guard, wall clock;
  ``plan_cpu_ms`` the same in process CPU time (this machine may be shared: see ``loadavg``);
  ``noguard`` is the greedy alone.
* **grid** (``--grid``): greedy (no guard) and equal-FLOPs bytes on DistCA-pretrain and ProLong,
  8/16/32 ranks x 32K/64K/128K tokens, sequential and balanced packing, tolerance 0.02/0.05/0.1,
  seeds 0-3, min_shard 512: the ratio greedy / equal_flops per case and its summary. Also per case
  the scheduler with its guard (``cadg``) against DistCA's released planner (``distca``,
  :mod:`cadlib.scheduling.distca`, same tolerance and min_shard; ``distca1`` without a minimum shard, as
  released): bytes, imbalance, and ``cadm``, the scheduler at DistCA's reached imbalance where that is
  tighter than the tolerance (matched balance).
  ``results/bench_scheduler_grid_distca.json`` is this part alone (``--grid --out ...``).
* **random** (``--random N``): the greedy alone against equal-FLOPs on N random tiny layouts (the
  generator of ``tests/test_scheduler.py``, seed 0: 1-8 ranks, 1-9 documents of 1-399 tokens cut at
  random, 1-8 servers, tolerance 0/0.02/0.1/0.3, min_shard 1/8/32): how often it moves more bytes
  where both reach the tolerance, misses the tolerance equal-FLOPs reaches, or ends with a higher peak
  where neither reaches it (``random_summary``).
* **host path** (``--host-path``, written to ``results/bench_host_path.json``): one training step's
  host work per rank at 64 x 512K: the layout (``Layout.from_chunks`` on the packer's chunk array,
  validated; ``layout_lists_ms``: ``Layout`` from per-rank lists of ``Chunk`` objects instead) ->
  plan (``place``, with the guard) -> the rank's device metadata (``metadata_ms``: ``build_dispatch``,
  the merged call's metadata and both packed for the device; ``dispatch_ms``: ``build_dispatch``
  alone), each rank's the median of ``--runs`` builds (``metadata_ms_max_single``: the slowest single
  build of any rank, as a step would see it on this shared VM). ``step_host_ms_max`` = layout + plan +
  the slowest rank's metadata. ``kv_rows_max`` is the largest per-rank KV gather (one entry per KV
  token a served task reads), which the host holds as ``host_runs_max`` runs; ``expand_on_cpu_ms``
  is that rank's expansion of every map the merged forward and backward read, with torch on this CPU
  (device work, not host: on a GPU it runs on the device after the one copy). With ``--sent-last``
  the plan is re-ordered (:func:`cadlib.scheduling.sentlast.sent_last`, ``sent_last_ms``, counted in the step)
  and the metadata built from the re-ordered plan.

    python scripts/bench/bench_scheduler.py                 # scale
    python scripts/bench/bench_scheduler.py --grid --out results/bench_scheduler_grid_distca.json   # the grid
    python scripts/bench/bench_scheduler.py --host-path     # per-step host time
    python scripts/bench/bench_scheduler.py --random 3000   # random tiny layouts (--all records them)
    python scripts/bench/bench_scheduler.py --all           # scale, grid, random and host path
    python scripts/bench/bench_scheduler.py --quick         # scale at 8, 64 servers x 128K, 1 run
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from cadlib.core.cost import ModelSpec
from cadlib.core.layout import Layout
from cadlib.data.packing import (
    pack,
    per_doc_zigzag_layout,
)
from cadlib.data.workload import sample_docs, sample_kwargs
from cadlib.dispatch.build import build_dispatch
from cadlib.infra.results import RESULTS_DIR, save_result
from cadlib.runtime.device import to_device
from cadlib.scheduling.scheduler import place
from cadlib.scheduling.sentlast import sent_last
from cadlib.testing import random_tiny_layout

DISTS = {"pretrain": {"dist": "pretrain"}, "prolong": {"dist": "prolong"},
         "pretrain-x4": {"dist": "pretrain", "elongate": 4.0}}


def make_layout(dist: str, n: int, tpr: int, layout: str, seed: int):
    kw = dict(DISTS[dist]) if dist in DISTS else sample_kwargs(dist)
    docs = sample_docs(kw.pop("dist"), n * tpr, seed=seed, **kw)
    return per_doc_zigzag_layout(docs, n) if layout == "zigzag" else pack(docs, n, tpr, method=layout)


def timed(fn, runs: int):
    """``(result, median wall seconds, median CPU seconds)`` over ``runs`` calls."""
    wall, cpu, out = [], [], None
    for _ in range(runs):
        w, c = time.perf_counter(), time.process_time()
        out = fn()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    return out, statistics.median(wall), statistics.median(cpu)


def scale_case(dist, n, tpr, layout_kind, args, model):
    t0 = time.perf_counter()
    layout = make_layout(dist, n, tpr, layout_kind, args.seed)
    setup_s = time.perf_counter() - t0
    row = {"dist": dist, "layout": layout_kind, "servers": n, "tokens_per_rank": tpr, "total_tokens": n * tpr,
           "n_docs": layout.n_docs, "n_chunks": int(sum(len(r) for r in layout.ranks)),
           "setup_s": round(setup_s, 3)}
    ch = layout.chunk_array()
    variants = [("colocated", "colocated", True), ("equal_flops", "equal_flops", True), ("cad", "cad", True),
                ("cad_noguard", "cad", False)]
    for name, method, guard in variants:
        p, wall, cpu = timed(lambda: place(layout, method, n, model, args.tolerance, args.min_shard, "bf16",
                                           chunks=ch, guard=guard), 1 if method == "colocated" else args.runs)
        r = {"imbalance": p.imbalance(), "n_tasks": p.n_tasks, "n_moves": p.meta["n_moves"],
             "n_splits": p.meta["n_splits"],
             "reached": p.meta["reached"], "guard_used": p.meta["guard"],
             "plan_ms": wall * 1e3, "plan_cpu_ms": cpu * 1e3, "loop_ms": p.meta["loop_seconds"] * 1e3,
             "dispatch_gb": p.forward_bytes(model) / 1e9}
        if n * tpr <= args.validate_max_tokens:
            _, r["validate_ms"], _ = timed(p.validate, 1)
            r["validate_ms"] *= 1e3
        row[name] = r
    row["imbalance_before"] = row["colocated"]["imbalance"]
    return row


def run_scale(args, model):
    cases = [(d, n, t, "sequential") for d in args.dists for n in args.servers for t in args.tokens_per_rank]
    cases += [(d, n, t, "zigzag") for d in args.zigzag_dists for n in args.servers
              for t in args.tokens_per_rank if n <= 64]
    rows = []
    for c in cases:
        rows.append(scale_case(*c, args, model))
        r = rows[-1]
        cad, eq, ng = r["cad"], r["equal_flops"], r["cad_noguard"]
        print(f"{r['dist']:12}{r['layout']:11}{r['servers']:>5}{r['tokens_per_rank'] // 1024:>6}K"
              f"{r['imbalance_before']:>7.2f}{eq['imbalance']:>7.3f}{cad['imbalance']:>7.3f}"
              f"{eq['dispatch_gb']:>9.2f}{ng['dispatch_gb']:>9.2f}{cad['dispatch_gb']:>9.2f}{cad['n_moves']:>6}"
              f"{cad['plan_ms']:>9.1f}{cad['plan_cpu_ms']:>9.1f}{ng['plan_cpu_ms']:>9.1f}", flush=True)
    return rows


def run_grid(args, model):
    rows = []
    for dist in ("distca-pretrain", "prolong"):
        for n in (8, 16, 32):
            for tpr in (32768, 65536, 131072):
                for pk in ("sequential", "balanced"):
                    for seed in range(4):
                        layout = make_layout(dist, n, tpr, pk, seed)
                        ch = layout.chunk_array()
                        for tol in (0.02, 0.05, 0.1):
                            eq = place(layout, "equal_flops", n, model, tol, 512, chunks=ch)
                            cad = place(layout, "cad", n, model, tol, 512, chunks=ch, guard=False)
                            cadg = place(layout, "cad", n, model, tol, 512, chunks=ch)
                            dca = place(layout, "distca", n, model, tol, 512, chunks=ch)
                            dca1 = place(layout, "distca", n, model, tol, 1, chunks=ch)   # no min shard
                            tol_m = min(tol, max(dca.imbalance() - 1.0, 0.0))   # DistCA's balance if tighter
                            cadm = cadg if tol_m == tol else place(layout, "cad", n, model, tol_m, 512,
                                                                   chunks=ch)
                            be, bc = eq.forward_bytes(model), cad.forward_bytes(model)
                            bg, bd, bm = (p.forward_bytes(model) for p in (cadg, dca, cadm))
                            rows.append({"dist": dist, "ranks": n, "tokens_per_rank": tpr, "pack": pk,
                                         "seed": seed, "tolerance": tol, "eq_gb": be / 1e9,
                                         "cad_gb": bc / 1e9,
                                         "ratio": _ratio(bc, be),
                                         "eq_reached": eq.meta["reached"], "cad_reached": cad.meta["reached"],
                                         "eq_moves": eq.meta["n_moves"], "cad_moves": cad.meta["n_moves"],
                                         "imbalance_before": eq.meta["imbalance_before"],
                                         "eq_imbalance": eq.imbalance(), "cadg_imbalance": cadg.imbalance(),
                                         "cadg_gb": bg / 1e9, "cadg_reached": cadg.meta["reached"],
                                         "cadg_guard": cadg.meta["guard"],
                                         "distca_gb": bd / 1e9, "distca_imbalance": dca.imbalance(),
                                         "distca_reached": dca.meta["reached"],
                                         "distca_receivers_met": dca.meta["receivers_met"],
                                         "distca_moves": dca.meta["n_moves"],
                                         "distca1_gb": dca1.forward_bytes(model) / 1e9,
                                         "distca1_imbalance": dca1.imbalance(),
                                         "distca1_reached": dca1.meta["reached"],
                                         "ratio_distca": bg / bd if bd else None,
                                         "cadm_tolerance": tol_m, "cadm_gb": bm / 1e9,
                                         "cadm_imbalance": cadm.imbalance(),
                                         "cadm_reached": cadm.meta["reached"],
                                         "ratio_distca_matched": bm / bd if bd else None})
    ratio = np.array([r["ratio"] for r in rows])
    dist_sum = _distca_summary(rows)
    summary = {"cases": len(rows), "ratio_min": float(ratio.min()), "ratio_median": float(np.median(ratio)),
               "ratio_max": float(ratio.max()), "cases_above_1": int((ratio > 1).sum()),
               "cases_above_1.01": int((ratio > 1.01).sum()),
               "eq_reached_cad_not": sum(r["eq_reached"] and not r["cad_reached"] for r in rows),
               "eq_not_reached": sum(not r["eq_reached"] for r in rows),
               "note": "the greedy without the equal-FLOPs guard; with it (the default) every ratio is <= 1",
               "distca": dist_sum}
    print("grid:", summary)
    return rows, summary


def _ratio(a: float, b: float) -> float:
    return a / b if b else (1.0 if a == 0 else float("inf"))


def _stats(x) -> dict:
    x = np.asarray(x, dtype=np.float64)
    return {"cases": int(x.size), "min": float(x.min()), "median": float(np.median(x)), "max": float(x.max()),
            "above_1": int((x > 1).sum())} if x.size else {"cases": 0}


def _distca_summary(rows) -> dict:
    """The scheduler with its guard (``cadg``) against DistCA's released planner, per grid case."""
    moved = [r for r in rows if r["distca_gb"] > 0]
    both = [r for r in moved if r["distca_reached"]]
    imb = {k: np.array([r[f"{k}_imbalance"] for r in rows]) for k in ("distca", "cadg", "eq")}
    return {
        "what": "ratio = cadg_gb / distca_gb: cadlib's scheduler with its guard / DistCA's released planner "
                "(cadlib.scheduling.distca), same tolerance and min_shard; reached: max <= (1 + tolerance) "
                "x mean",
        "ours_more_bytes": sum(r["cadg_gb"] > r["distca_gb"] for r in rows),
        "ours_more_bytes_distca_reached": sum(r["cadg_gb"] > r["distca_gb"] for r in both),
        "ratio_where_distca_moved": _stats([r["ratio_distca"] for r in moved]),
        "ratio_where_distca_reached": _stats([r["ratio_distca"] for r in both]),
        "distca_no_moves": len(rows) - len(moved),
        "distca_reached": sum(r["distca_reached"] for r in rows),
        "distca_receivers_met": sum(r["distca_receivers_met"] for r in rows),
        "cadg_reached": sum(r["cadg_reached"] for r in rows),
        "imbalance_median": {k: float(np.median(v)) for k, v in imb.items()},
        "imbalance_max": {k: float(v.max()) for k, v in imb.items()},
        "distca_tighter": int((imb["distca"] < imb["cadg"] - 1e-9).sum()),
        "distca1": "DistCA's planner as released, without a minimum shard (min_shard 1)",
        "ratio_distca1_where_moved": _stats([r["cadg_gb"] / r["distca1_gb"] for r in rows
                                             if r["distca1_gb"] > 0]),
        "distca1_reached": sum(r["distca1_reached"] for r in rows),
        "ours_more_bytes_than_distca1": sum(r["cadg_gb"] > r["distca1_gb"] for r in rows),
        "ratio_matched_where_distca_moved": _stats([r["ratio_distca_matched"] for r in moved]),
        "matched_note": "cadm: the scheduler at tolerance min(tol, DistCA's reached imbalance - 1), so at "
                        "least as balanced as DistCA's plan"}


def run_random(n: int, model) -> dict:
    """The greedy alone vs equal-FLOPs on ``n`` random tiny layouts (seed 0): loss counts."""
    rng = np.random.default_rng(0)
    out = {"layouts": n, "bytes": 0, "miss": 0, "peak": 0, "peak_at_tolerance_0": 0}
    for _ in range(n):
        layout, S = random_tiny_layout(rng)
        tol, m = float(rng.choice([0.0, 0.02, 0.1, 0.3])), int(rng.choice([1, 8, 32]))
        ch = layout.chunk_array()
        eq = place(layout, "equal_flops", S, model, tol, m, chunks=ch)
        raw = place(layout, "cad", S, model, tol, m, chunks=ch, guard=False)
        if eq.meta["reached"]:
            if not raw.meta["reached"]:
                out["miss"] += 1
            elif raw.forward_bytes(model) > eq.forward_bytes(model):
                out["bytes"] += 1
        elif not raw.meta["reached"] and raw.server_pairs().max() > eq.server_pairs().max():
            out["peak"] += 1
            out["peak_at_tolerance_0"] += tol == 0
    out["what"] = ("the greedy alone (no guard) against equal_flops: bytes = more forward bytes where both "
                   "reach the tolerance; miss = equal_flops reaches it and the greedy does not; peak = "
                   "neither reaches it and the greedy's peak is higher")
    print("random:", out)
    return out


def _metadata(plan, r):
    """Rank ``r``'s device metadata on the host: the dispatch, the merged call's metadata and both
    packed for the device (``to_device``: the runs in one buffer; on CUDA pinned and copied ``non_blocking``,
    here a CPU tensor). The per-token maps are expanded later, on the device, on first use."""
    d = build_dispatch(plan, r)
    to_device(d, "cpu")
    return d


def _expand_all(d):
    """Expand (torch, CPU here) every map a forward + backward with the merged call reads."""
    dd = to_device(d, "cpu")
    for name in ("q_send_index", "kv_send_index", "q_rows", "ret_rows", "self_rows", "self_local",
                 "kv_send_uniq", "kv_send_slot"):
        getattr(dd, name)
    for name in ("kv_rows", "once_pos", "once_rows", "rep_pos", "rep_slot", "rep_rows"):
        getattr(dd.shared, name)


HOST_CASES = ("pretrain:sequential", "prolong:sequential", "pretrain-x4:sequential", "pretrain-x4:zigzag")


def run_host_path(args, model):
    import torch  # noqa: F401  (imported by any training process; not part of a step's host time)

    n, tpr = 64, 512 * 1024
    out = []
    for dist, kind in (c.split(":") for c in args.host_cases):
        layout = make_layout(dist, n, tpr, kind, args.seed)
        ch = layout.chunk_array()
        _, lay_wall, lay_cpu = timed(lambda: Layout.from_chunks(ch, layout.doc_lens, n), args.runs)
        _, lists_wall, _ = timed(lambda: Layout(layout.ranks, layout.doc_lens), args.runs)
        plan, wall, cpu = timed(lambda: place(layout, "cad", n, model, args.tolerance, args.min_shard),
                                args.runs)
        _, val, _ = timed(plan.validate, 1)
        sl_wall = sl_cpu = 0.0
        if args.sent_last:
            sl, sl_wall, sl_cpu = timed(lambda: sent_last(plan), args.runs)
            plan = sl.plan
        _metadata(plan, 0)                                       # warm-up: first-call imports
        per, single, kv_rows, runs = [], [], [], []
        for r in range(n):                                       # each rank: median of args.runs builds
            _, w, c = timed(lambda: build_dispatch(plan, r), args.runs)
            d, mw, mc = timed(lambda: _metadata(plan, r), args.runs)
            _, once, _ = timed(lambda: _metadata(plan, r), 1)
            per.append((w, c, mw, mc))
            single.append(once)
            kv_rows.append(int(d.cu_k[-1]))
            runs.append(sum(x.lens.size for e in d.index.values() for x in e.runs())
                        + sum(x.lens.size for e in d.shared().index.values() for x in e.runs()))
        per = np.array(per) * 1e3
        worst = int(np.argmax(kv_rows))
        _, exp_wall, _ = timed(lambda: _expand_all(build_dispatch(plan, worst)), 1)
        row = {"dist": dist, "layout": kind, "servers": n, "tokens_per_rank": tpr, "n_tasks": plan.n_tasks,
               "n_chunks": int(len(ch)), "layout_ms": lay_wall * 1e3, "layout_cpu_ms": lay_cpu * 1e3,
               "layout_lists_ms": lists_wall * 1e3,
               "plan_ms": wall * 1e3, "plan_cpu_ms": cpu * 1e3, "sent_last": bool(args.sent_last),
               "sent_last_ms": sl_wall * 1e3, "sent_last_cpu_ms": sl_cpu * 1e3,
               "dispatch_ms_median": float(np.median(per[:, 0])), "dispatch_ms_max": float(per[:, 0].max()),
               "dispatch_cpu_ms_median": float(np.median(per[:, 1])),
               "dispatch_cpu_ms_max": float(per[:, 1].max()),
               "metadata_ms_median": float(np.median(per[:, 2])), "metadata_ms_max": float(per[:, 2].max()),
               "metadata_cpu_ms_max": float(per[:, 3].max()), "metadata_ms_max_single": max(single) * 1e3,
               "kv_rows_max": int(max(kv_rows)), "host_runs_max": int(max(runs)),
               "expand_on_cpu_ms": exp_wall * 1e3,
               "step_host_cpu_ms_max": (lay_cpu + cpu + sl_cpu) * 1e3 + float(per[:, 3].max()),
               "step_host_ms_max": (lay_wall + wall + sl_wall) * 1e3 + float(per[:, 2].max()),
               "step_host_ms_max_single": (lay_wall + wall + sl_wall + max(single)) * 1e3,
               "validate_ms": val * 1e3}
        out.append(row)
        print(f"host path {dist:12}{kind:11} layout {row['layout_ms']:.1f} ms "
              f"(cpu {row['layout_cpu_ms']:.1f}; from lists {row['layout_lists_ms']:.1f}), "
              f"plan {row['plan_ms']:.1f} ms (cpu {row['plan_cpu_ms']:.1f}), "
              + (f"sent-last {row['sent_last_ms']:.1f} ms, " if args.sent_last else "")
              + f"dispatch median {row['dispatch_ms_median']:.1f} max {row['dispatch_ms_max']:.1f} ms, "
              f"+ merged call and device packing median {row['metadata_ms_median']:.1f} "
              f"max {row['metadata_ms_max']:.1f} ms (single: {row['metadata_ms_max_single']:.1f}), "
              f"step max {row['step_host_ms_max']:.1f} ms (single: {row['step_host_ms_max_single']:.1f}); "
              f"kv rows {row['kv_rows_max']} from {row['host_runs_max']} runs, expanded on CPU in "
              f"{row['expand_on_cpu_ms']:.0f} ms; validate {row['validate_ms']:.1f} ms", flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 and 64 servers at 128K tokens/rank, one run")
    ap.add_argument("--grid", action="store_true", help="only the bytes grid")
    ap.add_argument("--host-path", action="store_true", help="only the per-step host path")
    ap.add_argument("--random", type=int, default=0, metavar="N",
                    help="only the greedy alone vs equal-FLOPs on N random tiny layouts")
    ap.add_argument("--all", action="store_true", help="scale, grid, random (3000) and host path")
    ap.add_argument("--servers", type=int, nargs="+", default=[8, 64, 512])
    ap.add_argument("--tokens-per-rank", type=int, nargs="+", default=[128 * 1024, 512 * 1024])
    ap.add_argument("--dists", nargs="+", default=list(DISTS))
    ap.add_argument("--zigzag-dists", nargs="+", default=["pretrain-x4"])
    ap.add_argument("--tolerance", type=float, default=0.1)
    ap.add_argument("--min-shard", type=int, default=512)
    ap.add_argument("--runs", type=int, default=5, help="planning runs per case (median reported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--validate-max-tokens", type=int, default=64 * 512 * 1024,
                    help="time Plan.validate only up to this many tokens")
    ap.add_argument("--out", default=str(RESULTS_DIR / "bench_scheduler.json"))
    ap.add_argument("--host-out", default=str(RESULTS_DIR / "bench_host_path.json"))
    ap.add_argument("--host-cases", nargs="+", default=list(HOST_CASES), metavar="DIST:LAYOUT",
                    help="host-path cases (default: all four)")
    ap.add_argument("--sent-last", action="store_true",
                    help="host path: re-order each plan with cadlib.scheduling.sentlast first (timed)")
    args = ap.parse_args(argv)
    if args.quick:
        args.servers, args.tokens_per_rank, args.runs = [8, 64], [128 * 1024], 1
    model = ModelSpec.from_name("llama3-8b")
    do_scale = args.all or not (args.grid or args.host_path or args.random)
    config = {k: v for k, v in vars(args).items() if k not in ("out", "host_out")} | {
        "model": model.name, "dtype": "bf16", "loadavg_at_start": list(os.getloadavg())}
    t_all = time.perf_counter()
    if args.random and not (do_scale or args.grid or args.host_path):
        run_random(args.random, model)                         # printed only; --all records it
        return
    if do_scale or args.grid or args.all:
        extra = {"target": {"servers": 64, "tokens_per_rank": 512 * 1024, "plan_ms": 10.0}}
        if do_scale:
            print(f"{'dist':12}{'layout':11}{'S':>5}{'tok/r':>7}{'before':>7}{'eq':>7}{'cad':>7}{'eq GB':>9}"
                  f"{'raw GB':>9}{'cad GB':>9}{'moves':>6}{'plan ms':>9}{'cpu ms':>9}{'raw cpu':>9}")
        scale = run_scale(args, model) if do_scale else []
        if args.grid or args.all:
            extra["grid"], extra["grid_summary"] = run_grid(args, model)
        if args.random or args.all:
            extra["random_summary"] = run_random(args.random or 3000, model)
        extra["wall_s"] = round(time.perf_counter() - t_all, 1)
        save_result(args.out, config, scale, **extra)
        print(f"wrote {args.out}")
    if args.host_path or args.all:
        rows = run_host_path(args, model)
        save_result(args.host_out, config, rows, target={"servers": 64, "tokens_per_rank": 512 * 1024,
                                                         "step_host_ms_per_rank": 50.0})
        print(f"wrote {args.host_out}")


if __name__ == "__main__":
    main()

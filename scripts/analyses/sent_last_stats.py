#!/usr/bin/env python
"""What ``--sent-last`` (cadlib.scheduling.sentlast) would save on the committed end-to-end runs, host only.

For every ``results/bench_e2e_<n>x_<dist>_<tokens>k_<link>.json`` (no suffix after the link), each batch's
plans are rebuilt as ``cadlib.train`` built them (:func:`cadlib.analysis.runs.cost_check.rebuild_plans`:
``cad``'s plan and ``cad-pingpong``'s two nano-batch plans), with and without the re-ordering. Per method
and rank: the query and KV rows each server gathers (:meth:`cadlib.dispatch.meta.Dispatch.gathered_rows`,
summed over the batches and, for ping-pong, the two nano-batches), and what the fitted cost of a gathered
row (``server_overhead_fit`` of ``results/cost_model_check.json``: ns per row and layer, forward and
backward) predicts the re-ordering saves per step: ``saving_ms`` = the slowest rank's measured attention
minus the slowest rank's after subtracting each rank's predicted change (mean over batches),
``saving_slowest_ms`` the change on the rank that was slowest.

A sent-last server lays its buffers out received first or local first, whichever gathers fewer rows
(``Dispatch.recv_first``). Servers that still gather KV rows afterwards are counted by the first
reason that applies: a kept task reads rows its rank sent away (a START or middle shard was sent:
``sent_start``), a kept task reads KV-only rows (ping-pong's nano-batch B reading A's rows, which are
last in its buffer: ``context``), a kept task reads KV from another rank (its document began
elsewhere: ``remote_prefix``), the server received tasks (``received``), a document in several
segments (``split``), or ``other``. ``sent_tasks`` /
``sent_start_tasks``: tasks sent away, and those a kept task of their home reads the KV of.

    python scripts/analyses/sent_last_stats.py                  # prints; --out FILE writes the rows as JSON
"""
from __future__ import annotations

import argparse
import glob
import json
import pathlib
import re
import sys

import numpy as np

from cadlib.analysis.runs.cost_check import rebuild_plans
from cadlib.dispatch.build import build_dispatch

ROOT = pathlib.Path(__file__).resolve().parents[2]

REASONS = ("sent_start", "context", "remote_prefix", "received", "split", "other")


def kv_reason(plan, d, rank: int) -> str:
    """Why server ``rank`` of ``plan`` (its dispatch ``d``) still gathers KV (see the docstring)."""
    ch = plan.layout.chunk_array()
    mine = (plan.home == rank) & (plan.server == rank)
    sent = (plan.home == rank) & (plan.server != rank)
    for i in np.flatnonzero(mine):
        if np.any(sent & (plan.doc == plan.doc[i]) & (plan.q_start < plan.q_start[i])):
            return "sent_start"
    docs = set(plan.doc[mine].tolist())
    for c in ch[ch[:, 3] == rank]:
        if c[0] in docs and not np.any((plan.doc == c[0]) & (plan.q_start < c[2]) & (plan.q_end > c[1])):
            return "context"
    for i in np.flatnonzero(mine):
        c = ch[ch[:, 0] == plan.doc[i]]
        if np.any((c[:, 3] != rank) & (c[:, 1] < plan.q_end[i])):
            return "remote_prefix"
    if d.n_recv_q:
        return "received"
    return "split" if d.shared().split_docs else "other"


def sent_start_tasks(plan) -> tuple[int, int]:
    """Tasks sent away, and those of them whose home keeps a later task of their document."""
    sent = np.flatnonzero(plan.home != plan.server)
    kept = plan.home == plan.server
    n = sum(bool(np.any(kept & (plan.home == plan.home[i]) & (plan.doc == plan.doc[i])
                        & (plan.q_start >= plan.q_end[i]))) for i in sent)
    return int(sent.size), int(n)


def setting_rows(path: str, fit: dict) -> list[dict]:
    res = json.load(open(path))
    cfg, records = res["config"], res["results"]["records"]
    world = int(cfg.get("nproc") or 1 + max(r["rank"] for r in records))
    attn: dict = {}
    for r in records:
        attn.setdefault((r["method"], r["batch"]), np.zeros(world))[r["rank"]] = r["attention_ms"]
    out = []
    for method in ("cad", "cad-pingpong"):
        tot = {sl: np.zeros((world, 2), dtype=np.int64) for sl in (False, True)}
        reasons = dict.fromkeys(REASONS, 0)
        saving, slowest, meas_max, n_sent, n_start = [], [], [], 0, 0
        for b in sorted({r["batch"] for r in records if r["method"] == method}):
            g = {}
            for sl in (False, True):
                spec, _, plan, nanos, _ = rebuild_plans({**cfg, "sent_last": sl}, b, world)
                plans = [plan] if method == "cad" else nanos
                g[sl] = np.zeros((world, 2), dtype=np.int64)
                for p in plans:
                    for r in range(world):
                        d = build_dispatch(p, r)
                        g[sl][r] += d.gathered_rows()
                        if sl and d.gathered_rows()[1]:
                            reasons[kv_reason(p, d, r)] += 1
                    if not sl:
                        s, st = sent_start_tasks(p)
                        n_sent, n_start = n_sent + s, n_start + st
                tot[sl] += g[sl]
            L = spec.n_layers
            delta = L * ((g[True] - g[False]) @ np.array([fit["ns_per_q_row"], fit["ns_per_kv_row"]])) / 1e6
            m = attn[(method, b)]
            meas_max.append(m.max())
            saving.append(m.max() - (m + delta).max())
            slowest.append(-delta[int(np.argmax(m))])
        out.append({"file": pathlib.Path(path).name, "method": method, "batches": len(saving),
                    "attention_ms_max": float(np.mean(meas_max)), "saving_ms": float(np.mean(saving)),
                    "saving_slowest_ms": float(np.mean(slowest)),
                    **{f"{k}_gathered_{when}": tot[sl][:, i].tolist() for i, k in enumerate(("q", "kv"))
                       for sl, when in ((False, "before"), (True, "after"))},
                    "kv_gather_reasons_after": reasons, "sent_tasks": n_sent, "sent_start_tasks": n_start})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pattern", default=str(ROOT / "results" / "bench_e2e_*x_*.json"))
    ap.add_argument("--fit", default=str(ROOT / "results" / "cost_model_check.json"),
                    help="a cost_model_check JSON with results.server_overhead_fit")
    ap.add_argument("--out", default=None, help="write the rows here (JSON)")
    args = ap.parse_args(argv)
    fit = json.load(open(args.fit))["results"]["server_overhead_fit"]
    files = sorted(f for f in glob.glob(args.pattern) if re.search(r"_(nvlink|inter-node-like)\.json$", f))
    rows = [row for f in files for row in setting_rows(f, fit)]
    for r in rows:
        print(f"{r['file']:48} {r['method']:12} attention {r['attention_ms_max']:6.1f} ms, saving "
              f"{r['saving_ms']:5.2f} ms ({100 * r['saving_ms'] / r['attention_ms_max']:.1f}%; slowest rank "
              f"{r['saving_slowest_ms']:5.2f}); q rows {r['q_gathered_before']} -> {r['q_gathered_after']}, "
              f"kv rows {r['kv_gathered_before']} -> {r['kv_gathered_after']}; KV still gathered: "
              + ", ".join(f"{k} {v}" for k, v in r["kv_gather_reasons_after"].items() if v)
              + f"; sent tasks {r['sent_tasks']} (a kept task reads {r['sent_start_tasks']})", flush=True)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"fit": fit, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

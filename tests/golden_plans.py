"""Fingerprints of the plans, dispatch sizes and bytes that the library computes for the committed
end-to-end batches and for the scheduler's bytes grid (``tests/golden/plans.json``).

``test_golden.py`` recomputes them and compares: a change of the package's structure must not change
what it computes. Regenerate (only when a change of results is intended, and say so in its commit)::

    .venv/bin/python tests/golden_plans.py --write
"""
from __future__ import annotations

import hashlib
import json
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]

from cadlib.analysis.runs.e2e import load_committed  # noqa: E402
from cadlib.core.cost import as_model  # noqa: E402
from cadlib.data.packing import pack  # noqa: E402
from cadlib.data.workload import sample_docs, sample_kwargs  # noqa: E402
from cadlib.dispatch.build import build_all  # noqa: E402
from cadlib.scheduling import scheduler  # noqa: E402
from cadlib.scheduling.recipes import Recipe, batch_docs, cad_plan, nano_plans  # noqa: E402
from cadlib.scheduling.scheduler import place  # noqa: E402

GOLDEN = ROOT / "tests" / "golden" / "plans.json"
GRID_DISTS = ("distca-pretrain", "prolong")
GRID_RANKS = (8, 16, 32)
GRID_TOKENS = (32768, 65536, 131072)
GRID_PACKS = ("sequential", "balanced")
GRID_SEEDS = range(4)
GRID_TOLERANCES = (0.02, 0.05, 0.1)


def digest(*arrays) -> str:
    h = hashlib.sha1()
    for a in arrays:
        a = np.ascontiguousarray(np.asarray(a, dtype=np.int64))
        h.update(str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def plan_print(plan, spec, dispatch: bool) -> dict:
    q, kv = plan.token_matrices()
    out = {"tasks": digest(plan.doc, plan.q_start, plan.q_end, plan.home, plan.server),
           "layout": digest(plan.layout.chunk_array()), "n_tasks": plan.n_tasks,
           "q_tokens": digest(q), "kv_tokens": digest(kv),
           "forward_bytes": plan.forward_bytes(spec), "total_bytes": plan.total_bytes(spec, backward=True),
           "imbalance": round(plan.imbalance(), 12)}
    for k in ("n_moves", "n_splits", "reached", "guard"):
        if k in plan.meta:
            out[k] = plan.meta[k]
    if dispatch:
        rows = []
        for d in build_all(plan):
            rows.append([d.q_send_splits, d.q_recv_splits, d.kv_send_splits, d.kv_recv_splits, d.n_tasks,
                         list(d.gathered_rows()), bool(d.q_identity), int(d.q_keep),
                         digest(d.cu_q, d.cu_k, d.tasks)])
        out["dispatch"] = rows
    return out


def e2e_prints() -> dict:
    out = {}
    for item in load_committed():
        cfg = item["config"]
        recipe = Recipe.from_config(cfg)
        world = int(cfg.get("nproc") or 2)
        spec = as_model(cfg["model"], **({"n_layers": cfg["layers"]} if cfg.get("layers") else {}))
        batches = sorted({int(r["batch"]) for r in item["results"]["per_batch"]})
        rows = {}
        for b in batches:
            docs = batch_docs(recipe, b, world)
            layout = pack(docs, world, recipe.tokens_per_rank, method="sequential")
            wlb = pack(docs, world, recipe.tokens_per_rank, method="balanced", model=cfg["model"],
                       cap=cfg.get("wlb_cap"))
            nanos, plans = nano_plans(layout, recipe, spec)
            rows[str(b)] = {
                "docs": digest(docs), "wlb_layout": digest(wlb.chunk_array()),
                "colocated": plan_print(scheduler.colocated(layout), spec, True),
                "cad": plan_print(cad_plan(layout, recipe, spec), spec, True),
                "nano_rows": [digest(np.concatenate([np.asarray(r, dtype=np.int64) for r in nb.rows]))
                              for nb in nanos],
                "nano_plans": [plan_print(p, spec, True) for p in plans]}
        out[item["file"]] = rows
    return out


def grid_prints() -> dict:
    spec = as_model("llama3-8b")
    out = {}
    for dist in GRID_DISTS:
        for n in GRID_RANKS:
            for tpr in GRID_TOKENS:
                for pk in GRID_PACKS:
                    for seed in GRID_SEEDS:
                        kw = sample_kwargs(dist)
                        docs = sample_docs(kw.pop("dist"), n * tpr, seed=seed, **kw)
                        layout = pack(docs, n, tpr, method=pk)
                        ch = layout.chunk_array()
                        for tol in GRID_TOLERANCES:
                            key = f"{dist} {n} {tpr} {pk} {seed} {tol}"
                            out[key] = {
                                "equal_flops": plan_print(place(layout, "equal_flops", n, spec, tol, 512,
                                                                chunks=ch), spec, False),
                                "cad_noguard": plan_print(place(layout, "cad", n, spec, tol, 512, chunks=ch,
                                                                guard=False), spec, False),
                                "cad": plan_print(place(layout, "cad", n, spec, tol, 512, chunks=ch), spec,
                                                  False),
                                "distca": plan_print(place(layout, "distca", n, spec, tol, 512, chunks=ch),
                                                     spec, False)}
    return out


def compute() -> dict:
    return {"e2e": e2e_prints(), "grid": grid_prints()}


if __name__ == "__main__":
    import time
    t = time.perf_counter()
    data = compute()
    print(f"{time.perf_counter() - t:.1f} s")
    if "--write" in sys.argv:
        GOLDEN.write_text(json.dumps(data, sort_keys=True, separators=(",", ":")) + "\n")
        print("wrote", GOLDEN)

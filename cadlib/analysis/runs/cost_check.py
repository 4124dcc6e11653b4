"""How well the cost models predict what was measured: the kernel latency table
(:class:`cadlib.core.measured.MeasuredCost`) and the pair-count model against each other on sampled
batches, and against the committed end-to-end runs (``scripts/analyses/cost_model_check.py``)."""
from __future__ import annotations

import numpy as np
import pandas as pd

from ...core.cost import as_model, imbalance
from ...core.measured import MeasuredCost
from ...data.packing import pack, rank_costs
from ...data.workload import sample_docs
from ...dispatch.build import build_dispatch
from ...scheduling import scheduler
from ...scheduling.recipes import Recipe, batch_docs, cad_plan, nano_plans
from ..model.sim import Hardware, attention_seconds, calibrated_cad_step

# ---------------------------------------------------------------------------------------------------
# What it buys: imbalance of modelled server times
# ---------------------------------------------------------------------------------------------------

def model_imbalance(plan, cost: MeasuredCost, model=None, phase: str = "fwd_bwd") -> dict:
    """For one plan: imbalance (max / mean) of the servers' attention under the pair-count model
    (pairs, what the scheduler balances; and :func:`cadlib.analysis.model.sim.attention_seconds`, pairs at an assumed
    rate per shard size) against the measured model (:meth:`MeasuredCost.server_seconds`)."""
    spec = as_model(model)
    pair_t = np.zeros(plan.n_servers)
    np.add.at(pair_t, plan.server, attention_seconds(plan.q_start, plan.q_end, spec, Hardware(), phase, 1))
    meas = cost.server_seconds(plan, phase, spec)
    return {"pairs": imbalance(plan.server_pairs()), "pair_rate_model": imbalance(pair_t),
            "measured": imbalance(meas), "measured_max_s": float(meas.max()),
            "measured_mean_s": float(meas.mean())}


def compare_models(cost: MeasuredCost, dists=("pretrain", "prolong"), n_servers=(8, 32),
                   tokens_per_rank: int = 65536, seeds=(0,), model=None, tolerance: float = 0.1,
                   use_cost_min_shard: bool = False) -> list[dict]:
    """On sampled batches (sequential packing, ``cadlib.scheduling.scheduler.schedule``): one row per (dist,
    servers, seed) with :func:`model_imbalance`; ``use_cost_min_shard`` schedules with the table's
    minimum shard (``cost_model=cost``) instead of the constant."""
    rows = []
    for dist in dists:
        for S in n_servers:
            for seed in seeds:
                docs = sample_docs(dist, S * tokens_per_rank, seed=seed)
                layout = pack(docs, S, tokens_per_rank)
                plan = scheduler.schedule(layout, S, model, tolerance,
                                cost_model=cost if use_cost_min_shard else None)
                rows.append({"dist": dist, "n_servers": S, "seed": seed, "min_shard": plan.meta["min_shard"],
                             **model_imbalance(plan, cost, model)})
    return rows


# ---------------------------------------------------------------------------------------------------
# What it buys on the committed end-to-end runs (scripts/analyses/cost_model_check.py)
# ---------------------------------------------------------------------------------------------------

def rebuild_plans(config: dict, batch: int, world: int):
    """Batch ``batch`` of an end-to-end run with ``config`` (a committed file's), rebuilt exactly as
    :mod:`cadlib.train` builds it: ``(spec, layout, plan, nano_plans, colocated_plan)``; ``plan`` is
    the ``cad`` method's, ``nano_plans`` ``cad-pingpong``'s two (its nano-batches cut documents when
    the file's ``nano_split`` is ``docs``; files without the key kept them whole)."""
    recipe = Recipe.from_config(config)
    spec = as_model(config["model"], **({"n_layers": config["layers"]} if config.get("layers") else {}))
    layout = pack(batch_docs(recipe, int(batch), world), world, recipe.tokens_per_rank, method="sequential")
    return (spec, layout, cad_plan(layout, recipe, spec), nano_plans(layout, recipe, spec)[1],
            scheduler.colocated(layout))


def attention_ms(plans, cost: MeasuredCost, spec) -> float:
    """Milliseconds of attention the step waits for under ``cost``: per plan (nano-batch) and phase
    (forward, backward) the slowest server, summed (every layer ends its attention at an all-to-all;
    :func:`cadlib.analysis.model.sim.simulate_cad`'s barrier), times the layers."""
    return 1e3 * spec.n_layers * sum(float(cost.server_seconds(p, ph, spec).max())
                                     for p in plans for ph in ("fwd", "bwd"))


def e2e_check(item: dict, cost: MeasuredCost) -> list[dict]:
    """Per batch of one committed end-to-end run (an item of :func:`cadlib.analysis.runs.e2e.load_committed`):

    * imbalance (max / mean over ranks) of ``cad``'s attention time: ``measured`` (the records'
      ``attention_ms``), ``pairs`` (the plan's, what the scheduler balanced; asserted equal to the
      run's recorded ``plan_imbalance``) and ``model`` (:meth:`MeasuredCost.server_seconds`);
    * ``cad``'s slowest server's attention, measured and ``cost``'s (kernel alone), in ms;
    * CAD-with-ping-pong's speedup over colocated: measured, the committed ``predicted_speedup``
      (:func:`cadlib.analysis.model.sim.calibrated_cad_step`: pairs at colocated's measured seconds per FLOP, the
      ``cad`` plan; recomputed here and asserted equal) and with ``cost``: the same step with the
      attention priced by the table on ping-pong's two nano-batch plans (:func:`attention_ms`),
      ``calibrated`` (times colocated's measured / modelled attention, as the default is) or not."""
    cfg, res = item["config"], item["results"]
    world = int(cfg.get("nproc") or 1 + max(r["rank"] for r in res["records"]))
    recs: dict = {}
    for r in res["records"]:
        recs.setdefault((r["method"], r["batch"]), []).append(r)
    rows = []
    for pb in res["per_batch"]:
        b = int(pb["batch"])
        cad = sorted(recs.get(("cad", b), []), key=lambda r: r["rank"])
        if len(cad) != world:
            continue
        spec, layout, plan, nanos, coloc = rebuild_plans(cfg, b, world)
        if not np.isclose(plan.imbalance(), cad[0]["plan_imbalance"][0], rtol=1e-9):
            raise ValueError(f"{item['file']} batch {b}: the rebuilt plan's imbalance {plan.imbalance():.6f} "
                             f"is not the run's {cad[0]['plan_imbalance'][0]:.6f}")
        meas = np.array([r["attention_ms"] for r in cad])
        model = cost.server_seconds(plan, "fwd_bwd", spec) * spec.n_layers * 1e3
        gathered = [gathered_rows(plan, r) for r in range(world)]
        row = {"setting": item["setting"], "file": item["file"], "batch": b, "measured": imbalance(meas),
               "pairs": float(plan.imbalance()), "model": imbalance(model),
               "attention_ms_measured_max": float(meas.max()), "attention_ms_model_max": float(model.max()),
               "layers": spec.n_layers, "attention_ms_measured": meas.tolist(),
               "attention_ms_model": model.tolist(),
               "q_gathered_rows": [g[0] for g in gathered], "kv_gathered_rows": [g[1] for g in gathered]}
        col = sorted(recs.get(("colocated", b), []), key=lambda r: r["rank"])
        if item.get("kernel_only_spans", True) and len(col) == world and "speedup cad-pingpong" in pb:
            step, attn = max(r["step_ms"] for r in col), np.array([r["attention_ms"] for r in col])
            flops = rank_costs(layout, spec, backward=True)["attention_flops"]
            srv = plan.server_flops(spec, backward=True, layers=None)
            default = step / calibrated_cad_step(step, attn, flops, srv)
            if pb.get("predicted_speedup") is not None and not np.isclose(default, pb["predicted_speedup"]):
                raise ValueError(f"{item['file']} batch {b}: recomputed prediction {default:.6f} is not the "
                                 f"committed {pb['predicted_speedup']:.6f}")
            kappa = attn.sum() / (cost.server_seconds(coloc, "fwd_bwd", spec).sum() * spec.n_layers * 1e3)
            a = attention_ms(nanos, cost, spec)
            row.update({"speedup_measured": float(pb["speedup cad-pingpong"]),
                        "speedup_default": float(default),
                        "speedup_model": step / (step - attn.max() + kappa * a),
                        "speedup_model_uncalibrated": step / (step - attn.max() + a),
                        "calibration": float(kappa)})
        rows.append(row)
    return rows


def gathered_rows(plan, rank: int) -> tuple[int, int]:
    """Rows server ``rank``'s fused call copies out of its buffers rather than reading them in place:
    ``(query rows, KV rows)`` (0 when :class:`cadlib.dispatch.meta.Dispatch` finds the query buffer, or
    the merged KV, to be the buffer as it is). A server that sent some of its own rows away gathers
    the rest, in forward and again in backward, and scatters their gradients back."""
    return build_dispatch(plan, rank).gathered_rows()


def server_overhead_fit(rows: list[dict]) -> dict:
    """Least squares over every (batch, rank) of :func:`e2e_check`'s rows: the measured attention time
    of ``cad`` against ``scale x`` the kernel model's plus a cost per gathered query row and per
    gathered KV row (per layer, forward and backward). ``ns_per_q_row`` / ``ns_per_kv_row``, and the
    root-mean-square error of the kernel model alone (scaled) and with the two terms, in ms and
    relative to the measured time."""
    meas, model, q, kv = (np.concatenate([np.asarray(r[k], dtype=float) * (r["layers"] if "rows" in k else 1)
                                          for r in rows if k in r])
                          for k in ("attention_ms_measured", "attention_ms_model", "q_gathered_rows",
                                    "kv_gathered_rows"))
    if meas.size < 4:
        raise ValueError(f"rows: need per-rank attention times of at least 4 (batch, rank) pairs, "
                         f"got {meas.size}")
    scale = float(model @ meas / (model @ model))
    coef = np.linalg.lstsq(np.c_[model, q / 1e6, kv / 1e6], meas, rcond=None)[0]
    err0, err1 = meas - scale * model, meas - np.c_[model, q / 1e6, kv / 1e6] @ coef

    def rms(e):
        return float(np.sqrt(np.mean(e ** 2)))
    return {"points": int(meas.size), "scale_alone": scale, "rms_ms_alone": rms(err0),
            "rms_rel_alone": rms(err0 / meas),
            "scale": float(coef[0]), "ns_per_q_row": float(coef[1]), "ns_per_kv_row": float(coef[2]),
            "rms_ms": rms(err1), "rms_rel": rms(err1 / meas)}


def e2e_check_summary(rows: list[dict]) -> list[dict]:
    """Per setting of :func:`e2e_check`'s rows: mean absolute error of each predicted imbalance
    against the measured one, and relative mean (max) absolute error of each predicted speedup."""
    df = pd.DataFrame(rows)
    out = []
    for setting, g in df.groupby("setting", sort=False):
        row = {"setting": setting, "file": g.file.iloc[0], "batches": len(g),
               "measured_imbalance_mean": float(g.measured.mean()),
               **{f"mae_imbalance_{k}": float((g[k] - g.measured).abs().mean()) for k in ("pairs", "model")}}
        if "speedup_measured" in g and g.speedup_measured.notna().any():
            for k in ("default", "model", "model_uncalibrated"):
                err = ((g[f"speedup_{k}"] - g.speedup_measured) / g.speedup_measured).abs()
                row[f"speedup_err_{k}_mean"] = float(err.mean())
                row[f"speedup_err_{k}_max"] = float(err.max())
        out.append(row)
    return out

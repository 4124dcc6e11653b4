"""What the end-to-end runs of :mod:`cadlib.train` say: per-batch speedups, the saving balancing could
bring and how much of it CAD recovers, exposed communication, the ping-pong gain, and the simulator's
prediction for the same batches, calibrated on the colocated run's own measurements.

Definitions (per batch ``b``; every time is the slowest rank's unless said otherwise, since the ranks
meet at the gradient all-reduce):

* ``speedup(m) = step(colocated) / step(m)``; ``layers`` variants use the decoder layers alone
  (forward + backward minus the LM head), which the head's ~2.4 layers of FLOPs would otherwise dilute.
* The **saving** balancing could bring, from the colocated run alone: ``attn_r`` is rank ``r``'s
  attention kernel time over the step (forward and backward, without the all-gathers and the waits
  inside them; sequential packing gives every rank the same linear work). The ranks meet at every
  layer's all-gather and at the all-reduce, so the step follows the slowest rank's attention; with
  every rank at the mean it would be ``saving = max_r attn_r - mean_r attn_r`` shorter. CAD
  **recovers** ``(step(colocated) - step(cad-pingpong)) / saving`` of it.
* **Exposed communication** of CAD with ping-pong: ``(step(cad-pingpong) - step(signal-only)) /
  step(cad-pingpong)``: the signal-only control runs the same schedule with one element per peer.
* **Ping-pong gain**: ``step(cad) / step(cad-pingpong)`` (DistCA: without ping-pong the step is 10-17%
  slower).
* **Prediction**: :func:`cadlib.sim.calibrated_cad_step`, the straggler model calibrated on
  colocated's measured kernel rate (seconds per attention FLOP), applied to the scheduler's plan of the
  same batch.
"""
from __future__ import annotations

import pandas as pd

from .cost import as_model
from .packing import pack, rank_costs
from .sim import calibrated_cad_step

SAVING_THRESHOLD = 0.05
"""Batches where balancing could save at least this fraction of colocated's step are held to the
recovery target."""


def frame(results: list[dict]) -> pd.DataFrame:
    """One row per (method, batch, rank) from the rank results of one ``cadlib.train`` run."""
    return pd.DataFrame([r for res in results for r in res["records"]])


def per_batch(df: pd.DataFrame) -> pd.DataFrame:
    """Slowest-rank times per (method, batch): step, layers, and the mean over ranks of the rest."""
    g = df.groupby(["method", "batch"])
    out = g[["step_ms", "layers_ms", "fwd_bwd_ms", "peak_mem_gib"]].max()
    out = out.join(g[["attention_ms", "comm_ms", "comm_exposed_ms", "allreduce_ms", "loss"]].mean())
    return out.reset_index()


def saving(df: pd.DataFrame) -> pd.DataFrame:
    """Per batch, from the colocated run: ``step``, ``ideal`` busy time and the ``saving`` (ms)."""
    c = df[df.method == "colocated"]
    rows = []
    for b, grp in c.groupby("batch"):
        attn = grp.attention_ms.to_numpy()
        rows.append({"batch": b, "colocated_step_ms": float(grp.step_ms.max()),
                     "saving_ms": float(attn.max() - attn.mean())})
    return pd.DataFrame(rows)


def predicted_speedup(df: pd.DataFrame, config: dict, world: int) -> pd.DataFrame:
    """The calibrated straggler model's CAD speedup per batch (see the module docstring)."""
    from types import SimpleNamespace

    from . import scheduler
    from .train import batch_docs

    args = SimpleNamespace(**config)
    spec = as_model(config["model"], **({"n_layers": config["layers"]} if config.get("layers") else {}))
    c = df[df.method == "colocated"]
    rows = []
    for b, grp in c.groupby("batch"):
        grp = grp.sort_values("rank")
        layout = pack(batch_docs(args, int(b), world), world, args.tokens_per_rank)
        flops = rank_costs(layout, spec, backward=True)["attention_flops"]
        plan = scheduler.schedule(layout, model=spec, tolerance=args.tolerance, min_shard=args.min_shard)
        plan_flops = plan.server_flops(spec, backward=True, layers=None)
        step = float(grp.step_ms.max())
        pred = calibrated_cad_step(step, grp.attention_ms.to_numpy(), flops, plan_flops)
        rows.append({"batch": b, "predicted_speedup": step / pred, "predicted_step_ms": pred})
    return pd.DataFrame(rows)


def summarise(results: list[dict], config: dict, world: int) -> dict:
    """Everything the end-to-end notebook and the benchmark report, per batch and as means."""
    df = frame(results)
    pb = per_batch(df)
    methods = list(dict.fromkeys(pb.method))
    step = pb.pivot(index="batch", columns="method", values="step_ms")
    layers = pb.pivot(index="batch", columns="method", values="layers_ms")
    table = pd.DataFrame(index=step.index)
    for m in methods:
        table[f"step_ms {m}"] = step[m]
        if m != "colocated" and "colocated" in step:
            table[f"speedup {m}"] = step["colocated"] / step[m]
            table[f"layers speedup {m}"] = layers["colocated"] / layers[m]
    summary: dict = {"methods": methods, "n_batches": int(len(step))}
    if "colocated" in step:
        sv = saving(df).set_index("batch")
        table["saving_frac"] = sv.saving_ms / sv.colocated_step_ms
        if "cad-pingpong" in step:
            table["recovered"] = (step["colocated"] - step["cad-pingpong"]) / sv.saving_ms
            big = table.saving_frac >= SAVING_THRESHOLD
            summary["recovered_min_where_saving_ge_5pct"] = float(table.recovered[big].min()) if big.any() \
                else None
            summary["max_slowdown_vs_colocated"] = float((step["cad-pingpong"] / step["colocated"]).max())
        try:
            pr = predicted_speedup(df, config, world).set_index("batch")
            table["predicted_speedup"] = pr.predicted_speedup
            summary["mean_predicted_speedup"] = float(pr.predicted_speedup.mean())
        except Exception as e:          # a prediction that cannot be made must not lose the measurement
            summary["prediction_error"] = repr(e)
    if {"cad-pingpong", "signal-only"} <= set(step):
        table["exposed_comm_frac"] = (step["cad-pingpong"] - step["signal-only"]) / step["cad-pingpong"]
        summary["mean_exposed_comm_frac"] = float(table.exposed_comm_frac.mean())
    if {"cad", "cad-pingpong"} <= set(step):
        table["pingpong_gain"] = step["cad"] / step["cad-pingpong"]
        summary["mean_pingpong_gain"] = float(table.pingpong_gain.mean())
    for m in methods:
        if f"speedup {m}" in table:
            summary[f"mean_speedup {m}"] = float(table[f"speedup {m}"].mean())
            summary[f"mean_layers_speedup {m}"] = float(table[f"layers speedup {m}"].mean())
    summary["peak_mem_gib"] = {m: float(pb[pb.method == m].peak_mem_gib.max()) for m in methods} \
        if pb.peak_mem_gib.notna().any() else None
    return {"summary": summary, "per_batch": table.reset_index().to_dict(orient="records")}

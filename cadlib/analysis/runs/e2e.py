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
* **Prediction**: :func:`cadlib.analysis.model.sim.calibrated_cad_step`, the straggler model calibrated on
  colocated's measured kernel rate (seconds per attention FLOP), applied to the scheduler's plan of the
  same batch.
"""
from __future__ import annotations

import pandas as pd

from ...core.cost import as_model
from ...core.defaults import DEFAULT_COMM_CTAS, DEFAULT_NANO_SPLIT, DEFAULT_SENT_LAST, DEFAULT_TOLERANCE
from ...core.spans import last_step
from ...data.packing import pack, rank_costs
from ...infra.results import find_results, load_result
from ...scheduling import scheduler
from ...scheduling.recipes import Recipe, batch_docs
from ..model.sim import calibrated_cad_step

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
    recipe = Recipe.from_config(config)
    spec = as_model(config["model"], **({"n_layers": config["layers"]} if config.get("layers") else {}))
    c = df[df.method == "colocated"]
    rows = []
    for b, grp in c.groupby("batch"):
        grp = grp.sort_values("rank")
        layout = pack(batch_docs(recipe, int(b), world), world, recipe.tokens_per_rank)
        flops = rank_costs(layout, spec, backward=True)["attention_flops"]
        plan = scheduler.schedule(layout, model=spec, tolerance=recipe.tolerance, min_shard=recipe.min_shard)
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


# ------------------------------------------------------------------------------ runs and result files
def collect(results: list[dict], world: int) -> dict:
    """The rank results of one ``cadlib.train`` run (``run_torchrun(...).attrs["results"]``) in the
    shape of a committed ``bench_e2e_*.json``'s ``results``: :func:`summarise`, plus ``timelines``
    (``{"rank<k>": {method: rows}}``), ``timelines_batches`` (``{"rank<k>": {method: {batch: rows}}}``, when
    ``--timeline-batches`` kept any), ``records``, ``model`` and ``device_name``."""
    out = summarise(results, dict(results[0]["config"]), world)
    out["timelines"] = {f"rank{r['rank']}": r["timelines"] for r in results}
    if any(r.get("timelines_batches") for r in results):
        out["timelines_batches"] = {f"rank{r['rank']}": r.get("timelines_batches", {}) for r in results}
    out["records"] = [rec for r in results for rec in r["records"]]
    out["model"], out["device_name"] = results[0]["model"], results[0]["device_name"]
    return out


def kernel_only_spans(res: dict, config: dict) -> bool:
    """Whether colocated's ``attention_ms`` counts its attention kernels alone. Runs made before that
    (all-gathers and the waits inside them counted as attention) lack the ``cp`` span that wraps the
    whole per-document CP call; their saving, recovery and prediction are not meaningful."""
    if config.get("colocated_impl", "allgather") != "allgather":
        return False                      # the all-to-all colocated plan times its kernel with the comm
    tls = [t.get("colocated") for t in res.get("timelines", {}).values()]
    rows = [r for t in tls if t for r in last_step(t)]
    return any(r["phase"] == "cp" for r in rows)


def setting_label(config: dict) -> str:
    """``pretrain 64K nvlink x2`` (``... eps 0.02`` when the scheduler's tolerance is not
    ``DEFAULT_TOLERANCE``, ``... whole docs`` when ping-pong's nano-batches kept documents whole,
    not ``DEFAULT_NANO_SPLIT``, ``... 4 CTAs`` or ``... NCCL's CTAs`` when CAD's all-to-alls ran on
    other NCCL thread blocks than the link's ``DEFAULT_COMM_CTAS``, ``... sent-last`` or ``... no
    sent-last`` against ``DEFAULT_SENT_LAST``, ``... fused`` with the fused linear blocks): what a
    committed result file measured."""
    link = f" {config['link']}" if config.get("link") else ""
    tol = config.get("tolerance", DEFAULT_TOLERANCE)
    eps = f" eps {tol:g}" if tol != DEFAULT_TOLERANCE else ""
    split = config.get("nano_split", "whole")
    eps += "" if split == DEFAULT_NANO_SPLIT else (" whole docs" if split == "whole" else f" nano {split}")
    ctas, default = config.get("comm_ctas"), DEFAULT_COMM_CTAS.get(config.get("link"))
    if ctas != default and (ctas or config.get("link") in DEFAULT_COMM_CTAS):
        eps += f" {ctas} CTAs" if ctas else " NCCL's CTAs"
    if bool(config.get("sent_last", False)) != DEFAULT_SENT_LAST:
        eps += " sent-last" if config.get("sent_last") else " no sent-last"
    if config.get("linear_blocks") == "fused":
        eps += " fused"
    return f"{config['dist']} {config['tokens_per_rank'] // 1024}K{link} x{config.get('nproc', '?')}{eps}"


def file_variant(stem: str, link: str | None) -> str:
    """What a result file's name adds after its link (``_eps0.05``, ``_ncclctas``; ``""`` for a run
    at the defaults): ``bench_e2e_2x_pretrain_64k_nvlink_eps0.05`` -> ``_eps0.05``."""
    link = link or "nvlink"
    return stem.split(f"_{link}", 1)[1] if f"_{link}" in stem else ""


def load_committed(pattern: str = "bench_e2e_*.json", results_dir=None) -> list[dict]:
    """Every committed end-to-end result file matching ``pattern`` (smoke runs left out), as dicts
    with ``file``, ``setting``, ``variant`` (:func:`file_variant`), ``device``, ``kernel_only_spans``,
    ``config`` and ``results``."""
    out = []
    for path in find_results(pattern, results_dir):
        if "_smoke_" in path.name:
            continue
        d = load_result(path)
        cfg, res = d["config"], d["results"]
        out.append({"file": path.name, "setting": setting_label(cfg),
                    "variant": file_variant(path.stem, cfg.get("link")),
                    "device": d.get("meta", {}).get("device") or res.get("device_name"),
                    "kernel_only_spans": kernel_only_spans(res, cfg), "config": cfg, "results": res})
    return out


def speedups(per_batch_rows: list[dict], kernel_only: bool = True) -> pd.DataFrame:
    """Long frame from a ``per_batch`` table: one row per (batch, method) with ``speedup`` over
    colocated, ``layers_speedup`` and ``predicted`` (the calibrated CAD prediction, the same for
    every method of a batch; NaN when the run's colocated attention was not kernel-only)."""
    pb = pd.DataFrame(per_batch_rows)
    rows = []
    for m in [c[len("speedup "):] for c in pb.columns if c.startswith("speedup ")]:
        for _, r in pb.iterrows():
            pred = r.get("predicted_speedup", float("nan")) if kernel_only else float("nan")
            rows.append({"batch": int(r["batch"]), "method": m, "speedup": float(r[f"speedup {m}"]),
                         "layers_speedup": float(r[f"layers speedup {m}"]), "predicted": float(pred)})
    return pd.DataFrame(rows, columns=["batch", "method", "speedup", "layers_speedup", "predicted"])


def settings_table(loaded: list[dict]) -> pd.DataFrame:
    """One row per committed setting: mean (min) speedup of every method over colocated, CAD with
    ping-pong over ``wlb``, exposed communication, ping-pong gain, worst slowdown against colocated
    and peak memory per GPU of every method."""
    rows = []
    for item in loaded:
        res = item["results"]
        pb = pd.DataFrame(res["per_batch"])
        row = {"setting": item["setting"], "device": item["device"], "batches": len(pb),
               "kernel_only_spans": item["kernel_only_spans"]}
        for c in [c for c in pb.columns if c.startswith("speedup ")]:
            row[f"mean {c}"] = float(pb[c].mean())
            row[f"min {c}"] = float(pb[c].min())
        if {"step_ms wlb", "step_ms cad-pingpong"} <= set(pb.columns):
            row["mean cad-pingpong over wlb"] = float((pb["step_ms wlb"] / pb["step_ms cad-pingpong"]).mean())
        if "step_ms cad-pingpong" in pb and "step_ms colocated" in pb:
            slow = pb["step_ms cad-pingpong"] / pb["step_ms colocated"]
            row["max slowdown cad-pingpong"] = float(slow.max())
        for c in ("exposed_comm_frac", "pingpong_gain"):
            if c in pb:
                row[f"mean {c}"], row[f"max {c}"] = float(pb[c].mean()), float(pb[c].max())
        for m, gib in (res["summary"].get("peak_mem_gib") or {}).items():
            row[f"peak GiB {m}"] = gib
        rows.append(row)
    return pd.DataFrame(rows)

"""A replay setting's results: every batch composed from the timed shapes (:func:`replay_setting`), the
summary per method (speedups over colocated and WLB-ideal, the simulator's, the batch count), the check
against the committed end-to-end run a setting replays, and how much pricing the timed calls from the
kernel table instead would move them (:func:`sample_check`; the pricing itself is
:mod:`cadlib.analysis.replay.calls`'). ``scripts/bench/bench_replay.py compose`` writes these under
``results/replay/``.

A replayed run may have been measured on another GPU than the one that timed the shapes: two H200s of
two sessions differ by a few percent. :func:`device_ratio` measures that difference on the run's own
steps, and the check is given both raw and with the timings scaled by it."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ...core.methods import METHODS
from ...infra.results import find_results, load_result
from ...scheduling.buffer import RECORD_KEYS
from .phases import (NCCL_LATENCY_S, TP_COLLECTIVES, Links, batch_work, choose_wlb, compose_work,
                     model_compose, phases)
from .calls import price_untimed
from .settings import Setting, Work
from .times import (LINEAR_GRID, attention_jobs, grid_points, head_key, linear_key, optimizer_key, scaled)


def missing_times(s: Setting, works: dict[str, Work], times: dict, backend: str) -> list[str]:
    """The keys :func:`phases` needs for these works that ``times`` lacks."""
    spec = s.spec
    keys = set(attention_jobs(works.values(), spec, backend))
    toks = np.concatenate([np.concatenate([w.tokens.ravel(), (w.tokens.sum(0) if w.pingpong else w.tokens)])
                           for w in works.values()])
    for key_of in (lambda n: linear_key(spec, backend, n, s.linear, s.tp),
                   lambda n: head_key(spec, backend, n, s.linear, s.tp)):
        have = [n for n in LINEAR_GRID if key_of(n) in times]
        if len(have) < 2:               # linear in tokens: two timed points interpolate and extrapolate
            keys |= {key_of(n) for n in grid_points(toks)}
    keys.add(optimizer_key(spec, backend))
    return sorted(k for k in keys if k not in times)


def _measured_steps(s: Setting) -> dict:
    """``{(method, batch): slowest rank's step in seconds}`` of the committed run a setting replays."""
    if s.source is None:
        return {}
    from_file = load_result(s.source)["results"]["records"]
    out: dict = {}
    for r in from_file:
        k = (r["method"], int(r["batch"]))
        out[k] = max(out.get(k, 0.0), r["step_ms"] * 1e-3)
    return out


ONE_GPU_RUNS = "bench_e2e_1x_*.json"
"""The committed one-GPU training runs, measured in the session that timed ``times_h200_1x.json``."""
SAME_GPU_KEYS = ("model", "layers", "tokens_per_rank", "ce_chunk", "mlp_recompute", "dtype")


def device_ratio(s: Setting, results_dir=None) -> dict | None:
    """How much slower the GPU of the run ``s`` replays computes than the timing GPU, measured on the one
    phase of a step that runs alone: the LM head and loss, the same matmuls over a rank's tokens in every
    method with no collective beside it. ``ratio``: the run's mean in-step head span over the same span
    in the committed one-GPU runs (:data:`ONE_GPU_RUNS`) of the same model, layers, tokens per rank and
    loss chunk. None when ``s`` replays no run, replays a one-GPU run itself, or none matches."""
    one_gpu = find_results(ONE_GPU_RUNS, results_dir)
    if s.source is None or s.source in {p.name for p in one_gpu}:
        return None
    run = load_result(Path(results_dir) / s.source if results_dir else s.source)
    key = tuple(run["config"].get(k) for k in SAME_GPU_KEYS)
    refs = [r for r in map(load_result, one_gpu) if tuple(r["config"].get(k) for k in SAME_GPU_KEYS) == key]
    if not refs:
        return None
    ours = float(np.mean([r["head_ms"] for r in run["results"]["records"]]))
    theirs = float(np.mean([r["head_ms"] for ref in refs for r in ref["results"]["records"]]))
    return {"ratio": ours / theirs, "head_ms": ours, "head_ms_timing_gpu": theirs,
            "runs": len(refs), "device": run.get("meta", {}).get("device")}


def replay_setting(s: Setting, times: dict, rates: dict, backend: str) -> dict | None:
    """Every batch of ``s`` composed from the timed shapes (None when some are missing): per batch and
    method the step, its idle fraction, the slowest and mean rank's attention, the exposed
    communication, the simulator's step for the same work and, for a replayed committed run, the
    measured step; per rank its tokens and attention; the summary per method."""
    links = Links.of(s, rates)
    measured = _measured_steps(s)
    dev = device_ratio(s) if measured else None
    on_run_gpu = scaled(times, dev["ratio"]) if dev else None
    rows, ranks, composed = [], [], []
    for b in range(s.batches):
        works = batch_work(s, b, rates)
        if missing_times(s, works, times, backend):
            return None
        got, sim = compose_work(s, works, times, links, backend), model_compose(s, works, links)
        dev_steps = compose_work(s, works, on_run_gpu, links, backend) if dev else {}
        timed = not any(times[k].get("modelled") for k in attention_jobs(works.values(), s.spec, backend))
        composed.append((works, got, sim, dev_steps, timed))
    cp = choose_wlb(s, [c[1] for c in composed])            # "setting": one degree, its least mean step
    sim_cp = choose_wlb(s, [c[2] for c in composed])        # the simulator's own choice, by its means
    if dev:
        choose_wlb(s, [c[3] for c in composed], cp)
    for b, (works, got, sim, dev_steps, timed) in enumerate(composed):
        for key, c in got.items():
            w = works.get(key) or works[f"wlb/{c.breakdown['cp']}"]
            ph = phases(s, w, times, links, backend, signal_only=key == "signal-only")
            attn = (ph.attn + ph.attn_bwd).sum(0) if w.pingpong else ph.attn + ph.attn_bwd
            row = {"batch": b, "method": key, "step_s": c.step, "idle_fraction": c.idle_fraction,
                   "attention_max_s": c.breakdown["attention_max_s"],
                   "attention_mean_s": c.breakdown["attention_mean_s"],
                   "exposed_comm_s": c.breakdown["exposed_comm_s"], "sim_step_s": sim[key].step,
                   "sim_idle_fraction": sim[key].idle_fraction, "calls_timed": timed}
            if "cp" in c.breakdown:
                row["cp"] = c.breakdown["cp"]
            if key == "wlb" and sim_cp is not None:
                row["sim_cp"] = sim_cp
            row.update({k: w.meta[k] for k in RECORD_KEYS if k in w.meta})   # CAD's tolerance rule
            if (key, b) in measured:
                row["measured_step_s"] = measured[(key, b)]
                if key in dev_steps:
                    row["step_s_on_run_gpu"] = dev_steps[key].step
            rows.append(row)
            if not key.startswith("wlb/"):
                ranks.append({"batch": b, "method": key, "tokens": np.asarray(w.tokens).tolist(),
                              "attention_ms_per_layer": (attn * 1e3).round(3).tolist()})
    out = {"per_batch": rows, "ranks": ranks, "summary": summarise(s, rows)}
    if dev:
        out["device_ratio"] = dev
        for rec in out["summary"]:
            rec["device_ratio"] = dev["ratio"]
    return out


SPEEDUP_DEFINITIONS = {"batch": "mean_of_ratios", "setting": "ratio_of_means"}
"""Which speedup ``speedup_over_<base>`` is, per ``wlb_choice``: ours, the mean over batches of the
per-batch ratios of steps; the paper's, the ratio of the mean steps ("the average duration of the runs
of WLB-LLM over DistCA", Figures 9 and 10)."""


def _sem(x) -> float:
    """The standard error of a mean over batches (0 for one batch)."""
    x = np.asarray(x, dtype=float)
    return float(x.std(ddof=1) / np.sqrt(x.size)) if x.size > 1 else 0.0


def ratio_sem(a, b) -> float:
    """The standard error of ``mean(a) / mean(b)`` over paired batches (the delta method:
    ``R * sqrt(var_a/a^2 + var_b/b^2 - 2 cov_ab/(a b)) / sqrt(n)``; 0 for one batch)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.size < 2:
        return 0.0
    ma, mb = a.mean(), b.mean()
    c = np.cov(a, b, ddof=1)
    var = c[0, 0] / ma ** 2 + c[1, 1] / mb ** 2 - 2 * c[0, 1] / (ma * mb)
    return float(ma / mb * np.sqrt(max(var, 0.0) / a.size))


def summarise(s: Setting, rows: list[dict]) -> list[dict]:
    """Per method: speedups over colocated and over WLB-ideal, each both as the mean of per-batch
    ratios (``..._mean_of_ratios``) and as the ratio of mean steps (``..._ratio_of_means``), with
    ``speedup_over_<base>`` the one of ``s.wlb_choice`` (:data:`SPEEDUP_DEFINITIONS`) and its standard
    error over the batches (``..._sem``; the mean step's is ``step_s_sem``), the per-batch
    ratios and the simulator's; the replay's error against a measured run; the batch count and how many
    had every attention call timed (``batches_timed``; the speedups over those alone, ``..._timed``); for WLB
    the CP degree of each batch and, under ``"setting"``, the degree chosen (the replay's and the
    simulator's) and every composed degree's mean step."""
    by = {(r["method"], r["batch"]): r for r in rows}
    methods = sorted({r["method"] for r in rows if "/" not in r["method"]}, key=list(METHODS).index)
    batches = sorted({r["batch"] for r in rows})
    timed = [b for b in batches if all(r.get("calls_timed", True) for r in rows if r["batch"] == b)]
    out = []
    for m in methods:
        rec = {"setting": s.name, "dist": s.dist, "max_doc_len": s.max_doc_len, "dp": s.dp, "tp": s.tp,
               "tokens_per_group": s.tokens, "method": m, "batches": len(batches),
               "ranks": s.dp, "step_s_mean": float(np.mean([by[(m, b)]["step_s"] for b in batches])),
               "step_s_sem": _sem([by[(m, b)]["step_s"] for b in batches]),
               "idle_fraction_mean": float(np.mean([by[(m, b)]["idle_fraction"] for b in batches])),
               "batches_timed": len(timed)}
        definition = SPEEDUP_DEFINITIONS[s.wlb_choice]
        for base in ("colocated", "wlb"):
            if (base, batches[0]) in by:
                for pre, f in (("", "step_s"), ("sim_", "sim_step_s")):
                    steps = np.array([[by[(k, b)][f] for b in batches] for k in (base, m)])
                    sp = steps[0] / steps[1]
                    got = {"mean_of_ratios": float(np.mean([float(x) for x in sp])),
                           "ratio_of_means": float(steps[0].mean() / steps[1].mean())}
                    rec[f"{pre}speedup_over_{base}"] = got[definition]
                    if not pre:
                        rec[f"speedup_over_{base}_per_batch"] = [float(x) for x in sp]
                        rec[f"speedup_over_{base}_sem"] = (_sem(sp) if definition == "mean_of_ratios"
                                                           else ratio_sem(steps[0], steps[1]))
                    for name, v in got.items():
                        rec[f"{pre}speedup_over_{base}_{name}"] = v
                if timed and len(timed) < len(batches):     # the batches whose every call was timed
                    t = np.array([[by[(k, b)]["step_s"] for b in timed] for k in (base, m)])
                    rec[f"speedup_over_{base}_timed"] = (float(t[0].mean() / t[1].mean())
                                                         if definition == "ratio_of_means"
                                                         else float(np.mean(t[0] / t[1])))
        rec["speedup_definition"] = definition
        sim_err = [by[(m, b)]["sim_step_s"] / by[(m, b)]["step_s"] - 1 for b in batches]
        rec["sim_vs_replay_step_err_mean"] = float(np.mean(sim_err))
        for field_, name in (("step_s", "replay_vs_measured"), ("step_s_on_run_gpu", "on_run_gpu")):
            if all(field_ in by[(m, b)] and "measured_step_s" in by[(m, b)] for b in batches):
                got = np.array([by[(m, b)][field_] for b in batches])
                ref = np.array([by[(m, b)]["measured_step_s"] for b in batches])
                rec[f"{name}_err_per_batch"] = [float(x) for x in got / ref - 1]
                rec[f"{name}_err_of_mean"] = float(got.mean() / ref.mean() - 1)
        if m == "wlb":
            rec["cp_chosen"] = [by[(m, b)].get("cp") for b in batches]
            if s.wlb_choice == "setting":
                rec["wlb_cp"], rec["sim_wlb_cp"] = by[(m, batches[0])]["cp"], by[(m, batches[0])]["sim_cp"]
                for pre, f in (("", "step_s"), ("sim_", "sim_step_s")):
                    rec[f"{pre}wlb_step_s_mean_by_cp"] = {
                        k.split("/")[1]: float(np.mean([by[(k, b)][f] for b in batches]))
                        for k in sorted({r["method"] for r in rows if r["method"].startswith("wlb/")},
                                        key=lambda k: int(k.split("/")[1]))}
        out.append(rec)
    return out


def setting_config(s: Setting, rates: dict, backend: str, times_meta: dict) -> dict:
    """A setting's full configuration for its result file."""
    cfg = {k: getattr(s, k) for k in s.__dataclass_fields__ if k not in ("config", "lengths")}
    return {**cfg, "spec": s.spec._asdict() if hasattr(s.spec, "_asdict") else vars(s.spec),
            "links": {k: vars(v) for k, v in vars(Links.of(s, rates)).items()}, "backend": backend,
            "nccl_latency_s": NCCL_LATENCY_S, "tp_collectives_per_layer": TP_COLLECTIVES,
            "times_device": times_meta.get("device"), "times_commit": times_meta.get("commit"),
            "replayed_run": s.config}


def summary_line(s: Setting, res: dict) -> str:
    parts = []
    for r in res["summary"]:
        if r["method"] in ("cad-pingpong", "wlb") or r["method"] == "colocated":
            sp = r.get("speedup_over_wlb")
            se = r.get("speedup_over_wlb_sem")
            wlb = (f" ({sp:.3f}x wlb" + (f" ± {se:.3f}" if se else "") + ")") if sp else ""
            parts.append(f"{r['method']} {r['step_s_mean'] * 1e3:.0f} ms{wlb}")
    return f"{s.name}: " + ", ".join(parts)


def sample_check(settings_, times: dict, cost, backend: str, rates: dict, model) -> list[dict]:
    """How much pricing the untimed server calls from the kernel table (by ``model``, a call model or one
    scale: :func:`cadlib.analysis.replay.calls.price_untimed`) moves a step:
    every batch of each setting whose calls were all timed, composed twice, from the timings and with
    every call from the table; per setting and method the mean steps both ways and their relative
    difference, and CAD with ping-pong's speedup over WLB-ideal both ways (WLB-ideal: its degree of least
    mean step over these batches, as the paper reports it). The check of ``compose --model-missing``."""
    out = []
    for s in settings_:
        links = Links.of(s, rates)
        steps = {"timed": {}, "modelled": {}}
        for b in range(s.batches):
            works = batch_work(s, b, rates)
            keys = attention_jobs(works.values(), s.spec, backend)
            if any(k not in times or times[k].get("modelled") for k in keys):
                continue
            table = {**times, **price_untimed(works, s.spec, backend, cost, model)}
            for name, tt in (("timed", times), ("modelled", table)):
                for m, c in compose_work(s, works, tt, links, backend).items():
                    steps[name].setdefault(m, []).append(c.step)
        if not steps["timed"]:
            continue
        mean = {n: {m: float(np.mean(v)) for m, v in d.items()} for n, d in steps.items()}
        for n in mean:
            wl = [v for m, v in mean[n].items() if m.startswith("wlb/")]
            if wl:
                mean[n]["wlb"] = min(wl)
        for m in mean["timed"]:
            if "/" in m:
                continue
            t_, mo = mean["timed"][m], mean["modelled"][m]
            rec = {"setting": s.name, "method": m, "batches": len(steps["timed"][next(iter(steps["timed"]))]),
                   "step_s_timed": t_, "step_s_modelled": mo, "step_err": mo / t_ - 1}
            if m != "wlb" and "wlb" in mean["timed"]:
                rec["speedup_timed"] = mean["timed"]["wlb"] / t_
                rec["speedup_modelled"] = mean["modelled"]["wlb"] / mo
            out.append(rec)
    return out

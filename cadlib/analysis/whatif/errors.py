"""What the what-if knows about its own error: its composition against the scale replay on every
committed 3D setting, and the replay's against the measured runs.

**Composition error.** A committed replay file (``results/replay/replay_3d_*.json``) holds a setting's
full configuration and, per method, its replayed steps (every call timed on one H200). The what-if
prices the same batches of the same setting (:mod:`cadlib.analysis.whatif.price`: attention from the
kernel table instead of the timed calls) and composes them the same way; per setting and method::

    step_err = mean_b step_whatif / mean_b step_replay - 1
    speedup_err = speedup_whatif - speedup_replay      (CAD with ping-pong over each baseline)
    saving_err = (1 - 1 / speedup_whatif) - (1 - 1 / speedup_replay)

with the speedup the file's own definition (mean of per-batch ratios, or ratio of means under the
paper's protocol). Where a replay timed every call of some batches only (the paper's protocol: the
others priced from the kernel table), the same errors over those batches alone carry ``_timed``: they
compare the what-if with measured kernels, not with another pricing.
``scripts/analyses/whatif_vs_replay.py`` writes them to
``results/replay/whatif_vs_replay.json`` with the kernel table's scales.

**Replay error.** The committed validation replays (``results/replay/replay_e2e_*_validation.json``) hold
the measured steps of the end-to-end runs on 2x H200 beside the replayed ones (on the run's GPU, its
device ratio applied): the largest ``|replayed / measured - 1|`` of a method's mean step, and the
largest ``|saving_replayed - saving_measured|`` of CAD with ping-pong over a baseline.
"""
from __future__ import annotations

import glob
import os
import pathlib

import numpy as np

from ...infra.results import RESULTS_DIR, load_result
from ..replay import phases as rp
from ..replay.settings import Setting
from .price import ERRORS_FILE, Pricing

VALIDATION_GLOB = "replay/replay_e2e_2x_*_validation.json"
"""The replays of the measured runs on 2x H200 (the one-GPU ones check the timings, not the composition)."""
PROTOCOLS = {"3d": ("replay/replay_3d_*_3d.json", "fa4", "fit"),
             "3d_fa2": ("replay/replay_3d_*_3d_fa2.json", "torch_flash", "fit"),
             "paper": ("replay/replay_3d_*_paper.json", None, "replay"),
             "paper_fa4": ("replay/replay_3d_*_paper_fa4.json", None, "replay")}
"""The committed 3D replay families: file pattern, attention backend (None: the file's own) and where
the kernel table's correction comes from: ``fit``, the call model fitted on the family's timed calls
(:func:`cadlib.analysis.replay.calls.call_model`); ``replay``, the pricing the replay itself gave its
untimed calls (:func:`replay_pricing`: under the paper's protocol the call model fitted on its timed
calls, for FA4 one scale). Under the paper's protocol the comparison that
measures the what-if is over the batches the replay timed call by call (``..._timed``): over the others
both price the same way."""


def replay_pricing(config: dict) -> dict | None:
    """The kernel table's correction a replay priced its untimed calls with, as a what-if scale
    (``{"all": scale}``, with ``"call_model"`` where the replay used one); None when it timed them all."""
    km = config.get("kernel_model") or {}
    if not km.get("scale"):
        return None
    out = {"all": float(km["scale"])}
    if km.get("untimed") == "call-model" and km.get("call_model"):
        out["call_model"] = km["call_model"]
    return out


CAD = "cad-pingpong"


def setting_of(config: dict) -> Setting:
    """The :class:`Setting` a replay file was composed from (its ``config`` holds every field)."""
    fields = {k: v for k, v in config.items() if k in Setting.__dataclass_fields__
              and k not in ("config", "lengths", "source")}
    for k in ("methods", "wlb_cp"):
        fields[k] = tuple(fields[k])
    return Setting(**fields)


def _speedups(s: Setting, steps: dict[str, list[float]], base: str) -> float:
    a, b = np.asarray(steps[base]), np.asarray(steps[CAD])
    return float(a.mean() / b.mean()) if s.wlb_choice == "setting" else float(np.mean(a / b))


def compare(path: str | os.PathLike, price: Pricing, rates: dict) -> list[dict]:
    """The what-if against one replay file: per method its step error; for CAD with ping-pong its
    speedup and saving errors over every baseline the file holds."""
    res = load_result(path)
    s = price.prepare(setting_of(res["config"]))
    links = rp.Links.of(s, rates)
    batches = [price.compose(s, rp.batch_work(s, b, rates), links) for b in range(s.batches)]
    rp.choose_wlb(s, batches)
    steps = {m: [c[m].step for c in batches] for m in batches[0] if "/" not in m}
    ref = {r["method"]: r for r in res["results"]["summary"]}
    rows = res["results"]["per_batch"]
    timed = sorted({r["batch"] for r in rows} - {r["batch"] for r in rows if not r.get("calls_timed", True)})
    timed = timed if 0 < len(timed) < s.batches else []
    by = {(r["method"], r["batch"]): r["step_s"] for r in rows}
    out = []
    for m, r in ref.items():
        if m not in steps or m == "signal-only":
            continue
        rec = {"setting": s.name, "file": os.path.basename(path), "method": m, "linear": s.linear,
               "step_s_replay": r["step_s_mean"], "step_s_whatif": float(np.mean(steps[m])),
               "step_err": float(np.mean(steps[m]) / r["step_s_mean"] - 1)}
        if m == CAD:
            for base in ("colocated", "wlb"):
                if base in steps and f"speedup_over_{base}" in r:
                    got, want = _speedups(s, steps, base), r[f"speedup_over_{base}"]
                    rec[f"speedup_over_{base}_replay"], rec[f"speedup_over_{base}_whatif"] = want, got
                    rec[f"speedup_over_{base}_err"] = got - want
                    rec[f"saving_over_{base}_err"] = (1 - 1 / got) - (1 - 1 / want)
                    if timed:
                        t_got = _speedups(s, {k: [steps[k][b] for b in timed] for k in (base, CAD)}, base)
                        t_want = _speedups(s, {k: [by[(k, b)] for b in timed] for k in (base, CAD)}, base)
                        rec[f"speedup_over_{base}_timed_err"] = t_got - t_want
        if timed:
            rec["timed_batches"] = len(timed)
            rec["step_err_timed"] = float(np.mean([steps[m][b] for b in timed])
                                          / np.mean([by[(m, b)] for b in timed]) - 1)
        out.append(rec)
    return out


def summary(rows: list[dict]) -> dict:
    """The largest errors of a family: ``max_step_err`` over methods, ``max_speedup_err`` and
    ``max_saving_err`` of CAD with ping-pong over each baseline and over all."""
    out = {"settings": len({r["setting"] for r in rows}),
           "max_step_err": max((abs(r["step_err"]) for r in rows), default=None)}
    for base in ("colocated", "wlb"):
        for q in ("speedup", "saving"):
            v = [abs(r[f"{q}_over_{base}_err"]) for r in rows if f"{q}_over_{base}_err" in r]
            out[f"max_{q}_err_over_{base}"] = max(v, default=None)
    if any("timed_batches" in r for r in rows):         # over the batches whose every call was timed
        out["timed_batches"] = sorted({r["timed_batches"] for r in rows if "timed_batches" in r})
        out["max_step_err_timed"] = max(abs(r["step_err_timed"]) for r in rows if "step_err_timed" in r)
        for base in ("colocated", "wlb"):
            key = f"speedup_over_{base}_timed_err"
            v = [abs(r[key]) for r in rows if key in r]
            out[f"max_speedup_err_over_{base}_timed"] = max(v, default=None)
    for q in ("speedup", "saving"):
        v = [out[f"max_{q}_err_over_{b}"] for b in ("colocated", "wlb")
             if out[f"max_{q}_err_over_{b}"] is not None]
        out[f"max_{q}_err"] = max(v, default=None)
    return out


def _saving(steps_base, steps_cad) -> float:
    return 1 - 1 / float(np.mean(np.asarray(steps_base) / np.asarray(steps_cad)))


def replay_error(results_dir: str | os.PathLike | None = None) -> dict | None:
    """The replay against the measured runs (module docstring): ``step`` (largest relative error of a
    method's mean step, on the run's GPU where its device ratio is known), ``saving`` (largest error of
    CAD with ping-pong's saving over a baseline), ``files``; None without the files."""
    root = pathlib.Path(results_dir or RESULTS_DIR)
    files = sorted(glob.glob(str(root / VALIDATION_GLOB)))
    if not files:
        return None
    step, saving = 0.0, 0.0
    for f in files:
        res = load_result(f)["results"]
        for r in res["summary"]:
            e = r.get("on_run_gpu_err_of_mean", r.get("replay_vs_measured_err_of_mean"))
            if e is not None and r["method"] != "signal-only":
                step = max(step, abs(e))
        by: dict = {}
        for r in res["per_batch"]:
            if "measured_step_s" in r and "/" not in r["method"]:
                by.setdefault(r["method"], []).append((r.get("step_s_on_run_gpu", r["step_s"]),
                                                       r["measured_step_s"]))
        for base in ("colocated", "wlb"):
            if base in by and CAD in by and len(by[base]) == len(by[CAD]):
                rep = _saving([x[0] for x in by[base]], [x[0] for x in by[CAD]])
                mea = _saving([x[1] for x in by[base]], [x[1] for x in by[CAD]])
                saving = max(saving, abs(rep - mea))
    return {"step": step, "saving": saving, "files": [os.path.relpath(f, root) for f in files]}


def load_errors(path: str | os.PathLike | None = None) -> dict | None:
    """The committed errors file's ``results`` (None when absent: an installed wheel has no results)."""
    p = path or ERRORS_FILE
    return load_result(p)["results"] if os.path.exists(p) else None

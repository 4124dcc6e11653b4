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
paper's protocol). ``scripts/analyses/whatif_vs_replay.py`` writes them to
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
             "paper_fa4": ("replay/replay_3d_*_paper_fa4.json", None, "replay"),
             "paper_fit": ("replay/replay_3d_*_paper.json", None, "fit")}
"""The committed 3D replay families: file pattern, attention backend (None: the file's own) and where
the kernel table's scale comes from: ``fit``, per method on the family's timed calls
(:func:`cadlib.analysis.whatif.price.kernel_scales`); ``replay``, the one scale the replay itself priced
its untimed calls with (``config.kernel_model.scale``; the paper protocol times batch 0 only and prices
the other 14 batches from the table at that scale, the FA4 files all of them). ``paper_fit`` prices the
paper's settings with per-method scales fitted on their timed batch 0, as a user's what-if prices: it
shows how far the replay's one scale moves its own speedups."""


def replay_scale(config: dict) -> float | None:
    """The kernel table's scale a replay priced its untimed calls with (None when it timed them all)."""
    km = config.get("kernel_model") or {}
    return float(km["scale"]) if km.get("scale") else None
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

"""A band the size of what is known: the what-if's estimate and three errors around it.

A what-if samples ``n`` steps of the user's data and prices each from the measured tables
(:mod:`cadlib.analysis.whatif.price`). Three things stand between its mean and the truth, each
measured, each a half-width on the same quantity:

* **sampling**: the mean of ``n`` sampled steps, not of every step the data would give: the 95%
  Student-t interval ``t_{0.975, n-1} sd / sqrt(n)`` of the per-step values (a speedup's through the
  saving ``s = 1 - 1 / x``: ``ds = dx / x^2``);
* **composition**: the what-if against the replay on every committed 3D setting
  (:mod:`cadlib.analysis.whatif.errors`): the largest step error, the largest saving error of CAD with
  ping-pong over that baseline;
* **replay**: the replay against the measured runs (the largest step and saving errors).

They are independent, so the half-width is ``h = sqrt(h_sampling^2 + h_composition^2 + h_replay^2)``;
a saving ``s`` reads ``s +- h`` and its speedups ``1 / (1 - (s +- h))``; a step ``x`` reads
``x (1 +- h_rel)``. ``dominant`` names the largest of the three. The band covers settings like the
committed ones (TP 8, the paper's models, one H200's kernels); other GPUs need their own tables.
"""
from __future__ import annotations

import numpy as np

from .errors import load_errors, replay_error

T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
        10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}
"""Student's t, two-sided 95%, by degrees of freedom (between entries the next smaller one's, a
slightly wider interval); 1.96 beyond."""
FAMILY = {"torch_flash": "3d_fa2", "fa4": "3d"}
"""Which committed family's composition error a backend's what-if carries (our protocol's replays)."""
NAMES = ("sampling", "composition", "replay")


def t975(dof: int) -> float:
    """Student's t quantile 0.975 at ``dof`` degrees of freedom (:data:`T975`)."""
    if dof < 1:
        return float("nan")
    keys = [k for k in T975 if k <= dof]
    return T975[max(keys)] if dof <= 120 else 1.96


def known_errors(backend: str, results_dir=None, errors_file=None) -> dict:
    """``{"composition": {"step", "saving_over_<base>"}, "replay": {"step", "saving"}, "family",
    "settings"}`` from the committed files; zeros and ``missing`` naming what is absent."""
    out = {"composition": {"step": 0.0, "saving_over_colocated": 0.0, "saving_over_wlb": 0.0},
           "replay": {"step": 0.0, "saving": 0.0}, "family": FAMILY.get(backend), "settings": 0,
           "missing": []}
    errs = load_errors(errors_file)
    fam = (errs or {}).get("families", {}).get(FAMILY.get(backend, ""))
    if fam is None:
        out["missing"].append("composition (results/replay/whatif_vs_replay.json)")
    else:
        s = fam["summary"]
        out["composition"] = {"step": s["max_step_err"],
                              "saving_over_colocated": s["max_saving_err_over_colocated"],
                              "saving_over_wlb": s["max_saving_err_over_wlb"]}
        out["settings"] = s["settings"]
    rep = (errs or {}).get("replay_error") or replay_error(results_dir)
    if rep is None:
        out["missing"].append("replay (results/replay/replay_e2e_2x_*_validation.json)")
    else:
        out["replay"] = {"step": rep["step"], "saving": rep["saving"]}
    return out


def _combine(parts: dict) -> tuple[float, str]:
    h = float(np.sqrt(sum(v ** 2 for v in parts.values())))
    return h, max(parts, key=parts.get)


def step_band(steps, known: dict, sd_rel: float | None = None) -> dict:
    """A method's mean step over the sampled ``steps`` and its band (module docstring); ``sd_rel``:
    the per-step spread (sd / mean) to use when ``steps`` holds one step (a sweep point)."""
    x = np.asarray(steps, dtype=np.float64)
    mean = float(x.mean())
    samp = (t975(x.size - 1) * x.std(ddof=1) / np.sqrt(x.size) / mean if x.size > 1
            else 1.96 * (sd_rel or 0.0))
    parts = {"sampling": float(samp), "composition": float(known["composition"]["step"]),
             "replay": float(known["replay"]["step"])}
    h, dom = _combine(parts)
    return {"mid": mean, "band": [mean * (1 - h), mean * (1 + h)], "half_width": h, "parts": parts,
            "dominant": dom}


def saving_band(ratios, base: str, known: dict, sd: float | None = None) -> dict:
    """CAD's speedup over ``base``: the mean of the per-step ratios ``ratios``, its saving and the
    band on both (module docstring); ``sd``: the per-step sd of the speedups to use for one step."""
    r = np.asarray(ratios, dtype=np.float64)
    x = float(r.mean())
    sd_x = float(r.std(ddof=1)) if r.size > 1 else float(sd or 0.0)
    samp = (t975(r.size - 1) * sd_x / np.sqrt(r.size) if r.size > 1 else 1.96 * sd_x) / x ** 2
    parts = {"sampling": float(samp), "composition": float(known["composition"][f"saving_over_{base}"]),
             "replay": float(known["replay"]["saving"])}
    h, dom = _combine(parts)
    s = 1 - 1 / x
    lo, hi = s - h, min(s + h, 0.99)
    return {"speedup": x, "speedup_band": [1 / (1 - lo), 1 / (1 - hi)], "saving": s,
            "saving_band": [lo, hi], "half_width": h, "parts": parts, "dominant": dom, "sd": sd_x}

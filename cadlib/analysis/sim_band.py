"""How far the simulator's steps and speedups were from measured and replayed ones: the error band of
a prediction, from the committed scale-replay files.

The simulator (:func:`cadlib.analysis.replay.model_compose`) composes durations from the cost model.
The committed files hold, for the same batches, what that composition predicted (``sim_step_s``) and a
truer step: the **measured** step of the end-to-end runs on 2x H200 (DP=2,
``results/replay/replay_e2e_*_validation.json``), and the **replayed** step of the paper's 3D settings,
every rank's kernels timed on one H200 and composed (``results/replay/replay_3d_*_3d.json``). Per
setting ``s`` and method ``m`` (means over the setting's batches ``b``)::

    step ratio      rho_s = mean_b true_step / mean_b sim_step
    speedup ratio   rho_s = mean_b (true_base / true_m) / mean_b (sim_base / sim_m)

A 3D setting's truth is itself a replay; the replay's own ratio against the measured runs,
``alpha = measured / replayed`` (the same two formulas on the DP=2 files, ``alpha`` in
``[alpha_lo, alpha_hi]``), widens it to ``[rho_s alpha_lo, rho_s alpha_hi]``. The band of a quantity
is then ``lo = min``, ``hi = max`` over both kinds of setting, ``mid`` the median of the measured
ratios and of ``rho_s median(alpha)``. A prediction ``x`` from the simulator becomes ``x mid`` with the
band ``[x lo, x hi]``: what the truth was, relative to the simulator, somewhere in the committed runs.
It covers the simulator's systematic error (its steps run fast: it leaves out launch gaps and
communication kernels slowing the compute beside them) and its spread over those settings, not
settings unlike them (other GPUs, pipeline bubbles, other models).
"""
from __future__ import annotations

import glob
import os
import pathlib
from dataclasses import dataclass

import numpy as np

from ..infra.results import RESULTS_DIR, load_result

MEASURED_GLOB = "replay/replay_e2e_*_validation.json"
REPLAYED_GLOB = "replay/replay_3d_*_3d.json"
METHODS = ("colocated", "wlb", "cad", "cad-pingpong")
BASES = ("colocated", "wlb")


@dataclass(frozen=True)
class Band:
    """``truth / simulator`` for one quantity: ``lo <= mid <= hi`` over ``n`` settings."""

    lo: float
    mid: float
    hi: float
    n: int

    def apply(self, x: float) -> tuple[float, float, float]:
        """``(x lo, x mid, x hi)``: a simulated value as the estimate and its band."""
        return x * self.lo, x * self.mid, x * self.hi


def _per_setting(path: str) -> dict:
    """``{method: {batch: (true_step, sim_step, measured_step or None)}}`` of one replay file."""
    out: dict = {}
    for r in load_result(path)["results"]["per_batch"]:
        if "/" in r["method"]:
            continue
        out.setdefault(r["method"], {})[int(r["batch"])] = (r["step_s"], r["sim_step_s"],
                                                            r.get("measured_step_s"))
    return out


def _ratios(rows: dict, truth: int, ref: int) -> dict[str, float]:
    """Per quantity key, ``truth / ref`` of one setting: ``step/<m>`` and ``speedup/<m>/<base>``;
    ``truth``, ``ref``: which entry of a row (0 replayed, 1 simulated, 2 measured) is which."""
    out = {}
    for m in METHODS:
        if m not in rows:
            continue
        b = sorted(rows[m])
        if any(rows[m][i][truth] is None for i in b):
            continue
        true, sim = np.mean([rows[m][i][truth] for i in b]), np.mean([rows[m][i][ref] for i in b])
        out[f"step/{m}"] = float(true / sim)
        for base in BASES:
            if base == m or base not in rows or any(rows[base].get(i, (None,) * 3)[truth] is None for i in b):
                continue
            t = np.mean([rows[base][i][truth] / rows[m][i][truth] for i in b])
            s = np.mean([rows[base][i][ref] / rows[m][i][ref] for i in b])
            out[f"speedup/{m}/{base}"] = float(t / s)
    return out


def error_bands(results_dir: str | os.PathLike | None = None) -> dict:
    """``{"bands": {key: Band}, "measured": [files], "replayed": [files], "source": text}`` from the
    committed files under ``results_dir`` (default ``results/``); ``bands`` is empty when there are none
    (an installed wheel has no results)."""
    root = pathlib.Path(results_dir or RESULTS_DIR)
    measured = sorted(glob.glob(str(root / MEASURED_GLOB)))
    replayed = sorted(glob.glob(str(root / REPLAYED_GLOB)))
    meas = [_per_setting(f) for f in measured]
    rep = [_per_setting(f) for f in replayed]
    sim_meas = [_ratios(r, 2, 1) for r in meas]        # measured / simulated
    rep_meas = [_ratios(r, 2, 0) for r in meas]        # measured / replayed: alpha
    sim_rep = [_ratios(r, 0, 1) for r in rep]          # replayed / simulated
    keys = sorted({k for d in sim_meas + sim_rep for k in d})
    bands = {}
    for k in keys:
        direct = [d[k] for d in sim_meas if k in d]
        alpha = [d[k] for d in rep_meas if k in d]
        scaled = [d[k] for d in sim_rep if k in d]
        lo, hi, mid_pts = [], [], list(direct)
        if direct:
            lo.append(min(direct))
            hi.append(max(direct))
        if scaled and alpha:
            lo.append(min(scaled) * min(alpha))
            hi.append(max(scaled) * max(alpha))
            mid_pts += [x * float(np.median(alpha)) for x in scaled]
        if mid_pts:
            bands[k] = Band(float(min(lo)), float(np.median(mid_pts)), float(max(hi)),
                            len(direct) + (len(scaled) if alpha else 0))
    source = (f"truth / simulator over {len(measured)} runs measured on 2x H200 (DP=2, {MEASURED_GLOB}) and "
              f"{len(replayed)} paper 3D settings replayed from timed H200 kernels ({REPLAYED_GLOB}), the "
              "replays widened by their own error against the measured runs")
    return {"bands": bands, "measured": [os.path.relpath(f, root) for f in measured],
            "replayed": [os.path.relpath(f, root) for f in replayed], "source": source}

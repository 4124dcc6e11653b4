"""How far the simulator's steps and speedups were from measured and replayed ones: the error band of
a prediction, from the committed scale-replay files.

The simulator (:func:`cadlib.analysis.replay.phases.model_compose`) composes durations from the cost model.
The committed files hold, for the same batches, what that composition predicted (``sim_step_s``) and a
truer step: the **measured** step of the end-to-end runs on 2x H200 (DP=2,
``results/replay/replay_e2e_*_validation.json``), and the **replayed** step of the paper's 3D settings,
every rank's kernels timed on one H200 and composed (``results/replay/replay_3d_*_3d.json``). Means
over a setting's batches ``b``.

**Steps** are off by a factor: the simulator's run fast (it leaves out launch gaps and communication
kernels slowing the compute beside them). Per setting ``rho = mean_b true_step / mean_b sim_step``; a 3D
setting's ``rho`` is widened by the replay's own factor against the measured runs, ``alpha = measured /
replayed`` at DP=2, to ``[rho alpha_lo, rho alpha_hi]``. The band is ``lo = min``, ``hi = max`` over all
settings, ``mid`` the median (3D ones times ``median(alpha)``); a simulated step ``x`` becomes ``x mid``
in ``[x lo, x hi]``.

**Speedups** are off in their gain: the simulator's too-fast linear layers make the straggler a larger
share of its step, so it overstates what balancing saves, in proportion. With the saving
``s = 1 - 1 / speedup`` (the share of the baseline's step saved; ``mean_b`` speedups), per setting::

    s_true = g s_sim + e

``g = s_true / s_sim`` is read on the settings where ``|s_sim| >= MIN_GAIN`` (below it the ratio is
noise): ``g_lo``, ``g_mid``, ``g_hi`` their min, median and max. The floor ``delta`` is the largest
``|s_true - g_mid s_sim|`` of the other settings (what the simulator misses where it sees no gain),
plus the replay's largest ``|s_measured - s_replayed|`` at DP=2 (the 3D truths are replays). A
simulated saving ``s`` becomes ``g_mid s`` in ``[min(g_lo s, g_hi s) - delta, max(g_lo s, g_hi s) +
delta]``, and back to speedups ``1 / (1 - s)``: where the simulator sees nothing to gain the estimate
is no gain, within the floor. The bands cover the simulator's error and its spread over the committed
settings, not settings unlike them (other GPUs, pipeline bubbles, other models).
"""
from __future__ import annotations

import glob
import os
import pathlib
from dataclasses import dataclass

import numpy as np

from ...core.methods import names
from ...infra.results import RESULTS_DIR, load_result

MEASURED_GLOB = "replay/replay_e2e_*_validation.json"
REPLAYED_GLOB = "replay/replay_3d_*_3d.json"
METHODS = names(trainable=True, signal_only=False)
"""The methods whose steps are measured and replayed (the signal-only control is no method to predict)."""
BASES = names(trainable=True, baseline=True)
MIN_GAIN = 0.05
"""Simulated savings at least this large (either sign) give the gain factor ``g``; smaller ones the floor."""
MAX_SAVING = 0.99
"""A saving band is cut here (a speedup of 100x) so that ``1 / (1 - s)`` stays finite."""


@dataclass(frozen=True)
class Band:
    """``truth / simulator`` for one quantity over ``n`` settings: ``lo <= mid <= hi``. ``kind``
    ``"step"``: factors on a step; ``"saving"``: gain factors ``g`` on a saving, with ``floor``."""

    lo: float
    mid: float
    hi: float
    n: int
    kind: str = "step"
    floor: float = 0.0

    def apply(self, x: float) -> tuple[float, float, float]:
        """A simulated step or speedup ``x`` as ``(low, estimate, high)`` (see the module docstring)."""
        if self.kind == "step":
            return x * self.lo, x * self.mid, x * self.hi
        s = 1 - 1 / x
        a, b = sorted((self.lo * s, self.hi * s))
        lo, mid, hi = (min(v, MAX_SAVING) for v in (a - self.floor, self.mid * s, b + self.floor))
        return 1 / (1 - lo), 1 / (1 - mid), 1 / (1 - hi)


def _per_setting(path: str) -> dict:
    """``{method: {batch: (true_step, sim_step, measured_step or None)}}`` of one replay file."""
    out: dict = {}
    for r in load_result(path)["results"]["per_batch"]:
        if "/" in r["method"]:
            continue
        out.setdefault(r["method"], {})[int(r["batch"])] = (r["step_s"], r["sim_step_s"],
                                                            r.get("measured_step_s"))
    return out


def _pairs(rows: dict, truth: int, ref: int) -> dict[str, tuple[float, float]]:
    """Per quantity key, ``(truth, reference)`` of one setting: ``step/<m>`` the mean steps,
    ``speedup/<m>/<base>`` the savings ``1 - 1 / mean_b speedup``; ``truth``, ``ref``: which entry of a
    row (0 replayed, 1 simulated, 2 measured) is which."""
    out = {}
    for m in METHODS:
        if m not in rows:
            continue
        b = sorted(rows[m])
        if any(rows[m][i][truth] is None for i in b):
            continue
        out[f"step/{m}"] = (float(np.mean([rows[m][i][truth] for i in b])),
                            float(np.mean([rows[m][i][ref] for i in b])))
        for base in BASES:
            if base == m or base not in rows or any(rows[base].get(i, (None,) * 3)[truth] is None for i in b):
                continue
            sp = [np.mean([rows[base][i][k] / rows[m][i][k] for i in b]) for k in (truth, ref)]
            out[f"speedup/{m}/{base}"] = (float(1 - 1 / sp[0]), float(1 - 1 / sp[1]))
    return out


def _step_band(direct, alpha, scaled) -> Band:
    """Factors ``truth / sim`` of the measured settings (``direct``), of the replayed ones (``scaled``),
    and the replay's own (``alpha``)."""
    lo, hi, mids = [], [], list(direct)
    if direct:
        lo.append(min(direct))
        hi.append(max(direct))
    if scaled and alpha:
        lo.append(min(scaled) * min(alpha))
        hi.append(max(scaled) * max(alpha))
        mids += [x * float(np.median(alpha)) for x in scaled]
    return Band(float(min(lo)), float(np.median(mids)), float(max(hi)), len(mids))


def _saving_band(points: list[tuple[float, float]], replay_err: float) -> Band:
    """``points``: ``(s_true, s_sim)`` of every setting; ``replay_err``: the replay's largest saving error."""
    g = [t / s for t, s in points if abs(s) >= MIN_GAIN]
    lo, mid, hi = (min(g), float(np.median(g)), max(g)) if g else (1.0, 1.0, 1.0)
    rest = [abs(t - mid * s) for t, s in points if abs(s) < MIN_GAIN]
    return Band(float(lo), mid, float(hi), len(points), "saving", float(max(rest, default=0.0) + replay_err))


def error_bands(results_dir: str | os.PathLike | None = None) -> dict:
    """``{"bands": {key: Band}, "measured": [files], "replayed": [files], "source": text}`` from the
    committed files under ``results_dir`` (default ``results/``); ``bands`` is empty when there are none
    (an installed wheel has no results)."""
    root = pathlib.Path(results_dir or RESULTS_DIR)
    measured = sorted(glob.glob(str(root / MEASURED_GLOB)))
    replayed = sorted(glob.glob(str(root / REPLAYED_GLOB)))
    meas = [_per_setting(f) for f in measured]
    sim_meas = [_pairs(r, 2, 1) for r in meas]         # measured vs simulated
    rep_meas = [_pairs(r, 2, 0) for r in meas]         # measured vs replayed
    sim_rep = [_pairs(_per_setting(f), 0, 1) for f in replayed]   # replayed vs simulated
    bands = {}
    for k in sorted({k for d in sim_meas + sim_rep for k in d}):
        if k.startswith("step/"):
            b = _step_band(*([d[k][0] / d[k][1] for d in ds if k in d]
                             for ds in (sim_meas, rep_meas, sim_rep)))
        else:
            err = max((abs(d[k][0] - d[k][1]) for d in rep_meas if k in d), default=0.0)
            b = _saving_band([d[k] for d in sim_meas + sim_rep if k in d], err)
        bands[k] = b
    source = (f"truth / simulator over {len(measured)} runs measured on 2x H200 (DP=2, {MEASURED_GLOB}) and "
              f"{len(replayed)} paper 3D settings replayed from timed H200 kernels ({REPLAYED_GLOB}); steps "
              "scaled by the factor truth / simulator, savings by the factor on the simulated gain plus a "
              "floor, the replays widened by their own error against the measured runs")
    return {"bands": bands, "measured": [os.path.relpath(f, root) for f in measured],
            "replayed": [os.path.relpath(f, root) for f in replayed], "source": source}

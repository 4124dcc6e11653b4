"""The what-if's answer: each method's numbers with their bands (:mod:`cadlib.analysis.whatif.band`), and
the verdict on CAD with ping-pong against the faster baseline, with its straggler and, when the band
includes no gain, the error that dominates it."""
from __future__ import annotations

import numpy as np

from ...core.methods import METHODS as ALL_METHODS
from . import ring
from .band import saving_band, step_band
from .setup import METHODS

BASELINES = tuple(m for m in METHODS if ALL_METHODS[m].baseline)
ROWS = (*METHODS, ring.KEY)
"""The what-if's rows: its methods and the CP ring over the packed sequence
(:mod:`cadlib.analysis.whatif.ring`)."""
LABELS = {**{m: ALL_METHODS[m].label for m in METHODS}, ring.KEY: ring.LABEL}



def banded(sim: dict, known: dict, tokens_per_step: int, spread: dict | None = None) -> dict:
    """Every method's numbers with their bands (:mod:`cadlib.analysis.whatif.band`); ``spread``: the
    per-step spreads of the planned setting, for a sweep point of one step."""
    out = {}
    for key, r in sim["methods"].items():
        row = {k: v for k, v in r.items() if k != "ranks"}
        sb = step_band(r["steps_s"], known, (spread or {}).get(f"step/{key}"))
        lo, hi = sb["band"]
        row.update(step_s=sb["mid"], step_s_band=[lo, hi], step_s_parts=sb["parts"],
                   tokens_per_s=tokens_per_step / sb["mid"],
                   tokens_per_s_band=[tokens_per_step / hi, tokens_per_step / lo])
        for base in BASELINES:
            if key == base:
                row[f"speedup_over_{base}_band"] = None
                continue
            sd = (spread or {}).get(f"speedup/{key}/{base}")
            b = saving_band(r[f"speedups_over_{base}"], base, known, sd)
            row[f"speedup_over_{base}"] = b["speedup"]
            row[f"speedup_over_{base}_band"] = b["speedup_band"] if key == "cad-pingpong" else None
            if key == "cad-pingpong":
                row[f"saving_over_{base}"] = b
        out[key] = row
    return out


def spreads(methods: dict) -> dict:
    """The per-step spreads of a planned setting (sd / mean of the steps, sd of CAD's speedups)."""
    out = {}
    for key, r in methods.items():
        x = np.asarray(r["steps_s"])
        out[f"step/{key}"] = float(x.std(ddof=1) / x.mean()) if x.size > 1 else 0.0
        for base in BASELINES:
            if f"saving_over_{base}" in r:
                out[f"speedup/{key}/{base}"] = r[f"saving_over_{base}"]["sd"]
    return out


def pct(x: float) -> str:
    """A share as a signed whole percent, ``+0%`` for anything that rounds to nothing."""
    return f"{round(100 * x):+d}%"


def _best_baseline(methods: dict) -> str:
    """The faster baseline by CAD's estimated speedups (as the verdict quotes them)."""
    return min(BASELINES, key=lambda k: methods["cad-pingpong"][f"speedup_over_{k}"])


def _classify(band) -> str:
    """``pays`` when the saving's band is above 0, ``loses`` below, else ``unsure``."""
    lo, hi = band
    return "pays" if lo > 0 else "loses" if hi < 0 else "unsure"


def _straggler(methods: dict, base: str) -> str:
    """What makes ``base`` slow where CAD is not: the slowest rank's excess attention or the exposed
    communication (per-document CP's all-gathers), whichever costs more of its step; then what CAD
    itself leaves exposed."""
    b, cad = methods[base], methods["cad-pingpong"]
    ratio = b["attention_max_s"] / b["attention_mean_s"] if b["attention_mean_s"] > 0 else 1.0
    excess = (b["attention_max_s"] - b["attention_mean_s"]) / b["step_s"]
    comm = b["exposed_comm_s"] / b["step_s"]
    who = LABELS[base]
    if max(excess, comm) < 0.02:
        text = (f"none to speak of: under {who} attention is balanced within {ratio:.2f}x the mean and "
                f"{100 * comm:.0f}% of the step is exposed communication")
    elif excess >= comm:
        text = (f"core attention: under {who} the slowest rank's attention is {ratio:.2f}x the mean "
                f"({100 * excess:.0f}% of the step)")
    else:
        text = (f"communication: under {who} per-document CP's K, V all-gathers leave {100 * comm:.0f}% of "
                f"the step exposed (attention within {ratio:.2f}x the mean)")
    exposed = cad["exposed_comm_s"] / cad["step_s"]
    if exposed >= 0.05:
        text += f"; CAD's all-to-alls leave {100 * exposed:.0f}% of its step exposed"
    return text


WHY = {"sampling": "the sampled steps differ among themselves (sample more steps: --steps)",
       "composition": "the what-if's composition against the replay (results/replay/whatif_vs_replay.json)",
       "replay": "the replay's own error against the measured runs"}


def verdict(methods: dict) -> dict:
    """CAD with ping-pong against the faster baseline: the saving ``1 - 1/speedup``, its band, the class
    (``pays``, ``loses``, ``unsure``), which error dominates the band, the straggler and one line."""
    base = _best_baseline(methods)
    sb = methods["cad-pingpong"][f"saving_over_{base}"]
    sp, save, band = sb["speedup"], sb["saving"], sb["saving_band"]
    cls = _classify(band)
    span = f"{pct(band[0])} to {pct(band[1])}"
    who, strag = LABELS[base], _straggler(methods, base)
    if cls == "pays":
        line = f"CAD saves about {100 * save:.0f}% of the step here against {who} (band {span})"
    elif cls == "loses":
        line = f"CAD does not pay off here: about {100 * -save:.0f}% slower than {who} (band {span})"
    elif abs(save) < 0.005:
        line = f"CAD and {who} take about the same step here (band {span} for CAD's saving)"
    elif save > 0:
        line = f"CAD saves about {100 * save:.0f}% against {who}, but the band ({span}) includes no gain"
    else:
        line = (f"CAD likely does not pay off here: about {100 * -save:.0f}% slower than {who}, though the "
                f"band ({span}) reaches a gain")
    if cls == "unsure":
        line += f"; the widest error is {WHY[sb['dominant']]}"
    return {"baseline": base, "speedup": sp, "speedup_band": sb["speedup_band"], "saving": save,
            "saving_band": band, "half_width": sb["half_width"], "parts": sb["parts"],
            "dominant": sb["dominant"], "class": cls, "straggler": strag,
            "line": f"{line}; the straggler is {strag}."}

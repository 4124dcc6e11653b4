"""Where the what-if's durations come from: the measured tables, composed as the scale replay composes.

The replay (:mod:`cadlib.analysis.replay`) times every kernel call of every rank on one GPU and composes
them over a link model; the what-if composes the same phases of the same work with the same code
(:func:`cadlib.analysis.replay.phases.phases`, :func:`~cadlib.analysis.replay.phases.compose_work`).
Only where each duration comes from differs, since nobody timed the user's batches:

* the linear layers, the LM head and the optimizer: the token grid timed for the model and TP
  degree (``times``, the replay cache's ``{"times": {key: ms}}``; :func:`cadlib.analysis.replay.times.interp`
  between the grid points ``LINEAR_GRID``), in the ``linear`` variant asked for when it was timed;
* core attention: each server's one fused call on its merged segments from a kernel latency table
  (``cost``, :class:`cadlib.core.measured.MeasuredCost`), corrected per call by
  :func:`cadlib.analysis.replay.calls.call_model`,
  fitted on the calls the replay timed: ``t_call = a x table + b + c x gathered rows / 1000`` per
  direction, plus ``d x`` the longest segment's KV rows / 1000 in the forward (the table sums the
  kernel's time over the segments; a served call also pays its stage's launch, the copies of its
  shards' buffers and the tail its longest segment leaves). A user's own table (``--gpu-table``) is
  used as it is, and a plain ``scale`` (one number, or one per method with ``"all"``) is still accepted;
* communication: the link model (:class:`cadlib.analysis.replay.phases.Links`).

Past the end of a timed grid the replay's interpolation follows the last segment; a grid whose last
segment falls (a calibration's noisy small shapes, e.g. ``python -m cadlib.calibrate --smoke``) would
price negative durations there, so :func:`clip_grid_ends` prices past the end by the last segment's slope
clipped at zero, ``t(n) = t(g_last) + max(0, slope) (n - g_last)``.

A model or TP degree with no timed grid falls back to the cost model
(:func:`cadlib.analysis.replay.phases.model_phases`, attention still from ``cost``), and
:attr:`Pricing.source` says so. ``times`` and ``cost`` default to the committed H200 files; a
calibrated table of another GPU plugs in through the same arguments.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from functools import lru_cache

from ...core.measured import MeasuredCost
from ...infra.results import RESULTS_DIR, load_result
from ..model.compose import Composed, compose
from ..replay import phases as rp
from ..replay.calls import price_untimed, table_ms, timed_calls
from ..replay.settings import Setting, Work
from ..replay.times import (
    LINEAR_GRID,
    head_key,
    linear_key,
    model_attention_times,
    optimizer_key,
)

TIMES_FILE = RESULTS_DIR / "replay" / "times_h200.json"
"""The replay's timing cache (every linear-layer, head and optimizer grid the replay timed on one H200)."""
KERNELS_FILE = RESULTS_DIR / "kernel_profile_h200.json"
"""The H200 kernel latency table (``scripts/bench/profile_kernels.py``)."""
ERRORS_FILE = RESULTS_DIR / "replay" / "whatif_vs_replay.json"
"""The what-if against the replay on every committed 3D setting (``scripts/analyses/whatif_vs_replay.py``);
it also records each backend's ``scale``."""
BACKEND = "torch_flash"
"""The attention kernel the what-if prices by default: FlashAttention-2 as PyTorch ships it, the kernel
the replay timed call by call (the FA4 replays derive theirs from it by a fitted ratio)."""
LINEAR = ("fused-sp", "")
"""The linear variants tried in order (:data:`cadlib.analysis.replay.times.LINEAR_VARIANTS`): the fused
blocks under sequence parallelism where timed (what Megatron runs), else the reference blocks."""


@lru_cache(maxsize=4)
def _load_times(path: str) -> dict:
    with open(path) as f:
        return json.load(f)["times"]


def load_times(path: str | os.PathLike | None = None) -> dict:
    """A replay cache's ``times`` (``{key: {"ms" | "fwd_ms", ...}}``); the committed one by default."""
    return _load_times(str(path or TIMES_FILE))


@lru_cache(maxsize=8)
def _load_cost(path: str, backend: str) -> MeasuredCost:
    return MeasuredCost.load(path, backend)


def load_cost(path: str | os.PathLike | None = None, backend: str = BACKEND) -> MeasuredCost:
    """A kernel latency table's ``backend``; the committed H200 table by default."""
    return _load_cost(str(path or KERNELS_FILE), backend)


def committed_scale(backend: str, errors_file: str | os.PathLike | None = None) -> dict | None:
    """The kernel table's scales for ``backend`` recorded in the errors file (``{"all": x, method: x}``,
    :func:`kernel_scales`), None without one."""
    p = errors_file or ERRORS_FILE
    if not os.path.exists(p):
        return None
    return load_result(p)["results"].get("scale", {}).get(backend, {}).get("scale")


def has_grid(times: dict, s: Setting, backend: str, variant: str) -> bool:
    """Whether ``times`` holds two grid points of the linear layers and of the head of ``s``'s model
    and TP degree in ``variant``, and its optimizer when ``s`` runs one."""
    spec = s.spec
    for key_of in (lambda n: linear_key(spec, backend, n, variant, s.tp),
                   lambda n: head_key(spec, backend, n, variant, s.tp)):
        if sum(key_of(n) in times for n in LINEAR_GRID) < 2:
            return False
    return not s.optimizer or optimizer_key(spec, backend) in times


def clip_grid_ends(times: dict) -> dict:
    """``times`` with, for every linear-layer and head grid that ends before ``LINEAR_GRID``'s last point,
    one point added at the next grid point holding each field at ``t(g_last) + max(0, slope) (g_next -
    g_last)`` (``slope`` of the last timed segment; marked ``"extrapolated"``): the replay's
    interpolation then prices past the end along the clipped slope (module docstring). Grids reaching
    the last point are kept (a falling last segment there stays, and prices negative only past
    ``g_last + t(g_last) / |slope|``)."""
    grids: dict[str, list[int]] = {}
    for k in times:
        head, _, n = k.rpartition("|")
        if k.startswith(("linear", "head")) and n.isdigit() and int(n) in LINEAR_GRID:
            grids.setdefault(head, []).append(int(n))
    out = dict(times)
    for head, ns in grids.items():
        ns = sorted(ns)
        if len(ns) < 2 or ns[-1] == LINEAR_GRID[-1]:
            continue
        (a, b), nxt = ns[-2:], LINEAR_GRID[LINEAR_GRID.index(ns[-1]) + 1]
        ta, tb = times[f"{head}|{a}"], times[f"{head}|{b}"]
        add = {f: tb[f] + max(0.0, (tb[f] - ta[f]) / (b - a)) * (nxt - b) for f in tb
               if f.endswith("ms") and isinstance(tb[f], (int, float)) and isinstance(ta.get(f), (int, float))}
        out[f"{head}|{nxt}"] = {**add, "extrapolated": True}
    return out


@dataclass
class Pricing:
    """How one what-if prices its batches: ``times`` (the replay cache's format), ``cost`` (a kernel
    table), ``scale`` on its calls, ``backend``; :meth:`prepare` picks the linear variant for a setting
    and says where the durations come from (``source``, ``fallback``)."""

    times: dict = field(repr=False)
    cost: MeasuredCost = field(repr=False)
    backend: str = BACKEND
    scale: float | dict = 1.0
    linear: str | None = None
    fallback: bool = False
    source: str = ""

    def prepare(self, s: Setting) -> Setting:
        """``s`` with the linear variant priced (the first of :data:`LINEAR` timed for its model and TP,
        or ``s.linear`` when asked); ``fallback`` when none is, the cost model then pricing them."""
        tried = (s.linear,) if self.linear is not None else LINEAR
        for v in tried:
            if has_grid(self.times, replace(s, linear=v), self.backend, v):
                self.fallback = False
                self.source = (f"linear layers, head and optimizer from the timed token grid of {s.spec.name}"
                               f"{' (' + v + ')' if v else ''}; attention from the {self.backend} kernel "
                               f"table x {self._scales()}; communication from the link model")
                return replace(s, linear=v)
        self.fallback = True
        self.source = (f"no timed token grid for {s.spec.name} (TP {s.tp}): linear layers and head from the "
                       f"cost model (a roofline, 20-40% fast on the timed settings); attention from the "
                       f"{self.backend} kernel table x {self._scales()}")
        return s

    def _scales(self) -> str:
        if not isinstance(self.scale, dict):
            return f"{self.scale:.3f}"
        cm = self.scale.get("call_model")
        if cm:
            f, b = cm["fwd"], cm["bwd"]
            longest = f" + {f[3]:.4f} ms per 1K KV rows of its longest segment" if len(f) > 3 else ""
            return (f"(fitted per call: forward {f[0]:.3f} x table + {f[1]:.2f} ms + {f[2]:.4f} ms per 1K "
                    f"gathered rows{longest}, backward {b[0]:.3f} x table + {b[1]:.2f} ms + {b[2]:.4f} ms)")
        return "(" + ", ".join(f"{k} {v:.3f}" for k, v in self.scale.items()) + ")"

    def scale_of(self, method: str) -> float:
        """The kernel table's scale for ``method``'s calls (``wlb/4`` is WLB's, signal-only CAD's)."""
        if not isinstance(self.scale, dict):
            return float(self.scale)
        fam = "cad-pingpong" if method == "signal-only" else method.split("/")[0]
        return float(self.scale.get(fam, self.scale["all"]))

    def table(self, s: Setting, works: dict[str, Work]) -> dict:
        """The durations of ``works``' calls: the timed grid with every server call priced from the
        kernel table at its method's scale (never looked up among the timed calls: a user's batches
        are not there)."""
        cm = self.scale.get("call_model") if isinstance(self.scale, dict) else None
        if cm:
            att = price_untimed(works, s.spec, self.backend, self.cost, cm)
        else:
            att = {}
            for k, w in works.items():
                att.update(model_attention_times([w], s.spec, self.backend, self.cost, self.scale_of(k)))
        return {**self.times, **att}

    def phases(self, s: Setting, w: Work, links: rp.Links, table: dict | None = None) -> rp.Phases:
        """One layer of ``w``'s per-rank durations (the replay's phases, or the cost model's on fallback)."""
        if self.fallback:
            ph, x = rp.model_phases(s, w, links, cost=self.cost), self.scale_of(w.method)
            return replace(ph, attn=ph.attn * x, attn_bwd=ph.attn_bwd * x)
        return rp.phases(s, w, table, links, self.backend)

    def compose(self, s: Setting, works: dict[str, Work], links: rp.Links) -> dict[str, Composed]:
        """Every method of a batch composed as the replay does
        (:func:`~cadlib.analysis.replay.phases.compose_work`)."""
        if not self.fallback:
            return rp.compose_work(s, works, self.table(s, works), links, self.backend)
        out = {k: replace(compose(w.method, self.phases(s, w, links), s.spec.n_layers), method=k)
               for k, w in works.items()}
        return rp._best_wlb(out) if s.wlb_choice == "batch" else out


def pricing(times: dict | None = None, cost: MeasuredCost | None = None, backend: str = BACKEND,
            scale: float | None = None, linear: str | None = None) -> Pricing:
    """A :class:`Pricing` from ``times`` and ``cost`` (default: the committed H200 files) and ``scale``
    (default: the committed errors file's for ``backend``, 1 without it or with a user's ``cost``)."""
    user_cost = cost is not None
    times = clip_grid_ends(load_times() if times is None else times)
    cost = load_cost(backend=backend) if cost is None else cost
    if scale is None:
        scale = 1.0 if user_cost else (committed_scale(backend) or 1.0)
    vals = [v for k, v in scale.items() if k != "call_model"] if isinstance(scale, dict) else (scale,)
    if not all(isinstance(v, (int, float)) and v > 0 for v in vals) or (isinstance(scale, dict)
                                                                         and "all" not in scale):
        raise ValueError(f"scale must be a number > 0 or a dict of them per method with 'all', got {scale!r}")
    return Pricing(times, cost, backend, scale, linear)


def kernel_scales(settings_, times: dict, cost: MeasuredCost, backend: str, rates: dict,
                  batches: int = 2) -> dict:
    """The kernel table's ``scale`` = measured / predicted (forward + backward, time-weighted) over the
    timed server calls of the first ``batches`` batches of ``settings_``: ``"all"`` and per method
    (colocated's whole documents, WLB's per-document CP pieces and CAD's shards cut their segments
    differently, and the table misses each by its own factor); ``calls`` per method."""
    meas: dict = {}
    for s, key, d, t in timed_calls(settings_, times, backend, rates, batches, per_work=True):
        fam = key.split("/")[0]
        if fam == "signal-only":
            continue
        p = table_ms(d, s.spec, cost)
        for f in (fam, "all"):
            m = meas.setdefault(f, [0.0, 0.0, 0])
            m[0] += t["fwd_ms"] + t["bwd_ms"]
            m[1] += p
            m[2] += 1
    if "all" not in meas:
        raise ValueError(f"no timed {backend} call among these settings to scale the kernel table to")
    return {"scale": {f: m[0] / m[1] for f, m in meas.items()}, "calls": {f: m[2] for f, m in meas.items()},
            "backend": backend, "batches": batches}

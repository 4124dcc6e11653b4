"""A calibration of the user's GPU (``python -m cadlib.calibrate --out mygpu.json``), read without torch.

The file is a result (:func:`cadlib.infra.results.save_result`) whose ``config`` names what was
calibrated (``model``, ``tp``, ``backend``, the ``linear`` variants) and whose ``results`` hold three
measured tables in the formats the replay already reads:

* ``kernel``: the attention kernel's latency grid, as ``scripts/bench/profile_kernels.py`` writes it
  (``{"config", "results"}``), so :meth:`GpuTable.measured_cost` is
  :meth:`cadlib.core.measured.MeasuredCost.from_table`; a task of ``pairs`` causal pairs costs
  ``pairs / R(q, k)`` with the rate ``R`` interpolated in ``(log2 q, log2 k)``;
* ``times``: the linear layers, the LM head and the optimizer step of the model's TP shard on the
  replay's token grid, keyed as the replay's cache (:func:`cadlib.analysis.replay.times.linear_key`,
  :func:`~cadlib.analysis.replay.times.head_key`, :func:`~cadlib.analysis.replay.times.optimizer_key`);
  a token count between two grid points costs ``t(n) = t(g_i) + (n - g_i) (t(g_{i+1}) - t(g_i)) /
  (g_{i+1} - g_i)`` (:func:`cadlib.analysis.replay.times.interp`);
* ``all_to_all``: the intra-node all-to-all's GB/s when several GPUs were visible (rows as the
  committed ``comm_overlap_probe_*.json``), else the reason it was skipped.

:func:`load` checks the file against the model and kernel the caller asked for and raises
:class:`GpuTableError` with one line naming the file and what is wrong; :func:`compare` sets a
calibration beside the committed H200 grids (the per-entry ratio, the fraction within 5%).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

from ...core.cost import ModelSpec, as_model
from ...core.measured import MeasuredCost
from ..replay.times import LINEAR_GRID, head_key, linear_key, optimizer_key

FORMAT = "cadlib.calibrate/1"
"""The ``config["format"]`` of a calibration file; another value is a file of another kind."""

LINEAR_FIELDS = ("pre_ms", "pre_bwd_ms", "post_ms", "post_bwd_ms")
"""The timed phases of one layer's linear parts (ms); the head and the optimizer have ``ms``."""


class GpuTableError(ValueError):
    """A calibration file that cannot price what was asked: its message is one line naming the file."""


@dataclass(frozen=True)
class GpuTable:
    """One GPU's calibration (see the module docstring)."""

    path: str
    device: str                       # the GPU's name as the run recorded it (e.g. "1x NVIDIA H200")
    backend: str                      # the attention kernel timed (fa4, torch_flash, ...)
    model: str                        # the model's name (its TP shard was timed)
    tp: int
    linear: tuple[str, ...]           # the linear variants timed ("" the reference blocks, "fused-sp")
    times: dict                       # replay-cache entries: key -> {"pre_ms", ...} or {"ms"}
    kernel: dict                      # the kernel latency table: {"config", "results"}
    all_to_all: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    @property
    def spec(self) -> ModelSpec:
        """The model's TP shard, the shapes the linear grid was timed at."""
        return as_model(self.model).shard(self.tp)

    def measured_cost(self) -> MeasuredCost:
        """The attention kernel's :class:`MeasuredCost` from this GPU's grid."""
        return MeasuredCost.from_table(self.kernel, self.backend)

    def linear_keys(self, variant: str = "") -> list[tuple[int, str, str]]:
        """``(tokens, linear key, head key)`` of the grid points timed with ``variant``."""
        if variant not in self.linear:
            raise GpuTableError(f"{self.path}: linear variant {variant!r} was not calibrated; it has "
                                f"{', '.join(repr(v) for v in self.linear)}")
        s = self.spec
        b, tp = self.backend, self.tp
        out = [(n, linear_key(s, b, n, variant, tp), head_key(s, b, n, variant, tp)) for n in LINEAR_GRID]
        return [(n, lk, hk) for n, lk, hk in out if lk in self.times and hk in self.times]

    def link_gbps(self) -> float | None:
        """The all-to-all's GB/s at its largest size (NCCL's own thread blocks on GPUs); None when it
        was skipped."""
        rows = self.all_to_all.get("rows", [])
        return float(max(rows, key=lambda r: r["mib_per_rank"])["a2a_gbps"]) if rows else None

    def label(self) -> str:
        """``"<device>, <backend>, <model> TP <tp>"``: what a number priced from it came from."""
        return f"{self.device}, {self.backend}, {self.model} TP {self.tp}"


def _fail(path, msg: str) -> GpuTableError:
    return GpuTableError(f"{path}: {msg}")


def parse(obj, path: str = "<table>", model: str | None = None, backend: str | None = None) -> GpuTable:
    """A :class:`GpuTable` from a loaded calibration (``{"meta", "config", "results"}``), checked: the
    ``model`` (a name) and ``backend`` asked for, when given, must be the calibrated ones."""
    if not isinstance(obj, dict) or not isinstance(obj.get("config"), dict) \
            or not isinstance(obj.get("results"), dict):
        raise _fail(path, "not a calibration file (a JSON object with 'config' and 'results' from "
                          "python -m cadlib.calibrate)")
    cfg, res = obj["config"], obj["results"]
    if cfg.get("format") != FORMAT:
        raise _fail(path, f"not a calibration file (config.format is {cfg.get('format')!r}, "
                          f"expected {FORMAT!r})")
    missing = [k for k in ("model", "tp", "backend", "linear") if k not in cfg] + \
        [f"results.{k}" for k in ("kernel", "times") if not isinstance(res.get(k), dict)]
    if missing:
        raise _fail(path, f"malformed calibration: missing {', '.join(missing)}")
    if model is not None:
        want = as_model(model).name if not isinstance(model, ModelSpec) else model.name
        if want != cfg["model"]:
            raise _fail(path, f"calibrated for model {cfg['model']!r}, not {want!r}; run python -m "
                              f"cadlib.calibrate --model {want} --out <file>")
    if backend is not None and backend != cfg["backend"]:
        raise _fail(path, f"calibrated with the {cfg['backend']!r} attention kernel, not {backend!r}; run "
                          f"python -m cadlib.calibrate --backend {backend} --out <file>")
    try:
        tp = int(cfg["tp"])
        as_model(cfg["model"]).shard(tp)
    except (TypeError, ValueError) as e:
        raise _fail(path, f"malformed calibration: {str(e).splitlines()[0]}") from None
    table = GpuTable(path=str(path), device=str(obj.get("meta", {}).get("device", "unknown GPU")),
                     backend=str(cfg["backend"]), model=str(cfg["model"]), tp=tp,
                     linear=tuple(cfg["linear"]), times=res["times"], kernel=res["kernel"],
                     all_to_all=res.get("all_to_all") or {}, meta=obj.get("meta", {}))
    try:
        table.measured_cost()
    except (KeyError, TypeError, ValueError) as e:
        raise _fail(path, f"malformed kernel table: {str(e).splitlines()[0] or type(e).__name__}") from None
    for v in table.linear:
        if len(table.linear_keys(v)) < 2:
            raise _fail(path, f"malformed calibration: fewer than two token counts of the "
                              f"{v or 'reference'!r} linear grid for {table.spec.name} with {table.backend}")
    if optimizer_key(table.spec, table.backend) not in table.times:
        raise _fail(path, f"malformed calibration: no optimizer step for {table.spec.name}")
    return table


def load(path: str | os.PathLike, model: str | None = None, backend: str | None = None) -> GpuTable:
    """Read and check a calibration file (:func:`parse`); any problem is a one-line :class:`GpuTableError`."""
    try:
        with open(path) as f:
            obj = json.load(f)
    except FileNotFoundError:
        raise _fail(path, "no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _fail(path, f"not a JSON calibration file ({str(e).splitlines()[0]})") from None
    return parse(obj, str(path), model, backend)


def compare(table: GpuTable, kernel_ref: dict, times_ref: dict, within: float = 0.05) -> dict:
    """The calibration beside reference grids (the committed ``kernel_profile_h200.json`` and
    ``replay/times_h200.json``'s ``times``): every entry both hold, ``ratio = ours / reference`` per
    timed field, and per kind (kernel, linear, head, optimizer) how many, the fraction with
    ``|ratio - 1| <= within`` and the time-weighted error ``sum |ours - ref| / sum ref`` (what a step
    priced from the table moves by: a step is a sum of these times, and the sub-millisecond points whose
    launch noise fails the per-entry bar weigh little in it). Kernel rows compare only at the same heads, and only the ``backend``."""
    if not within > 0:
        raise ValueError(f"within must be > 0, got {within!r}")
    rows = []
    kc, rc = table.kernel.get("config", {}), kernel_ref.get("config", {})
    same_heads = all(kc.get(k) == rc.get(k) for k in ("n_heads", "n_kv_heads", "head_dim", "dtype"))
    if same_heads:
        def point(r):
            return r.get("backend"), r.get("kind"), r.get("q_len"), r.get("kv_len"), r.get("n_seg")
        ref = {point(r): r for r in kernel_ref.get("results", []) if isinstance(r, dict)}
        for r in table.kernel.get("results", []):
            other = ref.get(point(r))
            if r.get("backend") != table.backend or other is None:
                continue
            for f in ("fwd_ms", "fwd_bwd_ms"):
                if r.get(f) and other.get(f):
                    rows.append({"kind": "kernel", "key": "{}|{}|q{}|kv{}|x{}".format(*point(r)), "field": f,
                                 "ours_ms": r[f], "ref_ms": other[f], "ratio": r[f] / other[f]})
    for key, e in table.times.items():
        other = times_ref.get(key)
        if other is None:
            continue
        kind = key.split("|", 1)[0].split("@", 1)[0]
        for f in LINEAR_FIELDS + ("ms",):
            if e.get(f) and other.get(f):
                rows.append({"kind": kind, "key": key, "field": f, "ours_ms": e[f], "ref_ms": other[f],
                             "ratio": e[f] / other[f]})
    summary = {}
    for kind in ("kernel", "linear", "head", "optimizer", "all"):
        sel = [x for x in rows if kind in ("all", x["kind"])]
        r = np.array([x["ratio"] for x in sel])
        ref_ms = sum(x["ref_ms"] for x in sel)
        summary[kind] = {"entries": int(r.size),
                         "time_weighted_err": (sum(abs(x["ours_ms"] - x["ref_ms"]) for x in sel) / ref_ms
                                               if ref_ms else None),
                         "within": int(np.sum(np.abs(r - 1) <= within)) if r.size else 0,
                         "fraction_within": float(np.mean(np.abs(r - 1) <= within)) if r.size else None,
                         "median_ratio": float(np.median(r)) if r.size else None}
    return {"within": within, "same_heads": same_heads, "summary": summary, "rows": rows}

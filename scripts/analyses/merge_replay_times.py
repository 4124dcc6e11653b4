"""Merge a device session's replay timings into the committed cache.

``bench_replay.py time`` on the GPU machine continues a copy of ``results/replay/times_h200.json``; this
takes what that copy adds: every new call, except those timed without a warm-up whose time is a first-run
outlier (:func:`cadlib.analysis.replay.calls.unwarmed_outliers`: over 1.6x the kernel table; the
replay then prices them as it prices untimed calls). The table also underprices some calls for real
(thousands of short segments), so the dropped keys go to ``--dropped-out``: time them again with a
warm-up (``bench_replay.py time --warmup 1 --retime-keys``) and merge that run; warmed-up calls are never
dropped. Calls the copy timed again keep the committed timing, except those the copy timed more carefully
(a warm-up where there was none, or the median of more runs; the same pool, or none), and, with
``--replace-unpooled``, those committed without a reserved pool that the copy timed with one (unless
timed without a warm-up at over 1.6x their committed time: such outliers keep it, and go to
``--dropped-out`` too); where the copy retimed warmed-up calls without a warm-up, the ratio of the two is
the warm-up check written to ``--check-out``. The session's environment is appended to the cache's
``meta_runs`` (``--note``: what the run was for). Host only (a minute).

    python scripts/analyses/merge_replay_times.py replay_times.json      # the cache the device call returned
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from cadlib.analysis.replay import calls, protocol
from cadlib.analysis.replay import phases as rp
from cadlib.core.measured import MeasuredCost
from cadlib.infra.results import RESULTS_DIR, atomic_write_json, load_result, save_result


def warmup_check(old: dict, new: dict) -> dict | None:
    """Calls timed warmed-up in ``old`` and again without a warm-up in ``new``, both with a reserved pool
    or both without (a pool that differs is a second change): unwarmed / warmed, per pass."""
    both = [k for k, e in new.items() if k in old and e != old[k] and e.get("warmup") == 0
            and old[k].get("warmup", 1) >= 1 and not old[k].get("modelled")
            and ("reserve_gib" in e) == ("reserve_gib" in old[k])]
    if not both:
        return None
    f = np.array([new[k]["fwd_ms"] / old[k]["fwd_ms"] for k in both])
    b = np.array([new[k]["bwd_ms"] / old[k]["bwd_ms"] for k in both])
    t = np.array([total_ms(new[k]) / total_ms(old[k]) for k in both])
    q = lambda x: {"median": float(np.median(x)), "p10": float(np.percentile(x, 10)),  # noqa: E731
                   "p90": float(np.percentile(x, 90)), "max": float(x.max())}
    return {"calls": len(both), "fwd": q(f), "bwd": q(b), "fwd_bwd": q(t)}


def total_ms(e: dict) -> float:
    """A timed call's forward and backward milliseconds."""
    return e["fwd_ms"] + e["bwd_ms"]


def more_careful(new: dict, old: dict) -> bool:
    """Whether timing ``new`` of a call was made more carefully than ``old``: a warm-up where it had none,
    or the median of more runs, and neither less."""
    w_new, w_old = min(new.get("warmup", 0), 1), min(old.get("warmup", 1), 1)
    i_new, i_old = new.get("iters", 1), old.get("iters", 1)
    return w_new >= w_old and i_new >= i_old and (w_new, i_new) != (w_old, i_old)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("new", help="the cache the device session wrote")
    p.add_argument("--cache", default=str(RESULTS_DIR / "replay" / "times_h200.json"))
    p.add_argument("--datasets", default="pretrain,prolong",
                   help="the paper-protocol 3D settings whose calls are screened: comma-separated datasets")
    p.add_argument("--backend", default="torch_flash")
    p.add_argument("--limit", type=float, default=calls.UNWARMED_LIMIT)
    p.add_argument("--dropped-out", default=None,
                   help="write the dropped keys here (a JSON list), for `bench_replay.py time --retime-keys`")
    p.add_argument("--replace-unpooled", action="store_true",
                   help="calls the copy timed again after reserving the pool (`bench_replay.py time "
                        "--retime-unpooled`) replace committed timings made without one")
    p.add_argument("--note", default="", help="a line for this run's meta_runs entry (what it was for)")
    p.add_argument("--check-out", default=str(RESULTS_DIR / "replay" / "warmup_check.json"))
    a = p.parse_args(argv)
    if a.limit <= 1:
        p.error(f"--limit must be > 1 (a multiple of the kernel table's time), got {a.limit}")
    datasets = [d for d in a.datasets.split(",") if d]
    if not datasets or set(datasets) - set(protocol.PAPER_DISTS):
        p.error(f"--datasets must name some of {', '.join(protocol.PAPER_DISTS)}, got {a.datasets!r}")
    for name, path in (("the new cache", a.new), ("--cache", a.cache)):
        if not Path(path).is_file():
            p.error(f"{name} {path!r} is not a file: give the cache a `bench_replay.py time` run wrote")
    cache_path = Path(a.cache)
    cache, new = json.loads(cache_path.read_text()), json.loads(Path(a.new).read_text())
    old_t, new_t = cache["times"], new["times"]
    added = {k: e for k, e in new_t.items() if k not in old_t}
    rates = rp.link_rates(load_result("comm_overlap_probe_2xh200_nvlink.json"),
                          load_result("comm_overlap_probe_2xh200_inter-node-like.json"))
    cost = MeasuredCost.load(RESULTS_DIR / "kernel_profile_h200.json", a.backend)
    todo = [s for d in datasets for s in protocol.paper_3d(d)]
    outliers = calls.unwarmed_outliers(todo, added, cost, a.backend, rates, a.limit)
    for k in outliers:
        added.pop(k)
    check = warmup_check(old_t, new_t)
    old_t.update(added)
    replaced = {k: e for k, e in new_t.items() if a.replace_unpooled and k in old_t and "reserve_gib" in e
                and "reserve_gib" not in old_t[k] and not old_t[k].get("modelled")}
    kept = sorted(k for k, e in replaced.items() if e.get("warmup") == 0 and total_ms(e) > a.limit * total_ms(
        old_t[k]))                          # a first run's outlier against the same call's own timing
    for k in kept:
        replaced.pop(k)
    outliers += kept
    rewarmed = {k: e for k, e in new_t.items() if k in old_t and k not in replaced and e != old_t[k]
                and more_careful(e, old_t[k]) and ("reserve_gib" in e) == ("reserve_gib" in old_t[k])}
    replaced.update(rewarmed)
    ratio = {f: float(np.median([e[f"{f}_ms"] / old_t[k][f"{f}_ms"] for k, e in replaced.items()]))
             for f in ("fwd", "bwd")} if replaced else {}
    old_t.update(replaced)
    cache.setdefault("meta_runs", []).append({
        **new.get("meta", {}), "screened": f"paper3d {a.datasets}", "backend": a.backend, "added": len(added),
        "dropped_outliers": outliers, "warmup": sorted({e.get("warmup", 1) for e in added.values()}),
        "reserve_gib": sorted({e.get("reserve_gib", 0) for e in added.values()}),
        **({"note": a.note} if a.note else {}),
        **({"replaced_unpooled": len(replaced) - len(rewarmed), "replaced_rewarmed": len(rewarmed),
            "replaced_new_over_old_median": ratio} if replaced else {})})
    atomic_write_json(cache_path, cache)
    print(f"{len(added)} calls added to {cache_path}; {len(outliers)} first-run outliers dropped (over "
          f"{a.limit}x the table, or a replaced call's committed time)")
    if replaced:
        n_pool = len(replaced) - len(rewarmed)
        print(f"{n_pool} timings made without a reserved pool and {len(rewarmed)} timed again more carefully "
              f"replaced; new / old medians forward {ratio['fwd']:.3f}, backward {ratio['bwd']:.3f}")
    if outliers and a.dropped_out:
        Path(a.dropped_out).write_text(json.dumps(outliers, indent=0))
        print(f"their keys: {a.dropped_out}; time them again with a warm-up (bench_replay.py time --warmup 1 "
              f"--retime-keys {a.dropped_out}) and merge that run")
    if check:
        save_result(Path(a.check_out), {"new": Path(a.new).name, "meta": new.get("meta", {})}, check)
        print(f"warm-up check on {check['calls']} calls timed both ways: unwarmed / warmed forward "
              f"{check['fwd']['median']:.3f}, backward {check['bwd']['median']:.3f} (medians)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The what-if against the scale replay on every committed 3D setting.

Writes ``results/replay/whatif_vs_replay.json``.

For each committed family of 3D replays (``replay_3d_*_3d.json``: FA4; ``*_3d_fa2.json``: FA2,
the kernel timed call by call; ``*_paper*.json``: the paper's protocol), the kernel table's correction is
the call model fitted on the timed server calls of its settings' batches
(:func:`cadlib.analysis.replay.calls.call_model`), or under the paper's protocol the one the replay
priced its untimed calls with (:data:`cadlib.analysis.whatif.errors.PROTOCOLS`); then every setting is
priced as the what-if prices (:mod:`cadlib.analysis.whatif.price`) and compared with the replay
(:func:`cadlib.analysis.whatif.errors.compare`): step errors per method, speedup and saving errors of CAD
with ping-pong over each baseline, and under the paper's protocol the same over the batches it timed call
by call. The replay's own error against the measured runs is recorded beside them. Host only, no torch
(minutes).

    python scripts/analyses/whatif_vs_replay.py
    python scripts/analyses/whatif_vs_replay.py --only 128k --out /tmp/w.json
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import time

from cadlib.analysis.replay import calls
from cadlib.analysis.replay import phases as rp
from cadlib.analysis.whatif import errors, price
from cadlib.infra.results import RESULTS_DIR, load_result, save_result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(price.ERRORS_FILE))
    p.add_argument("--only", default="", help="only the files whose name contains this")
    p.add_argument("--families", default=",".join(errors.PROTOCOLS), help="comma-separated: "
                   + ", ".join(errors.PROTOCOLS))
    p.add_argument("--scale-batches", type=int, default=None,
                   help="batches per setting the scales are fitted on (default: all of them; 2 before "
                        "2026-12-04)")
    a = p.parse_args(argv)
    rates = rp.link_rates(load_result("comm_overlap_probe_2xh200_nvlink.json"),
                          load_result("comm_overlap_probe_2xh200_inter-node-like.json"))
    times = price.load_times()
    out = {"scale": {}, "families": {}, "replay_error": errors.replay_error()}
    t0 = time.perf_counter()
    for fam in a.families.split(","):
        pattern, backend, mode = errors.PROTOCOLS[fam]
        files = [f for f in sorted(glob.glob(str(RESULTS_DIR / pattern))) if a.only in f]
        if not files:
            print(f"{fam}: no committed file ({pattern})")
            continue
        backend = backend or load_result(files[0])["config"]["backend"]
        cost = price.load_cost(backend=backend)
        settings = [errors.setting_of(load_result(f)["config"]) for f in files]
        nb = a.scale_batches or max(s.batches for s in settings)
        if mode == "replay":
            per_file = {os.path.basename(f): errors.replay_pricing(load_result(f)["config"]) or {"all": 1.0}
                        for f in files}
            sc = {"scale": {"all": sum(v["all"] for v in per_file.values()) / len(per_file)},
                  "per_file": per_file, "calls": {}, "backend": backend, "mode": mode}
        else:
            sc = {**price.kernel_scales(settings, times, cost, backend, rates, nb), "mode": mode}
            sc["per_method"] = sc["scale"]              # the earlier rule, kept for the record
            sc["scale"] = {"all": sc["scale"]["all"],
                           "call_model": calls.call_model(settings, times, cost, backend, rates, nb)}
        print(f"{fam} ({backend}): scales {sc['scale']} ({mode}) over {sc['calls']} calls", flush=True)
        rows = []
        for f in files:
            scale = sc["per_file"][os.path.basename(f)] if mode == "replay" else sc["scale"]
            r = errors.compare(f, price.pricing(times, cost, backend, scale, linear=""), rates)
            rows += r
            cad = next((x for x in r if x["method"] == errors.CAD), {})
            errs = " ".join(f"{x['method']} {x['step_err']:+.3f}" for x in r)
            print(f"  {r[0]['setting']}: steps {errs}; "
                  f"CAD x WLB {cad.get('speedup_over_wlb_err', float('nan')):+.3f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        if mode == "fit":                              # the scales a user's what-if prices with
            out["scale"].setdefault(backend, {**sc["scale"], "calls": sc["calls"], "fitted_on": fam})
        out["families"][fam] = {"backend": backend, "scale": sc, "summary": errors.summary(rows),
                                "rows": rows}
        print(f"{fam}: {out['families'][fam]['summary']}", flush=True)
    for b, v in out["scale"].items():                  # the shape price.committed_scale reads
        out["scale"][b] = {"scale": {k: x for k, x in v.items() if k not in ("calls", "fitted_on")},
                           "calls": v["calls"], "fitted_on": v["fitted_on"]}
    save_result(a.out, {"times": str(price.TIMES_FILE.relative_to(RESULTS_DIR.parent)),
                        "kernels": str(price.KERNELS_FILE.relative_to(RESULTS_DIR.parent)),
                        "families": a.families, "only": a.only, "scale_batches": a.scale_batches,
                        "rates_gbps": rates, "validation": errors.VALIDATION_GLOB}, out)
    print(f"wrote {a.out} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

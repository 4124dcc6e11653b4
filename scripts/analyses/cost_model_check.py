"""What the measured kernel cost model buys, on the committed end-to-end runs.

For every committed ``results/bench_e2e_*.json`` and every batch, the batch's layout and plans are
rebuilt exactly as ``cadlib.train`` built them (:func:`cadlib.analysis.runs.cost_check.rebuild_plans`; the
rebuilt plan's imbalance is checked against the one the run recorded) and compared
(:func:`cadlib.analysis.runs.cost_check.e2e_check`):

* method ``cad`` (one plan per batch): the imbalance (max / mean over ranks) of the measured
  attention time, against the pair-count model's (``plan.imbalance()``, what the scheduler balances) and the
  measured kernel model's (:meth:`cadlib.core.measured.MeasuredCost.server_seconds` with
  ``results/kernel_profile_h200.json``);
* CAD with ping-pong: the measured speedup over colocated against the committed prediction
  (``predicted_speedup``: pairs at colocated's measured seconds per FLOP) and the same prediction
  with the attention priced by the kernel table on ping-pong's two nano-batch plans;
* the server's time outside its kernel (:func:`cadlib.analysis.runs.cost_check.server_overhead_fit`): the
  measured attention of every (batch, rank) against the kernel model plus a cost per query and KV row the
  server gathers (a server that sent rows away gathers the rest; one that did not reads in place).

Host only (CPU, a few seconds).

    python scripts/analyses/cost_model_check.py                     # results/cost_model_check.json
    python scripts/analyses/cost_model_check.py --out /tmp/cmc.json --pattern 'bench_e2e_2x_uniform_*.json'
"""
from __future__ import annotations

import argparse
from pathlib import Path

from cadlib.analysis.runs.cost_check import e2e_check, e2e_check_summary, server_overhead_fit
from cadlib.analysis.runs.e2e import load_committed
from cadlib.core.measured import MeasuredCost
from cadlib.infra.results import REPO_ROOT, RESULTS_DIR, save_result

SPEEDUP_TARGET = 0.10
"""The target for the simulator's step-time error against the measured runs."""


def _repo_path(path) -> str:
    """``path`` relative to the repository when inside it (what a result file records), else absolute."""
    path = Path(path).resolve()
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", default=str(RESULTS_DIR / "kernel_profile_h200.json"),
                    help="kernel latency table (scripts/bench/profile_kernels.py)")
    ap.add_argument("--backend", default="fa4", help="backend of the table (the end-to-end runs' kernel)")
    ap.add_argument("--pattern", default="bench_e2e_*.json",
                    help="end-to-end result files under --results-dir")
    ap.add_argument("--results-dir", default=None, help="default: this repository's results/")
    ap.add_argument("--out", default=None, help="default: results/cost_model_check.json")
    args = ap.parse_args(argv)
    cost = MeasuredCost.load(args.table, args.backend)
    items = load_committed(args.pattern, args.results_dir)
    if not items:
        ap.error(f"no end-to-end result files match {args.pattern!r}")
    rows = [r for item in items for r in e2e_check(item, cost)]
    summary = e2e_check_summary(rows)
    for s in summary:
        line = (f"{s['setting']:<34} imbalance MAE: pairs {s['mae_imbalance_pairs']:.4f}, "
                f"measured model {s['mae_imbalance_model']:.4f}")
        if "speedup_err_default_mean" in s:
            line += (f" | speedup error: default {s['speedup_err_default_mean']:.2%} "
                     f"(max {s['speedup_err_default_max']:.2%}), measured model "
                     f"{s['speedup_err_model_mean']:.2%} (max {s['speedup_err_model_max']:.2%})")
        print(line)
    fit = server_overhead_fit(rows)
    print(f"measured attention per rank vs the kernel model: rms {fit['rms_ms_alone']:.1f} ms "
          f"({fit['rms_rel_alone']:.1%}); with {fit['ns_per_q_row']:.0f} ns per gathered query row and "
          f"{fit['ns_per_kv_row']:.0f} ns per gathered KV row (per layer, fwd+bwd): "
          f"rms {fit['rms_ms']:.1f} ms "
          f"({fit['rms_rel']:.1%}), over {fit['points']} (batch, rank) pairs")
    within = all(s.get(f"speedup_err_{k}_max", 0) <= SPEEDUP_TARGET
                 for s in summary for k in ("default", "model"))
    print(f"every batch's speedup within {SPEEDUP_TARGET:.0%} of the measured one, both models: {within}")
    table = _repo_path(args.table)
    config = {**vars(args), "table": table, "backend": cost.backend,
              "inputs": [_repo_path(Path(args.results_dir or RESULTS_DIR) / i["file"]) for i in items]
              + [table],
              "speedup_target": SPEEDUP_TARGET}
    path = Path(args.out) if args.out else RESULTS_DIR / "cost_model_check.json"
    save_result(path, config, {"summary": summary, "per_batch": rows, "speedups_within_target": within,
                               "server_overhead_fit": fit})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

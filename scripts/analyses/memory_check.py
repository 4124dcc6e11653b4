"""The memory model (``cadlib.core.memory``) against every committed measured peak, and what it says
about the paper's memory: ``results/memory_model_check.json``.

* ``summary``: per (file, method) of ``results/bench_e2e_*.json``, the measured peak (the run's
  ``peak_mem_gib``: the max over batches and ranks of ``torch.cuda.max_memory_allocated``) and the
  model's for the same batches (profile ``cadlib``, rows rebuilt from each batch's layouts and
  plans: :mod:`cadlib.analysis.runs.memory_check`), their error, the worst error of any (batch,
  rank); ``records``: every (file, method, batch, rank) as ``[measured GiB, model GiB, moment]``;
* ``divergence``: WLB-ideal's peak memory max / mean over ranks, measured and modelled on the runs,
  and modelled in Figure 4a's setting (512K-token chunks, 512K MaxDocLen, TP = 8, DP 2-8; our
  balanced packing, profile ``megatron``) against the paper's 1.08-1.17;
* ``paper_tokens``: Table 3's tokens per node against the most the baseline (per CP degree) and CAD
  fit in 140 GiB; ``table4``: Table 4's configurations that fit, per method.

Host only, no torch (a few seconds).

    python scripts/analyses/memory_check.py                   # results/memory_model_check.json
    python scripts/analyses/memory_check.py --out /tmp/m.json --pattern 'bench_e2e_1x_*.json'
"""
from __future__ import annotations

import argparse
import sys

from cadlib.analysis.runs.e2e import load_committed
from cadlib.analysis.runs.memory_check import (TARGET, check_item, divergence,
                                               measured_divergence, paper_tokens, summarise, table4)
from cadlib.core.paper import CLAIMS
from cadlib.infra.results import RESULTS_DIR, save_result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pattern", default="bench_e2e_*.json")
    p.add_argument("--out", default=str(RESULTS_DIR / "memory_model_check.json"))
    p.add_argument("--batches", type=int, default=10, help="sampled batches per Figure 4a setting")
    args = p.parse_args(argv)
    rows = [r for item in load_committed(args.pattern) for r in check_item(item)]
    if not rows:
        p.error(f"no committed run matches {args.pattern!r}")
    summary = summarise(rows)
    worst = max(abs(r["err"]) for r in rows)
    claim = CLAIMS["distca.memory_divergence"]
    fig4 = [divergence(d, dp, n_batches=args.batches) for d in ("pretrain", "prolong") for dp in (2, 4, 8)]
    results = {
        "max_abs_err": max(abs(s["err"]) for s in summary), "max_abs_record_err": worst,
        "within_target": worst <= TARGET, "summary": summary,
        "records": [[r["file"], r["method"], r["batch"], r["rank"], round(r["measured_gib"], 4),
                     round(r["model_gib"], 4), r["moment"]] for r in rows],
        "divergence": {"paper": list(claim.paper), "runs": measured_divergence(rows), "figure4a": fig4},
        "paper_tokens": paper_tokens(), "table4": table4()}
    save_result(args.out, {"pattern": args.pattern, "profile": "cadlib", "target": TARGET,
                           "records_columns": ["file", "method", "batch", "rank", "measured_gib",
                                               "model_gib", "moment"]}, results)
    for s in summary:
        print(f"{s['file']:55s} {s['method']:13s} measured {s['measured_peak_gib']:6.2f} GiB  model "
              f"{s['model_peak_gib']:6.2f}  err {s['err']:+.3f}  worst record {s['worst_record_err']:+.3f}")
    print(f"max |err| per (file, method) {results['max_abs_err']:.3f}, per record {worst:.3f} "
          f"(target {TARGET}) -> {args.out}")
    return 0 if worst <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())

"""A calibration (``python -m cadlib.calibrate``) beside the committed H200 grids: every kernel point and
linear, head and optimizer entry both hold, ``ratio = calibration / committed``, and per kind the
fraction within 5% (:func:`cadlib.analysis.whatif.gpu_table.compare`). Host only, no torch.

    python scripts/analyses/check_calibration.py mygpu.json                    # prints the summary
    python scripts/analyses/check_calibration.py $OUT/calibration_h200.json --out $OUT/calibration_check.json

Exit 0 when every kind's time-weighted error is within ``--within`` (the issue's bar: the table
reproduces the committed grid within 5%; a step priced from it is a sum of these times), 1 otherwise,
2 when the file cannot be read. The fraction of single entries within ``--within`` is printed beside it:
sub-millisecond kernel points and the 4K-token linear points carry launch noise of 10-90%.
"""
from __future__ import annotations

import argparse
import sys

from cadlib.analysis.whatif.gpu_table import GpuTableError, compare, load
from cadlib.infra.results import RESULTS_DIR, load_result, save_result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("table", help="the calibration file")
    ap.add_argument("--kernel-ref", default=str(RESULTS_DIR / "kernel_profile_h200.json"))
    ap.add_argument("--times-ref", default=str(RESULTS_DIR / "replay" / "times_h200.json"))
    ap.add_argument("--within", type=float, default=0.05, help="relative tolerance of one entry")
    ap.add_argument("--out", default=None, help="write every entry's ratio here (JSON)")
    a = ap.parse_args(argv)
    try:
        table = load(a.table)
    except GpuTableError as e:
        print(e, file=sys.stderr)
        return 2
    res = compare(table, load_result(a.kernel_ref), load_result(a.times_ref)["times"], a.within)
    print(f"{table.label()} against {a.kernel_ref} and {a.times_ref} (within {a.within:.0%}):")
    for kind, s in res["summary"].items():
        if s["entries"]:
            print(f"  {kind:>9}: time-weighted error {s['time_weighted_err']:.1%}; {s['within']:4d} of "
                  f"{s['entries']:4d} entries within ({s['fraction_within']:.0%}), median ratio "
                  f"{s['median_ratio']:.3f}")
    worst = sorted(res["rows"], key=lambda r: -abs(r["ratio"] - 1))[:5]
    for r in worst:
        print(f"  worst: {r['kind']} {r['key']} {r['field']}: {r['ours_ms']:.3f} / {r['ref_ms']:.3f} ms "
              f"= {r['ratio']:.3f}")
    if a.out:
        save_result(a.out, {"table": a.table, "table_meta": table.meta, "kernel_ref": a.kernel_ref,
                            "times_ref": a.times_ref, "within": a.within}, res)
    if res["summary"]["all"]["fraction_within"] is None:
        print("no entry in common with the committed grids (another model, TP or kernel)")
        return 1
    return 0 if all(s["time_weighted_err"] <= a.within for s in res["summary"].values() if s["entries"]) else 1


if __name__ == "__main__":
    sys.exit(main())

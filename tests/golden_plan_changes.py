"""Which golden plan fingerprints a change of the scheduler changes, and by how much.

Compares the fingerprints of ``tests/golden/plans.json`` (``--before``: that file as committed, or
another copy of it; run this before regenerating it) with the ones the code computes now
(``tests/golden_plans.py``): every committed end-to-end batch (its ``cad``, ``colocated`` and
nano-batch plans) and every case of the 432-case scheduler grid (``equal_flops``, ``cad_noguard``,
``cad``, ``distca``). Lists each plan fingerprint that differs with its ``forward_bytes``,
``total_bytes`` and ``imbalance`` (and ``n_moves``, ``reached``, ``guard``) before and after, and
summarises: how many plans changed, per kind; the ratio after/before of forward and total bytes,
min/median/max; the grid's ratio to ``equal_flops`` before and after; where ``cad`` (the guarded
scheduler) now moves more forward bytes than before, or than ``equal_flops`` in the same grid case;
and any other fingerprint (documents, layouts, nano-batch rows) that differs.

    python tests/golden_plan_changes.py --out results/scheduler_simplified_plan_changes.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import golden_plans

from cadlib.infra.results import save_result

ROOT = Path(__file__).resolve().parents[1]

FIELDS = ("forward_bytes", "total_bytes", "imbalance", "n_moves", "reached", "guard")


def plan_prints(tree, path=()):
    """``(path, fingerprint)`` of every plan fingerprint (a dict with ``tasks``) in ``tree``."""
    if isinstance(tree, dict):
        if "tasks" in tree:
            yield path, tree
            return
        for k in sorted(tree):
            yield from plan_prints(tree[k], path + (str(k),))
    elif isinstance(tree, list):
        for i, x in enumerate(tree):
            yield from plan_prints(x, path + (str(i),))


def other_prints(tree, path=()):
    """``(path, value)`` of every fingerprint that is not part of a plan's."""
    if isinstance(tree, dict):
        if "tasks" in tree:
            return
        for k in sorted(tree):
            yield from other_prints(tree[k], path + (str(k),))
    elif isinstance(tree, list) and any(isinstance(x, (dict, list)) for x in tree):
        for i, x in enumerate(tree):
            yield from other_prints(x, path + (str(i),))
    else:
        yield path, tree


def kind(path) -> str:
    """``grid <method>``, ``e2e cad``, ``e2e colocated`` or ``e2e nano``."""
    if path[0] == "grid":
        return f"grid {path[2]}"
    return "e2e nano" if path[3] == "nano_plans" else f"e2e {path[3]}"


def _stats(x) -> dict:
    return {"min": min(x), "median": statistics.median(x), "max": max(x)} if x else {}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", default=str(golden_plans.GOLDEN), help="the fingerprints before (plans.json)")
    ap.add_argument("--after", default=None, help="fingerprints after (default: computed now)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    before = json.loads(Path(args.before).read_text())
    t = time.perf_counter()
    after = (json.loads(Path(args.after).read_text()) if args.after
             else json.loads(json.dumps(golden_plans.compute(), sort_keys=True)))
    seconds = time.perf_counter() - t
    b, a = dict(plan_prints(before)), dict(plan_prints(after))
    assert set(b) == set(a), "the fingerprints cover different plans"
    changes = []
    for p in sorted(b):
        if b[p] != a[p]:
            changes.append({"plan": " / ".join(p), "kind": kind(p),
                            "before": {f: b[p].get(f) for f in FIELDS},
                            "after": {f: a[p].get(f) for f in FIELDS}})
    others = [" / ".join(p) for (p, v), (_, w) in zip(other_prints(before), other_prints(after)) if v != w]

    def ratio(c, f):
        return c["after"][f] / c["before"][f] if c["before"][f] else (1.0 if not c["after"][f] else None)

    kinds = sorted({kind(p) for p in b})
    more_than_before = [c["plan"] for c in changes if c["kind"] in ("grid cad", "e2e cad")
                        and c["after"]["forward_bytes"] > c["before"]["forward_bytes"]]
    more_than_eq = []
    for key, cases in after["grid"].items():
        if cases["cad"]["forward_bytes"] > cases["equal_flops"]["forward_bytes"]:
            more_than_eq.append(f"grid / {key}")
    noguard_more_than_eq = {
        which: sum(c["cad_noguard"]["forward_bytes"] > c["equal_flops"]["forward_bytes"]
                   for c in tree["grid"].values())
        for which, tree in (("before", before), ("after", after))}
    to_eq = {which: {m: _stats([c[m]["forward_bytes"] / c["equal_flops"]["forward_bytes"]
                               if c["equal_flops"]["forward_bytes"] else 1.0 for c in tree["grid"].values()])
                     for m in ("cad_noguard", "cad")}
             for which, tree in (("before", before), ("after", after))}
    guard_used = {which: sum(bool(c["cad"].get("guard")) for c in tree["grid"].values())
                  for which, tree in (("before", before), ("after", after))}
    summary = {
        "plans": len(b), "plans_changed": len(changes),
        "per_kind": {k: {"plans": sum(kind(p) == k for p in b),
                         "changed": sum(c["kind"] == k for c in changes)} for k in kinds},
        "forward_bytes_ratio_after_before": _stats([r for c in changes if (r := ratio(c, "forward_bytes"))
                                                    is not None]),
        "total_bytes_ratio_after_before": _stats([r for c in changes if (r := ratio(c, "total_bytes"))
                                                  is not None]),
        "forward_bytes_ratio_per_kind": {
            k: _stats([r for c in changes if c["kind"] == k and (r := ratio(c, "forward_bytes")) is not None])
            for k in kinds if any(c["kind"] == k for c in changes)},
        "grid_forward_bytes_ratio_to_equal_flops": to_eq,
        "n_cad_more_forward_bytes_than_before": len(more_than_before),
        "cad_more_forward_bytes_than_before": more_than_before,
        "cad_more_forward_bytes_than_equal_flops": more_than_eq,
        "grid_cad_noguard_more_forward_bytes_than_equal_flops": noguard_more_than_eq,
        "grid_cad_guard_used": guard_used,
        "other_fingerprints_changed": others,
        "what": "a plan changed when any of its fingerprint's fields did (tasks, token matrices, bytes, "
                "imbalance, moves, dispatch sizes); ratios over the changed plans; cad is the guarded "
                "scheduler (schedule), cad_noguard the greedy alone"}
    print(json.dumps(summary, indent=1))
    save_result(args.out, {"before": str(Path(args.before).resolve().relative_to(ROOT))
                           if Path(args.before).resolve().is_relative_to(ROOT) else args.before,
                           "after": args.after or "computed", "compute_seconds": round(seconds, 1)},
                changes, summary=summary)
    print("wrote", args.out)


if __name__ == "__main__":
    main()

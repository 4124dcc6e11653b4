"""The answer the report opens with: a few rows that say what reproduced and what did not, and one
figure of every claim's ours against the paper's figure. Both are read off the claims table
(:func:`cadlib.analysis.report.claims.claims_table`), so they never disagree with it."""

from __future__ import annotations

from ...core.paper import CLAIMS
from ..figures.plots import claims_chart

HEADLINE = (
    ("distca.idle_dp8", "Do equal token budgets leave GPUs idle? (DP=8, 512K context, simulated)"),
    (
        "distca.scheduler_bytes",
        "Does the scheduler balance attention with fewer bytes than bytes-blind balancing?",
    ),
    ("distca.composability", "Does one fused call over many CA-tasks keep the kernel's throughput?"),
    ("distca.comm_hidden", "Does ping-pong hide CAD's communication? (2x H200)"),
    ("distca.speedup_3d_pretrain",
     "Is CAD faster end to end than the best baseline? (64-256 GPUs, replayed on one H200)"),
)
"""The questions of the headline block, each answered by one claim's row."""
GOOD = ("holds", "within")


def headline_rows(table: list[dict]) -> list[dict]:
    """The headline block: one row per :data:`HEADLINE` question (``question``, ``verdict``, ``ours``,
    ``paper``, ``why``, ``claim``), then one row counting the claims that are not reproduced because
    this workbook cannot run them (more GPUs than lent, a larger model), with each claim's reason (its
    ``gap`` up to the parenthesis) once."""
    by_id = {r["claim"]: r for r in table}
    out = [
        {"question": q, "claim": cid, **{k: by_id[cid][k] for k in ("verdict", "ours", "paper", "why")}}
        for cid, q in HEADLINE
        if cid in by_id
    ]
    gap = [r for r in table if r["verdict"] == "not reproduced" and CLAIMS[r["claim"]].gap]
    if gap:
        reasons = dict.fromkeys(CLAIMS[r["claim"]].gap.split(" (")[0] for r in gap)   # each once, in order
        out.append(
            {
                "question": f"The {len(gap)} claims that need more GPUs than lent here "
                            f"({', '.join(r['claim'].split('.', 1)[-1] for r in gap)})",
                "claim": ", ".join(r["claim"] for r in gap),
                "verdict": "not reproduced",
                "ours": "—",
                "paper": ", ".join(r["paper"] for r in gap),
                "why": "; ".join(reasons),
            }
        )
    return out


def hero_points(table: list[dict]) -> list[dict]:
    """Every claim of ``table`` with a verdict other than ``not reproduced`` as a point of the hero
    figure: ``claim``, ``verdict``, ``ratio`` (ours over the paper's figure: over its nearer end for a
    range; 1 where ours is within it or a qualitative claim holds) and ``label``."""
    pts = []
    for r in table:
        c = CLAIMS[r["claim"]]
        v = r.get("value")
        if r["verdict"] == "not reproduced":
            continue
        if r["verdict"] in GOOD or v is None or c.paper is None:
            ratio = 1.0
        else:
            ref = c.high if r["verdict"] == "above" else c.low
            ratio = v / ref if ref else 1.0
        pts.append(
            {
                "claim": r["claim"],
                "verdict": r["verdict"],
                "ratio": float(ratio),
                "label": f"ours {r['ours']} vs paper {r['paper']}",
            }
        )
    return pts


def hero_figure(table: list[dict]):
    """Ours against the paper for every claim that was checked: 1 is the paper (inside its range), left
    of it below, right of it above (log axis)."""
    n_missing = sum(r["verdict"] == "not reproduced" for r in table)
    return claims_chart(
        hero_points(table),
        title=f"Ours against the paper, {len(table) - n_missing} of "
        f"{len(table)} claims checked ({n_missing} not reproduced, not drawn)",
    )

"""The answer the report opens with: a few questions, each answered by the claims table's rows (or,
for what two GPUs measured, the committed end-to-end runs), with the evidence behind the answer and its
scale; and one figure of every claim's ours against the paper's figure. Both are read off the claims
table (:func:`cadlib.analysis.report.claims.claims_table`), so they never disagree with it."""

from __future__ import annotations

from typing import NamedTuple

from ...core.paper import CLAIMS
from ..figures.plots import claims_chart
from . import claims as claims_mod
from .verdicts import answer, combine


class Question(NamedTuple):
    """One row of the answer block: the ``question``, the claims that answer it, the ``scale`` of the
    evidence in words, and ``measured``: read the committed 2x H200 end-to-end runs instead of the
    table's row (the table keeps the setting closest to the paper's, which may be replayed)."""

    question: str
    claims: tuple[str, ...]
    scale: str
    measured: bool = False


HEADLINE = (
    Question("Do equal token budgets leave GPUs idle?", ("distca.idle_dp4", "distca.idle_dp8"),
             "DP=4 and 8, 512K-token chunks"),
    Question("Does the scheduler balance attention with fewer bytes than bytes-blind balancing?",
             ("distca.scheduler_bytes",), "16 sampled batches, 8 ranks"),
    Question("Does one fused call over many CA-tasks keep the kernel's throughput?",
             ("distca.composability",), "one GPU, 128-2048-token shards"),
    Question("Does ping-pong hide CAD's communication?", ("distca.comm_hidden",),
             "2 GPUs, 64K-128K tokens per GPU", measured=True),
    Question("Does ping-pong hide CAD's communication at the paper's scale?", ("distca.comm_hidden",),
             "the paper's 64-256-GPU settings"),
    Question("Is CAD faster end to end than WLB-ideal?",
             ("distca.speedup_3d_pretrain", "distca.speedup_3d_prolong"),
             "the paper's 3D settings, 64-256 GPUs, Pretrain and ProLong"),
    Question("Is CAD faster end to end on two GPUs?",
             ("distca.speedup_3d_pretrain", "distca.speedup_3d_prolong"),
             "2 GPUs, 64K-128K tokens per GPU", measured=True),
)
"""The questions of the answer block."""
GOOD = ("reproduced",)
SHORT = {"distca.idle_dp4": "DP=4", "distca.idle_dp8": "DP=8", "distca.speedup_3d_pretrain": "Pretrain",
         "distca.speedup_3d_prolong": "ProLong"}
"""How a row names its claim where one question has several."""


def _short(cid: str, many: bool) -> str:
    return f"{SHORT.get(cid, cid.split('.', 1)[-1])} " if many else ""


def evidence_kind(kind: str) -> str:
    """A row's ``kind`` as the answer block names its evidence: ``measured on 2x H200``, ``replayed on
    1x H200``, ``simulated``, ``computed``."""
    kind = str(kind).split(" (")[0]
    if kind == "replayed":
        return "replayed on 1x H200"
    return kind.replace("NVIDIA ", "")


def _measured(q: Question, results_dir=None) -> dict | None:
    """A measured question's row from the committed 2x H200 runs (control runs left out): ours as the
    range over settings, answered by its worse end."""
    rows = [r for r in claims_mod.e2e_ours(results_dir)
            if r["claim"] in q.claims and not r["control"] and "_2gpu_" in r["setting"]]
    if not rows:
        return None
    said, ours, whys = [], [], []
    for cid in q.claims:
        got = [r for r in rows if r["claim"] == cid]
        if not got:
            continue
        c = CLAIMS[cid]
        lo, hi = min(r["ours"] for r in got), max(r["ours"] for r in got)
        worst = hi if c.high is not None and (c.low is None or hi > c.high) else lo
        word, why = claims_mod.judge(c, worst)
        reason = next((r["reason"] for r in got if r["reason"]), "")
        a, why = answer(word, "; ".join(s for s in (why, reason) if s), cid, worst)
        said.append(a)
        name = _short(cid, len(q.claims) > 1)
        a_, b_ = f"{lo:.3g}", f"{hi:.3g}"
        ours.append(f"{name}{a_}-{b_}{c.unit}" if a_ != b_ else f"{name}{a_}{c.unit}")
        whys.append(name + why if why else "")
    return {"question": q.question, "claim": ", ".join(q.claims), "verdict": combine(said),
            "evidence": f"measured on 2x H200, {q.scale}", "ours": "; ".join(ours),
            "paper": ", ".join(CLAIMS[c].paper_str() for c in q.claims),
            "why": "; ".join(w for w in whys if w)}


def headline_rows(table: list[dict], results_dir=None) -> list[dict]:
    """The answer block: one row per :data:`HEADLINE` question (``question``, ``evidence``, ``verdict``,
    ``ours``, ``paper``, ``why``, ``claim``), then one row counting the claims that are not reproduced
    because this workbook cannot run them (more GPUs than lent, a larger model), with each claim's
    reason (its ``gap`` up to the parenthesis) once."""
    by_id = {r["claim"]: r for r in table}
    out = []
    for q in HEADLINE:
        if q.measured:
            row = _measured(q, results_dir)
            if row:
                out.append(row)
            continue
        got = [by_id[c] for c in q.claims if c in by_id]
        got = [r for r in got if r["ours"] != "—"] or got      # a claim not run does not dilute one that ran
        if not got:
            continue
        many = len(got) > 1
        kinds = list(dict.fromkeys(evidence_kind(r["kind"]) for r in got))
        out.append({"question": q.question, "claim": ", ".join(r["claim"] for r in got),
                    "verdict": combine([r["verdict"] for r in got]),
                    "evidence": f"{' and '.join(kinds)}, {q.scale}",
                    "ours": "; ".join(_short(r["claim"], many) + r["ours"] for r in got),
                    "paper": ", ".join(r["paper"] for r in got),
                    "why": "; ".join(_short(r["claim"], many) + r["why"] for r in got if r["why"])})
    gap = [r for r in table
           if r["verdict"] in ("not reproduced", "not at this scale") and CLAIMS[r["claim"]].gap
           and r["ours"] == "—"]
    if gap:
        reasons = dict.fromkeys(CLAIMS[r["claim"]].gap.split(" (")[0] for r in gap)   # each once, in order
        out.append(
            {
                "question": f"The {len(gap)} claims that need more GPUs than lent here "
                            f"({', '.join(r['claim'].split('.', 1)[-1] for r in gap)})",
                "claim": ", ".join(r["claim"] for r in gap),
                "verdict": "not at this scale",
                "evidence": "none: not run",
                "ours": "—",
                "paper": ", ".join(r["paper"] for r in gap),
                "why": "; ".join(reasons),
            }
        )
    return out


def hero_points(table: list[dict]) -> list[dict]:
    """Every claim of ``table`` with a number of ours as a point of the hero figure: ``claim``,
    ``verdict`` (the answer), ``ratio`` (ours over the paper's figure: over its nearer end for a range;
    1 where ours is within it or a qualitative claim holds) and ``label``."""
    pts = []
    for r in table:
        c = CLAIMS[r["claim"]]
        v = r.get("value")
        direction = r.get("direction", r["verdict"])
        if r["ours"] == "—":
            continue
        if direction in ("holds", "within") or v is None or c.paper is None:
            ratio = 1.0
        else:
            ref = c.high if direction == "above" else c.low
            ratio = v / ref if ref else 1.0
        pts.append(
            {
                "claim": r["claim"],
                "verdict": r["verdict"],
                "ratio": float(ratio),
                "label": f"ours {r['ours']} vs paper {r['paper']} ({r['verdict']})",
            }
        )
    return pts


def hero_figure(table: list[dict]):
    """Ours against the paper for every claim that was checked: 1 is the paper (inside its range), left
    of it below, right of it above."""
    n_missing = sum(r["ours"] == "—" for r in table)
    return claims_chart(
        hero_points(table),
        title=f"Ours against the paper, {len(table) - n_missing} of "
        f"{len(table)} claims checked ({n_missing} not run here, not drawn)",
    )

"""How evenly each CP mechanism spreads attention, and the bytes it sends, from ``results/cp_balance.json``
(``scripts/analyses/cp_balance.py``: every mechanism laid out as it lays itself out on the same documents, CPU, no
timing) and from the ``volume`` suite of ``python -m cadlib.cp.check`` (the bytes each rank really hands to
``torch.distributed``, beside the closed forms of ``cadlib.cp.volume``).

The metrics are LongCA-bench's, per dispatch over the ``W`` ranks (``cadlib.cp.balance``)::

    max_mean = max_r area_r / mean_r area_r      1 when even
    area_entropy = -sum_r p_r ln p_r / ln W      1 when even      (p_r = area_r / sum area)

A mechanism with Ulysses groups of ``u`` ranks computes every head's share of a ring position's tokens on
each of its ``u`` ranks, so its areas are the ring's over ``W / u`` positions: the larger ``u``, the fewer
positions to fall unevenly on (:func:`heads_first`).
"""
from __future__ import annotations

import os
import pathlib

import pandas as pd

from ...infra.results import RESULTS_DIR, load_result

BALANCE_FILE = "cp_balance.json"
QUANTILED = ("area_entropy", "area_gini", "range_entropy", "range_gini", "max_total", "max_mean",
             "bytes_fwd_max", "bytes_bwd_max", "bytes_total")
"""The fields ``scripts/analyses/cp_balance.py`` gives as median and 20/80% quantiles over the draws."""
DOCUMENT_MASKS = ("causal_document", "full_document")


def load(results_dir: str | os.PathLike | None = None) -> tuple[pd.DataFrame | None, dict]:
    """``(rows, meta)`` of ``results/cp_balance.json``: one row per (mechanism, mask, world, tokens per
    GPU), each quantiled field as three columns (``max_mean``, ``max_mean_q20``, ``max_mean_q80``: the
    median and the 20/80% quantiles over the draws); ``(None, {})`` when the file is not committed."""
    path = pathlib.Path(results_dir or RESULTS_DIR) / BALANCE_FILE
    if not path.exists():
        return None, {}
    res = load_result(path)
    rows = []
    for r in res.get("results", []):
        flat = {k: v for k, v in r.items() if k not in QUANTILED}
        for k in QUANTILED:
            if isinstance(r.get(k), dict):
                flat.update({k: r[k]["median"], f"{k}_q20": r[k]["q20"], f"{k}_q80": r[k]["q80"]})
        rows.append(flat)
    return pd.DataFrame(rows), {**res.get("meta", {}), "config": res.get("config", {})}


def case(rows: pd.DataFrame, world: int, tokens_per_gpu: int) -> pd.DataFrame:
    """The rows of one (world, tokens per GPU), CAD's unsupported full-mask rows left out."""
    return rows[(rows.world == world) & (rows.tokens_per_gpu == tokens_per_gpu) & (rows.status == "ok")]


def metric_table(rows: pd.DataFrame, metric: str = "max_mean", band: bool = True) -> pd.DataFrame:
    """``metric`` per mask (rows) and mechanism (columns, in the file's order): ``median`` or, with ``band``
    and where the draws differ, ``median [q20-q80]``."""
    def text(r):
        lo, hi = r[f"{metric}_q20"], r[f"{metric}_q80"]
        return f"{r[metric]:.3g}" if not band or lo == hi else f"{r[metric]:.3g} [{lo:.3g}-{hi:.3g}]"
    order = list(dict.fromkeys(rows.mechanism))
    return (rows.assign(cell=rows.apply(text, axis=1))
            .pivot_table(index="mask", columns="mechanism", values="cell", aggfunc="first")
            .reindex(columns=[m for m in order if m in set(rows.mechanism)]))


def volume_table(rows: pd.DataFrame, unit: float = 2**20) -> pd.DataFrame:
    """Bytes the busiest rank sends forward and backward (closed forms, median over the draws), per mask
    and mechanism, in ``unit`` (MiB by default)."""
    order = list(dict.fromkeys(rows.mechanism))
    out = rows.assign(fwd=rows.bytes_fwd_max / unit, bwd=rows.bytes_bwd_max / unit)
    return (out.pivot_table(index="mask", columns="mechanism", values=["fwd", "bwd"], aggfunc="first")
            .reindex(columns=pd.MultiIndex.from_product([["fwd", "bwd"], [m for m in order
                                                                         if m in set(rows.mechanism)]])))


def heads_first(rows: pd.DataFrame) -> pd.DataFrame:
    """Per document-mask case (mask, world, tokens per GPU), the median max/mean area of each mechanism
    without a plan of its own (CAD left out; a column each, in order of its Ulysses group ``u``, the head
    parallelism, which ``u`` gives), and ``monotone``: whether the imbalance never grows as ``u`` grows,
    with ``u = W`` (Ulysses) at 1."""
    keep = rows[rows["mask"].isin(DOCUMENT_MASKS) & (rows.mechanism != "cad") & (rows.status == "ok")]
    out, order = [], {}
    for (mask, world, tpg), g in keep.groupby(["mask", "world", "tokens_per_gpu"], sort=True):
        g = g.sort_values(["ulysses_size", "max_mean"], ascending=[True, False])
        mm = g.max_mean.to_numpy()
        full_heads = g[g.ulysses_size == world].max_mean
        order.update(dict.fromkeys(g.mechanism))
        out.append({"mask": mask, "world": int(world), "tokens_per_gpu": int(tpg),
                    "u": ", ".join(str(int(u)) for u in g.ulysses_size), **dict(zip(g.mechanism, mm.tolist())),
                    "monotone": bool((mm[1:] <= mm[:-1] + 1e-12).all() and len(full_heads) > 0
                                     and abs(float(full_heads.max()) - 1) < 1e-9)})
    return pd.DataFrame(out, columns=["mask", "world", "tokens_per_gpu", *order, "u", "monotone"])


def draw_spread(rows: pd.DataFrame, mechanism: str = "ring") -> pd.DataFrame:
    """``mechanism``'s max/mean area per (mask, world, tokens per GPU): median and the 20-80% band over
    the draws (one draw, no band, on the one-document masks)."""
    d = rows[(rows.mechanism == mechanism) & (rows.status == "ok")]
    cols = ["mask", "world", "tokens_per_gpu", "draws", "max_mean", "max_mean_q20", "max_mean_q80"]
    return d[cols].sort_values(["mask", "world", "tokens_per_gpu"]).reset_index(drop=True)


def measured_volumes(per_rank_results: list[dict]) -> pd.DataFrame:
    """The ``volume`` suite's cases of every rank (``run_torchrun("cadlib.cp.check", ...)``'s
    ``attrs["results"]``): per (mechanism, mask, rank) the bytes the rank handed to ``torch.distributed``,
    forward and backward, beside the closed form for that rank (``cadlib.cp.volume.per_rank``) and, on
    one-document masks, the equal-shard formula (``cadlib.cp.volume.equal_shard``)."""
    out = []
    for res in per_rank_results:
        rank = res.get("rank")
        for c in res.get("cases", []):
            if c.get("suite") != "volume" or "skipped" in c:
                continue
            eq = c.get("equal_shard") or {}
            out.append({"mechanism": c["mechanism"], "mask": c["mask"], "rank": rank, "tokens": c["total"],
                        "sent fwd": c["sent"]["fwd"], "closed form fwd": c["per_rank"]["fwd"][rank],
                        "sent bwd": c["sent"]["bwd"], "closed form bwd": c["per_rank"]["bwd"][rank],
                        "equal-shard fwd": eq.get("fwd"), "equal-shard bwd": eq.get("bwd")})
    return pd.DataFrame(out)

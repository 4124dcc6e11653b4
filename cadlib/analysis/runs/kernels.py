"""LongCA-bench's kernel tables from the committed measurements, as frames: the block-sparse study
(``scripts/bench/bench_sparse.py``), the dense kernel x mask table's MHA rows and its 30-draw document-mask rows
(``scripts/bench/bench_kernels.py --heads 64:64`` and ``--draws 30``).

Every file is one GPU's run, written by ``scripts/device/longca_1gpu.sh`` (:data:`COMMAND`); a file that
is not committed yet reads as ``None`` and the notebook says so, never a number. Work is counted from the
exact mask area in every file (forward ``4 * D * Hq / H * area``, backward 2.5x), so a ratio of TF/s is a
ratio of times scaled by the same FLOPs:

    bwd / fwd = TF/s_bwd / TF/s_fwd = 2.5 * t_fwd / t_bwd     (below 1: the backward is the slower per FLOP)
"""
from __future__ import annotations

import os
import pathlib

import pandas as pd

from ...infra.results import RESULTS_DIR, load_result

SPARSE_FILE = "bench_sparse_h200.json"
MHA_FILE = "bench_kernels_mha.json"
DRAWS_FILE = "bench_kernels_draws.json"
COMMAND = "bash scripts/device/longca_1gpu.sh"
"""The one command that measures all three files on one H200 (about 7-8 minutes)."""
CHECK_TOL = 2e-2
"""Largest error relative to the dense reference's largest value that a (kernel, family, block, heads)
group's check may show in bf16 (the correct kernels measured 3e-3 to 5e-3)."""
UNSTABLE_SPREAD = 1.5
"""A cell whose 80% quantile time exceeds its 20% quantile by more than this held a compile (FlexAttention's
first 16K forward on the H200: 588 to 2,314 ms against 51 ms at 32K)."""
SPARSE_CELL = ("kernel", "family", "block", "sparsity", "seqlen", "heads")
"""What one block-sparse measurement varies; each cell has a ``fwd`` and a ``bwd`` record."""


def load_rows(name: str, results_dir: str | os.PathLike | None = None) -> tuple[pd.DataFrame | None, str]:
    """``(rows, device)`` of ``results/<name>``: one row per record, with the file's device; ``(None, "")``
    when the file is not committed."""
    path = pathlib.Path(results_dir or RESULTS_DIR) / name
    if not path.exists():
        return None, ""
    res = load_result(path)
    rows = pd.DataFrame(res.get("results", []))
    if name == SPARSE_FILE and len(rows):
        rows = unverified(rows)
    return rows, str(res.get("meta", {}).get("device") or "")


def unverified(rows: pd.DataFrame) -> pd.DataFrame:
    """Timed cells whose (kernel, family, block, heads) failed the dense-reference check, or whose check
    could not run, as status ``✗`` with the reason: a time of a wrong (or unchecked) result is not a
    measurement of the kernel (on the H200, FA4's block-sparse path with GQA 64:8 gave a forward error of
    1.18 against the reference; its 64-token blocks could not be checked)."""
    rows = rows.copy()
    if "check" not in rows:
        return rows
    bad = {}
    for r in rows.itertuples():
        chk = r.check if isinstance(r.check, dict) else None
        if chk is None:
            continue
        group = (r.kernel, r.family, r.block, r.heads)
        if chk.get("check_error"):
            bad[group] = f"unchecked: {chk['check_error'][:90]}"
        elif max(chk.get("max_err") or 0.0, chk.get("grad_err") or 0.0) > CHECK_TOL:
            bad[group] = (f"wrong: error {max(chk.get('max_err') or 0, chk.get('grad_err') or 0):.3g} against the "
                          f"dense reference (> {CHECK_TOL:g})")
    for group, why in bad.items():
        sel = ((rows.kernel == group[0]) & (rows.family == group[1]) & (rows.block == group[2])
               & (rows.heads == group[3]) & (rows.status == "ok"))
        rows.loc[sel, "status"] = "✗"
        rows.loc[sel, "error"] = why
    if {"q20_ms", "q80_ms"} <= set(rows.columns):          # a compile inside the timed runs
        shaky = (rows.status == "ok") & (rows.q80_ms > UNSTABLE_SPREAD * rows.q20_ms)
        rows.loc[shaky, "status"] = "~"
        rows.loc[shaky, "error"] = "unstable: its timed runs spread over more than 1.5x (a kernel compile inside)"
    return rows


def cell_text(rows: pd.DataFrame) -> pd.Series:
    """Each record as a table shows it: its TF/s (3 significant digits) or its status symbol (``X``
    unsupported, ``E`` out of memory, ``!`` failed, ``-`` not reached, ``✗`` failed or lacked its
    dense-reference check, ``~`` unstable timing)."""
    return rows.apply(lambda r: f"{r.tflops:.3g}" if r.status == "ok" else str(r.status), axis=1)


def sparse_table(rows: pd.DataFrame, seqlen: int | None = None) -> pd.DataFrame:
    """The block-sparse study at one length (default the longest with a measured cell: a time budget may
    leave longer ones ``-``): one row per (family, block, heads, sparsity), one column per (direction,
    kernel), TF/s or the status symbol."""
    if seqlen is None:
        ok = rows[rows.status == "ok"]
        seqlen = int((ok if len(ok) else rows).seqlen.max())
    sub = rows[rows.seqlen == seqlen]
    return (sub.assign(cell=cell_text(sub))
            .pivot_table(index=["family", "block", "heads", "sparsity"], columns=["direction", "kernel"],
                         values="cell", aggfunc="first")
            .sort_index(axis=1, level=0, ascending=False))


def bwd_over_fwd(rows: pd.DataFrame) -> pd.DataFrame:
    """Per block-sparse cell (:data:`SPARSE_CELL`) measured both ways: ``fwd_tflops``, ``bwd_tflops`` and
    ``ratio`` = backward TF/s / forward TF/s (module docstring)."""
    ok = rows[rows.status == "ok"]
    both = ok.pivot_table(index=list(SPARSE_CELL), columns="direction", values="tflops", aggfunc="first")
    if not {"fwd", "bwd"} <= set(both.columns):
        return pd.DataFrame(columns=[*SPARSE_CELL, "fwd_tflops", "bwd_tflops", "ratio"])
    both = both.dropna(subset=["fwd", "bwd"]).reset_index()
    both = both.rename(columns={"fwd": "fwd_tflops", "bwd": "bwd_tflops"})
    return both.assign(ratio=both.bwd_tflops / both.fwd_tflops)[[*SPARSE_CELL, "fwd_tflops", "bwd_tflops",
                                                                  "ratio"]]


def ratio_summary(ratios: pd.DataFrame) -> pd.DataFrame:
    """Per kernel of :func:`bwd_over_fwd`: cells, the median and largest ratio, and the share of cells
    whose backward is slower per FLOP than the forward (ratio below 1)."""
    g = ratios.groupby("kernel").ratio
    return pd.DataFrame({"cells": g.size(), "median bwd/fwd": g.median(), "max bwd/fwd": g.max(),
                         "share below 1": g.apply(lambda r: float((r < 1).mean()))})


def sparse_checks(rows: pd.DataFrame) -> pd.DataFrame:
    """The dense-reference check of each (kernel, family, block, heads): the length checked, the forward
    error ``max_err`` and the gradients' ``grad_err`` (relative to the reference's largest value)."""
    out = []
    for r in rows[rows.direction == "fwd"].itertuples():
        chk = getattr(r, "check", None)
        if isinstance(chk, dict):
            out.append({"kernel": r.kernel, "family": r.family, "block": r.block, "heads": r.heads,
                        "check_len": chk.get("check_len"), "max_err": chk.get("max_err"),
                        "grad_err": chk.get("grad_err"), "error": chk.get("check_error", "")})
    return pd.DataFrame(out, columns=["kernel", "family", "block", "heads", "check_len", "max_err", "grad_err",
                                      "error"])


def draw_bands(rows: pd.DataFrame) -> pd.DataFrame:
    """The records timed on several draws of their mask: per (backend, mask, heads, seqlen, direction) the
    median TF/s over the draws, its 20% and 80% quantiles, and the band's width relative to the median."""
    if "draws" not in rows:
        return pd.DataFrame()
    d = rows[(rows.status == "ok") & (rows.draws.fillna(1) > 1)]
    keep = ["backend", "mask", "heads", "seqlen", "direction", "draws", "tflops", "tflops_q20", "tflops_q80"]
    d = d[keep].assign(band=(d.tflops_q80 - d.tflops_q20) / d.tflops)
    return d.sort_values(["mask", "seqlen", "direction"]).reset_index(drop=True)


def with_heads(rows: pd.DataFrame, default: str) -> pd.DataFrame:
    """``rows`` with a ``heads`` column (``Hq:Hkv``); records written before it existed get ``default``."""
    heads = rows["heads"] if "heads" in rows else pd.Series(index=rows.index, dtype=object)
    return rows.assign(heads=heads.fillna(default))


def mha_beside_gqa(gqa: pd.DataFrame, mha: pd.DataFrame, seqlen: int | None = None) -> pd.DataFrame:
    """TF/s per mask of the backends measured both ways, GQA beside MHA, at one length (default the
    longest the MHA rows reach): columns (direction, backend, heads)."""
    mha = with_heads(mha, "64:64")
    if seqlen is None:
        seqlen = int(mha.seqlen.max())
    rows = pd.concat([with_heads(gqa, "64:8"), mha], ignore_index=True)
    rows = rows[(rows.seqlen == seqlen) & rows.backend.isin(set(mha.backend))]
    return (rows.assign(cell=cell_text(rows))
            .pivot_table(index="mask", columns=["direction", "backend", "heads"], values="cell", aggfunc="first")
            .sort_index(axis=1, level=0, ascending=False))



LIVE_CELL = ("mask", "seqlen", "direction", "backend")
"""What one cell of the kernel x mask table varies (the GQA 64:8 rows)."""


def live_beside_committed(committed: pd.DataFrame | None, committed_device: str,
                          live: pd.DataFrame | None = None,
                          live_device: str = "", masks=None, seqlens=None, backends=None) -> pd.DataFrame:
    """A subset of the kernel x mask table, the committed TF/s beside a live run's (when given): one row
    per (mask, seqlen, direction, backend) of ``masks`` x ``seqlens`` x ``backends`` (default the live
    run's cells), columns ``committed (<device>)``, ``live (<device>)`` (TF/s or the status symbol,
    :func:`cell_text`) and ``live / committed`` where both are measured."""
    parts = {}
    for label, rows, dev in (("committed", committed, committed_device), ("live", live, live_device)):
        if rows is None or not len(rows):
            continue
        rows = with_heads(rows, "64:8")
        rows = rows[rows.heads == "64:8"].assign(tflops=rows.get("tflops", float("nan")))   # none timed: none
        for col, keep in (("mask", masks), ("seqlen", seqlens), ("backend", backends)):
            if keep is not None:
                rows = rows[rows[col].isin(list(keep))]
        parts[label] = (f"{label} ({dev or 'unknown device'})", rows.set_index(list(LIVE_CELL)))
    if not parts:
        return pd.DataFrame(columns=list(LIVE_CELL)).set_index(list(LIVE_CELL))
    index = parts["live"][1].index if "live" in parts else parts["committed"][1].index
    out = pd.DataFrame(index=index.drop_duplicates())
    for name, rows in parts.values():
        rows = rows[~rows.index.duplicated(keep="last")].reindex(out.index)
        out[name] = [f"{t:.3g}" if s == "ok" else ("" if s != s else str(s))     # s != s: no such cell
                     for t, s in zip(rows.tflops, rows.status)]
        out[f"_{name}"] = rows.tflops.where(rows.status == "ok")
    if len(parts) == 2:
        (live_name, _), (committed_name, _) = parts["live"], parts["committed"]
        ratio = out[f"_{live_name}"] / out[f"_{committed_name}"]
        out["live / committed"] = [f"{r:.2f}" if r == r else "" for r in ratio]
    return out[[c for c in out.columns if not c.startswith("_")]].sort_index()

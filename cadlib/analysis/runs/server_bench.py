"""The attention server's measured efficiency from the committed benchmark files, as tables: its
overhead over the kernel alone (``scripts/bench/bench_attention_server.py``), composability of query shards
(``scripts/bench/server_composability.py``), and how much KV the servers of a plan share."""
from __future__ import annotations

import os

import numpy as np
import pandas as pd

from ...dispatch.build import build_all
from ...dispatch.kvshare import kv_accounting
from ...infra.results import find_results, load_result

OVERHEAD_COLUMNS = ("backend", "dist", "tokens_per_gpu", "world", "rank", "step_fwd_tflops", "raw_fwd_tflops",
                    "step_fwd_bwd_tflops", "raw_fwd_bwd_tflops", "step_over_raw_fwd", "step_over_raw_fwd_bwd",
                    "comm_fwd_fraction", "comm_fwd_bwd_fraction")


def server_overhead(results_dir: str | os.PathLike | None = None,
                    pattern: str = "bench_attention_server_overhead_*gpu.json"):
    """The attention-server overhead benchmark (``scripts/bench/bench_attention_server.py --part overhead``)
    as one row per (file, case, rank): ``OVERHEAD_COLUMNS`` plus ``device`` and ``file``. ``step_*``
    is the whole CAD attention step (metadata, all-to-alls, fused kernel, return), ``raw_*`` the fused
    kernel alone on the same tasks. Empty frame (with those columns) when no file matches."""
    rows = []
    for path in find_results(pattern, results_dir):
        res = load_result(path)
        for case in res.get("results", []):
            for r in case.get("ranks", []):
                rows.append({**{k: r.get(k) for k in OVERHEAD_COLUMNS},
                             "device": res.get("meta", {}).get("device"), "file": path.name})
    return pd.DataFrame(rows, columns=[*OVERHEAD_COLUMNS, "device", "file"])


def server_overhead_summary(rows):
    """Per case (backend, distribution, tokens per GPU, GPUs) of :func:`server_overhead`'s rows: the
    lowest step TF/s over the ranks and the lowest fused-kernel TF/s, forward and forward+backward, and
    the overhead: per rank ``raw TF/s / step TF/s - 1`` (the step's extra time over its own kernel's
    on the same tasks), the largest over the ranks.
    ``case`` labels a row for plots, e.g. ``fa4 pretrain 64K x2``."""
    keys = ["backend", "dist", "tokens_per_gpu", "world"]
    if len(rows) == 0:
        return pd.DataFrame(columns=[*keys, "case"])
    rows = rows.assign(**{f"overhead_{m}": rows[f"raw_{m}_tflops"] / rows[f"step_{m}_tflops"] - 1
                          for m in ("fwd", "fwd_bwd")})
    g = rows.groupby(keys, sort=True)
    out = g.agg(step_fwd_tflops=("step_fwd_tflops", "min"), raw_fwd_tflops=("raw_fwd_tflops", "min"),
                step_fwd_bwd_tflops=("step_fwd_bwd_tflops", "min"),
                raw_fwd_bwd_tflops=("raw_fwd_bwd_tflops", "min"), overhead_fwd=("overhead_fwd", "max"),
                overhead_fwd_bwd=("overhead_fwd_bwd", "max")).reset_index()
    out.insert(0, "case", [f"{b} {d} {t // 1024}K x{w}" for b, d, t, w in
                           zip(out.backend, out.dist, out.tokens_per_gpu, out.world)])
    return out


COMPOSABILITY_COLUMNS = ["backend", "doc", "shard", "kv_share", "pattern", "order", "mode", "tflops", "ratio",
                         "stage", "path", "reference", "device", "commit", "date", "file"]
COMPOSABILITY_PATHS = {"kernel": "kernel alone, a KV copy per shard",
                       "copy": "server, a KV copy per shard",
                       "merged": "server, one KV per (server, document)",
                       "unsplit": "unsplit document"}
"""What each ``kv_share`` mode of the composability benchmark runs (``path`` column)."""


def composability(results_dir: str | os.PathLike | None = None,
                  pattern: str = "bench_attention_server_composability_1gpu_*.json"):
    """The composability benchmark (a document cut into query shards, each with its KV prefix, in
    one fused call) as one row per (file, backend, document, shard, kv_share, pattern, mode):
    ``tflops`` and ``ratio`` (TF/s over the unsplit document of the same file), ``mode`` ``fwd`` or
    ``fwd_bwd``; skipped (out of memory) measurements have no row.

    * ``kv_share``: ``kernel`` (the kernel alone on per-shard KV copies; files written before the
      server merged shards carry no such field), ``copy`` (the server path, a KV copy per shard),
      ``merged`` (the server path, one KV buffer per (server, document), :mod:`cadlib.dispatch.kvshare`) or ``unsplit``
      (the reference row, ratio 1); ``path`` says it in words (:data:`COMPOSABILITY_PATHS`).
    * ``stage``: ``before`` (per-shard copies: ``kernel``, ``copy``), ``after`` (``merged``) or
      ``unsplit``: what a plot of KV sharing's change compares.
    * ``pattern``: ``all`` or ``alternate`` (every other shard on the server: nothing merges);
      ``order``: the kernel mode's call order (``lpt``, longest KV prefix first as the server, or ``doc``).
    * ``reference``: ``bracketed`` where the file timed the unsplit document before and after the
      cases and divides by their mean (``scripts/bench/server_composability.py`` since a90939d), ``single``
      where it was timed once, before the cases. The same unsplit 16K call measured 556-653 TF/s
      forward+backward across the committed files (577 and 635 within one bracketed run), so a
      single-reference ratio can be off by several percent.
    * ``device``, ``commit`` (the code measured), ``date`` and ``file``."""
    rows = []
    for path in find_results(pattern, results_dir):
        res = load_result(path)
        meta, cfg = res.get("meta", {}), res.get("config", {})
        bracketed = any(r.get("when") for r in res.get("results", []))
        for r in res.get("results", []):
            kv = r.get("kv_share", "kernel")
            if kv == "kernel" and r.get("shard") == r.get("doc_len"):
                kv = "unsplit"                        # older files: the one-shard row is the unsplit call
            stage = {"merged": "after", "unsplit": "unsplit"}.get(kv, "before")
            for mode in ("fwd", "fwd_bwd"):
                if r.get(f"{mode}_vs_unsplit") is not None:
                    rows.append({"backend": r["backend"], "doc": r["doc_len"], "shard": r["shard"],
                                 "kv_share": kv, "pattern": r.get("pattern", "all"),
                                 "order": cfg.get("order", "lpt"), "mode": mode,
                                 "tflops": r[f"{mode}_tflops"], "ratio": r[f"{mode}_vs_unsplit"],
                                 "stage": stage, "path": COMPOSABILITY_PATHS.get(kv, kv),
                                 "reference": "bracketed" if bracketed else "single",
                                 "device": meta.get("device"), "commit": str(meta.get("commit", ""))[:7],
                                 "date": meta.get("date", ""), "file": path.name})
    return pd.DataFrame(rows, columns=COMPOSABILITY_COLUMNS)


COMPOSABILITY_TARGET = 0.95
"""The composability target: forward+backward on 512-token shards at least this share of the unsplit
document's TF/s, on 16K and 64K documents (1 x H200, FA4, bf16, llama3-8b heads)."""


def composability_before_after(rows, backend: str = "fa4", mode: str = "fwd_bwd"):
    """KV sharing's before and after from :func:`composability`'s rows: one row per (document, shard, series)
    of ``backend`` and ``mode``, every shard on the server (pattern ``all``, call order ``lpt``),
    unsplit rows left out. ``series``: ``<stage>: <path> (<commit>)``; the server paths keep one
    series per commit measured (a later commit's rerun is its own line), the kernel alone (the same
    kernel at every commit) only its first measurement, the one the server path started from."""
    sel = rows[(rows.backend == backend) & (rows["mode"] == mode) & (rows.pattern == "all")
               & (rows.order == "lpt") & (rows.stage != "unsplit")].copy()
    first = sel[sel.kv_share == "kernel"].groupby("doc").date.transform("min")
    sel = sel.drop(first.index[sel.loc[first.index, "date"] != first])
    sel["series"] = sel.stage + ": " + sel.path + " (" + sel.commit + ")"
    return sel.sort_values(["doc", "stage", "date", "shard"], ascending=[True, False, True, True]) \
        .reset_index(drop=True)


def composability_targets(rows, shard: int = 512, target: float = COMPOSABILITY_TARGET, backend: str = "fa4"):
    """Per document and measurement (file) of the merged server path at ``shard``-token shards: the
    forward+backward and forward ratios, ``meets`` (fwd+bwd >= ``target``), ``before``, the
    per-shard-copy kernel's first fwd+bwd ratio at that shard (NaN where it did not fit in memory),
    ``reference`` (see :func:`composability`), ``date`` and ``latest`` (the newest measurement of the
    document: the code as it is, with the best reference; what the target is judged on)."""
    ba = composability_before_after(rows, backend)
    fwd = composability_before_after(rows, backend, "fwd")
    out = []
    for (doc, commit), g in ba[(ba.kv_share == "merged") & (ba.shard == shard)].groupby(["doc", "commit"]):
        f = fwd[(fwd.kv_share == "merged") & (fwd.shard == shard) & (fwd.doc == doc) & (fwd.commit == commit)]
        before = ba[(ba.kv_share == "kernel") & (ba.shard == shard) & (ba.doc == doc)].ratio
        out.append({"doc": int(doc), "shard": shard, "commit": commit, "file": g.file.iloc[0],
                    "fwd_bwd": float(g.ratio.iloc[0]),
                    "fwd": float(f.ratio.iloc[0]) if len(f) else float("nan"),
                    "before_fwd_bwd": float(before.iloc[0]) if len(before) else float("nan"),
                    "target": target, "meets": bool(g.ratio.iloc[0] >= target),
                    "reference": g.reference.iloc[0], "date": g.date.iloc[0]})
    cols = ["doc", "shard", "commit", "file", "fwd_bwd", "fwd", "before_fwd_bwd", "target", "meets",
            "reference", "date"]
    t = pd.DataFrame(out, columns=cols).sort_values(["doc", "date"]).reset_index(drop=True)
    t["latest"] = t.date.eq(t.groupby("doc").date.transform("max"))
    return t


def sharing_stats(plan) -> dict:
    """Over every server of ``plan``: (server, document) pairs with several tasks, how many of them
    merge into one segment (contiguous shards) and how many stay split (non-contiguous: copies), and
    the KV rows the fused calls read in both modes vs the distinct rows. Host only."""
    keys = ("n_tasks", "n_segments", "split_docs", "unique_kv_tokens", "copy_kv_tokens", "merged_kv_tokens")
    tot = dict.fromkeys(keys, 0)
    shared_pairs = 0
    for d in build_all(plan):
        acc = kv_accounting(d, 1)
        for k in keys:
            tot[k] += acc[k]
        doc = np.asarray(d.task_doc, dtype=np.int64)
        if doc.size:
            per_doc = np.bincount(np.unique(doc, return_inverse=True)[1])
            shared_pairs += int(np.sum(per_doc > 1))
    tot["server_doc_pairs_with_several_tasks"] = shared_pairs
    tot["kv_read_copy_over_unique"] = tot["copy_kv_tokens"] / max(tot["unique_kv_tokens"], 1)
    tot["kv_read_merged_over_unique"] = tot["merged_kv_tokens"] / max(tot["unique_kv_tokens"], 1)
    return tot

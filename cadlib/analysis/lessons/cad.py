"""The lessons of chapter 2 (CA-tasks, the scheduler, the attention servers), re-exported by
:mod:`cadlib.analysis.lessons.toys`: one move by hand (:func:`shard_candidates`), a plan's tasks
(:func:`task_table`), the scheduler against its two baselines (:func:`planner_comparison`), and a
dispatch read token by token (:func:`token_ids`, :func:`token_runs`, :func:`dispatch_table`,
:func:`server_call`)."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd

from ...core import cost
from ...core.layout import Layout
from ...core.plan import Plan
from ...data import packing, workload
from ...dispatch import build as dispatch
from ...scheduling import scheduler

ID_BASE = 1000
"""A toy token's id is ``ID_BASE * doc + position``: documents of the hand-sized examples are shorter."""


# ---------------------------------------------------------------------------------------------------
# Chapter 2: CA-tasks, the scheduler, the attention servers
# ---------------------------------------------------------------------------------------------------


def task_table(plan: Plan, moved_only: bool = False) -> pd.DataFrame:
    """A plan's tasks, one row each: doc, queries ``[q_start, q_end)``, home, server, query tokens,
    pairs and whether it moved (server != home)."""
    df = pd.DataFrame(
        [dict(t._asdict(), q_tokens=t.n_q, pairs=t.pairs, moved=t.server != t.home) for t in plan.tasks]
    )
    return df[df.moved].reset_index(drop=True) if moved_only else df


def shard_candidates(
    layout: Layout, donor: int, receiver: int, model, tolerance: float = 0.05
) -> pd.DataFrame:
    """The two shapes one move can take when ``donor`` hands part of its one task to ``receiver``: the
    **start** shard ``[a, a+k)`` and the **end** shard ``[b-k, b)``, each the largest that keeps the donor
    at or above the receiver. Per candidate: the shard, pairs moved, query and KV tokens sent, bytes
    (forward dispatch: Q and K,V out) and bytes per pair."""
    (c,) = layout.ranks[donor]
    load = [sum(cost.causal_pairs(x.start, x.end) for x in r) for r in layout.ranks]
    room = (load[donor] - load[receiver]) // 2
    a, b = c.start, c.end
    k_start = max(k for k in range(1, b - a + 1) if cost.causal_pairs(a, a + k) <= room)
    k_end = max(k for k in range(1, b - a + 1) if cost.causal_pairs(b - k, b) <= room)
    base_kv = scheduler.colocated(layout).token_matrices()[1].sum()  # KV the layout sends anyway
    rows = []
    for name, (s, e) in {"start shard": (a, a + k_start), "end shard": (b - k_end, b)}.items():
        rest = [(c.doc, x, y, donor, donor) for x, y in ((a, s), (e, b)) if y > x]
        others = [
            (x.doc, x.start, x.end, r, r) for r, rk in enumerate(layout.ranks) for x in rk if r != donor
        ]
        plan = Plan(layout, others + rest + [(c.doc, s, e, donor, receiver)])
        q, kv = plan.token_matrices()
        q_tok, kv_tok = int(q[donor, receiver]), int(kv.sum() - base_kv)
        added = q_tok * model.q_bytes() + kv_tok * model.kv_bytes()
        pairs = int(cost.causal_pairs(s, e))
        rows.append(
            {
                "candidate": name,
                "shard": f"[{s}, {e})",
                "pairs moved": pairs,
                "query tokens": q_tok,
                "KV tokens": kv_tok,
                "bytes added": int(added),
                "bytes / pair": added / pairs,
            }
        )
    return pd.DataFrame(rows).set_index("candidate")


def planner_comparison(
    distribution: str,
    n_ranks: int,
    tokens_per_rank: int,
    model,
    tolerance: float,
    min_shard: int,
    seeds: Sequence[int],
) -> pd.DataFrame:
    """The scheduler, DistCA's released planner and bytes-blind equal-FLOPs on the same batches
    (``seeds`` x sequential and balanced packing): per batch and method the imbalance before and after,
    whether it reached the tolerance, the **bytes out** (forward dispatch: Q, K, V to the servers, what
    the schedulers price) and the **bytes out and back** (plus O and LSE returned)."""
    methods = {"ours": "cad", "DistCA planner": "distca", "equal FLOPs": "equal_flops"}
    rows = []
    for pack_method in ("sequential", "balanced"):
        for s in seeds:
            d = workload.sample_docs(
                total_tokens=n_ranks * tokens_per_rank,
                seed=s,
                max_doc_len=tokens_per_rank,
                **workload.sample_kwargs(distribution),
            )
            lay = packing.pack(d, n_ranks, tokens_per_rank, method=pack_method)
            row = {"batch": f"{pack_method}-{s}", "imbalance before": scheduler.colocated(lay).imbalance()}
            for name, method in methods.items():
                p = scheduler.place(
                    lay, method, model=model, tolerance=tolerance, min_shard=min_shard
                ).validate()
                row |= {
                    f"{name} imbalance": p.imbalance(),
                    f"{name} reached": bool(p.meta["reached"]),
                    f"{name} out GB": p.forward_bytes(model) / 1e9,
                    f"{name} out+back GB": p.total_bytes(model) / 1e9,
                }
            rows.append(row)
    vs = pd.DataFrame(rows).set_index("batch")
    for base in ("DistCA planner", "equal FLOPs"):
        for what in ("out", "out+back"):
            vs[f"ours / {base}, {what}"] = vs[f"ours {what} GB"] / vs[f"{base} {what} GB"]
    return vs


def planner_summary(vs: pd.DataFrame) -> pd.DataFrame:
    """Per baseline of :func:`planner_comparison`: batches where it reached ε, and ours / its bytes (median,
    range, batches where ours moves more), out and out+back."""
    rows = []
    for base in ("equal FLOPs", "DistCA planner"):
        for what in ("out", "out+back"):
            r = vs[f"ours / {base}, {what}"]
            rows.append(
                {
                    "baseline": base,
                    "bytes": what,
                    "baseline reached ε": int(vs[f"{base} reached"].sum()),
                    "ours reached ε": int(vs["ours reached"].sum()),
                    "median ours/baseline": r.median(),
                    "min": r.min(),
                    "max": r.max(),
                    "batches where ours moves more": int((r > 1).sum()),
                    "of batches": len(vs),
                }
            )
    return pd.DataFrame(rows).set_index(["baseline", "bytes"])


def token_ids(layout: Layout) -> list[np.ndarray]:
    """Every rank's tokens in buffer order as ``ID_BASE * doc + position``: ``d<doc>[<position>]``."""
    if max(layout.doc_lens) > ID_BASE:
        raise ValueError(
            f"token_ids names tokens of documents up to {ID_BASE} tokens; got a document of "
            f"{max(layout.doc_lens)}"
        )
    return [
        np.array([ID_BASE * c.doc + i for c in r for i in range(c.start, c.end)], dtype=np.int64)
        for r in layout.ranks
    ]


def token_runs(ids) -> str:
    """Token ids as runs of consecutive positions of one document: ``d0[16:20) d1[0:8)`` (``-`` if none)."""
    out, run = [], None
    for t in map(int, ids):
        if run and t == run[1] and t // ID_BASE == run[0] // ID_BASE:
            run[1] = t + 1
        else:
            if run:
                out.append(run)
            run = [t, t + 1]
    if run:
        out.append(run)
    return " ".join(f"d{a // ID_BASE}[{a % ID_BASE}:{(b - 1) % ID_BASE + 1})" for a, b in out) or "-"


def dispatch_table(plan: Plan) -> pd.DataFrame:
    """What every rank sends where in the first all-to-all of the plan's dispatch (``build_all``): one
    row per (from, to, Q or KV) with the token count and the tokens as runs; checked against the plan's
    own accounting (``Plan.token_matrices``)."""
    ids, ds = token_ids(plan.layout), dispatch.build_all(plan)
    rows = []
    for src, d in enumerate(ds):
        for kind, idx, splits in (
            ("Q", d.q_send_index, d.q_send_splits),
            ("KV", d.kv_send_index, d.kv_send_splits),
        ):
            for dst, part in enumerate(np.split(ids[src][idx], np.cumsum(splits)[:-1])):
                if len(part):
                    rows.append(
                        {"from": src, "to": dst, "what": kind, "tokens": len(part), "which": token_runs(part)}
                    )
    sends = pd.DataFrame(rows, columns=["from", "to", "what", "tokens", "which"])
    for kind, mat in zip(("Q", "KV"), plan.token_matrices()):
        got = np.zeros_like(mat)
        for r in sends[sends.what == kind].itertuples():
            got[r[1], r[2]] = r.tokens
        np.testing.assert_array_equal(got, mat)
    return sends


def server_call(plan: Plan, server: int) -> tuple[pd.DataFrame, dict]:
    """Server ``server``'s one fused varlen call, on the tokens of :func:`token_ids`: per task its query
    rows (``cu_q``) and KV rows (``cu_k``), read from the server's buffers (its own rows, then those it
    received; :func:`cadlib.dispatch.build.simulate_exchange`), each checked to be the task's queries
    and its causal KV prefix. Returns the table and ``{cu_seqlens_q, cu_seqlens_k, max_q, max_k}``."""
    ids, ds = token_ids(plan.layout), dispatch.build_all(plan)
    recv_q, recv_kv = dispatch.simulate_exchange(ds, ids, "q"), dispatch.simulate_exchange(ds, ids, "kv")
    srv = ds[server]
    q_buf, kv_buf = (
        np.concatenate([ids[server], recv_q[server]]),
        np.concatenate([ids[server], recv_kv[server]]),
    )
    rows = []
    for i, ti in enumerate(srv.tasks):
        t = plan.tasks[ti]
        q_rows = q_buf[srv.q_rows[srv.cu_q[i] : srv.cu_q[i + 1]]]
        kv_rows = kv_buf[srv.kv_rows[srv.cu_k[i] : srv.cu_k[i + 1]]]
        np.testing.assert_array_equal(q_rows, ID_BASE * t.doc + np.arange(t.q_start, t.q_end))
        np.testing.assert_array_equal(kv_rows, ID_BASE * t.doc + np.arange(0, t.q_end))
        rows.append(
            {
                "task": f"d{t.doc} queries [{t.q_start}, {t.q_end})",
                "home": t.home,
                "cu_q": f"{srv.cu_q[i]}:{srv.cu_q[i + 1]}",
                "queries": token_runs(q_rows),
                "cu_k": f"{srv.cu_k[i]}:{srv.cu_k[i + 1]}",
                "keys/values": token_runs(kv_rows),
            }
        )
    return pd.DataFrame(rows), {
        "cu_seqlens_q": srv.cu_q.tolist(),
        "cu_seqlens_k": srv.cu_k.tolist(),
        "max_q": int(srv.max_q),
        "max_k": int(srv.max_k),
    }

"""The plumbing of the lessons (the notebooks), so that their cells stay a few lines: hand-sized
examples a reader can check with a pencil, the tables that show them, and the small studies the
notebooks grow them into. Nothing here computes what a module of its own owns: the layouts, plans,
dispatches, simulations and masks come from the layers below.

* chapter 1 (stragglers): :func:`unit_step` (a step in unit costs), :func:`paper_idle_table`,
  :func:`straggler_view` and :func:`explorer` (the interactive view), :func:`pp_cases` (1F1B);
* chapter 2 (CAD): :func:`shard_candidates` (one move by hand), :func:`task_table`,
  :func:`planner_comparison`, :func:`token_ids`, :func:`token_runs`, :func:`dispatch_table`,
  :func:`server_call`;
* chapter 3 (ping-pong): :func:`nano_halves`;
* every chapter: :func:`check_params`, the parameter checks a notebook runs first.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np
import pandas as pd

from ..core import cost
from ..core.layout import Layout
from ..core.plan import Plan
from ..data import packing, workload
from ..dispatch import build as dispatch
from ..scheduling import nanosplit, scheduler
from . import plots, sim
from .idle import pp_timeline

ID_BASE = 1000
"""A toy token's id is ``ID_BASE * doc + position``: documents of the hand-sized examples are shorter."""


def check_params(**rules) -> None:
    """Raise ValueError naming the first parameter that breaks its rule: ``name=(value, ok, what)``,
    where ``ok`` is a bool or a callable of the value and ``what`` says what is valid."""
    for name, (value, ok, what) in rules.items():
        good = ok(value) if callable(ok) else ok
        if not good:
            raise ValueError(f"{name} must be {what}, got {value!r}")


# ---------------------------------------------------------------------------------------------------
# Chapter 1: stragglers
# ---------------------------------------------------------------------------------------------------


def unit_step(layout: Layout, linear: float = 1.0, pair: float = 1.0) -> pd.DataFrame:
    """One data-parallel step in unit costs: per rank its ``tokens``, causal ``pairs``, ``busy =
    linear * tokens + pair * pairs`` and ``wait`` for the slowest rank at the gradient all-reduce.
    ``attrs``: ``step`` (the slowest rank's busy time) and ``idle_fraction``
    (``sum wait / (ranks x step)``)."""
    costs = packing.rank_costs(layout, None)
    pairs = np.array(
        [sum(cost.causal_pairs(c.start, c.end) for c in r) for r in layout.ranks], dtype=np.int64
    )
    tokens = np.asarray(costs["tokens"], dtype=np.int64)
    busy = linear * tokens + pair * pairs
    step = float(busy.max())
    df = pd.DataFrame(
        {"tokens": tokens, "pairs": pairs, "busy": busy, "wait": step - busy},
        index=pd.RangeIndex(layout.n_ranks, name="rank"),
    )
    df.attrs.update(step=step, idle_fraction=float(df["wait"].sum() / (layout.n_ranks * step)))
    return df


def paper_idle_table(frame: pd.DataFrame, paper: Mapping[int, float]) -> pd.DataFrame:
    """The paper's idle figure beside ours, per DP size, from :func:`cadlib.analysis.idle.straggler_idle`
    run with both packings: the paper's share, the median over sampled batches of variable-length
    chunking and its 25-75% range, its tokens max/mean, and the median of fixed-length packing."""
    var, fixed = frame[frame.packing == "varlen"], frame[frame.packing == "sequential"]
    q = var.groupby("dp").idle_fraction.quantile([0.25, 0.5, 0.75]).unstack()
    dps = sorted(q.index)
    return pd.DataFrame(
        {
            "paper": [paper[d] / 100 if d in paper else np.nan for d in dps],
            "variable-length (median)": q[0.5].to_numpy(),
            "variable-length, 25%-75%": [f"{a:.0%}-{b:.0%}" for a, b in zip(q[0.25], q[0.75])],
            "tokens max/mean": var.groupby("dp").tokens_max_over_mean.median().to_numpy(),
            "fixed-length (median)": fixed.groupby("dp").idle_fraction.median().to_numpy(),
        },
        index=pd.Index(dps, name="DP"),
    )


def straggler_view(distribution: str, context: int, dp: int, model, seed: int = 0, tolerance: float = 0.1):
    """One sampled batch of ``dp`` ranks x ``context`` tokens: per-rank linear and attention seconds under
    plain DP and under CAD (the simulator's H200 rates), titled with both step times."""
    docs = workload.sample_docs(
        total_tokens=dp * context, seed=seed, max_doc_len=context, **workload.sample_kwargs(distribution)
    )
    lay = packing.pack(docs, dp, context)
    dp_t, cad_t = sim.simulate("dp", lay, model), sim.simulate("cad", lay, model, tolerance=tolerance)
    return plots.rank_loads(
        {
            "linear s": dp_t.breakdown["linear"],
            "attention s (DP)": dp_t.breakdown["attention"],
            "attention s (CAD)": cad_t.breakdown["attention"],
        },
        f"{distribution}, {context:,} tokens/rank, DP={dp}: DP step {dp_t.step:.1f}s, "
        f"CAD step {cad_t.step:.1f}s",
        yaxis="seconds per step",
    )


def explorer(view: Callable, controls: Mapping[str, tuple]):
    """ipywidgets controls that redraw ``view(**values)`` (a function returning a figure) below them.
    ``controls``: ``name -> (options or (min, max), value)``: a list or tuple of options gives a dropdown,
    a ``range`` a slider. Returns the box to display."""
    import ipywidgets as widgets
    from IPython.display import display

    ws = {}
    for name, (options, value) in controls.items():
        if isinstance(options, range):
            ws[name] = widgets.IntSlider(
                min=options.start, max=options.stop - 1, value=value, description=name
            )
        else:
            ws[name] = widgets.Dropdown(options=list(options), value=value, description=name)
    out = widgets.Output()

    def redraw(_=None):
        with out:
            out.clear_output(wait=True)
            view(**{k: w.value for k, w in ws.items()}).show()

    for w in ws.values():
        w.observe(redraw, names="value")
    box = widgets.VBox([widgets.HBox(list(ws.values())), out])
    display(box)
    return box


def pp_cases(model, pp_stages: int, n_microbatches: int, microbatch_tokens: int):
    """1F1B on ``pp_stages`` stages: equal microbatches of eight short documents each, against the same
    step whose microbatch 0 is one whole document of the same tokens. Returns ``(timeline, makespans)``:
    every op of both cases (``lane``, ``phase``, ``start_ms``, ``end_ms``, ``microbatch``, ``case``) and each
    case's step in seconds; the second case is checked against the simulator's own PP entry."""
    check_params(
        pp_stages=(
            pp_stages,
            pp_stages >= 1 and model.n_layers % pp_stages == 0,
            f"a divisor of n_layers={model.n_layers}",
        ),
        n_microbatches=(n_microbatches, n_microbatches >= 2, "an integer >= 2"),
        microbatch_tokens=(microbatch_tokens, microbatch_tokens >= 8, "an integer >= 8"),
    )
    hw, lps, short = sim.Hardware(), model.n_layers // pp_stages, microbatch_tokens // 8
    cases = {
        "equal microbatches": [[(0, short)] * 8] * n_microbatches,
        "microbatch 0 = one long document": [[(0, 8 * short)]] + [[(0, short)] * 8] * (n_microbatches - 1),
    }
    frames, makespans = [], {}
    for name, mbs in cases.items():
        fwd, bwd = (
            np.tile(
                [
                    sim.linear_seconds(sum(e - s for s, e in mb), model, hw, ph, lps)
                    + sim.attention_seconds(*zip(*mb), model, hw, ph, lps).sum()
                    for mb in mbs
                ],
                (pp_stages, 1),
            )
            for ph in ("fwd", "bwd")
        )
        t = _pp_frame(fwd, bwd, heavy=name.startswith("microbatch 0"))
        frames.append(t.assign(case=name))
        makespans[name] = sim.one_f_one_b(fwd, bwd)[0]
    long_case = cases["microbatch 0 = one long document"]
    ranks, d = [], 0
    for mb in long_case:
        ranks.append([(d + k, 0, e - s) for k, (s, e) in enumerate(mb)])
        d += len(mb)
    lens = [e - s for mb in long_case for s, e in mb]
    pp = sim.simulate_pp(Layout(ranks, lens), model, pp_stages=pp_stages)
    np.testing.assert_allclose(pp.step, makespans["microbatch 0 = one long document"], rtol=1e-9)
    return pd.concat(frames, ignore_index=True), makespans


def _pp_frame(fwd, bwd, heavy: bool) -> pd.DataFrame:
    t = pp_timeline(fwd, bwd)
    long = (t.microbatch == 0) & heavy
    t["phase"] = np.where(t.phase == "F", "forward", "backward") + np.where(long, " (long document)", "")
    t["lane"] = "stage " + t.stage.astype(str)
    return t


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


# ---------------------------------------------------------------------------------------------------
# Chapter 3: ping-pong's nano-batches
# ---------------------------------------------------------------------------------------------------


def nano_halves(layout: Layout, min_piece: int = 512) -> pd.DataFrame:
    """Tokens of nano-batch A and B per rank, with whole documents and with documents that may be cut
    between the halves (``split_nano_batches``), and ``|A - B|``."""
    rows = []
    for cut in (False, True):
        a, b = nanosplit.split_nano_batches(layout, "tokens", split_docs=cut, min_piece=min_piece)
        for r in range(layout.n_ranks):
            rows.append(
                {
                    "nano-batches": "cut documents" if cut else "whole documents",
                    "rank": f"rank {r}",
                    "A tokens": len(a.rows[r]),
                    "B tokens": len(b.rows[r]),
                }
            )
    df = pd.DataFrame(rows)
    df["|A - B|"] = (df["A tokens"] - df["B tokens"]).abs()
    return df


# ---------------------------------------------------------------------------------------------------
# Chapter 4: end to end
# ---------------------------------------------------------------------------------------------------


def toy_runs(steps: Mapping[str, float], colocated_attention: Sequence[float]) -> list[dict]:
    """Rank results in the shape ``cadlib.train`` returns them, for a hand-sized end-to-end example: one
    batch, each method's step (the same on every rank: they meet at the all-reduce) and colocated's
    attention time per rank, for :func:`cadlib.analysis.e2e.summarise`."""
    nan = float("nan")
    return [
        {
            "rank": r,
            "records": [
                {
                    "method": m,
                    "batch": 0,
                    "rank": r,
                    "step_ms": float(s),
                    "layers_ms": float(s),
                    "fwd_bwd_ms": float(s),
                    "peak_mem_gib": nan,
                    "attention_ms": float(attn) if m == "colocated" else nan,
                    "comm_ms": 0.0,
                    "comm_exposed_ms": 0.0,
                    "allreduce_ms": 0.0,
                    "loss": 0.0,
                }
                for m, s in steps.items()
            ],
        }
        for r, attn in enumerate(colocated_attention)
    ]

"""The paper's 4D runs (Table 4: DP x PP x CP x TP, Llama-8B) replayed on one GPU's timings.

The settings and their micro-batches are :mod:`cadlib.analysis.replay.settings4d`'s (a step's
documents as ``n_micro`` microbatches of whole documents through ``pp`` stages of TP=8 nodes). Per
configuration ``(pp, dp)`` and method:

* ``colocated`` and ``wlb`` (WLB-ideal: the step's documents re-binned whole over the microbatches by
  WLB-LLM's variable-length packing, then balanced over each microbatch's replicas with per-document
  CP of degree ``c``, :func:`~cadlib.analysis.replay.settings4d.wlb_micro_layouts`): Megatron's 1F1B
  (:func:`cadlib.analysis.model.compose.one_f_one_b`) of
  per-(stage, microbatch) op durations, each the composition of the stage's layers over its
  data-parallel ranks (:func:`~cadlib.analysis.model.compose.compose_pass`), plus the point-to-point
  activation (forward) or gradient (backward) of the op, the LM head on the last stage. WLB as DistCA's
  4D driver runs it is a choice of :class:`~cadlib.analysis.replay.settings4d.Setting4D`
  (:data:`~cadlib.analysis.replay.settings4d.WLB_CHOICES_4D`: its packer over all
  replicas and micro-batches, the whole-replica all-gather, its sweep's admissible CP degrees).
* ``cad-pingpong`` and ``signal-only``: DistCA's lock-step ticks (:func:`cadlib.core.pipeline.lockstep`),
  each tick's CA-tasks of all stages' current microbatches scheduled together over all GPUs
  (:mod:`cadlib.scheduling.pipeline`); a dummy stage's GPUs serve. The servers are stateless
  (:mod:`cadlib.runtime.resend`; ``Setting4D.backward = "resend"``): O and the LSE return in the
  forward, the backward resends Q, O, dO, LSE and K, V to the backward tick's servers.

Durations: the linear layers, LM head and optimizer from the H200 timings of the 3D replay
(``results/replay/times_h200.json``, the same TP=8 shard); core attention from the measured kernel
table (:class:`cadlib.core.measured.MeasuredCost`, FA4, on each server's merged segments), except
for the calls timed on an H200 (:class:`cadlib.analysis.replay.times.SegmentPrice`): a batch has
500-8,600 distinct calls, more than a session's device time can time, so ``scripts/bench/bench_replay.py
shapes4d`` samples 40 per setting by modelled time, those are timed, and the others take the table
times the sample's measured / predicted (:func:`cadlib.analysis.replay.times.segment_model_check`);
four settings were also timed call by call (``shapes4d --all``), which checks the sample
(:func:`cadlib.analysis.report.scale.sample_check_4d`); the network at 50 GB/s per GPU between nodes. As the
paper sweeps configurations, each method's step is that of its best ``pp`` (and ``c`` for WLB) over the
setting's batches; which configurations fit in memory is :mod:`cadlib.analysis.replay.sweep4d`'s filter
(the paper's protocol; our earlier views ``any`` and ``budget`` allow every configuration, or cap the
tokens per rank). Not modelled: the LM head
split between the forward and backward ticks (a third forward, as its matmuls are), p2p overlapping
compute.
"""
from __future__ import annotations


import numpy as np

from ...core.cost import CAD_A2A_TO_SERVERS
from ...core.layout import Layout
from ...core.methods import METHODS, names
from ...core.paper import DISTCA_4D_TOLERANCE_FACTORS
from ...core.pipeline import lockstep
from ...core.precision import DTYPE_BYTES
from ...scheduling import scheduler
from ...scheduling.pipeline import fitted_tick_plans, micro_nanos, tick_plans
from ..model.compose import Phases, compose_lockstep, compose_pass, one_f_one_b
from .phases import Links, shard_params, tp_seconds
from .settings import Setting, gather_bytes
from .settings4d import Setting4D, micro_layouts, step_groups, wlb_micro_layouts
from .times import DTYPE, SegmentPrice, head_key, interp, linear_key, optimizer_key

HEAD_FWD_SHARE = 1 / 3
"""The LM head's forward share of its timed forward + backward (its matmuls: one forward, two backward);
the fused head (variant ``fused-sp``) makes its gradient in the forward: all of it there."""
MEMORY_SLACK = 0.01
"""How far over the microbatch's tokens per rank a configuration may go in the ``budget`` view (ceil
rounding of WLB's bins)."""
METHODS_4D = names(lambda m: m.headline or m.signal_only)
"""The methods of Table 4: the headline's (colocated, WLB-ideal, CAD with ping-pong) and the signal-only
control (:mod:`cadlib.core.methods`)."""


def _segments(plan, server: int):
    """A server's merged segments ``(q_len, kv_len)``: its tasks of one document with contiguous query
    ranges are one segment (as :mod:`cadlib.dispatch.kvshare` merges them)."""
    sel = plan.server == server
    doc, a, b = plan.doc[sel], plan.q_start[sel], plan.q_end[sel]
    if not doc.size:
        return np.zeros(0), np.zeros(0)
    o = np.lexsort((a, doc))
    doc, a, b = doc[o], a[o], b[o]
    new = np.ones(doc.size, dtype=bool)
    new[1:] = (doc[1:] != doc[:-1]) | (a[1:] != b[:-1])
    start = np.flatnonzero(new)
    end = b[np.r_[start[1:] - 1, doc.size - 1]]
    return (end - a[start]).astype(np.float64), end.astype(np.float64)


def _attention(plans, price, R: int) -> tuple[np.ndarray, np.ndarray]:
    """Per plan (nano-batch) and server: the forward and backward seconds of its fused call
    (:class:`cadlib.analysis.replay.times.SegmentPrice`: timed, or the kernel table scaled)."""
    f, bk = np.zeros((len(plans), R)), np.zeros((len(plans), R))
    for i, p in enumerate(plans):
        for r in range(R):
            q, kv = _segments(p, r)
            if q.size:
                f[i, r], bk[i, r] = price.seconds(q, kv)
    return f, bk


def _cad_bytes(plans, spec, backward: bool, resend: bool = True):
    """Per nano-batch and rank ``(sent, received)`` of the collectives before and after attention, with
    stateless servers (``resend``, :meth:`cadlib.core.cost.ModelSpec.cad_a2a_bytes`): forward Q and KV
    out, O and LSE back; backward Q, O, dO, LSE and KV out, dQ and dKV back."""
    per = spec.cad_a2a_bytes(resend, DTYPE)
    pre, post = [], []
    for p in plans:
        q, kv = p.token_matrices()
        qs, qr, ks, kr = q.sum(1), q.sum(0), kv.sum(1), kv.sum(0)
        for name, acc in zip(("out_bwd", "in_bwd") if backward else ("in", "out"), (pre, post)):
            bq, bkv = per[name]
            home, server = qs * bq + ks * bkv, qr * bq + kr * bkv
            acc.append((home, server) if name in CAD_A2A_TO_SERVERS else (server, home))
    return pre, post


def _linear(base: Setting, tokens, times: dict, links: Links, backend: str) -> dict:
    spec = base.spec
    lin = {f: interp(times, lambda n: linear_key(spec, backend, n, base.linear, base.tp), tokens, f)
           for f in ("pre_ms", "post_ms", "pre_bwd_ms", "post_bwd_ms")}
    tp = tp_seconds(base, tokens, links.tp)
    return {"pre": lin["pre_ms"] + tp["pre"], "post": lin["post_ms"] + tp["post"],
            "pre_bwd": lin["pre_bwd_ms"] + tp["pre_bwd"], "post_bwd": lin["post_bwd_ms"] + tp["post_bwd"]}


def _coll(link, pairs, signal_only: bool):
    t = np.stack([link.seconds(s, r) for s, r in pairs])
    return np.where(t > 0, link.latency_s, 0.0) if signal_only else t


def p2p_seconds(s: Setting4D, tokens, link) -> np.ndarray:
    """A stage's activation (or its gradient) to the next node: its tokens x hidden in bf16, each GPU
    of the tensor-parallel group sending its sequence-parallel share."""
    b = np.asarray(tokens, dtype=np.float64) * s.spec.hidden * DTYPE_BYTES[DTYPE] / s.tp
    return link.seconds(b)


def stage_params(s: Setting4D, pp: int) -> float:
    """Parameters of the largest stage's GPU: its layers and the embedding or LM head (one of them)."""
    spec = s.spec
    per_layer = spec.linear_params_per_layer() + 2 * spec.hidden
    return spec.n_layers // pp * per_layer + spec.vocab * spec.hidden * (1 if pp > 1 else 2)


def _allreduce(s: Setting4D, pp: int, dp: int, link) -> float:
    if dp == 1:
        return 0.0
    b = stage_params(s, pp) * DTYPE_BYTES[DTYPE] * 2 * (dp - 1) / dp
    return float(link.seconds(np.array([b]))[0])


def _ends(s: Setting4D, pp: int, times: dict, backend: str):
    """The optimizer of a stage, the LM head as a function of tokens (forward, backward)."""
    spec = s.spec
    opt = times[optimizer_key(spec, backend)]["ms"] * 1e-3 * stage_params(s, pp) / shard_params(spec)

    share = 1.0 if s.linear == "fused-sp" else HEAD_FWD_SHARE

    def head(tokens):
        h = interp(times, lambda n: head_key(spec, backend, n, s.linear, s.tp), tokens, "ms")
        return h * share, h * (1 - share)
    return opt, head


# ---------------------------------------------------------------------------------------------------
# One configuration's step, per method
# ---------------------------------------------------------------------------------------------------

def pipeline_1f1b(s: Setting4D, lays: list[Layout], pp: int, dp: int, times, links: Links, price,
                  backend: str, method: str, gather_cp: int | None = None, replica: int = 1) -> dict:
    """Colocated or WLB under 1F1B: each op is its stage's layers over the microbatch's ``dp`` ranks
    (``gather_cp``: per-document CP's all-gather over whole CP groups of that degree,
    :func:`cadlib.analysis.replay.settings.gather_bytes`); ``replica``: ranks per DP replica (WLB's CP
    degree), each replica its own 1F1B under ``s.schedule == "replica"``."""
    base, spec = s.base(dp), s.spec
    L = spec.n_layers // pp
    opt, head = _ends(s, pp, times, backend)
    group = replica if s.schedule == "replica" else dp     # ranks that run one 1F1B together
    n_rep = dp // group
    f, bk = np.zeros((n_rep, pp, len(lays))), np.zeros((n_rep, pp, len(lays)))
    busy = 0.0                                    # GPU-seconds of work, all stages
    for m, lay in enumerate(lays):
        tok = lay.tokens_per_rank().astype(np.float64)
        plan = scheduler.colocated(lay)
        af, ab = _attention([plan], price, dp)
        g = gather_bytes(lay, spec, gather_cp)
        lin = _linear(base, tok, times, links, backend)
        ph = Phases(**lin, attn=af[0], attn_bwd=ab[0], comm_in=links.dp.seconds(*g["in"]),
                    comm_out=links.dp.seconds(*g["out"]), comm_in_bwd=links.dp.seconds(*g["in_bwd"]),
                    comm_out_bwd=links.dp.seconds(*g["out_bwd"]), head=np.zeros(dp))
        hf, hb = head(tok)
        p2p = p2p_seconds(s, tok, links.dp) if pp > 1 else np.zeros(dp)
        fe, fb, _ = compose_pass("colocated", ph, L)
        be, bb, _ = compose_pass("colocated", ph, L, backward=True)
        top = lambda x: np.asarray(x, dtype=np.float64).reshape(n_rep, group).max(1)   # noqa: E731
        f[:, :, m] = (top(fe) + top(p2p))[:, None]
        bk[:, :, m] = (top(be) + top(p2p))[:, None]
        f[:, -1, m] += top(hf)
        bk[:, -1, m] += top(hb)
        busy += pp * float((fb + bb + 2 * p2p).sum()) + float((hf + hb).sum())
    makespan = max(one_f_one_b(f[r], bk[r])[0] for r in range(n_rep))
    step = makespan + (_allreduce(s, pp, dp, links.dp) + opt if s.optimizer else 0.0)
    return {"step_s": step, "pipeline_s": makespan, "idle_fraction": 1 - busy / (pp * dp * makespan)}


def pipeline_lockstep(s: Setting4D, lays: list[Layout], pp: int, dp: int, times, links: Links, price,
                      backend: str, signal_only: bool = False) -> dict:
    """CAD with ping-pong in DistCA's lock-step ticks, every tick's plans over all ``pp x dp`` nodes."""
    base, spec, R = s.base(dp), s.spec, pp * dp
    L = spec.n_layers // pp
    opt, head = _ends(s, pp, times, backend)
    recipe = base.recipe()
    ticks = lockstep(pp, len(lays))
    nanos = micro_nanos(lays, recipe)
    fits = []
    if s.tolerance_rule == "buffer":
        plans, fits = fitted_tick_plans(ticks, lays, recipe, spec, nanos, s.buffer_gib,
                                        DISTCA_4D_TOLERANCE_FACTORS, resend=True, dtype=DTYPE)
    else:
        plans = tick_plans(ticks, lays, recipe, spec, nanos)
    composed, imb = [], []
    for tick, ps in zip(ticks, plans):
        bwd = tick.phase == "B"
        tok = np.array([[len(r) for r in _stack_rows(tick, [n[j] for n in nanos], dp)] for j in range(2)],
                       dtype=np.float64)
        af, ab = _attention(ps, price, R)
        pre, post = _cad_bytes(ps, spec, bwd, resend=s.backward == "resend")
        lin = _linear(base, tok, times, links, backend)
        zero = np.zeros((2, R))
        c_pre, c_post = _coll(links.cad, pre, signal_only), _coll(links.cad, post, signal_only)
        ph = Phases(**lin, attn=zero if bwd else af, attn_bwd=ab if bwd else zero,
                    comm_in=zero if bwd else c_pre, comm_out=zero if bwd else c_post,
                    comm_in_bwd=c_post if bwd else zero, comm_out_bwd=c_pre if bwd else zero,
                    head=np.zeros(R))
        last = tick.micro[-1]
        hd = np.zeros(R)
        if last is not None:
            hf, hb = head(tok.sum(0)[-dp:])
            hd[-dp:] = hb if bwd else hf
        composed.append((tick.phase, ph, hd))
        imb.append(max(p.imbalance() for p in ps))
    p2p = p2p_seconds(s, s.micro_tokens, links.dp) if pp > 1 else 0.0
    ar, opt = (_allreduce(s, pp, dp, links.dp), opt) if s.optimizer else (0.0, 0.0)
    c = compose_lockstep("signal-only" if signal_only else "cad-pingpong", composed, L, ar, opt,
                         float(np.max(p2p)))
    fit = {} if not fits else {"tolerance_max": max(f.tolerance for f in fits),
                               "buffer_need_gib_max": max(f.need for f in fits) / 2 ** 30,
                               "buffer_failed_ticks": sum(f.grown for f in fits)}
    return {"step_s": c.step, "pipeline_s": c.step - ar - opt,
            "idle_fraction": c.idle_fraction, "exposed_comm_s": c.breakdown["exposed_comm_s"],
            "plan_imbalance_max": float(max(imb)), **fit}


def _stack_rows(tick, parts, dp: int):
    """Per rank of the tick, its rows of its stage's nano-batch (none on a dummy stage)."""
    out = []
    for m in tick.micro:
        out += [np.zeros(0)] * dp if m is None else list(parts[m].rows)
    return out


def replay_setting_4d(s: Setting4D, times: dict, rates: dict, backend: str, price: SegmentPrice,
                      progress=None) -> dict:
    """Every configuration and method of every batch, and per method its best configuration; ``price``
    gives the server calls' durations (and counts how many were timed)."""
    links = Links.of(s.base(1), rates)
    rows = []
    for b in range(s.batches):
        for pp, dp, n_micro in s.configs():
            groups = step_groups(s, b, dp, n_micro)
            base = micro_layouts(s, groups, dp)
            common = dict(batch=b, pp=pp, dp=dp, n_micro=n_micro)
            rows.append({**common, "method": "colocated", "cp": 1, "max_tokens_per_rank": s.micro_tokens,
                         **pipeline_1f1b(s, base, pp, dp, times, links, price, backend, "colocated")})
            for c in s.wlb_degrees(dp, n_micro):
                lays = wlb_micro_layouts(s, groups, dp, c)
                top = int(max(lay.tokens_per_rank().max() for lay in lays))
                rows.append({**common, "method": "wlb", "cp": c, "max_tokens_per_rank": top,
                             **pipeline_1f1b(s, lays, pp, dp, times, links, price, backend, "wlb",
                                             c if s.wlb_gather == "replica" else None)})
            for m in names(pingpong=True):
                rows.append({**common, "method": m, "cp": 1, "max_tokens_per_rank": s.micro_tokens,
                             **pipeline_lockstep(s, base, pp, dp, times, links, price, backend,
                                                 signal_only=METHODS[m].signal_only)})
            if progress is not None:
                progress(f"{s.name} batch {b} pp={pp}")
    return {"per_config": rows, "summary": summarise_4d(s, rows),
            "attention_calls": {"timed": price.timed, "modelled": price.modelled}}


def summarise_4d(s: Setting4D, rows: list[dict]) -> list[dict]:
    """Per method and view its best configuration (the lowest mean step over the batches) and the
    speedups over WLB-ideal's and colocated's best in the same view (mean steps, as the paper averages
    durations). Views: ``any`` (every configuration), ``budget`` (only those whose ranks all hold at
    most ``micro_tokens x (1 + MEMORY_SLACK)`` tokens: the paper sets the batch where the baseline
    just fits in memory) and ``pp=<n>`` (at that pipeline degree)."""
    import collections
    by = collections.defaultdict(list)
    top = collections.defaultdict(int)
    for r in rows:
        k = (r["method"], r["pp"], r["dp"], r["cp"])
        by[k].append(r["step_s"])
        top[k] = max(top[k], r["max_tokens_per_rank"])
    views = {"any": lambda k: True,
             "budget": lambda k: top[k] <= s.micro_tokens * (1 + MEMORY_SLACK),
             **{f"pp={pp}": (lambda k, pp=pp: k[1] == pp) for pp, _, _ in s.configs()}}
    out = []
    for view, keep in views.items():
        best = {}
        for k, steps in by.items():
            if not keep(k):
                continue
            mean = float(np.mean(steps))
            if k[0] not in best or mean < best[k[0]]["step_s_mean"]:
                best[k[0]] = {"setting": s.name, "dist": s.dist, "max_doc_len": s.max_doc_len, "gpus": s.gpus,
                              "batch": s.batch, "view": view, "method": k[0], "pp": k[1], "dp": k[2], "cp": k[3],
                              "batches": len(steps), "step_s_mean": mean, "max_tokens_per_rank": top[k]}
        for r in best.values():
            for base in ("wlb", "colocated"):
                if base in best:
                    r[f"speedup_over_{base}"] = best[base]["step_s_mean"] / r["step_s_mean"]
        out += [best[m] for m in METHODS_4D if m in best]
    return out

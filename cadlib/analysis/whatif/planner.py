"""Does CAD pay off on this data and this cluster? The user's documents, model, cluster and training
setup, priced from the measured tables as the scale replay prices them, with the band of what is known.

Batches are sampled from the user's lengths (:func:`cadlib.data.workload.sample_lengths`) or a named
distribution, as the scale replay samples (:func:`cadlib.analysis.replay.settings.batch_lengths`, the same
seeds), and each is planned for every method (:func:`cadlib.analysis.replay.phases.batch_work`): colocated
(sequential packing, per-document CP for documents split between ranks), WLB-ideal (balanced packing
with per-document CP of the best degree) and CAD with ping-pong. The durations are the measured tables'
(:mod:`cadlib.analysis.whatif.price`: the timed token grid, the kernel table scaled to the timed calls,
the link model), composed tick by tick (:mod:`cadlib.analysis.model.compose`) per stage and micro-batch.

The cluster, its links and the training setup are :mod:`cadlib.analysis.whatif.setup`'s.

A step of ``m`` micro-batches on ``pp`` stages of ``L / pp`` layers (1F1B): micro-batch ``i`` on stage
``s`` takes its composed forward ``F[s, i]`` and backward ``B[s, i]`` (the ranks of a stage meet at
every collective; the LM head only on the last stage), :func:`cadlib.analysis.model.compose.one_f_one_b` gives the
makespan, and the gradient all-reduce and the optimizer follow: ``step = makespan + allreduce +
optimizer``. With ``pp = m = 1`` this is exactly the replay's composition of the same batch. Per
method: tokens/s ``= dp m T / step``;
idle fraction ``= 1 - mean_g busy_g / step``; bytes each GPU sends in the attention collectives per
step (tensor parallelism and the all-reduce, the same for every method, left out); activation memory
per GPU, ``tokens_held x L / pp x activation_bytes_per_token x min(pp, m)`` (in flight on the first
stage) plus, for CAD, what its attention server keeps until the backward (received Q, K, V, and the
O and LSE it computed), against the GPU's memory (weights, gradients and optimizer state not counted).

Every step and CAD's speedups are the means over the sampled steps with the band of
:mod:`cadlib.analysis.whatif.band` (sampling, composition and replay errors in quadrature); the
verdict compares CAD with the faster baseline, and a short sweep over DP and context (MaxDocLen with
the tokens per group in proportion) shows where it flips.
"""
from __future__ import annotations

import pathlib
import time
from dataclasses import asdict, replace

import numpy as np

from ...core.cost import as_model
from ...core.memory import GIB
from ...core.measured import MeasuredCost
from ...data.packing import pack
from ...scheduling import scheduler
from ..model.compose import Composed, compose, one_f_one_b
from ..replay import phases as replay_phases
from ..replay import settings as replay
from . import ring
from .band import known_errors
from .gpu_table import GpuTable
from .price import Pricing, pricing
from .setup import METHODS, Cluster, Documents, Training, setting
from .verdict import BASELINES, LABELS, ROWS, banded, spreads, verdict

SWEEP_DP = (0.25, 0.5, 1, 2)
SWEEP_CONTEXT = (0.5, 1, 2)


# ---------------------------------------------------------------------------------------------------
# One micro-batch on one stage, and a step
# ---------------------------------------------------------------------------------------------------

def _zeros_like_bwd(ph, head_fwd: bool):
    """The forward half of one layer's phases (the head's forward third where ``head_fwd``)."""
    z = np.zeros_like
    return replace(ph, pre_bwd=z(ph.pre_bwd), post_bwd=z(ph.post_bwd), attn_bwd=z(ph.attn_bwd),
                   comm_in_bwd=z(ph.comm_in_bwd), comm_out_bwd=z(ph.comm_out_bwd),
                   head=ph.head / 3 if head_fwd else z(ph.head), allreduce=0.0, optimizer=0.0)


def _stage(method: str, ph, layers: int, last: bool) -> tuple[float, float, Composed]:
    """``(forward, backward, composed)`` of a micro-batch on one stage: no all-reduce, no optimizer
    (once per step, after the last backward); the LM head (one forward, two backward thirds) on the
    last stage only."""
    full = replace(ph, allreduce=0.0, optimizer=0.0, head=ph.head if last else np.zeros_like(ph.head))
    c = compose(method, full, layers)
    f = compose(method, _zeros_like_bwd(ph, last), layers).step
    return f, max(c.step - f, 0.0), c


def _work_stats(w: replay.Work, s: replay.Setting, coloc_tokens: np.ndarray) -> dict:
    """Bytes each rank sends in one layer, and the activation bytes it holds (one micro-batch, one layer)."""
    spec = s.spec
    sent = sum(np.asarray(w.bytes[k][0], dtype=np.float64).reshape(-1, coloc_tokens.size).sum(0)
               for k in ("in", "out", "in_bwd", "out_bwd"))
    held = (coloc_tokens if w.method == "cad-pingpong" else w.tokens).astype(np.float64)
    act = held * spec.activation_bytes_per_token()
    if w.method == "cad-pingpong":
        per_q = spec.q_bytes() + spec.o_bytes() + spec.lse_bytes()
        for ds in w.dispatch:
            act = act + np.array([d.n_recv_q * per_q + d.n_recv_kv * spec.kv_bytes() for d in ds])
    return {"sent": sent, "act": act}


def _method_steps(s: replay.Setting, cluster: Cluster, training: Training, step: int, price: Pricing,
                  links, progress=None, rings: tuple = ()) -> dict:
    """Every method's step ``step`` (its ``micro_batches`` batches), with what the output reports; the
    CP ring at each degree of ``rings`` (``(c, Link)``) as ``cp-ring/c``."""
    m, pp, L = training.micro_batches, cluster.pp, s.spec.n_layers
    keys = (*METHODS, *(f"{ring.KEY}/{c}" for c, _ in rings))
    F = {k: np.zeros((pp, m)) for k in keys}
    B = {k: np.zeros((pp, m)) for k in keys}
    acc = {k: {"busy": 0.0, "attn_max": 0.0, "attn_mean": 0.0, "exposed": 0.0, "sent": 0.0, "act": 0.0,
               "cp": [], "ranks": None} for k in keys}
    plan_ms = []
    act_per_token = s.spec.activation_bytes_per_token()
    for i in range(m):
        b = step * m + i
        docs = replay.batch_lengths(s, b)
        t0 = time.perf_counter()
        scheduler.schedule(pack(docs, s.dp, s.tokens), model=s.spec, tolerance=s.tolerance,
                           min_shard=s.min_shard)
        plan_ms.append((time.perf_counter() - t0) * 1e3)
        works = replay_phases.batch_work(s, b)
        coloc = works["colocated"].tokens
        table = None if price.fallback else price.table(s, works)
        per = {}
        for key, w in works.items():
            ph = price.phases(s, w, links, table)
            last = _stage(w.method, ph, L, True)
            first = _stage(w.method, ph, L, False) if pp > 1 else last
            st = _work_stats(w, s, coloc)
            tok = coloc if w.pingpong else w.tokens
            per[key] = (ph, first, last, st, tok, w.pingpong)
        for c, link in rings:
            tok = ring.rank_tokens(docs, s.dp, c)
            base = price.phases(s, replace(works["colocated"], tokens=tok), links, table)
            ph, st = ring.priced(docs, c, base, s.spec, price.cost, link, price.scale_of(ring.KEY))
            last = _stage("colocated", ph, L, True)
            first = _stage("colocated", ph, L, False) if pp > 1 else last
            per[f"{ring.KEY}/{c}"] = (ph, first, last, {**st, "act": tok * act_per_token}, tok, False)
        wl = [k for k in per if k.startswith("wlb/")]
        best = min(wl, key=lambda k: per[k][2][2].step)
        for key in keys:
            ph, first, last, st, tok, pingpong = per[best if key == "wlb" else key]
            F[key][:-1, i], B[key][:-1, i] = first[0], first[1]
            F[key][-1, i], B[key][-1, i] = last[0], last[1]
            c, a = last[2], acc[key]
            a["busy"] = a["busy"] + (c.busy if pp == 1 else (c.busy + (pp - 1) * first[2].busy) / pp)
            a["attn_max"] += c.breakdown["attention_max_s"]
            a["attn_mean"] += c.breakdown["attention_mean_s"]
            a["exposed"] += c.breakdown["exposed_comm_s"]
            a["sent"] = a["sent"] + st["sent"] * L
            a["act"] = np.maximum(a["act"], st["act"] * L * min(pp, m))
            if key == "wlb":
                a["cp"].append(int(best.split("/")[1]))
            if i == 0:
                attn = (ph.attn + ph.attn_bwd).sum(0) if pingpong else ph.attn + ph.attn_bwd
                a["ranks"] = {"tokens": np.asarray(tok).tolist(), "attention_s": (attn * L).tolist(),
                              "busy_s": c.busy.tolist()}
        optimizer = ph.optimizer
        if progress:
            progress(1)
    allreduce = replay_phases.allreduce_seconds(s, links.dp) + optimizer
    out = {}
    for key in keys:
        a = acc[key]
        span = one_f_one_b(F[key], B[key])[0]
        stp = span + allreduce
        busy = np.asarray(a["busy"]) + allreduce
        out[key] = {"step_s": stp, "idle_fraction": float(max(0.0, 1 - busy.mean() / stp)),
                    "attention_max_s": a["attn_max"], "attention_mean_s": a["attn_mean"],
                    "exposed_comm_s": a["exposed"], "sent_bytes_mean": float(np.mean(a["sent"])),
                    "sent_bytes_max": float(np.max(a["sent"])),
                    "activation_bytes_max": float(np.max(a["act"])),
                    "cp": a["cp"], "ranks": a["ranks"]}
    out["plan_ms"] = plan_ms
    return out


def make_pricing(cluster: Cluster, times: dict | None = None, cost: MeasuredCost | None = None) -> Pricing:
    """The what-if's :class:`~cadlib.analysis.whatif.price.Pricing`: ``times`` and ``cost`` given, else
    the committed H200 files (``cluster.kernels``, a kernel table's path, in place of the committed one)."""
    if cost is None and cluster.kernels:
        cost = MeasuredCost.load(cluster.kernels)
    return pricing(times, cost, backend=cost.backend if cost is not None else "torch_flash")


def ring_degrees(model, cluster: Cluster, training: Training) -> dict:
    """The CP ring's degrees to price (:func:`cadlib.analysis.whatif.ring.degrees`): those whose sequence
    holds the context and whose peak fits ``cluster.gpu_mem_gib``; none fitting memory, those holding
    the context (``why`` says so); none of those either, the largest."""
    info = ring.degrees(model, cluster.gpus_per_node, cluster.tp, cluster.pp, cluster.dp,
                        training.tokens_per_group, training.context, training.micro_batches,
                        cluster.gpu_mem_gib)
    ctx = [d for d in info if d["context"]]
    fits = [d for d in ctx if d["recompute"] is not None]
    why = "fits the context and memory" if fits else \
        f"none fits in {cluster.gpu_mem_gib:g} GiB: priced anyway" if ctx else "none holds the context"
    return {"degrees": info, "priced": [d["cp"] for d in (fits or ctx or info[-1:])], "why": why}


def simulate(model, cluster: Cluster, training: Training, docs: Documents, progress=None,
             price: Pricing | None = None, with_ring: bool = True) -> dict:
    """Every method's steps priced from the measured tables (no band): per method the mean over the
    sampled steps of the step, idle fraction, attention of the slowest and the mean rank, exposed
    communication, bytes sent and activation memory per GPU; the speedups (mean per-step ratios) and
    each step's; rank detail of the first step; ``pricing``: where the durations came from. With
    ``with_ring``, the CP ring at each of :func:`ring_degrees`' degrees, its row the degree of least mean
    step (``ring``: the degrees, their mean steps and the one chosen)."""
    price = price or make_pricing(cluster)
    s = price.prepare(setting(model, cluster, training, docs))
    links = cluster.links()
    rd = ring_degrees(model, cluster, training) if with_ring else {"priced": []}
    where = {d["cp"]: d["link"] for d in rd.get("degrees", [])}
    rings = tuple((c, ring.ring_link(c, where[c], cluster.intra_node_gbps, cluster.inter_node_gbps))
                  for c in rd["priced"])
    steps = [_method_steps(s, cluster, training, k, price, links, progress, rings)
             for k in range(training.steps)]
    means = {c: float(np.mean([st[f"{ring.KEY}/{c}"]["step_s"] for st in steps])) for c in rd["priced"]}
    chosen = min(means, key=means.get) if means else None
    if chosen is not None:
        for st in steps:
            st[ring.KEY] = {**st[f"{ring.KEY}/{chosen}"], "cp": [chosen]}
    res = {}
    for key in (ROWS if chosen is not None else METHODS):
        rows = [st[key] for st in steps]
        r = {f: float(np.mean([x[f] for x in rows])) for f in rows[0] if f not in ("cp", "ranks")}
        r["sent_bytes_max"] = float(max(x["sent_bytes_max"] for x in rows))
        r["activation_bytes_max"] = float(max(x["activation_bytes_max"] for x in rows))
        for base in BASELINES + ((ring.KEY,) if key == "cad-pingpong" and chosen else ()):
            sp = [st[base]["step_s"] / st[key]["step_s"] for st in steps]
            r[f"speedup_over_{base}"] = float(np.mean(sp))
            r[f"speedups_over_{base}"] = sp
        if key in ("wlb", ring.KEY):
            r["cp"] = [c for x in rows for c in x["cp"]]
        r["ranks"] = rows[0]["ranks"]
        r["steps_s"] = [x["step_s"] for x in rows]
        res[key] = r
    return {"methods": res, "plan_ms": [p for st in steps for p in st["plan_ms"]],
            "ring": {**rd, "mean_step_s": means, "chosen": chosen},
            "pricing": {"source": price.source, "fallback": price.fallback, "backend": price.backend,
                        "linear": s.linear, "scale": price.scale}}


# ---------------------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------------------

def sweep_points(cluster: Cluster, training: Training) -> list[tuple[int, int]]:
    """``(dp, context)`` of the sweep: DP times ``SWEEP_DP``, context times ``SWEEP_CONTEXT`` (whole
    numbers only), the planned setting left out."""
    dps = sorted({int(cluster.dp * f) for f in SWEEP_DP
                  if cluster.dp * f >= 1 and float(cluster.dp * f).is_integer()})
    ctxs = sorted({int(training.context * f) for f in SWEEP_CONTEXT
                   if float(training.context * f).is_integer() and training.tokens_per_group * f >= 1})
    return [(d, c) for d in dps for c in ctxs if (d, c) != (cluster.dp, training.context)]


def sweep(model, cluster: Cluster, training: Training, docs: Documents, known: dict, spread: dict,
          price: Pricing, progress=None) -> list[dict]:
    """The verdict at each :func:`sweep_points` setting, one sampled step each (its sampling error the
    planned setting's per-step spread, ``spread``): context scales MaxDocLen and the tokens per group
    together."""
    out = []
    for dp, ctx in sweep_points(cluster, training):
        cl = replace(cluster, gpus=dp * cluster.tp * cluster.pp)
        tr = replace(training, context=ctx, steps=1,
                     tokens_per_group=max(1, training.tokens_per_group * ctx // training.context))
        sim = simulate(model, cl, tr, docs, price=price, with_ring=False)
        methods = banded(sim, known, dp * tr.micro_batches * tr.tokens_per_group, spread)
        v = verdict(methods)
        out.append({"dp": dp, "gpus": cl.gpus, "context": ctx, "tokens_per_group": tr.tokens_per_group,
                    "baseline": v["baseline"], "speedup": v["speedup"], "speedup_band": v["speedup_band"],
                    "saving": v["saving"], "saving_band": v["saving_band"], "class": v["class"]})
        if progress:
            progress(1)
    return out


def work_units(cluster: Cluster, training: Training, with_sweep: bool = True) -> int:
    """Progress units of :func:`plan`: one per planned micro-batch and one per sweep point."""
    n = training.steps * training.micro_batches
    return n + (len(sweep_points(cluster, training)) if with_sweep else 0)


def plan(model, cluster: Cluster, training: Training, docs: Documents, *, with_sweep: bool = True,
         results_dir=None, progress=None, times: dict | None = None,
         cost: MeasuredCost | None = None, gpu: GpuTable | None = None) -> dict:
    """The what-if: inputs, per method the estimates with their bands, the verdict, the sweep and where
    the verdict flips, where the durations and the band come from, the first step's ranks; JSON-ready.
    ``times`` (the replay cache's format) and ``cost`` (a kernel table) price the batches
    (:mod:`cadlib.analysis.whatif.price`; default the committed H200 files); ``gpu``, a calibration of
    the user's GPU (:class:`~cadlib.analysis.whatif.gpu_table.GpuTable`), gives both."""
    model = as_model(model)
    t0 = time.perf_counter()
    if gpu is not None:
        times, cost = gpu.times, gpu.measured_cost()
    price = make_pricing(cluster, times, cost)
    errors_file = None if results_dir is None else \
        pathlib.Path(results_dir) / "replay" / "whatif_vs_replay.json"
    known = known_errors(price.backend, results_dir, errors_file)
    sim = simulate(model, cluster, training, docs, progress, price)
    tokens_per_step = cluster.dp * training.micro_batches * training.tokens_per_group
    methods = banded(sim, known, tokens_per_step)
    v = verdict(methods)
    pts = sweep(model, cluster, training, docs, known, spreads(methods), price, progress) \
        if with_sweep else []
    notes = []
    if sim["pricing"]["fallback"]:
        notes.append(sim["pricing"]["source"])
    if cluster.pp > 1 or training.micro_batches > 1:
        notes.append("pipeline stages and micro-batches are composed by 1F1B, which the committed replays "
                     "did not check: the composition error covers one stage and one micro-batch")
    if gpu is not None:
        sim["pricing"]["gpu_table"] = {"path": gpu.path, "label": gpu.label()}
        notes.append(f"priced from your GPU's calibration ({gpu.label()}); the composition error was "
                     "measured with the committed H200 tables")
    elif cost is not None or cluster.kernels:
        notes.append("attention priced from a kernel table of your own; the composition error was measured "
                     "with the committed H200 table")
    if known["missing"]:
        notes.append(f"no {' and no '.join(known['missing'])}: those errors are left out of the band")
    mem = cluster.gpu_mem_gib * GIB
    over = [k for k in methods if methods[k]["activation_bytes_max"] > mem]
    if over:
        notes.append(f"activations exceed the GPU's {cluster.gpu_mem_gib:g} GiB under "
                     f"{', '.join(LABELS[k] for k in over)} (no recompute: an upper bound)")
    spec = setting(model, cluster, training, docs).spec
    lengths = None if docs.lengths is None else np.asarray(docs.lengths)
    return {
        "inputs": {"model": asdict(model), "cluster": {**asdict(cluster), "dp": cluster.dp,
                                                       "dp_gbps": cluster.dp_gbps()},
                   "training": asdict(training), "documents": _doc_summary(docs, lengths, training)},
        "methods": methods, "verdict": v, "sweep": pts,
        "flips": [p for p in pts if p["class"] != v["class"]],
        "pricing": sim["pricing"],
        "band": {"errors": known, "source": BAND_SOURCE, "notes": notes},
        "ranks": {k: r["ranks"] for k, r in sim["methods"].items()},
        "ring": sim["ring"],
        "memory": {"gpu_memory_bytes": cluster.gpu_mem_gib * GIB,
                   "activation_bytes_per_token_per_layer": spec.activation_bytes_per_token()},
        "timing": {"plan_ms": sim["plan_ms"], "wall_s": time.perf_counter() - t0},
    }


BAND_SOURCE = ("half-width = sqrt(sampling^2 + composition^2 + replay^2): the 95% interval of the mean over "
               "the sampled steps, the what-if against the replay on every committed 3D setting, the replay "
               "against "
               "the measured runs (cadlib.analysis.whatif.band)")


def _doc_summary(docs: Documents, lengths, training: Training) -> dict:
    out = {"source": docs.label, "dist": docs.dist}
    if lengths is not None:
        out.update(n_lengths=int(lengths.size), mean=float(lengths.mean()), median=float(np.median(lengths)),
                   p99=float(np.percentile(lengths, 99)), max=int(lengths.max()),
                   longer_than_context=int(np.count_nonzero(lengths * training.elongate > training.context)))
        q = np.unique(np.quantile(lengths, np.linspace(0, 1, 101)))
        out["quantiles"] = q.tolist()
    return out

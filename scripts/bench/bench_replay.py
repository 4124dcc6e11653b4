"""The paper's scale on one GPU: time every rank's work of every sampled batch, then compose the steps.

Two steps (:mod:`cadlib.analysis.replay.settings` says what a rank's work is):

* ``time`` (a GPU): builds every setting's batches, plans and dispatches on the host and times, on this
  one GPU, every distinct kernel shape the steps need that the cache does not hold yet: each rank's
  attention-server call (the serve stage, forward and backward, on random buffers of the dispatch's
  sizes), one decoder layer's linear parts and the LM head on a grid of token counts, and one
  optimizer step. ``--linear`` says how the linear parts and head compute (``""``: the reference blocks
  on every token, the committed timings; ``fused-sp``: the fused blocks with sequence parallelism's
  norms on tokens / TP: :data:`cadlib.analysis.replay.times.LINEAR_VARIANTS`), under keys of their own;
  ``--linear-only`` times just those (every point of the grid) and the optimizer, no attention. The
  cache (``--cache``, JSON) grows across runs; a run stops at ``--budget-s`` and writes what it has, so
  the next one continues.
* ``shapes4d`` (any machine): the 4D settings (Table 4) need thousands of distinct server calls per
  batch (1,900-8,300 for the 128K rows), more than a session's device time can time; this lists
  every distinct call of each setting's first batch and samples ``--sample`` per setting, in
  proportion to their modelled time, into ``results/replay/shapes_4d_sample.json``; ``time --suite
  4d`` times them, and ``compose --suite 4d`` scales the kernel table to them. ``--suite paper4d``: the
  4D protocol's sweep over the configurations that fit (its first batch: 109,335 distinct calls, 117-34,290
  a setting, about 6,600 s of kernel time, so a sample again), into ``--shapes``.
* ``compose`` (any machine): composes every batch's step from the cache and the link model
  (:mod:`cadlib.analysis.model.compose`) and writes a JSON per setting under ``--out`` and the summary.

    python scripts/bench/bench_replay.py time --suite validation,3d --cache $OUT/replay_times.json \
        --budget-s 500
    python scripts/bench/bench_replay.py compose --suite validation,3d --cache results/replay/times_h200.json
    python scripts/bench/bench_replay.py shapes4d --sample 40        # Table 4: a sample of its server calls
    python scripts/bench/bench_replay.py time --suite 4d --cache $OUT/replay_times.json      # time the sample
    python scripts/bench/bench_replay.py compose --suite 4d --workers 2   # Table 4: PP, attention scaled
    python scripts/bench/bench_replay.py shapes4d --suite paper4d --backend torch_flash --sample 30 \
        --shapes results/replay/shapes_paper4d_sample.json    # the 4D protocol's sample, then time --suite 4d
    python scripts/bench/bench_replay.py compose --suite paper4d --backend torch_flash --linear fused-sp \
        --model-missing --fitting-only --workers 2    # Table 4 under the paper's protocol (DistCA's sweep)
    python scripts/bench/bench_replay.py time --suite 3d --only prolong_128k --linear fused-sp --linear-only \
        --cache $OUT/replay_times.json                       # the TP=8 shard's layers, fused, SP's norms
    python scripts/bench/bench_replay.py compose --suite validation,3d --linear fused-sp --tag _fused_sp
    python scripts/bench/bench_replay.py time --suite 3d --backend torch_flash --warmup 0 --retime-unpooled \
        --cache $OUT/replay_times.json --budget-s 500   # our earlier protocol's FA2 calls, as timed today
    python scripts/bench/bench_replay.py time --smoke --cache /tmp/t.json && \
        python scripts/bench/bench_replay.py compose --smoke --cache /tmp/t.json --out /tmp/replay     # CPU
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from cadlib.analysis.replay import calls as replay_calls
from cadlib.analysis.replay import phases as replay_phases
from cadlib.analysis.replay import protocol
from cadlib.analysis.replay import pipelined as replay4d
from cadlib.analysis.replay import settings4d
from cadlib.analysis.replay import results as replay_results
from cadlib.analysis.replay import settings as replay
from cadlib.analysis.replay import sweep4d
from cadlib.analysis.replay import times as replay_times
from cadlib.analysis.runs.e2e import load_committed
from cadlib.bench.inputs import ServeCall, rand
from cadlib.bench.layers import Head, blocks_of, sp_of, time_head, time_linear, time_optimizer
from cadlib.bench.timer import RESERVE_GIB, WARMUP, reserve_pool, time_phases
from cadlib.core.measured import MeasuredCost
from cadlib.infra.results import RESULTS_DIR, atomic_write_json, environment_info, load_result, save_result
from cadlib.runtime import kernels
from cadlib.runtime.device import to_device
from cadlib.runtime.model import DecoderLayer

SUITES = ("validation", "3d", "paper3d", "waterfall3d", "changes3d", "idle", "allgather", "smoke", "4d",
          "paper4d", "changes4d")
SWEEP_SUITES = ("paper4d", "changes4d")
"""The 4D protocol's suites (:func:`cadlib.analysis.replay.protocol.paper_4d`, its variants), composed by
:func:`cmd_compose_paper4d`."""
PAPER4D_SAMPLE = RESULTS_DIR / "replay" / "shapes_paper4d_sample.json"
"""The 4D protocol's timed sample of server calls (``shapes4d --suite paper4d``), which scales its table."""


def named(s, only: str) -> bool:
    """Whether setting ``s``'s name contains one of the comma-separated parts of ``only`` ("" = all)."""
    return any(part in s.name for part in only.split(","))


def settings(suites: list[str], batches: int | None, only: str = "",
             linear: str = "") -> list[replay.Setting]:
    """The settings of ``suites`` (``only``: those whose name contains it), composing the ``linear``
    variant's timings."""
    out = []
    for s in suites:
        if s == "validation":
            out += [replay.e2e_setting(it) for it in load_committed() if it["variant"] == ""]
        elif s == "3d":
            out += replay.paper_3d_settings(batches or 5)
        elif s in ("paper3d", "waterfall3d", "changes3d"):      # the paper's protocol, and our variants of it
            n = batches or protocol.PAPER_BATCHES_3D
            base = [x for d in protocol.PAPER_DISTS for x in protocol.paper_3d(d, n)]
            if s == "paper3d":
                out += base
            else:
                step = protocol.variant if s == "waterfall3d" else protocol.one_change
                out += [step(x, v.name) for x in base if named(x, only) for v in protocol.VARIANTS]
        elif s == "idle":
            out += replay.idle_settings(batches or 5)
        elif s == "allgather":
            out += replay.allgather_settings()
        elif s == "4d" or s in SWEEP_SUITES:
            continue                        # composed by cmd_compose_4d (cadlib.analysis.replay.pipelined)
        elif s == "smoke":
            out += replay.smoke_settings()
        else:
            raise SystemExit(f"unknown suite {s!r}; choose from: {', '.join(SUITES)}")
    out = [replace(s, linear=linear) for s in out if named(s, only)]
    if not out and "4d" not in suites and not set(suites) & set(SWEEP_SUITES):
        raise SystemExit(f"no setting of {suites} is named like {only!r}")
    return out


# ----------------------------------------------------------------------------------------- timing
def time_attention(d, spec, device, dtype, backend, gen, iters: int, warmup: int = WARMUP,
                   reserve_gib: float = 0.0) -> dict:
    """The serve stage of dispatch ``d``, forward then backward, on random buffers of its sizes; the
    median of ``iters`` timed runs after ``warmup`` untimed ones (``reserve_gib``: the pool the caller
    reserved, :func:`cadlib.bench.timer.reserve_pool`, recorded with the timing)."""
    call = ServeCall(to_device(d, device), spec, device, dtype, backend, gen)
    fw, bw = time_phases([call.forward, call.backward], device, iters=iters, warmup=warmup,
                         after=call.zero_grad)
    return {"fwd_ms": float(np.median(fw)), "bwd_ms": float(np.median(bw)), "iters": iters, "warmup": warmup,
            "reserve_gib": reserve_gib}


def _plan_batch(task):
    """A pool worker: one batch's work (host only): its distinct server calls and token counts."""
    s, b, rates, backend = task
    works = replay_phases.batch_work(s, b, rates)
    tokens = [np.concatenate([w.tokens.ravel(), (w.tokens.sum(0) if w.pingpong else w.tokens)])
              for w in works.values()]
    return s.name, b, replay_times.attention_jobs(works.values(), s.spec, backend), np.concatenate(tokens)


def time_segments(q_lens, kv_lens, spec, device, dtype, backend, gen, iters: int, warmup: int = WARMUP,
                  reserve_gib: float = 0.0) -> dict:
    """One fused causal call on merged segments (query and KV lengths), forward then backward; the
    median of ``iters`` timed runs after ``warmup`` untimed ones (``reserve_gib``: the pool reserved,
    recorded with the timing)."""
    cu_q = torch.tensor(np.r_[0, np.cumsum(q_lens)], dtype=torch.int32, device=device)
    cu_k = torch.tensor(np.r_[0, np.cumsum(kv_lens)], dtype=torch.int32, device=device)
    mq, mk = int(max(q_lens)), int(max(kv_lens))
    q = rand(gen, int(cu_q[-1]), spec.n_heads, spec.head_dim, device, dtype)
    k, v = (rand(gen, int(cu_k[-1]), spec.n_kv_heads, spec.head_dim, device, dtype) for _ in range(2))
    dout = torch.randn_like(q)

    def fwd():
        return kernels.attend(q, k, v, cu_q, cu_k, mq, mk, causal=True, backend=backend)

    def bwd(out_lse):
        kernels.attend_backward(dout, q, k, v, *out_lse, cu_q, cu_k, mq, mk, causal=True, backend=backend)
    fw, bw = time_phases([fwd, bwd], device, iters=iters, warmup=warmup)
    return {"fwd_ms": float(np.median(fw)), "bwd_ms": float(np.median(bw)), "iters": iters, "warmup": warmup,
            "reserve_gib": reserve_gib}


def time_again(a, times: dict) -> set | None:
    """The cached calls a ``time`` run times again (None: it times only what the cache lacks):
    ``--retime-keys``' list, the calls timed without a reserved pool (``--retime-unpooled``) or those whose
    times look like a kernel compile (``--retime``)."""
    if a.retime_keys:                       # a listed set (e.g. a merge's dropped outliers), cached or not
        again = set(a.retime_keys)
        why = "listed"
    elif a.retime_unpooled:                 # timed before reserve_pool existed: by-method bias up to 7%
        again = {k for k, e in times.items() if k.startswith(("attn|", "seg|")) and "reserve_gib" not in e
                 and not e.get("modelled")}
        why = "timed without a reserved pool"
    elif a.retime:
        again, why = set(replay_times.compile_suspects(times)), "that look like compiles"
    else:
        return None
    print(f"timing again those of these settings among {len(again)} calls {why}", flush=True)
    return again


def time_4d(a, cache, save, device, dtype, pool_gib: float = 0.0) -> int:
    """The sampled 4D server calls (``shapes4d``) that the cache lacks."""
    sample = load_result(a.shapes)["results"]
    times, t0 = cache["times"], time.perf_counter()
    gen = torch.Generator(device=device).manual_seed(0)
    spec = settings4d.paper_4d_settings(1)[0].spec
    backend = kernels.resolve_backend(a.backend, device, dtype, spec.head_dim)
    jobs = [(replay_times.key_for_backend(k, backend), sh) for k, sh in sample["shapes"].items()]
    again = time_again(a, times) or set()
    jobs = [(k, sh) for k, sh in jobs if k not in times or k in again]
    done = 0
    for k, sh in jobs:
        if time.perf_counter() - t0 > a.budget_s:
            break
        times[k] = {
            **time_segments(sh["q"], sh["kv"], spec, device, dtype, backend, gen, a.iters, a.warmup,
                            pool_gib),
            "setting": sh["setting"]}
        done += 1
        if done % 50 == 0:
            print(f"[{time.perf_counter() - t0:5.0f} s] {done}/{len(jobs)} sampled 4D calls", flush=True)
    save()
    print(f"timed {done} of {len(jobs)} sampled 4D calls in {time.perf_counter() - t0:.0f} s")
    return 0 if done == len(jobs) else 3


def cmd_time(a) -> int:
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cache_path = Path(a.cache)
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    times = cache.setdefault("times", {})
    t_start = time.perf_counter()
    pool_gib = reserve_pool(device, a.reserve_gib) / 2**30     # what each timing records
    if a.suite == "4d":
        def save4d():
            cache["meta"] = environment_info()
            atomic_write_json(cache_path, cache)
        return time_4d(a, cache, save4d, device, dtype, pool_gib)
    rates = replay_phases.link_rates(load_result("comm_overlap_probe_2xh200_nvlink.json"),
                                     load_result("comm_overlap_probe_2xh200_inter-node-like.json"))
    todo = settings(a.suite.split(","), a.batches, a.only, a.linear)
    if a.linear_only:                       # no attention runs: the backend only labels the keys
        backends = {s.name: a.backend or "fa4" for s in todo}
    else:
        backends = {s.name: kernels.resolve_backend(a.backend, device, dtype, s.spec.head_dim) for s in todo}
    by_name = {s.name: s for s in todo}
    # batch-major: a run that stops at its budget has timed the first batches of every setting
    tasks = [(s, b, rates, backends[s.name]) for b in range(max(s.batches for s in todo)) for s in todo
             if b < s.batches]
    gen = torch.Generator(device=device).manual_seed(0)
    done = skipped = 0
    again = time_again(a, times)
    tokens: dict[str, list] = {s.name: [] for s in todo}

    def save():
        if a.linear_only:                   # the attention calls' provenance stays the cache's meta
            cache.setdefault("meta_linear", {})[a.linear or "reference"] = environment_info()
        else:
            cache["meta"] = environment_info()
        atomic_write_json(cache_path, cache)

    def over() -> bool:
        return time.perf_counter() - t_start > a.budget_s

    def finish(s, grid=None):
        """The linear layers, the head and the optimizer of setting ``s``'s shard (at ``grid``'s token
        counts; by default those its batches need), computed the ``s.linear`` way."""
        spec, backend, var = s.spec, backends[s.name], s.linear
        grid = replay_times.grid_points(np.concatenate(tokens[s.name])) if grid is None else grid
        layer = DecoderLayer(spec, recompute="mlp", blocks=blocks_of(var), dtype=dtype, device=device)
        head = Head(spec, device, dtype, blocks_of(var))
        for n in grid:
            sp = sp_of(var, s.tp, n, s.spec, device, dtype)
            for key, fn in ((replay_times.linear_key(spec, backend, n, var, s.tp),
                             lambda: time_linear(layer, spec, n, device, dtype, max(2, a.iters), sp)),
                            (replay_times.head_key(spec, backend, n, var, s.tp),
                             lambda: time_head(head, spec, n, device, max(2, a.iters), sp))):
                if key not in times and not over():
                    times[key] = {**fn(), "linear": var or "reference", "tp": s.tp}
        key = replay_times.optimizer_key(spec, backend)
        if key not in times and not over():
            times[key] = time_optimizer(spec, device, dtype, 3)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            reserve_pool(device, a.reserve_gib)

    if a.linear_only:                       # every grid point of each distinct shard, no attention
        seen = set()
        for s in todo:
            if (s.spec, s.tp) not in seen:
                seen.add((s.spec, s.tp))
                finish(s, replay_times.LINEAR_GRID)
                save()
                print(f"[{time.perf_counter() - t_start:6.0f} s] {s.name}'s shard: linear grid "
                      f"({a.linear or 'reference'}) timed", flush=True)
        return 0 if not over() else 3
    # the host plans batches in worker processes (started before CUDA) while this one times
    with multiprocessing.get_context("fork").Pool(max(1, min(a.workers, len(tasks)))) as pool:
        left = {s.name: s.batches for s in todo}
        for name, b, jobs, toks in pool.imap(_plan_batch, tasks):
            s = by_name[name]
            tokens[name].append(toks)
            jobs = {k: d for k, d in jobs.items() if (k in again if again is not None else k not in times)}
            for k, d in jobs.items():
                if over():
                    skipped += 1
                    continue
                times[k] = time_attention(d, s.spec, device, dtype, backends[name], gen, a.iters, a.warmup,
                                          pool_gib)
                if again is not None:       # timed once again: a later batch's same call is done
                    again.discard(k)
                done += 1
            print(f"[{time.perf_counter() - t_start:6.0f} s] {name} batch {b}: {len(jobs)} new calls "
                  f"({done} timed, {skipped} left over budget)", flush=True)
            left[name] -= 1
            if not left[name]:
                finish(s)
                save()
    save()
    print(f"timed {done} attention calls in {time.perf_counter() - t_start:.0f} s; {skipped} left over the "
          f"budget; cache {cache_path} holds {len(times)} shapes")
    return 0 if not skipped else 3


# ---------------------------------------------------------------------------------------- compose
def cmd_compose(a) -> int:
    cache = json.loads(Path(a.cache).read_text())
    times, meta = cache["times"], cache.get("meta", {})
    if a.more_times:                        # timings of another session, for the shapes the cache lacks
        more = json.loads(Path(a.more_times).read_text())["times"]
        times = {**{k: v for k, v in more.items() if k not in times}, **times}
    derived = None
    if a.derive_from:
        times, derived = replay_times.derive_backend(times, a.backend or "fa4", a.derive_from)
        print(f"{a.backend or 'fa4'} from {a.derive_from} where not timed: {derived}")
    rates = replay_phases.link_rates(load_result("comm_overlap_probe_2xh200_nvlink.json"),
                                     load_result("comm_overlap_probe_2xh200_inter-node-like.json"))
    backend = a.backend or "fa4"
    if "4d" in a.suite.split(","):
        return cmd_compose_4d(a, times, meta, rates, backend)
    if set(a.suite.split(",")) & set(SWEEP_SUITES):
        return cmd_compose_paper4d(a, cache, times, meta, rates, backend)
    out_dir = Path(a.out)
    summary = []
    model_check = None
    if a.model_missing:
        cost = MeasuredCost.load(RESULTS_DIR / "kernel_profile_h200.json", backend)
        # the scale: measured / predicted over the timed calls of the settings composed here (the first
        # --fit-batches batches of each: by default all), else of the earlier replay's first three settings
        todo = settings(a.suite.split(","), a.batches, a.only, a.linear)
        fit_on = todo
        nb = a.fit_batches or max(s.batches for s in todo)
        try:
            model_check = replay_calls.kernel_model_check(fit_on, cache["times"], cost, backend, rates, nb)
        except ValueError:
            fit_on = replay.paper_3d_settings()[:3]
            model_check = replay_calls.kernel_model_check(fit_on, cache["times"], cost, backend, rates, nb)
        model_check["fit_batches"] = nb
        print(f"kernel table against the timed calls: {model_check}")
        if a.untimed == "call-model":       # per call and method, fitted on the same timed calls
            model_check["call_model"] = replay_calls.call_model(fit_on, cache["times"], cost, backend, rates,
                                                                nb)
            model_check["untimed"] = "call-model"
        else:
            model_check["untimed"] = "scale"
        untimed = model_check.get("call_model") or model_check["scale"]
        sample = replay_results.sample_check(todo, cache["times"], cost, backend, rates, untimed)
        if sample:
            errs = [r["step_err"] for r in sample]
            sp = [r["speedup_modelled"] - r["speedup_timed"] for r in sample if "speedup_timed" in r]
            model_check["sample_check"] = sample
            print(f"the batches timed call by call, all their calls from the table instead: steps "
                  f"{min(errs):+.3f}..{max(errs):+.3f}, speedups over WLB-ideal "
                  f"{min(sp, default=0):+.3f}..{max(sp, default=0):+.3f}")
    for s in settings(a.suite.split(","), a.batches, a.only, a.linear):
        if model_check is not None:
            for b in range(s.batches):
                works = replay_phases.batch_work(s, b, rates)
                times.update(replay_calls.price_untimed(works, s.spec, backend, cost, untimed, times))
        res = replay_results.replay_setting(s, times, rates, backend)
        if res is None:
            print(f"{s.name}: shapes missing from the cache; run `time` first")
            continue
        save_result(out_dir / f"replay_{s.name}{a.tag}.json",
                    {**replay_results.setting_config(s, rates, backend, meta), "derived_times": derived,
                     "kernel_model": model_check}, res)
        summary += res["summary"]
        print(replay_results.summary_line(s, res), flush=True)
    if summary:
        save_result(out_dir / f"replay_summary{a.tag}.json", {"cache": str(a.cache), "times_meta": meta,
                                                               "rates_gbps": rates, "backend": backend,
                                                               "derived_times": derived,
                                                               "kernel_model": model_check}, summary)
    return 0


def _shapes_4d(job):
    """A pool worker: the distinct server calls of a 4D setting's first ``batches`` steps, with their
    modelled time; under the 4D protocol (``paper``), over the configurations of DistCA's grid that the
    memory model fits (those the headline replays)."""
    s, times, rates, backend, cost, batches, paper = job
    price = replay_times.SegmentPrice(s.spec, backend, cost, record=True)
    if paper:
        sweep4d.replay_sweep(replace(s, batches=batches), times, rates, backend, price, only_fitting=True)
    else:
        replay4d.replay_setting_4d(replace(s, batches=batches), times, rates, backend, price)
    return s, price.shapes


def cmd_shapes4d(a) -> int:
    """Sample each 4D setting's server calls, in proportion to their modelled time (seed 0); with
    ``--all``, every distinct call of its first ``--batches`` steps (a full timing, to check the sample
    against)."""
    cache = json.loads(Path(a.cache).read_text())
    rates = replay_phases.link_rates(load_result("comm_overlap_probe_2xh200_nvlink.json"),
                                     load_result("comm_overlap_probe_2xh200_inter-node-like.json"))
    backend = a.backend or "fa4"
    cost = MeasuredCost.load(RESULTS_DIR / "kernel_profile_h200.json", backend)
    paper = "paper4d" in a.suite.split(",")        # the 4D protocol's sweep, else our earlier 4D settings
    todo = sweep_settings(["paper4d"], 1, a.only) if paper else \
        [s for s in settings4d.paper_4d_settings(1) if named(s, a.only)]
    batches = (a.batches or 3) if a.all else 1
    rng, out, counts = np.random.default_rng(0), {}, {}
    jobs = [(s, cache["times"], rates, backend, cost, batches, paper) for s in todo]
    with multiprocessing.get_context("spawn").Pool(max(1, min(a.workers, len(todo)))) as pool:
        for s, shapes in pool.imap_unordered(_shapes_4d, jobs):
            keys = sorted(shapes)
            w = np.array([shapes[k]["model_ms"] for k in keys])
            pick = np.arange(len(keys)) if a.all else \
                rng.choice(len(keys), size=min(a.sample, len(keys)), replace=False, p=w / w.sum())
            for i in pick:
                out[keys[i]] = {**shapes[keys[i]], "setting": s.name}
            counts[s.name] = {"distinct": len(keys), "model_s": float(w.sum() / 1e3),
                              "sampled": int(pick.size)}
            print(f"{s.name}: {len(keys)} distinct calls, {w.sum() / 1e3:.0f} s modelled; "
                  f"sampled {pick.size}", flush=True)
    cfg = {"suite": "paper4d" if paper else "4d", "sample_per_setting": "all" if a.all else a.sample,
           "batches": batches, "seed": 0,
           "backend": backend, "weights": "modelled fwd+bwd time", "per_setting": counts}
    path = save_result(Path(a.shapes), cfg, {"shapes": out})
    print(f"{len(out)} calls -> {path}")
    return 0


def _one_4d(job):
    s, times, rates, backend, cost, scale = job
    price = replay_times.SegmentPrice(s.spec, backend, cost, scale, times)
    return s, replay4d.replay_setting_4d(s, times, rates, backend, price)


def cmd_compose_4d(a, times, meta, rates, backend) -> int:
    """The 4D settings (Table 4): attention from the kernel table scaled to the timed FA4 calls, the
    linear layers, head and optimizer from the cache; one process per setting (``--workers``)."""
    cost = MeasuredCost.load(RESULTS_DIR / "kernel_profile_h200.json", backend)
    shapes_path = Path(a.shapes)
    shapes = load_result(shapes_path)["results"]["shapes"] if shapes_path.exists() else {}
    spec = settings4d.paper_4d_settings(1)[0].spec
    check = replay_times.segment_model_check(times, shapes, cost, spec, backend)
    if check is None:
        check = replay_calls.kernel_model_check(replay.paper_3d_settings()[:3], times, cost, backend, rates)
    print(f"kernel table against the timed calls: {check}", flush=True)
    todo = [replace(s, linear=a.linear) for s in settings4d.paper_4d_settings(a.batches or 3)
            if named(s, a.only)]
    jobs = [(s, times, rates, backend, cost, check["scale"]) for s in todo]
    out_dir, summary = Path(a.out), []
    with multiprocessing.get_context("spawn").Pool(max(1, min(a.workers, len(jobs)))) as pool:
        for s, res in pool.imap_unordered(_one_4d, jobs):
            cfg = {k: getattr(s, k) for k in s.__dataclass_fields__}
            save_result(out_dir / f"replay_{s.name}{a.tag}.json",
                        {**cfg, "configs": s.configs(), "backend": backend, "kernel_model": check,
                         "rates_gbps": rates, "times_meta": meta, "memory_slack": replay4d.MEMORY_SLACK,
                         "head_fwd_share": replay4d.HEAD_FWD_SHARE}, res)
            summary += res["summary"]
            best = {r["method"]: r for r in res["summary"] if r["view"] == "budget"}
            print(f"{s.name}: " + ", ".join(f"{m} {r['step_s_mean']:.2f} s (pp {r['pp']}, cp {r['cp']})"
                                            for m, r in best.items()), flush=True)
    summary.sort(key=lambda r: (r["setting"], r["view"], replay4d.METHODS_4D.index(r["method"])))
    save_result(out_dir / f"replay_summary_4d{a.tag}.json", {"cache": str(a.cache), "times_meta": meta,
                                                      "more_times": a.more_times,
                                                      "backend": backend, "kernel_model": check,
                                                      "rates_gbps": rates}, summary)
    return 0


def sweep_settings(suites: list[str], batches: int | None, only: str = "", linear: str = "") -> list:
    """The 4D protocol's settings of ``suites``: ``paper4d`` (Table 4's 8B rows, both datasets) and
    ``changes4d`` (each of :data:`cadlib.analysis.replay.protocol.VARIANTS_4D` on its own)."""
    n = batches or protocol.PAPER_BATCHES_4D
    base = [x for d in protocol.PAPER_DISTS for x in protocol.paper_4d(d, n) if named(x, only)]
    out = list(base) if "paper4d" in suites else []
    if "changes4d" in suites:
        out += [protocol.one_change_4d(x, v.name) for x in base for v in protocol.VARIANTS_4D]
    return [replace(x, linear=linear) for x in out]


def _one_sweep(job):
    s, times, rates, backend, cost, scale, only_fitting = job
    t0 = time.time()
    price = replay_times.SegmentPrice(s.spec, backend, cost, scale, times)
    res = sweep4d.replay_sweep(s, times, rates, backend, price, only_fitting=only_fitting)
    return s, res, time.time() - t0


def cmd_compose_paper4d(a, cache, times, meta, rates, backend) -> int:
    """Table 4 under the paper's protocol (:mod:`cadlib.analysis.replay.sweep4d`): every configuration of
    DistCA's grid (``--fitting-only``: those that fit in memory) of every step. Attention: the calls the
    cache timed, the others from the kernel table times measured / predicted over the timed sample of the
    4D protocol's calls (``shapes4d --suite paper4d``; without one, over the 3D protocol's timed calls of
    this backend). ``--model-missing`` says so; without it an untimed call is an error."""
    if not a.model_missing:
        raise SystemExit("paper4d prices the server calls nobody timed from the kernel table: "
                         "pass --model-missing")
    cost = MeasuredCost.load(RESULTS_DIR / "kernel_profile_h200.json", backend)
    t0 = time.time()
    kernel = "FA2" if backend == "torch_flash" else backend
    spec = protocol.paper_4d(next(iter(protocol.PAPER_DISTS)), 1)[0].spec
    sample = load_result(PAPER4D_SAMPLE)["results"]["shapes"] if PAPER4D_SAMPLE.exists() else {}
    check = replay_times.segment_model_check(times, sample, cost, spec, backend)
    if check is not None:                   # the 4D protocol's own calls, timed as it prices them
        check["note"] = (f"modelled from kernel table, scale from {check['calls']:,} timed {kernel} calls "
                         f"sampled from the 4D protocol's first batch ({PAPER4D_SAMPLE.name})")
    else:                                   # served 3D calls: their scale includes what serving adds
        base3d = [replace(x, batches=1) for d in protocol.PAPER_DISTS for x in protocol.paper_3d(d, 1)]
        check = replay_calls.kernel_model_check(base3d, cache["times"], cost, backend, rates, batches=1)
        check["note"] = (f"modelled from kernel table, scale from the 3D protocol's {check['calls']:,} timed "
                         f"{kernel} calls (batch 0 of every paper3d setting)")
    print(f"kernel table against the timed calls ({time.time() - t0:.0f} s): {check}", flush=True)
    todo = sweep_settings(a.suite.split(","), a.batches, a.only, a.linear)
    if not todo:
        raise SystemExit(f"no 4D protocol setting is named like {a.only!r}")
    jobs = [(s, times, rates, backend, cost, check["scale"], a.fitting_only) for s in todo]
    tag = a.tag or "_paper"
    out_dir, summary = Path(a.out), []
    with multiprocessing.get_context("spawn").Pool(max(1, min(a.workers, len(jobs)))) as pool:
        for s, res, wall in pool.imap_unordered(_one_sweep, jobs):
            cfg = {k: getattr(s, k) for k in s.__dataclass_fields__}
            save_result(out_dir / f"replay_{s.name}{tag}.json",
                        {**cfg, "protocol": "paper_4d", "tokens_per_step": s.total_tokens,
                         "grid": "DistCA's zconfig grid (cadlib.core.paper.DISTCA_ZCONFIG)",
                         "memory_model": "cadlib.core.memory.configs, Megatron profile, recompute mlp",
                         "fitting_only": a.fitting_only, "backend": backend, "linear": a.linear,
                         "kernel_model": check, "attention": check["note"], "rates_gbps": rates,
                         "times_meta": meta, "wall_s": wall}, res)
            summary += res["summary"]
            best = {r["method"]: r for r in res["summary"] if r["view"] == "paper"}
            cad = best.get("cad-pingpong", {})
            line = ", ".join(f"{m} {r['step_s_mean']:.2f}±{r['step_s_se']:.2f} s "
                             f"(pp {r['pp']}, cp {r['cp']}, mb {r['n_micro']})" for m, r in best.items())
            if "speedup_over_wlb" in cad:
                sp, se = cad["speedup_over_wlb"], cad["speedup_se"]
                line += f"; speedup {sp:.3f}±{se:.3f}"
            print(f"{s.name} ({wall:.0f} s): {line}", flush=True)
    summary.sort(key=lambda r: (r["setting"], r["view"], r["method"]))
    save_result(out_dir / f"replay_summary_4d{tag}.json",
                {"cache": str(a.cache), "suites": a.suite, "batches": a.batches or protocol.PAPER_BATCHES_4D,
                 "backend": backend, "linear": a.linear, "kernel_model": check, "attention": check["note"],
                 "fitting_only": a.fitting_only, "rates_gbps": rates, "times_meta": meta,
                 "wall_s": time.time() - t0}, summary)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=("time", "compose", "shapes4d"))
    ap.add_argument("--suite", default="validation,3d", help=f"comma-separated: {', '.join(SUITES)}")
    ap.add_argument("--smoke", action="store_true", help="the CPU smoke suite (tiny model, sdpa_ref)")
    ap.add_argument("--cache", default=str(RESULTS_DIR / "replay" / "times_h200.json"))
    ap.add_argument("--out", default=str(RESULTS_DIR / "replay"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--more-times", default=None,
                    help="compose: a second cache whose shapes are used where --cache lacks them")
    ap.add_argument("--only", default="",
                    help="only the settings whose name contains this (comma-separated: any of these)")
    ap.add_argument("--batches", type=int, default=None, help="batches per paper setting (default 5)")
    ap.add_argument("--budget-s", type=float, default=math.inf)
    ap.add_argument("--iters", type=int, default=1, help="timed runs per attention call (median)")
    ap.add_argument("--warmup", type=int, default=WARMUP,
                    help="untimed runs before each attention call's timed ones (0 halves the time of a "
                         "kernel that compiles nothing per shape, as torch_flash; a first-run outlier is "
                         "caught by --retime's screen, which trusts only warmed-up entries)")
    ap.add_argument("--reserve-gib", type=float, default=RESERVE_GIB,
                    help="GiB the caching allocator holds before the attention calls are timed, so that "
                         "none pays cudaMalloc (cadlib.bench.timer.reserve_pool; 0: none)")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--untimed", default="call-model", choices=("call-model", "scale"),
                    help="with --model-missing, how an untimed 3D call is priced from the kernel table: "
                         "per call and method, fitted on the timed calls (cadlib.analysis.replay.calls), or "
                         "one scale over them")
    ap.add_argument("--fit-batches", type=int, default=None,
                    help="with --model-missing, the first this many batches of each setting whose timed "
                         "calls the scale and the call model are fitted on (default: all; 2 before the "
                         "protocol's later batches were timed)")
    ap.add_argument("--model-missing", action="store_true",
                    help="compose: server calls nobody timed from the kernel table, scaled to the timed ones")
    ap.add_argument("--derive-from", default=None,
                    help="compose: where --backend was not timed, scale this backend's times (fitted ratio)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--linear", default="", choices=tuple(replay_times.LINEAR_VARIANTS),
                    help="time / compose: how the linear layers and head compute (cadlib.analysis.replay."
                         "times.LINEAR_VARIANTS; '' the committed reference timings, fused-sp the fused "
                         "blocks with sequence parallelism's norms on tokens / TP)")
    ap.add_argument("--linear-only", action="store_true",
                    help="time: only the linear layers, head and optimizer, at every point of the grid")
    ap.add_argument("--retime", action="store_true",
                    help="time: only the cached calls whose times look like a compile "
                         "(cadlib.analysis.replay.times.compile_suspects), again, with a warm-up")
    ap.add_argument("--retime-keys", default=None,
                    help="time: only the calls a JSON list of keys names (cached or not), again, with "
                         "--warmup's warm-up: e.g. the calls a merge dropped as first-run outliers")
    ap.add_argument("--retime-unpooled", action="store_true",
                    help="time: only the cached calls timed before the pool was reserved (no reserve_gib), "
                         "again (results/replay/retime_sample_3d_fa2_h200.json: such timings differ by "
                         "method by up to 7%%); a run that stops at its budget leaves the rest for the next")
    ap.add_argument("--shapes", default=str(RESULTS_DIR / "replay" / "shapes_4d_sample.json"),
                    help="shapes4d: where to write the 4D sample; time --suite 4d: the sample to time")
    ap.add_argument("--sample", type=int, default=40, help="shapes4d: calls sampled per 4D setting")
    ap.add_argument("--all", action="store_true",
                    help="shapes4d: every distinct call of the first --batches steps (default 3), "
                         "not a sample")
    ap.add_argument("--fitting-only", action="store_true",
                    help="paper4d: replay only the configurations the memory model fits (no 'any' view)")
    ap.add_argument("--workers", type=int, default=12, help="processes planning batches beside the timing")
    a = ap.parse_args(argv)
    if a.smoke:
        a.suite, a.device = "smoke", "cpu"
        a.backend = a.backend or "sdpa_ref"
    if a.warmup < 0:
        ap.error(f"--warmup must be >= 0, got {a.warmup}")
    if a.reserve_gib < 0:
        ap.error(f"--reserve-gib must be >= 0, got {a.reserve_gib}")
    if sum(map(bool, (a.retime, a.retime_keys, a.retime_unpooled))) > 1:
        ap.error("choose one of --retime, --retime-keys and --retime-unpooled")
    if a.retime_keys:                       # read once, here: a bad file stops before any timing
        try:
            keys = json.loads(Path(a.retime_keys).read_text())
        except (OSError, ValueError) as e:
            keys = e
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            ap.error(f"--retime-keys {a.retime_keys!r} is not a JSON list of cache keys ({keys!s:.80}); "
                     "merge_replay_times.py --dropped-out writes one")
        a.retime_keys = keys
    if a.fit_batches is not None and a.fit_batches < 1:
        ap.error(f"--fit-batches must be >= 1, got {a.fit_batches}")
    if a.iters < 1 or (a.batches is not None and a.batches < 1) or a.sample < 1:
        ap.error("--iters, --batches and --sample must be >= 1")
    if a.command == "shapes4d":
        return cmd_shapes4d(a)
    return cmd_time(a) if a.command == "time" else cmd_compose(a)


if __name__ == "__main__":
    sys.exit(main())

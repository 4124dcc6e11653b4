"""Attention-server benchmark: (1) kernel composability and (2) the CAD server's overhead.

(1) **composability** (``scripts/bench/server_composability.py``): a causal document of L tokens is cut
    into query shards of s tokens served by ONE server in one fused call, ``--kv-share`` ``merged``
    (contiguous shards as one segment over one KV copy, :mod:`cadlib.dispatch.kvshare`), ``copy`` (the
    server's reference path: one KV prefix copy per shard) or ``kernel`` (the kernel alone on per-shard
    copies, as the committed ``..._lpt_*.json`` files); ``--patterns all`` (every shard on the server) or
    ``alternate`` (every other shard: they cannot merge). TF/s are compared with the unsplit document.
    A case whose estimated memory exceeds ``--mem-budget-gb`` is skipped, with the reason recorded.
(2) **overhead**: the whole CAD attention step (``cadlib.runtime.stages.cad_attention``: plan -> metadata ->
    all-to-all -> one fused kernel per server -> return) against the raw fused kernel on the tasks
    this server received, for ``pretrain`` and ``prolong`` batches of 64K and 128K tokens per GPU;
    the all-to-alls are also timed on their own (events around blocking collectives) to give the
    fraction of the step spent communicating.

Run::

    python scripts/bench/bench_attention_server.py --part composability          # 1 GPU
    python scripts/bench/bench_attention_server.py --part composability --doc-lens 16384,65536 \
        --shards 128,512,1024,2048 --kv-share merged,copy --backends fa4   # KV sharing vs per-shard copies
    python scripts/bench/bench_attention_server.py --part overhead               # 1 GPU
    torchrun --nproc-per-node=2 scripts/bench/bench_attention_server.py --part overhead   # 2 GPUs
    python scripts/bench/bench_attention_server.py --smoke                        # CPU, sdpa_ref, tiny
    torchrun --nproc-per-node=2 scripts/bench/bench_attention_server.py --smoke --part overhead  # 2x gloo

Writes ``results/bench_attention_server_<part>_<world>gpu[_smoke].json`` (atomically, with device,
torch version, commit, date, backend versions and the full configuration) and prints a table.
Targets are reported, not asserted: server forward >= 0.95 of the unsplit kernel's TF/s for
shards >= 512 tokens; fa4 on the server >= 60% of ``cost.H200_MATMUL_TFLOPS`` in fwd+bwd.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from server_composability import run_composability

from cadlib.bench.inputs import rand
from cadlib.bench.meters import backend_versions, peak_gb, reset_peak, tflops
from cadlib.bench.timer import Clock, time_fn
from cadlib.core.cost import H200_MATMUL_TFLOPS, MIN_SHARD_TOKENS, ModelSpec, causal_pairs
from cadlib.data.packing import pack
from cadlib.data.workload import sample_docs
from cadlib.infra.groups import init_from_env
from cadlib.infra.results import RESULTS_DIR, save_result
from cadlib.runtime import kernels, stages
from cadlib.scheduling.scheduler import schedule

GPU_BACKENDS = ("fa4", "torch_flash", "flash_attn")


@dataclass
class Config:
    model: str = "llama3-8b"
    dtype: str = "bfloat16"
    doc_lens: list = field(default_factory=lambda: [16384, 65536])
    shards: list = field(default_factory=lambda: [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384])
    dists: list = field(default_factory=lambda: ["pretrain", "prolong"])
    tokens_per_gpu: list = field(default_factory=lambda: [65536, 131072])
    order: str = "lpt"  # composability call order: "lpt" (longest KV prefix first, like the server), "doc"
    warmup: int = 3
    iters: int = 10
    mem_budget_gb: float = 125.0          # an H200 holds ~143 GB; OOM is caught and recorded too
    min_shard: int = MIN_SHARD_TOKENS
    tolerance: float = 0.1
    seed: int = 0
    backends: list = field(default_factory=list)
    kv_share: list = field(default_factory=lambda: ["merged", "copy"])   # composability server modes
    patterns: list = field(default_factory=lambda: ["all"])              # composability shard patterns
    smoke: bool = False

    @classmethod
    def smoke_config(cls) -> "Config":
        return cls(model="tiny", doc_lens=[256, 1024], shards=[16, 32, 64, 128, 256],
                   tokens_per_gpu=[512, 1024], warmup=1, iters=2, mem_budget_gb=0.01, min_shard=32,
                   kv_share=["merged", "copy", "kernel"], patterns=["all", "alternate"], smoke=True)


# ---------------------------------------------------------------------------------------------------
# (2) Server overhead
# ---------------------------------------------------------------------------------------------------

class TimedAllToAll:
    """The all-to-all of :class:`cadlib.runtime.comm.AllToAll`, run blocking between two marks of a
    :class:`cadlib.bench.timer.Clock` (CUDA events on the current stream, or the wall clock on the CPU),
    to measure communication alone."""

    def __init__(self, group, device):
        self.group, self.clock, self.spans = group, Clock(device), []

    def start(self, send, send_splits, recv_splits, fill=None):
        recv = send.new_empty((int(sum(recv_splits)), *send.shape[1:]))
        a = self.clock.mark()
        dist.all_to_all_single(recv, send.contiguous(), list(recv_splits), list(send_splits),
                               group=self.group)
        self.spans.append((a, self.clock.mark()))
        return _Ready(recv)

    def take_ms(self) -> float:
        self.clock.sync()
        ms = sum(self.clock.ms(a, b) for a, b in self.spans)
        self.spans = []
        return ms


class _Ready:
    def __init__(self, recv):
        self.recv = recv

    def wait(self):
        return self.recv


def make_plan(layout, spec: ModelSpec, cfg: Config):
    """The CAD scheduler's plan (``cadlib.scheduling.scheduler.schedule``), timed by the caller."""
    return schedule(layout, model=spec, tolerance=cfg.tolerance, min_shard=cfg.min_shard)


def _time_steps(rec, plan, spec, dtype, rt, backend, cfg, gen, flops) -> None:
    """The whole CAD step (dispatch, all-to-all, fused kernel, return), forward and fwd+bwd; then the
    same with every all-to-all blocking and timed, for the fraction of the step spent communicating."""
    n = rec["n_local"]
    q = rand(gen, n, spec.n_heads, spec.head_dim, rt.device, dtype)
    k, v = (rand(gen, n, spec.n_kv_heads, spec.head_dim, rt.device, dtype) for _ in range(2))
    dout = torch.randn_like(q)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

    def step_fwd(comm=None):
        with torch.no_grad():
            stages.cad_attention(q, k, v, plan, rt.group, attn_backend=backend, comm=comm)

    def step_fb(comm=None):
        qg.grad = kg.grad = vg.grad = None
        stages.cad_attention(qg, kg, vg, plan, rt.group, attn_backend=backend, comm=comm).backward(dout)

    for mode, fn in (("fwd", step_fwd), ("fwd_bwd", step_fb)):
        t = time_fn(fn, rt.device, iters=cfg.iters, warmup=cfg.warmup, group=rt.group)
        rec[f"step_{mode}_ms"] = t["median_ms"]
        rec[f"step_{mode}_tflops"] = tflops(flops[mode], t["median_ms"])
        timed = TimedAllToAll(rt.group, rt.device)
        comm_ms, step_ms = [], []
        for _ in range(cfg.iters):
            t = time_fn(lambda: fn(timed), rt.device, iters=1, warmup=0, group=rt.group)
            step_ms.append(t["median_ms"])
            comm_ms.append(timed.take_ms())
        rec[f"comm_{mode}_ms"] = statistics.median(comm_ms)
        rec[f"step_timed_comm_{mode}_ms"] = statistics.median(step_ms)
        rec[f"comm_{mode}_fraction"] = statistics.median(c / s for c, s in zip(comm_ms, step_ms))
    rec["step_peak_gb"] = peak_gb(rt.device)


def _time_raw(rec, dd, spec, dtype, rt, backend, cfg, gen, flops) -> None:
    """The raw fused kernel on this server's received tasks, laid out as the server's default
    (merged) call lays them out: same segments, cu_q/cu_k and shapes."""
    m, sh = dd.meta, dd.shared
    q = rand(gen, len(m.q_rows), spec.n_heads, spec.head_dim, rt.device, dtype)
    k, v = (rand(gen, sh.meta.kv_rows.size, spec.n_kv_heads, spec.head_dim, rt.device, dtype)
            for _ in range(2))
    dout = torch.randn_like(q)
    rec["raw_segments"], rec["raw_kv_tokens"] = sh.meta.n_segments, int(sh.meta.kv_rows.size)

    def raw_fwd():
        return kernels.attend(q, k, v, sh.cu_q, sh.cu_k, sh.meta.max_q, sh.meta.max_k, backend=backend)

    def raw_fb():
        o, lse = raw_fwd()
        kernels.attend_backward(dout, q, k, v, o, lse, sh.cu_q, sh.cu_k, sh.meta.max_q, sh.meta.max_k,
                                backend=backend)

    for mode, fn in (("fwd", raw_fwd), ("fwd_bwd", raw_fb)):
        t = time_fn(fn, rt.device, iters=cfg.iters, warmup=cfg.warmup)
        rec[f"raw_{mode}_ms"] = t["median_ms"]
        rec[f"raw_{mode}_tflops"] = tflops(flops[mode], t["median_ms"])
        rec[f"step_over_raw_{mode}"] = rec[f"step_{mode}_ms"] / t["median_ms"]


def _time_unsplit(rec, docs, spec, dtype, rt, backend, cfg, gen) -> None:
    """The unsplit kernel: every document of the batch whole (one segment each) on this GPU."""
    cu = torch.tensor([0] + list(docs), dtype=torch.int64).cumsum(0).to(rt.device, torch.int32)
    n = int(sum(docs))
    q = rand(gen, n, spec.n_heads, spec.head_dim, rt.device, dtype)
    k, v = (rand(gen, n, spec.n_kv_heads, spec.head_dim, rt.device, dtype) for _ in range(2))
    t = time_fn(lambda: kernels.attend(q, k, v, cu, cu, max(docs), max(docs), backend=backend),
                rt.device, iters=cfg.iters, warmup=cfg.warmup)
    pairs = float(causal_pairs(0, docs).sum())
    rec["unsplit_fwd_tflops"] = tflops(spec.attention_flops(pairs, layers=1), t["median_ms"])


def overhead_case(dist_name, tpg, spec, dtype, rt, backend, cfg) -> dict:
    """One batch (``tpg`` tokens per GPU of ``dist_name`` documents, sequential packing) on ``rt``."""
    docs = sample_docs(dist_name, tpg * rt.world, seed=cfg.seed)
    layout = pack(docs, rt.world)
    t0 = time.perf_counter()
    plan = make_plan(layout, spec, cfg)
    plan_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    dd = stages.prepare(plan, rt.group, rt.device)
    meta_ms = (time.perf_counter() - t0) * 1e3
    m = dd.meta
    served = [plan.tasks[i] for i in m.tasks]
    pairs = float(plan.server_pairs()[rt.rank])
    flops = {"fwd": spec.attention_flops(pairs, layers=1),
             "fwd_bwd": spec.attention_flops(pairs, backward=True, layers=1)}
    rec = {"backend": backend, "dist": dist_name, "tokens_per_gpu": tpg, "world": rt.world,
           "rank": rt.rank, "n_docs": len(docs), "max_doc": max(docs), "n_local": m.n_local,
           "plan_ms": plan_ms, "metadata_ms": meta_ms, "plan_meta": {k: v for k, v in plan.meta.items()
                                                                     if k != "dispatch"},
           "n_tasks": m.n_tasks, "min_task_q": min((t.n_q for t in served), default=0),
           "server_q_tokens": int(len(m.q_rows)), "server_kv_tokens": int(len(m.kv_rows)),
           "recv_q_tokens": m.n_recv_q, "recv_kv_tokens": m.n_recv_kv, "imbalance": plan.imbalance(),
           "server_fwd_gflop": flops["fwd"] / 1e9}
    gen = torch.Generator(device=rt.device).manual_seed(cfg.seed + rt.rank)
    reset_peak(rt.device)
    try:
        _time_steps(rec, plan, spec, dtype, rt, backend, cfg, gen, flops)
        if m.n_tasks:
            _time_raw(rec, dd, spec, dtype, rt, backend, cfg, gen, flops)
        _time_unsplit(rec, docs, spec, dtype, rt, backend, cfg, gen)
        if "raw_fwd_tflops" in rec:
            rec["raw_fwd_vs_unsplit"] = rec["raw_fwd_tflops"] / rec["unsplit_fwd_tflops"]
        rec["step_fwd_bwd_vs_matmul_peak"] = rec["step_fwd_bwd_tflops"] / H200_MATMUL_TFLOPS
        rec["peak_gb"] = peak_gb(rt.device)
    except torch.cuda.OutOfMemoryError as e:
        rec["skipped"] = f"out of memory: {str(e).splitlines()[0]}"
    except Exception as e:  # record and go on: one backend failing must not lose the others' results
        rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return rec


def run_overhead(cfg: Config, rt, backends) -> list[dict]:
    spec = ModelSpec.from_name(cfg.model)
    dtype = getattr(torch, cfg.dtype)
    rows = []
    for backend in backends:
        for dist_name in cfg.dists:
            for tpg in cfg.tokens_per_gpu:
                rec = overhead_case(dist_name, tpg, spec, dtype, rt, backend, cfg)
                per_rank = [None] * rt.world
                dist.all_gather_object(per_rank, rec, group=rt.group)
                row = {"backend": backend, "dist": dist_name, "tokens_per_gpu": tpg, "world": rt.world,
                       "ranks": per_rank}
                ok = [r for r in per_rank if "step_fwd_ms" in r]
                for mode in ("fwd", "fwd_bwd"):
                    if len(ok) == rt.world:
                        row[f"step_{mode}_ms_max"] = max(r[f"step_{mode}_ms"] for r in ok)
                        row[f"comm_{mode}_fraction_mean"] = statistics.mean(r[f"comm_{mode}_fraction"]
                                                                            for r in ok)
                rows.append(row)
                if rt.rank == 0:
                    print(_fmt_over(row), flush=True)
    return rows


def _fmt_over(row: dict) -> str:
    r0 = row["ranks"][0]
    if "step_fwd_ms" not in r0:
        return f"{row['backend']:>11} {row['dist']:>8} {row['tokens_per_gpu']:>7}/GPU x{row['world']}: " \
               f"{r0.get('skipped') or r0.get('error')}"
    g = r0.get
    return (f"{row['backend']:>11} {row['dist']:>8} {row['tokens_per_gpu']:>7}/GPU x{row['world']} "
            f"tasks {g('n_tasks'):>4} (min {g('min_task_q')}) | step fwd {g('step_fwd_tflops'):7.3g} "
            f"raw {g('raw_fwd_tflops', float('nan')):7.3g} unsplit {g('unsplit_fwd_tflops'):7.3g} TF/s | "
            f"fwd+bwd step {g('step_fwd_bwd_tflops'):7.3g} raw {g('raw_fwd_bwd_tflops', float('nan')):7.3g} "
            f"TF/s | comm {100 * g('comm_fwd_fraction'):4.1f}% / {100 * g('comm_fwd_bwd_fraction'):4.1f}%")


# ---------------------------------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=["composability", "overhead", "all"], default="all")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU with sdpa_ref")
    ap.add_argument("--backends", default=None, help="comma-separated; default: every available GPU one")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--mem-budget-gb", type=float, default=None)
    ap.add_argument("--doc-lens", default=None, help="comma-separated composability document lengths")
    ap.add_argument("--tokens-per-gpu", default=None, help="comma-separated overhead batch sizes")
    ap.add_argument("--order", choices=["lpt", "doc"], default=None,
                    help="composability shard order of the 'kernel' mode (default lpt, as the server)")
    ap.add_argument("--shards", default=None, help="comma-separated composability shard sizes")
    ap.add_argument("--kv-share", default=None,
                    help="comma-separated composability modes: merged, copy (server paths), kernel "
                         "(the kernel alone on per-shard KV copies); default merged,copy")
    ap.add_argument("--patterns", default=None,
                    help="comma-separated composability patterns: all (every shard on the server), "
                         "alternate (every other shard: cannot merge); default all")
    ap.add_argument("--out", default=None, help="result file (default results/bench_attention_server_...)")
    args = ap.parse_args(argv)

    cfg = Config.smoke_config() if args.smoke else Config()
    for name in ("iters", "warmup", "mem_budget_gb", "order"):
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
    if args.doc_lens:
        cfg.doc_lens = [int(x) for x in args.doc_lens.split(",")]
    if args.tokens_per_gpu:
        cfg.tokens_per_gpu = [int(x) for x in args.tokens_per_gpu.split(",")]
    if args.shards:
        cfg.shards = [int(x) for x in args.shards.split(",")]
    if args.kv_share:
        cfg.kv_share = args.kv_share.split(",")
    if args.patterns:
        cfg.patterns = args.patterns.split(",")
    rt = init_from_env("gloo" if args.smoke else None)
    if args.smoke:
        avail = ["sdpa_ref"]
    else:
        avail = [b for b in kernels.available_backends(rt.device) if b in GPU_BACKENDS]
        if not avail:
            raise SystemExit(f"no GPU attention backend available on {rt.device} (available: "
                             f"{kernels.available_backends(rt.device)}); use --smoke on a CPU")
    cfg.backends = [kernels.resolve_backend(b, rt.device) for b in args.backends.split(",")] \
        if args.backends else avail

    parts = ["composability", "overhead"] if args.part == "all" else [args.part]
    if rt.world > 1 and "composability" in parts:
        if rt.rank == 0:
            print("composability is a one-GPU measurement: run it with plain python; skipped under "
                  f"torchrun with {rt.world} ranks", flush=True)
        parts.remove("composability")
    for part in parts:
        if part == "composability":
            results = run_composability(cfg, rt.device, cfg.backends)
        else:
            results = run_overhead(cfg, rt, cfg.backends)
        if rt.rank == 0:
            tag = f"{part}_{rt.world}gpu" + ("_smoke" if cfg.smoke else "")
            path = Path(args.out) if args.out else RESULTS_DIR / f"bench_attention_server_{tag}.json"
            if args.out and len(parts) > 1:
                path = path.with_name(f"{path.stem}_{part}{path.suffix}")
            save_result(path, {**asdict(cfg), "part": part, "world": rt.world,
                               "device_type": rt.device.type}, results,
                        backend_versions=backend_versions(),
                        targets={"server_fwd_vs_unsplit_min_for_shards_ge_512": 0.95,
                                 "fa4_fwd_bwd_fraction_of_matmul_peak": 0.60,
                                 "matmul_peak_tflops": H200_MATMUL_TFLOPS})
            print(f"wrote {path}", flush=True)
    if dist.is_initialized():
        dist.barrier(group=rt.group)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

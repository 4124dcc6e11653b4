"""Context-parallel benchmark: every CP mechanism of :mod:`cadlib.cp` on the same masks and sizes.

Per (mechanism, mask, document distribution, tokens per GPU): the global sequence of
``world * tokens_per_gpu`` tokens (one document for ``causal``; documents from ``--dists`` for
``causal_document``), random q, k, v in ``[n_local, H, D]``, then ``--warmup`` untimed and ``--reps``
timed forward passes (``mech.apply_attn``) and backward passes (``out.backward``), each rank timing
with CUDA events after a barrier. The time of a repetition is the SLOWEST rank's; TF/s per GPU are
``flops(mask area) / world / time``, counted from the exact mask area (:mod:`cadlib.data.masks`), never
from what a mechanism computes (padding, duplicated KV, recomputation do not count). Peak memory is
the largest rank's ``max_memory_allocated`` above what was allocated before the case.

    torchrun --nproc-per-node=2 scripts/bench/bench_cp.py --out results/bench_cp.json
    torchrun --nproc-per-node=2 scripts/bench/bench_cp.py --mechanisms ring,ulysses --merge ...
    torchrun --nproc-per-node=2 scripts/bench/bench_cp.py --smoke           # gloo on CPU, tiny, seconds
    cadlib.infra.launch.run_torchrun("scripts/bench/bench_cp.py", 2, ["--smoke"], pg_backend="gloo")  # a cell

Masks: ``causal``, ``full`` (one document), ``causal_document``, ``full_document`` (every mechanism that
serves them; CAD's CA-tasks are causal, so its full-mask cases are ``X``). Draws: ``--draws N`` times
every document mask on ``N`` independent draws of its documents (seeds ``seed .. seed + N - 1``;
LongCA-bench takes 30) and reports the median of the draws' medians with the 20/80% quantiles across
draws (``per_draw`` keeps each). A case that fails (unsupported mask, out of memory, an error) is
recorded with its reason and the run goes on. Rank 0 writes the JSON (after every case, merged with
``--merge``) through :func:`cadlib.infra.results.save_result`; every rank also writes its records with
:func:`cadlib.infra.progress.write_result` when started by ``run_torchrun``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

_T0 = time.monotonic()          # --time-budget-s counts from here (torch import, NCCL start included)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from cadlib.bench.inputs import rand  # noqa: E402
from cadlib.bench.meters import reset_peak, tflops  # noqa: E402
from cadlib.bench.timer import stats, time_samples  # noqa: E402
from cadlib.cp import MECHANISMS, make  # noqa: E402
from cadlib.data.masks import make_mask  # noqa: E402
from cadlib.infra.groups import destroy, init_from_env  # noqa: E402
from cadlib.infra.progress import log, report_progress, write_result  # noqa: E402
from cadlib.infra.results import save_result  # noqa: E402
from cadlib.runtime.kernels import TORCH_DTYPES  # noqa: E402

DTYPES = TORCH_DTYPES
MASKS = ("causal", "causal_document", "full", "full_document")


def _slowest(ms: list[float], group, device) -> list[float]:
    t = torch.tensor(ms, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def run_draws(mech_name, mask_name, dist_name, tpg, args, env, heads, dtype) -> dict:
    """:func:`run_case` on ``args.draws`` draws of a document mask: median and 20/80% quantiles across
    draws."""
    per = []
    for i in range(args.draws):
        per.append(run_case(mech_name, mask_name, dist_name, tpg, args, env, heads, dtype,
                            seed=args.seed + i))
        if per[-1]["status"] != "ok":
            return {**per[-1], "draws": i + 1, "error": f"draw {i}: " + per[-1].get("error", "")}
    rec = {**per[0], "draws": args.draws,
           "per_draw": [{"seed": args.seed + i, "fwd_ms": r["fwd"]["median_ms"],
                         "bwd_ms": r["bwd"]["median_ms"], "area": r["area"], "n_docs": r["n_docs"]}
                        for i, r in enumerate(per)]}
    for d in ("fwd", "bwd"):
        ms = np.array([r[d]["median_ms"] for r in per])
        tf = np.array([r[d]["tflops_per_gpu"] for r in per])
        rec[d] = {"median_ms": float(np.median(ms)), "q20_ms": float(np.quantile(ms, 0.2)),
                  "q80_ms": float(np.quantile(ms, 0.8)), "tflops_per_gpu": float(np.median(tf)),
                  "tflops_q20": float(np.quantile(tf, 0.2)), "tflops_q80": float(np.quantile(tf, 0.8))}
    rec["fwd_bwd_tflops_per_gpu"] = float(np.median([r["fwd_bwd_tflops_per_gpu"] for r in per]))
    rec["peak_mem_gb"] = max(r["peak_mem_gb"] for r in per)
    return rec


def run_case(mech_name, mask_name, dist_name, tpg, args, env, heads, dtype, seed=None) -> dict:
    world, device, group = env.world, env.device, env.group
    total = world * tpg
    seed = args.seed if seed is None else seed
    mask = make_mask(mask_name, total, seed, dist=dist_name)
    doc_lens = mask.document_lengths()
    rec = {"mechanism": mech_name, "mask": mask_name, "dist": dist_name, "tokens_per_gpu": tpg,
           "world": world, "total_tokens": total, "n_docs": len(doc_lens), "area": mask.area(),
           "heads": list(heads), "head_dim": args.head_dim}
    causal = mask_name.startswith("causal")
    reset_peak(device)
    base_mem = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    try:
        kw = {"min_shard": args.min_shard} if mech_name == "cad" else {}
        mech = make(mech_name, group, doc_lens, causal, attn_backend=args.attn_backend, **kw)
        gen = torch.Generator(device=device).manual_seed(seed + env.rank)
        n = mech.n_local
        q = rand(gen, n, heads[0], args.head_dim, device, dtype)
        k, v = (rand(gen, n, heads[1], args.head_dim, device, dtype) for _ in range(2))
        dout = torch.randn_like(q)
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))

        def fwd():
            with torch.no_grad():
                mech.apply_attn(q, k, v)

        def forward_graph():
            return mech.apply_attn(q, k, v)[0]

        def bwd(out):
            out.backward(dout)
        timing = {"iters": args.reps, "warmup": args.warmup, "group": group}
        ms_f = _slowest(time_samples(fwd, device, **timing), group, device)
        ms_b = _slowest(time_samples(bwd, device, pre=forward_graph, **timing), group, device)
        peak = (torch.cuda.max_memory_allocated(device) - base_mem) / 1e9 if device.type == "cuda" else 0.0
        pk = torch.tensor([peak], dtype=torch.float64, device=device)
        dist.all_reduce(pk, op=dist.ReduceOp.MAX, group=group)
        for name, ms, direction in (("fwd", ms_f, "fwd"), ("bwd", ms_b, "bwd")):
            st, flops = stats(ms), mask.flops(heads[0], args.head_dim, direction)
            rec[name] = {**{k: st[k] for k in ("median_ms", "q20_ms", "q80_ms")}, "flops": flops,
                         "tflops_per_gpu": tflops(flops / world, st["median_ms"])}
        tot_ms = rec["fwd"]["median_ms"] + rec["bwd"]["median_ms"]
        fb = mask.flops(heads[0], args.head_dim, "fwd_bwd")
        rec["fwd_bwd_tflops_per_gpu"] = tflops(fb / world, tot_ms)
        rec["peak_mem_gb"] = float(pk.item())
        rec["tokens_per_rank"] = mech.tokens_per_rank().tolist()
        if mech_name in ("usp", "loongtrain"):
            rec["ulysses_size"] = mech.u                  # u = world: Ulysses; u = 1: ring
        if mech_name == "loongtrain":
            rec["window"] = mech.window                   # ring positions per window of the double ring
        rec["status"] = "ok"
    except ValueError as e:                      # a mechanism that does not serve this mask (CAD: full)
        rec.update(status="X", error=str(e)[:300])
    except torch.cuda.OutOfMemoryError:
        rec.update(status="E", error="out of memory")
    except Exception as e:
        msg = f"{type(e).__name__}: {e}"
        rec.update(status="E" if "out of memory" in msg.lower() else "!", error=msg[:500],
                   trace=traceback.format_exc(limit=4)[-1500:])
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rec


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mechanisms", default=",".join(MECHANISMS))
    p.add_argument("--masks", default=None, help=f"comma-separated, from: {', '.join(MASKS)} (default all; "
                   "--smoke: causal,causal_document)")
    p.add_argument("--draws", type=int, default=1, help="draws of each document mask (LongCA-bench: 30)")
    p.add_argument("--dists", default="prolong64k,prolong512k")
    p.add_argument("--tokens-per-gpu", default="8192,16384,32768,65536")
    p.add_argument("--heads", default="64,8", help="query heads,KV heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    p.add_argument("--attn-backend", default=None, help="cadlib.runtime.kernels backend (default: fastest)")
    p.add_argument("--min-shard", type=int, default=512, help="CAD scheduler's minimum shard")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-budget-s", type=float, default=None, help="start no new case after this long")
    p.add_argument("--out", default="results/bench_cp.json")
    p.add_argument("--merge", action="store_true", help="add to --out, replacing equal cases")
    p.add_argument("--pg-backend", default=None)
    p.add_argument("--smoke", action="store_true", help="gloo on CPU, tiny sizes, fp32, seconds")
    args = p.parse_args(argv)
    if args.smoke:
        args.tokens_per_gpu, args.heads, args.head_dim, args.dtype = "128,256", "4,2", 16, "fp32"
        args.warmup, args.reps, args.min_shard, args.pg_backend = 1, 2, 16, args.pg_backend or "gloo"
        args.dists = "pile"
        if args.out == "results/bench_cp.json":
            args.out = "results/bench_cp_smoke.json"
    args.masks = args.masks or ("causal,causal_document" if args.smoke else ",".join(MASKS))
    for m in args.mechanisms.split(","):
        if m not in MECHANISMS:
            p.error(f"unknown mechanism {m!r}; choose from: {', '.join(MECHANISMS)}")
    for m in args.masks.split(","):
        if m not in MASKS:
            p.error(f"unknown mask {m!r}; choose from: {', '.join(MASKS)}")
    return args


def _key(r):
    return (r["mechanism"], r["mask"], r["dist"], r["tokens_per_gpu"], r["world"])


def main(argv=None) -> int:
    args = parse_args(argv)
    env = init_from_env(args.pg_backend)
    dtype = DTYPES[args.dtype] if env.device.type == "cuda" else torch.float32
    heads = tuple(int(x) for x in args.heads.split(","))
    out = Path(args.out)
    rows = json.loads(out.read_text()).get("results", []) if args.merge and out.exists() else []
    cases = []
    for mask in args.masks.split(","):
        dists = args.dists.split(",") if "document" in mask else [None]
        for d in dists:
            for tpg in (int(x) for x in args.tokens_per_gpu.split(",")):
                cases += [(m, mask, d, tpg) for m in args.mechanisms.split(",")]
    config = {**vars(args), "world": env.world, "device": str(env.device),
              "device_name": torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu"}
    t0, mine = _T0, []
    for i, (m, mask, d, tpg) in enumerate(cases):
        late = args.time_budget_s is not None and time.monotonic() - t0 > args.time_budget_s
        over = torch.tensor([float(late)], device=env.device)
        dist.all_reduce(over, op=dist.ReduceOp.MAX, group=env.group)     # every rank decides alike
        if over.item():
            rec = {"mechanism": m, "mask": mask, "dist": d, "tokens_per_gpu": tpg, "world": env.world,
                   "status": "-", "error": "time budget"}
        else:
            run = run_draws if args.draws > 1 and "document" in mask else run_case
            rec = run(m, mask, d, tpg, args, env, heads, dtype)
        mine.append(rec)
        if env.rank == 0:
            rows = [r for r in rows if _key(r) != _key(rec)] + [rec]
            save_result(out, config, rows)
            if rec["status"] == "ok":
                brief = (f"fwd {rec['fwd']['tflops_per_gpu']:.3g} bwd {rec['bwd']['tflops_per_gpu']:.3g} "
                         f"TF/s/GPU, {rec['peak_mem_gb']:.2f} GB")
            else:
                brief = f"{rec['status']} {rec.get('error', '')[:100]}"
            log(f"{m:>9} {mask:>15} {d or '':>11} {tpg:>6}/GPU: {brief}")
        report_progress(i + 1, len(cases), f"{m} {mask}")
    write_result({"rank": env.rank, "world": env.world, "records": mine, "config": config})
    if env.rank == 0:
        log(f"wrote {out}")
    destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())

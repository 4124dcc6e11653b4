"""Check distributed CAD attention against a single-process reference (a torchrun entry).

    python -m torch.distributed.run --nproc-per-node 4 -m cadlib.verify \\
        --dist pretrain --tokens-per-rank 2048 --dtype fp32 --seed 0
    # from a notebook: cadlib.infra.launch.run_torchrun("cadlib.verify", 4, [...])
    # on GPUs (NCCL, bf16): torchrun --nproc-per-node 2 -m cadlib.verify --dtype bf16 --model llama3-8b

Every rank builds the same documents, layout and plan from the seed (no broadcast), and the same
random q, k, v, dO over the FULL documents. Each rank takes its local rows (layout order), runs
``cad_attention`` forward and backward, and compares o, dq, dk, dv with the reference: per-document
causal attention in fp32 (torch SDPA with autograd) over the same (dtype-rounded) inputs. The error of
a tensor is ``max |cad - ref| / max |ref|`` over all ranks (all-reduced). Each rank writes, per case,
the errors and the per-server attention load (pairs) before (colocated) and after the plan with
:func:`cadlib.infra.progress.write_result`; the process exits 1 if any error exceeds the tolerance
(default 1e-5 fp32, 2e-2 bf16).

``--dist`` and ``--case`` take comma-separated lists; every combination runs in this one launch.
Cases: ``random`` (sampled documents, sequential packing), ``one-token`` (plus several 1-token
documents), ``empty-rank`` (one rank holds no tokens; needs >= 2 ranks), ``spanning`` (one document
spanning all ranks). ``--plan``: ``scheduler`` (cadlib.scheduling.scheduler.schedule), ``random`` (random
splits on random servers: stresses the dispatch beyond what the scheduler does), ``colocated``.
``--sent-last``: the plan re-ordered so that each rank's rows sent to other servers come last
(:mod:`cadlib.scheduling.sentlast`); the ranks then hold their tokens in that layout's order.
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from .core.cost import MODELS, ModelSpec
from .core.layout import Layout, global_rows
from .core.plan import Plan, layout_to_tasks
from .core.precision import DTYPES, RTOL
from .data.packing import pack
from .data.workload import DISTRIBUTIONS, sample_docs
from .dispatch.build import build_all
from .infra.groups import destroy, init_from_env
from .infra.progress import log, report_progress, write_result
from .runtime.kernels import TORCH_DTYPES
from .runtime.stages import cad_attention
from .scheduling.scheduler import schedule
from .scheduling.sentlast import sent_last
from .testing import random_inputs, random_plan, rank_inputs, reference

CASES = ("random", "one-token", "empty-rank", "spanning")
PLANS = ("scheduler", "random", "colocated")


def _docs(dist_name: str, total: int, seed: int, args) -> list[int]:

    kw = {}
    if dist_name == "uniform":
        kw["length"] = args.doc_len or max(1, args.tokens_per_rank // 4)
    if dist_name == "lognormal":
        kw.update(mu=math.log(args.doc_len or max(2, args.tokens_per_rank // 4)), sigma=1.0)
    return sample_docs(dist_name, total, seed, max_doc_len=args.max_doc_len, **kw)


def make_layout(case: str, dist_name: str, world: int, tokens_per_rank: int, seed: int,
                args) -> Layout | None:
    """The linear layout of one case (None when the case needs more ranks than ``world``)."""
    total = world * tokens_per_rank
    if case == "random":
        return pack(_docs(dist_name, total, seed, args), world, tokens_per_rank, method=args.pack)
    if case == "one-token":
        n_one = min(8, total - 1)
        docs = _docs(dist_name, total - n_one, seed, args)
        rng = np.random.default_rng(seed)
        for pos in rng.integers(0, len(docs) + 1, size=n_one):
            docs.insert(int(pos), 1)
        return pack(docs, world, tokens_per_rank, method=args.pack)
    if case == "empty-rank":
        if world < 2:
            return None
        full = pack(_docs(dist_name, (world - 1) * tokens_per_rank, seed, args), world - 1, tokens_per_rank,
                    method=args.pack)
        ranks = list(full.ranks)
        ranks.insert(world // 2, [])
        return Layout(ranks, full.doc_lens)
    if case == "spanning":
        return pack([total], world, tokens_per_rank)
    raise ValueError(f"unknown case {case!r}; choose one of: {', '.join(CASES)}")


def make_plan(layout: Layout, kind: str, model: ModelSpec, seed: int, args) -> Plan:
    if kind == "scheduler":

        kw = {} if args.min_shard is None else {"min_shard": args.min_shard}
        return schedule(layout, model=model, tolerance=args.tolerance_eps, **kw)
    if kind == "random":
        return random_plan(layout, seed)
    if kind == "colocated":
        return Plan(layout, layout_to_tasks(layout))
    raise ValueError(f"unknown plan {kind!r}; choose one of: {', '.join(PLANS)}")


def check_case(layout: Layout, plan: Plan, model: ModelSpec, dtype: torch.dtype, device, group, seed: int,
               attn_backend: str | None, timing_iters: int = 0, kv_share: str | None = None) -> dict:
    """Run CAD forward+backward on this rank's rows and compare with the reference; with
    ``timing_iters``, also the median wall time of that many more forward+backward passes."""
    rank = dist.get_rank(group)
    heads = (model.n_heads, model.n_kv_heads, model.head_dim)
    full = random_inputs(layout.total_tokens, heads, seed, dtype, device)
    rows = torch.as_tensor(global_rows(layout, rank), device=device)
    q, k, v, dout = rank_inputs(full, rows)
    t0 = time.perf_counter()
    o = cad_attention(q, k, v, plan, group, attn_backend=attn_backend, kv_share=kv_share)
    o.backward(dout)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - t0
    my_docs = sorted({c.doc for c in layout.ranks[rank]})
    ref = reference(*full, layout.doc_lens, my_docs)
    errs = torch.zeros(4, dtype=torch.float64, device=device)
    scale = torch.zeros(4, dtype=torch.float64, device=device)
    for i, (got, want) in enumerate(zip((o, q.grad, k.grad, v.grad), ref)):
        want = want.index_select(0, rows)
        if got.shape != want.shape:
            raise ValueError(f"tensor {i}: CAD gave shape {tuple(got.shape)}, reference {tuple(want.shape)}")
        if want.numel():
            errs[i] = (got.double() - want.double()).abs().max()
            scale[i] = want.double().abs().max()
    times = []
    for _ in range(timing_iters):               # warm repeats, timed outside the comm path
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t1 = time.perf_counter()
        cad_attention(q, k, v, plan, group, attn_backend=attn_backend, kv_share=kv_share).backward(dout)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t1)
    dist.all_reduce(errs, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(scale, op=dist.ReduceOp.MAX, group=group)
    rel = (errs / scale.clamp_min(1e-30)).tolist()
    q_mat, kv_mat = plan.token_matrices()
    ds = build_all(plan)
    return {"identity_servers": sum(d.q_identity for d in ds),           # no gather/scatter (dispatch)
            "identity_receiving": sum(d.q_identity and d.n_recv_q > 0 for d in ds),
            "identity_donors": sum(d.q_identity and d.n_send_q > 0 for d in ds),     # sent-last plans
            "kv_prefix_servers": sum(d.shared().kv_identity and d.shared().n_kv < d.n_local + d.n_recv_kv
                                     for d in ds),
            "rel_err": dict(zip(("o", "dq", "dk", "dv"), rel)),
            "load_before": Plan(layout, layout_to_tasks(layout)).server_pairs().tolist(),
            "load_after": plan.server_pairs().tolist(), "imbalance_after": plan.imbalance(),
            "n_tasks": len(plan.tasks), "q_tokens_sent": int(q_mat.sum()),
            "kv_tokens_sent": int(kv_mat.sum()), "n_docs": layout.n_docs,
            "local_tokens": int(rows.numel()), "first_fwd_bwd_s": elapsed,
            "fwd_bwd_s": float(np.median(times)) if times else None}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m cadlib.verify", description=__doc__.split("\n")[0])
    p.add_argument("--dist", default="pretrain", help="comma-separated cadlib.data.workload distributions")
    p.add_argument("--case", default="random", help=f"comma-separated, from: {', '.join(CASES)}")
    p.add_argument("--plan", default="scheduler", choices=PLANS)
    p.add_argument("--pack", default="sequential", choices=("sequential", "balanced"))
    p.add_argument("--tokens-per-rank", type=int, default=2048)
    p.add_argument("--dtype", default="fp32", choices=DTYPES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="seeds seed, seed+1, ... per combination")
    p.add_argument("--model", default="tiny", help="ModelSpec name for head counts and head_dim")
    p.add_argument("--attn-backend", default=None, help="attention backend (cadlib.runtime.kernels); default: auto")
    p.add_argument("--pg-backend", default=None, help="process-group backend: gloo, nccl (default auto)")
    p.add_argument("--min-shard", type=int, default=None, help="scheduler min_shard (default: its own)")
    p.add_argument("--tolerance-eps", type=float, default=0.1, help="scheduler imbalance tolerance")
    p.add_argument("--rtol", type=float, default=None, help="max relative error (default by dtype)")
    p.add_argument("--doc-len", type=int, default=None, help="uniform length / lognormal median")
    p.add_argument("--max-doc-len", type=int, default=None, help="clip sampled document lengths")
    p.add_argument("--timing-iters", type=int, default=0, help="extra timed fwd+bwd passes per case")
    p.add_argument("--kv-share", default="merged", choices=("merged", "copy"),
                   help="the attention server's KV layout (cadlib.runtime.server): merged shards or a copy per task")
    p.add_argument("--sent-last", action="store_true",
                   help="re-order each plan so that rows sent to other servers come last (cadlib.scheduling.sentlast)")
    args = p.parse_args(argv)

    for c in args.case.split(","):
        if c not in CASES:
            p.error(f"unknown case {c!r}; choose one of: {', '.join(CASES)}")
    for d in args.dist.split(","):
        if d not in DISTRIBUTIONS:
            p.error(f"unknown distribution {d!r} in --dist; choose from: {', '.join(DISTRIBUTIONS)}")
    if args.model.lower() not in MODELS:
        p.error(f"unknown --model {args.model!r}; choose one of: {', '.join(MODELS)}")
    for flag, val, lo in (("--tokens-per-rank", args.tokens_per_rank, 1), ("--repeats", args.repeats, 1),
                          ("--timing-iters", args.timing_iters, 0), ("--min-shard", args.min_shard, 1),
                          ("--doc-len", args.doc_len, 1), ("--max-doc-len", args.max_doc_len, 1)):
        if val is not None and val < lo:
            p.error(f"{flag} must be >= {lo}, got {val}")
    if not args.tolerance_eps >= 0:
        p.error(f"--tolerance-eps (the scheduler's imbalance tolerance) must be >= 0, got "
                f"{args.tolerance_eps}")
    if args.rtol is not None and not args.rtol > 0:
        p.error(f"--rtol must be > 0, got {args.rtol}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    env = init_from_env(args.pg_backend)
    model = ModelSpec.from_name(args.model)
    dtype = TORCH_DTYPES[args.dtype]
    rtol = args.rtol if args.rtol is not None else RTOL[args.dtype]
    combos = [(d, c, args.seed + i) for d in args.dist.split(",") for c in args.case.split(",")
              for i in range(args.repeats)]
    results, ok = [], True
    for step, (dist_name, case, seed) in enumerate(combos):
        base = {"dist": dist_name, "case": case, "seed": seed, "world": env.world, "dtype": args.dtype,
                "kv_share": args.kv_share, "sent_last": args.sent_last,
                "plan": args.plan, "tokens_per_rank": args.tokens_per_rank, "model": model.name}
        layout = make_layout(case, dist_name, env.world, args.tokens_per_rank, seed, args)
        if layout is None:
            results.append({**base, "skipped": f"case {case!r} needs >= 2 ranks"})
            continue
        plan = make_plan(layout, args.plan, model, seed, args)
        if args.sent_last:

            plan = sent_last(plan).plan
            layout = plan.layout
        res = {**base, **check_case(layout, plan, model, dtype, env.device, env.group, seed,
                                    args.attn_backend, args.timing_iters, args.kv_share)}
        res["passed"] = max(res["rel_err"].values()) <= rtol
        ok &= res["passed"]
        results.append(res)
        if env.rank == 0:
            log(f"{dist_name}/{case}/seed {seed}: rel err "
                + " ".join(f"{k}={v:.2e}" for k, v in res["rel_err"].items())
                + f" imbalance {max(res['load_before']) / max(np.mean(res['load_before']), 1):.2f}"
                + f" -> {res['imbalance_after']:.2f} {'ok' if res['passed'] else 'FAILED'}")
        report_progress(step + 1, len(combos), f"{dist_name}/{case}")
    checked = sum("rel_err" in r for r in results)
    if checked == 0:
        ok = False
        if env.rank == 0:
            log(f"FAILED: no case was checked ({len(results)} skipped: "
                f"{sorted({r.get('skipped', '') for r in results})}); nothing verifies CAD here")
    cuda = env.device.type == "cuda"
    write_result({"rank": env.rank, "world": env.world, "device": str(env.device), "group_rank": env.node,
                  "local_rank": env.local_rank, "local_world": env.local_world,
                  "device_name": torch.cuda.get_device_name(env.device) if cuda else "cpu",
                  "torch": torch.__version__, "rtol": rtol, "passed": ok, "checked": checked,
                  "cases": results,
                  "config": vars(args)})
    destroy()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

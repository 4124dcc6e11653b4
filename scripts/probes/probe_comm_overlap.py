"""How much does an NCCL all-to-all on one stream slow the attention and GEMM kernels on another, and
how fast is the all-to-all, as a function of the thread blocks (CTAs) its communicator may use?

Ping-pong runs CAD's all-to-alls beside the other nano-batch's compute. Every CTA NCCL holds is an SM
the compute kernels cannot use: in the end-to-end runs over NVLink the attention kernels ran 4%
slower on average (up to 11%) beside the real all-to-alls than beside one-element ones. Per
``--ctas`` value (``0``: NCCL's own choice), on a group of its own (:func:`cadlib.infra.groups.comm_group`):

* ``a2a_ms``: one ``all_to_all_single`` of ``--mib`` MiB per rank, alone (median), and its GB/s;
* ``attn_ms`` / ``gemm_ms``: a fused causal varlen attention forward+backward (``--docs`` documents
  of ``--doc-len`` tokens, llama3-8b heads) and a bf16 GEMM chain, alone and while all-to-alls run
  back to back on another stream (``*_beside_ms``), and the slowdown.

    torchrun --standalone --nproc-per-node 2 scripts/probes/probe_comm_overlap.py --out $OUT/probe.json
    NCCL_P2P_DISABLE=1 torchrun ... --out $OUT/probe_internode.json     # through host memory
    torchrun --standalone --nproc-per-node 2 scripts/probes/probe_comm_overlap.py --smoke   # CPU/gloo harness
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from cadlib.bench.timer import time_fn
from cadlib.infra.groups import comm_group, destroy, init_from_env
from cadlib.infra.progress import log
from cadlib.infra.results import save_result
from cadlib.runtime import kernels


def workloads(args, device, dtype):
    """The two compute kernels: attention forward+backward and a GEMM chain (closures)."""
    hq, hkv, d = 32, 8, 128
    n = args.docs * args.doc_len
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(n, hq, d, generator=g, device=device, dtype=dtype)
    k, v = (torch.randn(n, hkv, d, generator=g, device=device, dtype=dtype) for _ in range(2))
    cu = torch.arange(0, n + 1, args.doc_len, dtype=torch.int32, device=device)
    backend = None if device.type == "cuda" else "sdpa_ref"

    def attn():
        o, lse = kernels.attend(q, k, v, cu, cu, args.doc_len, args.doc_len, backend=backend)
        kernels.attend_backward(o, q, k, v, o, lse, cu, cu, args.doc_len, args.doc_len, backend=backend)

    x = torch.randn(args.gemm_m, 4096, generator=g, device=device, dtype=dtype)
    w1 = torch.randn(4096, 14336, generator=g, device=device, dtype=dtype) / 64
    w2 = torch.randn(14336, 4096, generator=g, device=device, dtype=dtype) / 128

    def gemm():
        y = x
        for _ in range(4):
            y = (y @ w1) @ w2
    return {"attn": attn, "gemm": gemm}


def probe(args, env, ctas: int, work) -> dict:
    device = env.device
    group = comm_group(env.group, ctas or None)
    world = env.world
    elems = args.mib * 2**20 // 2 // world * world
    send = torch.ones(elems, device=device, dtype=torch.bfloat16)
    recv = torch.empty_like(send)

    def a2a():
        dist.all_to_all_single(recv, send, group=group)

    for _ in range(3):
        a2a()
    dist.barrier(group=env.group)
    def ms(fn, reps, before=None):
        """Device milliseconds of ``fn`` (median): its kernels queued behind a device sleep, so that
        their host launch time (FA4's is several ms) is not counted; ``before`` queues the all-to-alls
        beside it after that sleep."""
        return time_fn(fn, device, iters=reps, warmup=0, ahead=True, before=before)["median_ms"]

    rec = {"ctas": ctas or "nccl default", "mib_per_rank": args.mib, "a2a_ms": ms(a2a, args.reps)}
    rec["a2a_gbps"] = args.mib * 2**20 * (world - 1) / world / rec["a2a_ms"] / 1e6
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    for name, fn in work.items():
        fn()
        dist.barrier(group=env.group)
        alone = ms(fn, args.reps)
        dist.barrier(group=env.group)
        def queue_a2a():                                 # all-to-alls back to back on another stream
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(args.a2a_per_call):
                    a2a()

        beside = []
        for _ in range(args.reps):
            beside.append(ms(fn, 1, queue_a2a if side is not None else None))
            if side is not None:
                torch.cuda.current_stream(device).wait_stream(side)
            dist.barrier(group=env.group)
        rec[f"{name}_ms"], rec[f"{name}_beside_ms"] = alone, statistics.median(beside)
        rec[f"{name}_slowdown"] = rec[f"{name}_beside_ms"] / alone
    if group is not env.group:
        dist.destroy_process_group(group)
    return rec


def recommend(rows: list[dict], floor_ms: float = 8.0) -> int:
    """The CTA limit to use (0: NCCL's choice): the one whose all-to-all costs the compute beside it
    least, ``a2a_ms x (slowdown - 1)`` with the larger of the two kernels' slowdowns (what a hidden
    all-to-all adds to the step), among those whose all-to-all is not much slower than NCCL's own
    choice (at most 1.25 x its time, or ``floor_ms``: ping-pong hides it behind a nano-batch's linear
    layers, tens of ms at the end-to-end sizes)."""
    base = next(r for r in rows if r["ctas"] == "nccl default")
    ok = [r for r in rows if r["a2a_ms"] <= max(1.25 * base["a2a_ms"], floor_ms)] or [base]
    best = min(ok, key=lambda r: (r["a2a_ms"] * max(max(r["attn_slowdown"], r["gemm_slowdown"]) - 1, 0.0),
                                  r["a2a_ms"]))
    return 0 if best["ctas"] == "nccl default" else int(best["ctas"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ctas", default="0,1,2,4,8,16", help="comma-separated; 0: NCCL's own choice")
    ap.add_argument("--mib", type=int, default=256, help="all-to-all MiB per rank")
    ap.add_argument("--a2a-per-call", type=int, default=24, help="all-to-alls queued beside each kernel run")
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--doc-len", type=int, default=16384)
    ap.add_argument("--gemm-m", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--smoke", action="store_true", help="CPU/gloo, tiny sizes")
    ap.add_argument("--out", default=None)
    ap.add_argument("--recommend-out", default=None,
                    help="write the recommended bench_e2e flag (--comm-ctas N, or nothing) to this file")
    args = ap.parse_args(argv)
    ctas = [int(c) for c in args.ctas.split(",")]
    if any(c < 0 for c in ctas):
        ap.error(f"--ctas: thread blocks must be >= 0 (0: NCCL's choice), got {args.ctas}")
    if args.smoke:
        args.mib, args.docs, args.doc_len, args.gemm_m, args.reps, ctas = 1, 2, 64, 64, 2, [0]
    env = init_from_env("gloo" if args.smoke else None)
    dtype = torch.bfloat16 if env.device.type == "cuda" else torch.float32
    work = workloads(args, env.device, dtype)
    rows = []
    for c in ctas:
        rows.append(probe(args, env, c, work))
        if env.rank == 0:
            log(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in rows[-1].items()))
    if env.rank == 0:
        best = recommend(rows) if any(r["ctas"] == "nccl default" for r in rows) else 0
        log(f"recommended CTA limit: {best or 'none (NCCL default)'}")
        if args.out:
            cfg = {k: v for k, v in vars(args).items() if k not in ("out", "recommend_out")}
            save_result(args.out, {**cfg, "world": env.world, "ctas": ctas}, rows, recommended_ctas=best)
        if args.recommend_out:
            Path(args.recommend_out).write_text(f"--comm-ctas {best}\n" if best else "\n")
    destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Check the CP mechanisms against a single-process reference (a torchrun entry; one launch, many cases).

    python -m torch.distributed.run --nproc-per-node 4 -m cadlib.cp.check --suite layout,protocol
    # from a notebook or a test: cadlib.infra.launch.run_torchrun("cadlib.cp.check", 4, [...], pg_backend="gloo")

Every rank builds the same problem from the seed (no broadcast): documents, global q, k, v, dO.
Each rank takes its local rows, runs forward and backward, and the errors
``max |got - ref| / max |ref|`` of o, dq, dk, dv over all ranks (all-reduced) are compared with the
tolerance (default 1e-5 in fp32). The reference is per-document attention in float64 (torch SDPA
math with autograd). Suites:

* ``layout``: :func:`cadlib.cp.allgather.layout_attention` on random layouts (documents split
  across ranks in shuffled chunks, 1-token documents, a rank with at most one 1-token document).
* ``protocol``: every mechanism of ``--mechanisms`` on every mask of ``--masks`` through
  ``dispatch -> apply_attn -> backward``, at ``--tokens`` tokens (documents shorter than the group
  among them) and at ``world - 1`` tokens (some ranks hold nothing, every document is shorter than
  the group); checks no NaN and that ``undispatch(dispatch(x)) == x``. CAD skips the full masks: its
  CA-tasks are causal by construction (a task's KV is the prefix ``[0, q_end)`` of its document), and
  serving a full mask would need tasks whose KV is the whole document, through the plan, the scheduler's
  costs, the dispatch and the server, none of which exists.
* ``volume``: every mechanism on every mask of ``--masks`` at ``8 * world`` tokens in bf16: the bytes
  each rank hands to ``torch.distributed`` for other ranks, forward and backward
  (:func:`cadlib.cp.traffic.count_sent`), must equal :func:`cadlib.cp.volume.per_rank` exactly, and on
  the one-document masks (equal shards) also :func:`cadlib.cp.volume.equal_shard`'s closed form.

Each rank writes its cases with :func:`cadlib.infra.progress.write_result`; exit code 1 if any failed.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from ..core.layout import global_rows
from ..core.precision import DTYPES, RTOL
from ..infra.groups import destroy, init_from_env
from ..infra.progress import log, report_progress, write_result
from ..infra.results import save_result
from ..runtime.kernels import TORCH_DTYPES
from ..testing import random_cp_layout, random_inputs, rank_inputs, reference_f64
from . import MECHANISMS, make
from .allgather import gathered_tokens, layout_attention, shared_docs
from .traffic import count_sent
from .volume import equal_shard, per_rank

SUITES = ("layout", "protocol", "volume")
PROTOCOL_MASKS = ("full", "causal", "full_document", "causal_document")


# ---------------------------------------------------------------------------------------------------
# Problems
# ---------------------------------------------------------------------------------------------------

def protocol_docs(mask: str, world: int, seed: int, total: int) -> list[int]:
    """Document lengths of a protocol case: one document for ``full``/``causal``; for the document
    masks, random lengths including several shorter than the group size."""
    if mask in ("full", "causal"):
        return [total]
    rng = np.random.default_rng(seed)
    lens: list[int] = []
    while sum(lens) < total:
        short = rng.random() < 0.4
        hi = max(2, world) if short else max(2, total // 2)
        lens.append(int(rng.integers(1, hi)))
    lens[-1] -= sum(lens) - total
    return [n for n in lens if n > 0]


ZERO_REF_FLOOR = 1e-3
"""See :func:`_errors`."""


def _errors(got, ref, rows, group, device) -> dict:
    """All-reduced ``max |got - ref| / max |ref|`` of o, dq, dk, dv, and whether any is NaN.

    A reference that is exactly zero (a one-token document: softmax over a single key has no
    gradient with respect to its score, so dq = dk = 0) would turn any rounding into an infinite
    relative error; each denominator is therefore at least ``ZERO_REF_FLOOR`` times the largest of the
    four reference scales (the inputs are unit normal, so the four are of one order)."""
    errs = torch.zeros(5, dtype=torch.float64, device=device)
    scale = torch.zeros(4, dtype=torch.float64, device=device)
    for i, (g, r) in enumerate(zip(got, ref)):
        r = r.index_select(0, rows)
        if g.numel():
            errs[i] = (g.double() - r).abs().max()
            scale[i] = r.abs().max()
        errs[4] += float(torch.isnan(g).any())
    dist.all_reduce(errs, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(scale, op=dist.ReduceOp.MAX, group=group)
    floor = (scale.max() * ZERO_REF_FLOOR).clamp_min(1e-30)
    rel = (errs[:4] / torch.maximum(scale, floor)).tolist()
    return {"rel_err": dict(zip(("o", "dq", "dk", "dv"), rel)), "nan": bool(errs[4] > 0)}


def _run(fn, full, rows, doc_lens, causal, group, device):
    q, k, v, dout = rank_inputs(full, rows)
    t0 = time.perf_counter()
    o = fn(q, k, v)
    o.backward(dout)
    elapsed = time.perf_counter() - t0
    ref = reference_f64(*full, doc_lens, causal)
    return {**_errors((o.detach(), q.grad, k.grad, v.grad), ref, rows, group, device), "fwd_bwd_s": elapsed}


def check_layout(world, rank, group, device, dtype, seed, heads) -> dict:

    layout = random_cp_layout(world, seed)
    full = random_inputs(layout.total_tokens, heads, seed, dtype, device)
    rows = torch.as_tensor(global_rows(layout, rank), device=device)
    res = _run(lambda q, k, v: layout_attention(q, k, v, layout, group), full, rows, layout.doc_lens, True,
               group, device)
    return {**res, "suite": "layout", "n_docs": layout.n_docs, "gathered_tokens": gathered_tokens(layout),
            "shared_docs": int(shared_docs(layout).sum()),
            "tokens_per_rank": layout.tokens_per_rank().tolist()}


def check_protocol(mech_name, mask, world, rank, group, device, dtype, seed, heads, total) -> dict:
    """One mechanism on one mask: dispatch, apply_attn, backward, against the reference."""
    causal = mask in ("causal", "causal_document")
    doc_lens = protocol_docs(mask, world, seed, total)
    base = {"suite": "protocol", "mechanism": mech_name, "mask": mask, "n_docs": len(doc_lens),
            "min_doc": min(doc_lens), "total": sum(doc_lens)}
    if mech_name == "cad" and not causal:
        return {**base, "skipped": "CAD serves causal masks only"}
    kwargs = {"min_shard": 4} if mech_name == "cad" else {}
    mech = make(mech_name, group, doc_lens, causal, **kwargs)
    full = random_inputs(sum(doc_lens), heads, seed, dtype, device)
    rows = torch.as_tensor(mech.local_rows(), device=device)
    res = _run(lambda q, k, v: mech.apply_attn(q, k, v)[0], full, rows, doc_lens, causal, group, device)
    back = mech.undispatch(mech.dispatch(full[0]))
    res["undispatch_ok"] = bool(torch.equal(back, full[0]))
    shape = {k: int(getattr(mech, a)) for k, a in (("ulysses_size", "u"), ("window", "window")) if hasattr(mech, a)}
    return {**base, **res, **shape, "tokens_per_rank": mech.tokens_per_rank().tolist()}


def check_volume(mech_name, mask, world, rank, group, device, seed, heads, total) -> dict:
    """Bytes one mechanism sends per rank, counted, against the closed forms (the ``volume`` suite)."""
    causal = mask in ("causal", "causal_document")
    doc_lens = protocol_docs(mask, world, seed, total)
    base = {"suite": "volume", "mechanism": mech_name, "mask": mask, "n_docs": len(doc_lens), "total": total}
    if mech_name == "cad" and not causal:
        return {**base, "skipped": "CAD serves causal masks only"}
    mech = make(mech_name, group, doc_lens, causal, **({"min_shard": 4} if mech_name == "cad" else {}))
    full = random_inputs(total, heads, seed, torch.bfloat16, device)
    q, k, v, dout = rank_inputs(full, mech.local_rows())
    with count_sent() as fwd:
        o = mech.apply_attn(q, k, v)[0]
    with count_sent() as bwd:
        o.backward(dout)
    grid = {"ulysses_size": getattr(mech, "u", None), "window_size": getattr(mech, "window", None)}
    want = per_rank(mech_name, doc_lens, world, heads[:2], heads[2], 2, causal, plan=getattr(mech, "plan", None),
                    **grid)
    eq = (equal_shard(mech_name, total, world, heads[:2], heads[2], 2, **grid)
          if len(doc_lens) == 1 and mech_name != "cad" and total % (2 * world) == 0 else None)
    got = [fwd.total, bwd.total]
    diff = [abs(got[0] - want["fwd"][rank]), abs(got[1] - want["bwd"][rank])]
    if eq is not None:
        diff += [abs(got[0] - eq["fwd"]), abs(got[1] - eq["bwd"])]
    t = torch.tensor([float(max(diff)), float(got[0] + got[1])], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return {**base, "sent": {"fwd": got[0], "bwd": got[1], "by_kind": {**fwd.by_kind, **{
        f"bwd_{k}": v for k, v in bwd.by_kind.items()}}}, "per_rank": want, "equal_shard": eq,
        "max_diff": float(t[0]), "max_sent": float(t[1]), **{k: v for k, v in grid.items() if v is not None}}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m cadlib.cp.check", description=__doc__.split("\n")[0])
    p.add_argument("--suite", default="layout,protocol", help=f"comma-separated, from: {', '.join(SUITES)}")
    p.add_argument("--mechanisms", default=",".join(MECHANISMS))
    p.add_argument("--masks", default=",".join(PROTOCOL_MASKS))
    p.add_argument("--seeds", type=int, default=3, help="random layouts per world size (layout suite)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokens", type=int, default=61, help="global tokens of a protocol case")
    p.add_argument("--heads", default="8,2,8", help="Hq,Hkv,head_dim (Hq a multiple of the world size)")
    p.add_argument("--dtype", default="fp32", choices=DTYPES)
    p.add_argument("--rtol", type=float, default=None)
    p.add_argument("--pg-backend", default=None)
    p.add_argument("--out", default=None, help="also save rank 0's cases here (cadlib.infra.results.save_result)")
    args = p.parse_args(argv)
    for s in args.suite.split(","):
        if s not in SUITES:
            p.error(f"unknown suite {s!r}; choose one of: {', '.join(SUITES)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    env = init_from_env(args.pg_backend)
    dtype, heads = TORCH_DTYPES[args.dtype], tuple(int(x) for x in args.heads.split(","))
    rtol = args.rtol if args.rtol is not None else RTOL[args.dtype]
    jobs = []
    if "layout" in args.suite.split(","):
        jobs += [("layout", None, None, args.seed + i, 0) for i in range(args.seeds)]
    if "protocol" in args.suite.split(","):
        sizes = [args.tokens, max(1, env.world - 1)]        # the second leaves ranks without tokens
        jobs += [("protocol", m, mask, args.seed, n) for n in sizes for m in args.mechanisms.split(",")
                 for mask in args.masks.split(",")]
    if "volume" in args.suite.split(","):
        jobs += [("volume", m, mask, args.seed, 8 * env.world) for m in args.mechanisms.split(",")
                 for mask in args.masks.split(",")]
    results, ok = [], True
    for step, (suite, mech, mask, seed, n_tok) in enumerate(jobs):
        if suite == "layout":
            res = check_layout(env.world, env.rank, env.group, env.device, dtype, seed, heads)
        elif suite == "volume":
            res = check_volume(mech, mask, env.world, env.rank, env.group, env.device, seed, heads, n_tok)
        else:
            res = check_protocol(mech, mask, env.world, env.rank, env.group, env.device, dtype, seed, heads,
                                 n_tok)
        res.update(world=env.world, seed=seed, dtype=args.dtype)
        if "skipped" in res:
            results.append(res)
            report_progress(step + 1, len(jobs), suite)
            continue
        if suite == "volume":
            res["passed"] = res["max_diff"] == 0
            ok &= res["passed"]
            results.append(res)
            if env.rank == 0:
                log(f"volume {mech}/{mask}: sent fwd {res['sent']['fwd']} bwd {res['sent']['bwd']} B, "
                    f"closed form off by {res['max_diff']:.0f} B" + (" ok" if res["passed"] else " FAILED"))
            report_progress(step + 1, len(jobs), suite)
            continue
        res["passed"] = max(res["rel_err"].values()) <= rtol and not res["nan"] \
            and res.get("undispatch_ok", True)
        ok &= res["passed"]
        results.append(res)
        if env.rank == 0:
            what = "layout" if suite == "layout" else f"{mech}/{mask}/T={res['total']}"
            log(f"{what} seed {seed}: " + " ".join(f"{k}={v:.1e}" for k, v in res["rel_err"].items())
                + (" ok" if res["passed"] else " FAILED"))
        report_progress(step + 1, len(jobs), suite)
    write_result({"rank": env.rank, "world": env.world, "rtol": rtol, "passed": ok, "cases": results,
                  "config": vars(args)})
    if args.out and env.rank == 0:

        save_result(args.out, {**vars(args), "world": env.world, "device": str(env.device)}, results,
                    passed=ok, rtol=rtol, zero_ref_floor=ZERO_REF_FLOOR)
    destroy()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

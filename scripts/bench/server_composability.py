"""Part (1) of ``scripts/bench/bench_attention_server.py``: kernel composability on ONE attention server.

A causal document of L tokens is cut into query shards of s tokens and served by one server in one
fused call, three ways (``--kv-share``):

* ``kernel``: the kernel alone on pre-gathered inputs, every shard ``[a, b)`` with its own copy of the
  KV prefix ``[0, b)`` (what the committed ``..._lpt_*.json`` files measured);
* ``copy``: the whole server path with ``kv_share="copy"``: gather one prefix copy per task, the
  kernel, and (backward) the fp32 ``index_add_`` of every copy's dK/dV;
* ``merged``: the server path with ``kv_share="merged"`` (:mod:`cadlib.dispatch.kvshare`): contiguous shards
  as one segment over one KV copy.

``--pattern all`` gives the server every shard of the document (they merge into one segment);
``alternate`` gives it every other shard (non-contiguous: they cannot merge, each keeps its copy; the
other shards belong to a second server that is not run). FLOPs are those of the server's shards
(``ModelSpec.attention_flops``, one layer, backward 2.5x); ``*_vs_unsplit`` divides TF/s by the unsplit
document's (one segment, kernel alone, ``kv_share="unsplit"`` rows: timed before and after the cases,
``when``; the mean of the two is the reference). A case whose estimated memory
exceeds ``--mem-budget-gb`` is skipped with the reason; an out-of-memory error is recorded too.
"""
from __future__ import annotations

import torch

from cadlib.bench.inputs import rand
from cadlib.bench.meters import GB, peak_gb, reset_peak, tflops
from cadlib.bench.timer import time_fn
from cadlib.core.cost import ModelSpec, causal_pairs
from cadlib.core.layout import Layout
from cadlib.core.plan import CATask, Plan
from cadlib.dispatch.build import build_dispatch
from cadlib.runtime import kernels
from cadlib.runtime.device import to_device
from cadlib.runtime.server import serve_backward, serve_forward

MODES = ("merged", "copy", "kernel")
PATTERNS = ("all", "alternate")


def shard_bounds(doc_len: int, shard: int) -> list[tuple[int, int]]:
    """Query shards ``[a, b)`` of ``shard`` tokens (the last may be shorter) covering the document."""
    return [(a, min(a + shard, doc_len)) for a in range(0, doc_len, shard)]


def estimate_bytes(doc_len: int, kv_tok: int, spec: ModelSpec, elt: int, backward: bool,
                   fp32_kv_copies: bool = False) -> float:
    """Memory of one case: the document's q, k, v, out, lse; ``kv_tok`` KV rows read by the kernel and
    their gather index; with ``backward`` also dout, dq, the kernel's dK/dV of those rows and its
    fp32/expanded-head accumulators (``max(2, Hq/Hkv)`` x, e.g. FA2's GQA expansion), an fp32 dQ
    accumulator, and with ``fp32_kv_copies`` (the copy path) an fp32 copy of one of dK/dV per row."""
    hq, hkv, d = spec.n_heads, spec.n_kv_heads, spec.head_dim
    kv = kv_tok * 2 * hkv * d * elt
    base = doc_len * (2 * hq + 2 * hkv) * d * elt + doc_len * hq * 4 + kv + kv_tok * 8
    if not backward:
        return float(base)
    grads = 2 * doc_len * hq * d * elt + doc_len * hq * d * 4 + kv + max(2, hq // hkv) * kv
    extra = kv_tok * hkv * d * 4 + doc_len * 2 * hkv * d * 4 if fp32_kv_copies else 0
    return float(base + grads + extra)


def server_dispatch(doc_len: int, bounds, pattern: str, device):
    """The server's dispatch: the document on rank 0, shards on server 0 (``all``) or the even ones on
    server 0 and the odd ones on server 1 (``alternate``). Returns ``(device dispatch, my shards)``."""
    if pattern not in PATTERNS:
        raise ValueError(f"pattern must be one of {', '.join(PATTERNS)}; got {pattern!r}")
    two = pattern == "alternate"
    layout = Layout([[(0, 0, doc_len)], []] if two else [[(0, 0, doc_len)]], [doc_len])
    tasks = [CATask(0, a, b, 0, (i % 2) if two else 0) for i, (a, b) in enumerate(bounds)]
    d = build_dispatch(Plan(layout, tasks), 0)
    return to_device(d, device), [(a, b) for i, (a, b) in enumerate(bounds) if not two or i % 2 == 0]


def _kernel_fns(q, k, v, mine, order, backend, device, backward):
    """The old measurement: the kernel alone on pre-gathered per-shard KV copies."""
    call = sorted(mine, key=lambda ab: -ab[1]) if order == "lpt" else mine
    qq = q.index_select(0, torch.cat([torch.arange(a, b) for a, b in call]).to(device))
    idx = torch.cat([torch.arange(b) for _, b in call]).to(device)
    kk, vv = k.index_select(0, idx), v.index_select(0, idx)
    cu_q = torch.tensor([0] + [b - a for a, b in call]).cumsum(0).to(device=device, dtype=torch.int32)
    cu_k = torch.tensor([0] + [b for _, b in call]).cumsum(0).to(device=device, dtype=torch.int32)
    mq, mk = max(b - a for a, b in call), max(b for _, b in call)
    dout = torch.randn_like(qq)
    if not backward:
        return lambda: kernels.attend(qq, kk, vv, cu_q, cu_k, mq, mk, backend=backend)

    def fn():
        o, lse = kernels.attend(qq, kk, vv, cu_q, cu_k, mq, mk, backend=backend)
        kernels.attend_backward(dout, qq, kk, vv, o, lse, cu_q, cu_k, mq, mk, backend=backend)
    return fn


def _server_fns(q, k, v, dd, mode, backend, backward):
    """The server path: serve_forward (and serve_backward) with ``kv_share=mode``."""
    dout = torch.randn(len(dd.meta.q_rows), *q.shape[1:], device=q.device, dtype=q.dtype)
    if not backward:
        return lambda: serve_forward(q, k, v, dd, backend, mode)

    def fn():
        o, lse = serve_forward(q, k, v, dd, backend, mode)
        serve_backward(q, k, v, o, dout, lse, dd, backend, mode)
    return fn


def case(doc_len, shard, spec, dtype, device, backend, cfg, gen, mode, pattern) -> dict:
    """One (document, shard size, mode, pattern) measurement, forward and forward+backward."""
    bounds = shard_bounds(doc_len, shard)
    dd, mine = server_dispatch(doc_len, bounds, pattern, device)
    sh = dd.meta.shared()
    kv_tok = {"merged": int(sh.kv_rows.size)}.get(mode, sum(b for _, b in mine))
    elt = torch.finfo(dtype).bits // 8
    pairs = sum(causal_pairs(a, b) for a, b in mine)
    rec = {"backend": backend, "doc_len": doc_len, "shard": shard, "kv_share": mode, "pattern": pattern,
           "n_shards": len(mine), "n_segments": sh.n_segments if mode == "merged" else len(mine),
           "kv_tokens": kv_tok, "pairs": pairs}
    for ph, backward in (("fwd", False), ("fwd_bwd", True)):
        flops = spec.attention_flops(pairs, backward=backward, layers=1)
        est = estimate_bytes(doc_len, kv_tok, spec, elt, backward, fp32_kv_copies=mode == "copy")
        rec[f"{ph}_est_gb"] = est / GB
        if est > cfg.mem_budget_gb * GB:
            rec[f"{ph}_skipped"] = f"estimated {est / GB:.1f} GB > budget {cfg.mem_budget_gb} GB"
            continue
        reset_peak(device)
        q = k = v = fn = None
        try:
            q = rand(gen, doc_len, spec.n_heads, spec.head_dim, device, dtype)
            k, v = (rand(gen, doc_len, spec.n_kv_heads, spec.head_dim, device, dtype) for _ in range(2))
            fn = _kernel_fns(q, k, v, mine, cfg.order, backend, device, backward) if mode == "kernel" \
                else _server_fns(q, k, v, dd, mode, backend, backward)
            t = time_fn(fn, device, iters=cfg.iters, warmup=cfg.warmup)
            rec[f"{ph}_ms"] = t["median_ms"]
            rec[f"{ph}_tflops"] = tflops(flops, t["median_ms"])
            rec[f"{ph}_peak_gb"] = peak_gb(device)
        except torch.cuda.OutOfMemoryError as e:
            rec[f"{ph}_skipped"] = f"out of memory: {str(e).splitlines()[0]}"
        except Exception as e:  # a backend that cannot run this case: record it, keep going
            rec[f"{ph}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        finally:
            q = k = v = fn = None  # noqa: F841  (free before the next case)
    return rec


def unsplit(doc_len, spec, dtype, device, backend, cfg, gen) -> dict:
    """The reference: the whole document as one segment, kernel alone."""
    rec = case(doc_len, doc_len, spec, dtype, device, backend, cfg, gen, "kernel", "all")
    rec["kv_share"] = "unsplit"
    return rec


def run_composability(cfg, device, backends) -> list[dict]:
    spec = ModelSpec.from_name(cfg.model)
    dtype = getattr(torch, cfg.dtype)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    for m in cfg.kv_share:
        if m not in MODES:
            raise ValueError(f"kv_share mode {m!r} unknown; choose from {', '.join(MODES)}")
    rows = []
    for backend in backends:
        for doc_len in cfg.doc_lens:
            # The reference is timed before AND after the cases, and their mean TF/s is what the
            # cases are divided by: a GPU that starts cool runs its first kernels at higher clocks
            # (the 16K unsplit document once measured faster than the 64K one, 653 vs 623 TF/s).
            whole = unsplit(doc_len, spec, dtype, device, backend, cfg, gen)
            cases = []
            for pattern in cfg.patterns:
                for mode in cfg.kv_share:
                    cases += [case(doc_len, s, spec, dtype, device, backend, cfg, gen, mode, pattern)
                              for s in sorted({s for s in cfg.shards if s < doc_len})]
            again = unsplit(doc_len, spec, dtype, device, backend, cfg, gen)
            whole["when"], again["when"] = "before the cases", "after the cases"
            ref = {ph: (whole[f"{ph}_tflops"] + again[f"{ph}_tflops"]) / 2 for ph in ("fwd", "fwd_bwd")
                   if f"{ph}_tflops" in whole and f"{ph}_tflops" in again}
            cases = [whole, again] + cases
            for c in cases:
                for ph, t in ref.items():
                    if f"{ph}_tflops" in c:
                        c[f"{ph}_vs_unsplit"] = c[f"{ph}_tflops"] / t
                print(fmt(c), flush=True)
            rows += cases
    return rows


def fmt(c: dict) -> str:
    def cell(ph):
        if f"{ph}_tflops" in c:
            return f"{c[f'{ph}_tflops']:8.3g} ({c.get(f'{ph}_vs_unsplit', float('nan')):.2f})"
        return f"{'skip' if f'{ph}_skipped' in c else 'error':>15}"
    return (f"{c['backend']:>11} {c['kv_share']:>8} {c['pattern']:>9} doc {c['doc_len']:>6} "
            f"shard {c['shard']:>6} x{c['n_shards']:<5} seg {c['n_segments']:<5} "
            f"fwd TF/s {cell('fwd')}  fwd+bwd TF/s {cell('fwd_bwd')}")

"""Linear layers against their matmuls: per block and direction, the TF/s of useful FLOPs of the plain
reference blocks and of the fused ones (``cadlib.runtime.blocks``, ``cadlib.runtime.fused``), beside
the time of the same GEMMs alone, at 16K-256K tokens, for the whole model's layer (TP 1) and one GPU's
shard of a TP group (TP 8, Megatron's sequence parallelism: norms and residuals on tokens / TP,
:class:`cadlib.bench.shard.LocalSP`; the collectives are not timed, the replay prices them).

Blocks (``n`` the group's tokens; ``q, kv, f, V`` the shard's widths, ``h`` the hidden size)::

    pre    norm, QKV, RoPE            useful FLOPs  fwd 2 n h (q + 2 kv)          bwd twice that
    post   O, residual, norm, MLP     useful FLOPs  fwd 2 n (q h + 3 h f)       bwd twice that (no recompute)
    head   final norm, LM head, loss  useful FLOPs  fwd 2 n h V                   bwd twice that
    layer  pre + post, forward + backward (the issue's "full layer" target)
    norm   RMSNorm alone, fwd + bwd: the reference, the Triton kernel and torch's own F.rms_norm
    optimizer  one AdamW step over the GPU's parameters (foreach, torch's fused): ms and GB/s

``gemm`` rows time the block's GEMMs alone (random inputs of the same shapes, bf16 out): pre one QKV GEMM
forward and two backward; post O, gate, up, down forward and two each backward; head per chunk of
``--ce-chunk`` tokens one forward, two backward. ``of_gemm`` = GEMM-only ms / the block's ms;
``of_peak`` = TF/s / ``H200_MATMUL_TFLOPS`` (790). Each record also says whether FlashAttention-4 is
installed (the linear layers do not use it; ``--merge`` keeps both runs' records). ``--impls compiled``
adds the references under ``torch.compile`` (pre and post; not by default: its compiles take minutes).

    python scripts/bench/bench_linear.py --out results/bench_linear_h200.json --merge --time-budget-s 200
    python scripts/bench/bench_linear.py --smoke --out /tmp/bench_linear.json   # CPU, tiny model, seconds
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from cadlib.bench.meters import backend_versions, peak_gb, reset_peak, tflops
from cadlib.bench.shard import LocalSP
from cadlib.bench.timer import time_phases
from cadlib.core.cost import H200_MATMUL_TFLOPS, as_model
from cadlib.infra.results import RESULTS_DIR, save_result
from cadlib.runtime import fused
from cadlib.runtime.blocks import ChunkedCrossEntropy, rms_norm
from cadlib.runtime.model import DecoderLayer

TOKENS = (131072, 65536, 262144, 32768, 16384)
"""In priority order: the issue's targets are at 128K."""
KEY = ("block", "direction", "impl", "recompute", "tokens", "tp", "fa4_installed")


def _randn(shape, device, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, device=device) * scale).to(dtype)


class Shapes:
    """One GPU's part of a layer at ``n`` tokens of a TP group of ``tp`` (``spec`` the shard)."""

    def __init__(self, model, tp: int, n: int, device, dtype):
        self.spec, self.tp, self.n, self.device, self.dtype = as_model(model).shard(tp), tp, n, device, dtype
        self.rows = n // tp                                 # the norms' tokens under SP

    def flops(self, block: str) -> float:
        """Useful forward FLOPs of ``block`` (backward: twice)."""
        s, n = self.spec, self.n
        return {"pre": 2.0 * n * s.hidden * (s.q_dim + 2 * s.kv_dim),
                "post": 2.0 * n * (s.q_dim * s.hidden + 3 * s.hidden * s.ffn),
                "head": 2.0 * n * s.hidden * s.vocab}[block]

    def sp(self):
        return LocalSP(self.tp, self.n, self.spec.hidden, self.device, self.dtype) if self.tp > 1 else None


def block_phases(sh: Shapes, block: str, impl: str, recompute: str, chunk: int):
    """``(fwd, bwd, reset)`` of one block computed the ``impl`` way, on random inputs."""
    s, dev, dt, n = sh.spec, sh.device, sh.dtype, sh.n
    gen = torch.Generator(device=dev).manual_seed(0)
    sp = sh.sp()
    x = _randn((sh.rows, s.hidden), dev, dt, gen).requires_grad_()
    if block == "head":
        w = torch.ones(s.hidden, device=dev, dtype=dt, requires_grad=True)
        head = _randn((s.vocab, s.hidden), dev, dt, gen, 0.02).requires_grad_()
        tgt = torch.randint(0, s.vocab, (n,), device=dev, generator=gen)

        def fwd():
            h = rms_norm(x, w, 1e-5, impl)
            return ChunkedCrossEntropy.apply(h if sp is None else sp.gather(h), head, tgt, chunk, impl)
        params = [w, head]
        bwd = torch.Tensor.backward
    else:
        layer = DecoderLayer(s, recompute=recompute, blocks="reference" if impl == "compiled" else impl,
                             dtype=dt, device=dev)
        if impl == "compiled":              # the references under torch.compile (token counts dynamic)
            layer.pre_attention = torch.compile(layer.pre_attention, dynamic=True)
            layer.mlp = torch.compile(layer.mlp, dynamic=True)
        params = list(layer.parameters())
        with torch.no_grad():
            for p in params:
                p.copy_(_randn(p.shape, dev, dt, gen, 0.02) if p.dim() > 1 else torch.ones_like(p))
        if block == "pre":
            ang = torch.rand(n, s.head_dim // 2, device=dev, generator=gen) * 100
            ang = torch.cat([ang, ang], -1)
            cos, sin = ang.cos().to(dt), ang.sin().to(dt)
            grads = [_randn((n, hh, s.head_dim), dev, dt, gen)
                     for hh in (s.n_heads, s.n_kv_heads, s.n_kv_heads)]

            def fwd():
                return layer.pre_attention(x, cos, sin, sp)

            def bwd(qkv):
                torch.autograd.backward(qkv, grads)
        else:
            o = _randn((n, s.n_heads, s.head_dim), dev, dt, gen).requires_grad_()
            gy = _randn((sh.rows, s.hidden), dev, dt, gen)

            def fwd():
                return layer.post_attention(x, o, sp)

            def bwd(y):
                y.backward(gy)

    def reset():
        for t in [x, *params] + ([] if block != "post" else [o]):
            t.grad = None
    return fwd, bwd, reset


def gemm_phases(sh: Shapes, block: str, chunk: int):
    """``(fwd, bwd)`` running the block's GEMMs alone (module docstring)."""
    s, dev, dt, n = sh.spec, sh.device, sh.dtype, sh.n
    gen = torch.Generator(device=dev).manual_seed(1)
    r = lambda *shape: _randn(shape, dev, dt, gen, 0.5)            # noqa: E731
    if block == "pre":
        mats = [(n, s.hidden, s.q_dim + 2 * s.kv_dim)]
    elif block == "post":
        mats = [(n, s.q_dim, s.hidden), (n, s.hidden, s.ffn), (n, s.hidden, s.ffn), (n, s.ffn, s.hidden)]
    else:
        mats = [(min(chunk, n), s.hidden, s.vocab)] * -(-n // chunk)
    bufs = {(m, k, o): (r(m, k), r(k, o), r(m, o)) for m, k, o in set(mats)}    # a chunk's reused
    ops = [bufs[m] for m in mats]

    def fwd():
        for a, w, _ in ops:
            a @ w

    def bwd(_):
        for a, w, g in ops:
            g @ w.t()
            a.t() @ g
    return fwd, bwd


def time_block(sh: Shapes, block: str, impl: str, recompute: str, args) -> list[dict]:
    """The block's forward and backward records (``impl="gemm"``: its GEMMs alone)."""
    reset_peak(sh.device)
    if impl == "gemm":
        fwd, bwd = gemm_phases(sh, block, args.ce_chunk)
        reset = None
    else:
        fwd, bwd, reset = block_phases(sh, block, impl, recompute, args.ce_chunk)
    ms = time_phases([fwd, bwd], sh.device, iters=args.iters, warmup=args.warmup, after=reset)
    out = []
    for direction, times, mult in (("fwd", ms[0], 1), ("bwd", ms[1], 2)):
        t = float(torch.tensor(times).median())
        f = sh.flops(block) * mult
        out.append({"block": block, "direction": direction, "impl": impl, "recompute": recompute,
                    "tokens": sh.n, "tp": sh.tp, "ms": t, "flops": f, "tflops": tflops(f, t),
                    "of_peak": tflops(f, t) / H200_MATMUL_TFLOPS, "peak_mem_gb": peak_gb(sh.device)})
    return out


def time_norm(sh: Shapes, impl: str, args) -> dict:
    """RMSNorm alone on ``[n / tp, hidden]``, forward + backward (``impl``: reference, fused, torch)."""
    gen = torch.Generator(device=sh.device).manual_seed(2)
    x = _randn((sh.rows, sh.spec.hidden), sh.device, sh.dtype, gen).requires_grad_()
    w = torch.ones(sh.spec.hidden, device=sh.device, dtype=sh.dtype, requires_grad=True)
    dy = _randn((sh.rows, sh.spec.hidden), sh.device, sh.dtype, gen)

    def run():
        y = F.rms_norm(x, (sh.spec.hidden,), w, 1e-5) if impl == "torch" else rms_norm(x, w, 1e-5, impl)
        y.backward(dy)
        x.grad = w.grad = None
    t = float(torch.tensor(time_phases([run], sh.device, iters=args.iters, warmup=args.warmup)[0]).median())
    moved = 4 * x.numel() * x.element_size()                      # x, dy read; y, dx written
    return {"block": "norm", "direction": "fwd+bwd", "impl": impl, "recompute": "none", "tokens": sh.n,
            "tp": sh.tp, "rows": sh.rows, "ms": t, "gbps": moved / (t * 1e-3) / 1e9}


def time_optimizer(model, tp: int, impl: str, args, device, dtype) -> dict:
    """One AdamW step over one GPU's parameters (``impl``: foreach, or torch's fused), after one untimed
    step that makes the optimizer's state; bytes: params, grads read, params and two moments read
    and written."""
    s = as_model(model, **({"n_layers": args.layers} if args.layers else {})).shard(tp)
    gen = torch.Generator(device=device).manual_seed(3)
    shapes = [(s.vocab, s.hidden)] * 2 + [(s.hidden,)] + [
        (s.q_dim, s.hidden), (s.kv_dim, s.hidden), (s.kv_dim, s.hidden), (s.hidden, s.q_dim),
        (s.ffn, s.hidden), (s.ffn, s.hidden), (s.hidden, s.ffn), (s.hidden,), (s.hidden,)] * s.n_layers
    params = [torch.nn.Parameter(_randn(sh, device, dtype, gen, 0.02)) for sh in shapes]
    for p in params:
        p.grad = _randn(p.shape, device, dtype, gen, 1e-3)
    opt = torch.optim.AdamW(params, lr=1e-5, **({"fused": True} if impl == "fused" else {"foreach": True}))
    t = float(torch.tensor(time_phases([opt.step], device, iters=args.iters, warmup=1)[0]).median())
    n = sum(p.numel() for p in params)
    moved = n * params[0].element_size() * 7
    del opt, params
    return {"block": "optimizer", "direction": "step", "impl": impl, "recompute": "none", "tokens": 0,
            "tp": tp, "params": n, "layers": s.n_layers, "ms": t, "gbps": moved / (t * 1e-3) / 1e9}


def layer_rows(rows: list[dict]) -> list[dict]:
    """``layer``: pre + post, forward + backward, per (impl, recompute, tokens, tp, fa4), against the
    GEMM-only time of the same GEMMs."""
    by = {tuple(r[k] for k in KEY): r for r in rows if "ms" in r}
    out = []
    for r in rows:
        if r["block"] != "post" or r["direction"] != "fwd" or r["impl"] == "gemm":
            continue
        parts = [by.get((b, d, r["impl"], rc, r["tokens"], r["tp"], r["fa4_installed"]))
                 for b, rc in (("pre", "none"), ("post", r["recompute"])) for d in ("fwd", "bwd")]
        gemm = [by.get((b, d, "gemm", "none", r["tokens"], r["tp"], r["fa4_installed"]))
                for b in ("pre", "post") for d in ("fwd", "bwd")]
        if None in parts:
            continue
        ms, f = sum(p["ms"] for p in parts), sum(p["flops"] for p in parts)
        row = {**{k: r[k] for k in KEY}, "block": "layer", "direction": "fwd+bwd", "ms": ms, "flops": f,
               "tflops": tflops(f, ms), "of_peak": tflops(f, ms) / H200_MATMUL_TFLOPS}
        if None not in gemm:
            row["gemm_ms"] = sum(g["ms"] for g in gemm)
            row["of_gemm"] = row["gemm_ms"] / ms
        out.append(row)
    return out


def cells(args, fused_ok: bool) -> list[tuple]:
    """``(tokens, tp, block, impl, recompute)`` in the order they run (128K first)."""
    impls = [i for i in args.impls.split(",") if i != "fused" or fused_ok]
    out = []
    for n in args.tokens:
        for tp in args.tps:
            for block in args.blocks.split(","):
                if block in ("pre", "post", "head"):
                    out.append((n, tp, block, "gemm", "none"))
                    for impl in impls:
                        if impl == "compiled" and block == "head":
                            continue
                        for rc in (args.recomputes.split(",") if block == "post" else ["none"]):
                            out.append((n, tp, block, impl, rc))
                elif block == "norm":
                    out += [(n, tp, "norm", i, "none") for i in [*impls, "torch"] if i != "compiled"]
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--layers", type=int, default=None, help="layers of the optimizer's parameters")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--tps", default="1,8")
    p.add_argument("--blocks", default="pre,post,head,norm,optimizer")
    p.add_argument("--impls", default="reference,fused",
                   help="reference, fused (skipped where it cannot run), compiled (the references' pre and "
                        "MLP under torch.compile, dynamic token counts: minutes of compiling on a GPU)")
    p.add_argument("--recomputes", default="none,mlp", help="the post block's")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--ce-chunk", type=int, default=8192)
    p.add_argument("--time-budget-s", type=float, default=float("inf"))
    p.add_argument("--out", default=str(RESULTS_DIR / "bench_linear_h200.json"))
    p.add_argument("--merge", action="store_true", help="keep the records of --out and run only the others")
    p.add_argument("--smoke", action="store_true", help="CPU, the tiny model, small token counts")
    a = p.parse_args(argv)
    if a.smoke:
        a.model, a.tokens, a.tps, a.iters, a.warmup, a.ce_chunk = "tiny", "128", "1,2", 1, 0, 64
    a.tokens = [int(t) for t in str(a.tokens).split(",")]
    a.tps = [int(t) for t in str(a.tps).split(",")]
    if a.iters < 1 or a.warmup < 0 or a.ce_chunk < 1 or min(a.tokens) < 1 or min(a.tps) < 1:
        p.error("--iters, --ce-chunk, --tokens and --tps must be >= 1 and --warmup >= 0")
    if any(n % tp for n in a.tokens for tp in a.tps):
        p.error("every --tps must divide every --tokens (the norms' rows under sequence parallelism)")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    device = torch.device("cpu" if a.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    versions = backend_versions()
    fa4 = versions.get("flash-attn-4") is not None
    fused_ok = fused.can_fuse(torch.empty(0, device=device, dtype=dtype))
    out = Path(a.out)
    old = json.loads(out.read_text())["results"]["records"] if a.merge and out.exists() else []
    rows = [r for r in old if r["block"] != "layer"]
    done = {tuple(r[k] for k in KEY) for r in rows}
    t0, skipped = time.perf_counter(), 0
    for n, tp, block, impl, rc in cells(a, fused_ok):
        key = (block, "fwd+bwd" if block == "norm" else "fwd", impl, rc, n, tp, fa4)
        if key in done:
            continue
        if time.perf_counter() - t0 > a.time_budget_s:
            skipped += 1
            continue
        sh = Shapes(a.model, tp, n, device, dtype)
        try:
            new = [time_norm(sh, impl, a)] if block == "norm" else time_block(sh, block, impl, rc, a)
        except torch.cuda.OutOfMemoryError as e:
            new = [{"block": block, "direction": d, "impl": impl, "recompute": rc, "tokens": n, "tp": tp,
                    "error": f"out of memory: {str(e)[:200]}"} for d in ("fwd", "bwd")]
        for r in new:
            r["fa4_installed"] = fa4
        rows += new
        ok = [r for r in new if "ms" in r]
        done_s = ", ".join(f"{r['direction']} {r['ms']:.2f} ms" + (f" {r['tflops']:.0f} TF/s" if "tflops" in r
                                                                    else "") for r in ok)
        print(f"[{time.perf_counter() - t0:5.0f} s] {block:>5} {impl:>9} rc={rc:<4} tp={tp} n={n:>6}: "
              f"{done_s}", flush=True)
    if "optimizer" in a.blocks.split(","):
        for tp in a.tps:
            for impl in ("foreach", "fused"):
                if ("optimizer", "step", impl, "none", 0, tp, fa4) not in done and \
                        time.perf_counter() - t0 <= a.time_budget_s:
                    rows.append({**time_optimizer(a.model, tp, impl, a, device, dtype), "fa4_installed": fa4})
    gemm = {(r["block"], r["direction"], r["tokens"], r["tp"], r["fa4_installed"]): r["ms"]
            for r in rows if r.get("impl") == "gemm" and "ms" in r}
    for r in rows:
        g = gemm.get((r["block"], r["direction"], r["tokens"], r["tp"], r["fa4_installed"]))
        if g is not None and "ms" in r and r["impl"] != "gemm":
            r["gemm_ms"], r["of_gemm"] = g, g / r["ms"]
    config = {**{k: v for k, v in vars(a).items()}, "device": str(device), "dtype": str(dtype)[6:],
              "fused_available": fused_ok, "kernels": versions, "peak_tflops": H200_MATMUL_TFLOPS}
    save_result(out, config, {"records": rows + layer_rows(rows), "not_reached": skipped})
    print(f"{len(rows)} records -> {out}" + (f"; {skipped} cells over the time budget" if skipped else ""))
    return 0 if not skipped else 3


if __name__ == "__main__":
    sys.exit(main())

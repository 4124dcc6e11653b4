"""One GPU's linear work as the scale replay times it: a decoder layer's linear parts, the model's ends
(embedding, final norm, LM head and loss) and the optimizer step, each at a token count, for
``scripts/bench/bench_replay.py time`` and :mod:`cadlib.calibrate`.

A layer's linear parts cost about ``LINEAR_BWD_MULT + 1 = 3`` times their forward GEMMs,
``2 n (q_dim + 2 kv_dim + ...)`` FLOPs per token (:meth:`cadlib.core.cost.ModelSpec.linear_flops_per_token`);
the four phases are timed apart (pre-attention forward and backward, post-attention forward and
backward, the MLP recomputed in the backward as DistCA's runs do). How the blocks compute is the
replay's linear variant (:data:`cadlib.analysis.replay.times.LINEAR_VARIANTS`): ``""`` the reference
blocks on every token of the TP group, ``"fused-sp"`` the fused blocks with sequence parallelism's
norms on ``n / tp`` tokens (:class:`cadlib.bench.shard.LocalSP`).
"""
from __future__ import annotations

import numpy as np
import torch

from ..runtime.blocks import ChunkedCrossEntropy, RMSNorm
from .shard import LocalSP
from .timer import time_phases, time_samples


def blocks_of(variant: str) -> str:
    """The blocks a linear variant runs (:data:`cadlib.analysis.replay.times.LINEAR_VARIANTS`)."""
    return "fused" if variant == "fused-sp" else "reference"


def sp_of(variant: str, tp: int, n: int, spec, device, dtype):
    """Sequence parallelism's stand-in for one GPU of ``tp`` at ``n`` tokens (None: every token
    through the norms, the committed timings, or ``tp = 1``)."""
    return LocalSP(tp, n, spec.hidden, device, dtype) if variant == "fused-sp" and tp > 1 else None


def time_linear(layer, spec, n, device, dtype, iters: int, sp=None) -> dict:
    """One decoder layer's linear parts at ``n`` tokens: pre-attention (norm, QKV, RoPE) and
    post-attention (O projection, MLP with recompute), each forward and backward; the median of
    ``iters`` timed runs after as many untimed ones (a new token count allocates). With ``sp``
    (:class:`cadlib.bench.shard.LocalSP`) the norms and residuals run on its ``n / tp`` tokens."""
    rows = n if sp is None else sp.local
    x = torch.randn(rows, spec.hidden, device=device, dtype=dtype, requires_grad=True)
    pos = torch.arange(n, device=device) % 8192
    inv = 1.0 / (500000.0 ** (torch.arange(0, spec.head_dim, 2, device=device, dtype=torch.float32)
                              / spec.head_dim))
    ang = torch.cat([pos[:, None] * inv[None]] * 2, -1)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    o = torch.randn(n, spec.n_heads, spec.head_dim, device=device, dtype=dtype, requires_grad=True)
    gq = torch.randn(n, spec.n_heads, spec.head_dim, device=device, dtype=dtype)
    gk = torch.randn(n, spec.n_kv_heads, spec.head_dim, device=device, dtype=dtype)
    gy = torch.randn(rows, spec.hidden, device=device, dtype=dtype)

    def reset():
        x.grad = o.grad = None
        layer.zero_grad(set_to_none=True)
    phases = [lambda: layer.pre_attention(x, cos, sin, sp),
              lambda qkv: torch.autograd.backward(qkv, (gq, gk, gk)),
              lambda _: layer.post_attention(x, o, sp),
              lambda y: y.backward(gy)]
    ms = time_phases(phases, device, iters=iters, warmup=iters, after=reset)
    return {k: float(np.median(v)) for k, v in zip(("pre_ms", "pre_bwd_ms", "post_ms", "post_bwd_ms"), ms)}


class Head(torch.nn.Module):
    """The model's ends (:class:`cadlib.runtime.model.Decoder`'s embedding, final norm and LM head),
    with random weights made on the device."""

    def __init__(self, spec, device, dtype, blocks: str = "reference"):
        super().__init__()
        w = {"device": device, "dtype": dtype}
        self.blocks = blocks
        self.embed = torch.nn.Embedding(spec.vocab, spec.hidden, **w)
        self.norm = RMSNorm(spec.hidden, blocks=blocks, **w)
        self.lm_head = torch.nn.Linear(spec.hidden, spec.vocab, bias=False, **w)


def time_head(head, spec, n, device, iters: int, sp=None) -> dict:
    """Embedding, final norm, LM head and its chunked loss at ``n`` tokens, forward and backward; the
    median of ``iters`` timed runs after as many untimed ones. With ``sp`` the embedding's output is
    scattered to ``n / tp`` tokens (vocabulary-parallel) and the final norm's gathered."""
    tok = torch.randint(0, spec.vocab, (n,), device=device)
    tgt = torch.randint(0, spec.vocab, (n,), device=device)

    def run():
        e = head.embed(tok)
        h = head.norm(e if sp is None else sp.scatter(e))
        h = h if sp is None else sp.gather(h)
        ChunkedCrossEntropy.apply(h, head.lm_head.weight, tgt, 8192, head.blocks).backward()
    ms = time_samples(run, device, iters=iters, warmup=iters, after=lambda: head.zero_grad(set_to_none=True))
    return {"ms": float(np.median(ms))}


def time_optimizer(spec, device, dtype, iters: int) -> dict:
    """One AdamW step over a GPU's parameters (their shapes; the values do not matter), after one
    untimed step (it also makes the optimizer's state)."""
    shapes = [(spec.vocab, spec.hidden), (spec.vocab, spec.hidden), (spec.hidden,)]
    per = [(spec.n_heads * spec.head_dim, spec.hidden), (spec.n_kv_heads * spec.head_dim, spec.hidden),
           (spec.n_kv_heads * spec.head_dim, spec.hidden), (spec.hidden, spec.n_heads * spec.head_dim),
           (spec.ffn, spec.hidden), (spec.ffn, spec.hidden), (spec.hidden, spec.ffn), (spec.hidden,),
           (spec.hidden,)]
    params = [torch.nn.Parameter(torch.randn(s, device=device, dtype=dtype) * 0.02)
              for s in shapes + per * spec.n_layers]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-5)
    ms = time_samples(opt.step, device, iters=iters, warmup=1)
    return {"ms": float(np.median(ms)), "params": sum(p.numel() for p in params)}

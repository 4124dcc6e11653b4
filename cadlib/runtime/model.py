"""A Llama-style decoder whose core attention is a parameter: the model CAD trains.

The model computes everything *except* core attention, in the rank's own token layout (DistCA's
"linear layout"): embedding, RMSNorm, the Q/K/V/O projections with RoPE, the SwiGLU MLP and the LM
head. Core attention ``softmax(q k^T / sqrt(D) + causal mask) v`` is a callable handed to
:meth:`Decoder.forward`, called ONCE per layer with the layer's ``q, k, v``; it alone knows where
documents begin and which rank attends what (colocated, per-document context parallelism, or CAD).
RoPE is applied here, before any dispatch, so attention servers never see positions.

Per layer (pre-norm residual blocks)::

    q, k, v = rope(Wq rms(x)), rope(Wk rms(x)), Wv rms(x)          # pre_attention
    x = x + Wo attn(q, k, v)                                       # post_attention ...
    x = x + W2 (silu(W1 rms(x)) * W3 rms(x))                       # ... SwiGLU MLP

and the loss is the summed token cross-entropy of ``lm_head(rms(x))``, computed in chunks of tokens
so that the ``[tokens, vocab]`` logits never exist at once (:class:`ChunkedCrossEntropy`).

A step's inputs (positions restarting at every document, synthetic tokens and targets from a layout)
and a reference core attention over whole documents are in :mod:`cadlib.runtime.batches`.
"""
from __future__ import annotations

import zlib
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..core.cost import ModelSpec, as_model
from ..core.pipeline import split_layers

IGNORE_INDEX = -100
"""Target id that contributes nothing to the loss (each document's last token)."""

INIT_STD = 0.02
"""Standard deviation of every weight matrix at initialisation (norm weights start at 1)."""

CoreAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
"""``core_attention(q [n, Hq, D], k [n, Hkv, D], v [n, Hkv, D], layer_index) -> o [n, Hq, D]``."""


# ---------------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------------

def _up(x: torch.Tensor) -> torch.Tensor:
    """``x`` in at least fp32 (fp64 stays fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class _RMSNormFn(torch.autograd.Function):
    """``y = (x * r).to(dtype) * w`` with ``r = 1 / sqrt(mean(x^2) + eps)`` in fp32; saves only ``x``
    and ``r`` (autograd of the plain expression would also keep fp32 copies of ``x``). Backward, with
    ``xh = x r`` and ``gw = dy * w`` (fp32): ``dx = r (gw - xh mean(gw * xh))``, ``dw = sum_i dy_i xh_i``."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        xf = _up(x)
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, r)
        return (xf * r).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, dy):
        x, weight, r = ctx.saved_tensors
        xh = _up(x) * r
        gw = _up(dy) * _up(weight)
        dx = r * (gw - xh * (gw * xh).mean(-1, keepdim=True))
        dw = (_up(dy) * _up(xh.to(x.dtype))).reshape(-1, x.shape[-1]).sum(0)
        return dx.to(x.dtype), dw.to(weight.dtype), None


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * w`` over the last dimension, computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-5, *, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFn.apply(x, self.weight, self.eps)


SWIGLU_BWD_ELEMS = 1 << 27
"""The SwiGLU backward works in fp32 on row blocks of at most this many elements (512 MiB each), not on
the whole ``[n, ffn]`` at once (at 128K tokens x 14336 that would be 7 GiB per temporary)."""


class _SwiGLUFn(torch.autograd.Function):
    """``silu(a) * b`` with ``silu(a) = a sigmoid(a)``, keeping only ``a`` and ``b`` for backward
    (autograd of the plain expression also keeps ``silu(a)``). With ``s = sigmoid(a)``:
    ``da = dy b s (1 + a (1 - s))``, ``db = dy silu(a)`` (fp32)."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx, dy):
        a, b = ctx.saved_tensors
        da, db = torch.empty_like(a), torch.empty_like(b)
        rows = max(1, SWIGLU_BWD_ELEMS // max(1, a.shape[-1]))
        for i in range(0, a.shape[0], rows):                 # fp32 temporaries of bounded size
            af, g = _up(a[i:i + rows]), _up(dy[i:i + rows])
            s = torch.sigmoid(af)
            da[i:i + rows] = g * _up(b[i:i + rows]) * s * (1 + af * (1 - s))
            db[i:i + rows] = g * af * s
        return da, db


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding, rotate-half convention, on ``x [n, H, D]`` with ``cos, sin [n, D]``::

        rope(x)_m = x_m * cos(m theta) + rotate_half(x_m) * sin(m theta)

    i.e. each pair ``(x_i, x_{i + D/2})`` is rotated by the angle ``m * theta_i`` of its token's
    position ``m``, so ``rope(q)_m . rope(k)_n`` depends on positions only through ``m - n``.
    ``rotate_half([x1, x2]) = [-x2, x1]`` (halves of the last dimension)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None, :] + torch.cat((-x2, x1), dim=-1) * sin[:, None, :]


class DecoderLayer(nn.Module):
    """One pre-norm Llama block, split around core attention: :meth:`pre_attention` gives the
    layer's ``q, k, v``; :meth:`post_attention` takes the attention output ``o`` back."""

    def __init__(self, spec: ModelSpec, *, mlp_recompute: bool = False, dtype=None, device=None):
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        h, d = spec.hidden, spec.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = spec.n_heads, spec.n_kv_heads, d
        self.mlp_recompute = mlp_recompute
        self.attn_norm = RMSNorm(h, dtype=dtype, device=device)
        self.wq = nn.Linear(h, spec.n_heads * d, **kw)       # weight [Hq*D, hidden]
        self.wk = nn.Linear(h, spec.n_kv_heads * d, **kw)    # weight [Hkv*D, hidden]
        self.wv = nn.Linear(h, spec.n_kv_heads * d, **kw)
        self.wo = nn.Linear(spec.n_heads * d, h, **kw)       # weight [hidden, Hq*D]
        self.mlp_norm = RMSNorm(h, dtype=dtype, device=device)
        self.w1 = nn.Linear(h, spec.ffn, **kw)               # gate, weight [ffn, hidden]
        self.w3 = nn.Linear(h, spec.ffn, **kw)               # up,   weight [ffn, hidden]
        self.w2 = nn.Linear(spec.ffn, h, **kw)               # down, weight [hidden, ffn]

    def pre_attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``h = rms(x)``; ``q = rope(Wq h)``, ``k = rope(Wk h)``, ``v = Wv h`` as ``[n, heads, D]``."""
        n = x.shape[0]
        h = self.attn_norm(x)
        q = self.wq(h).view(n, self.n_heads, self.head_dim)
        k = self.wk(h).view(n, self.n_kv_heads, self.head_dim)
        v = self.wv(h).view(n, self.n_kv_heads, self.head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU on the normed input: ``W2 (silu(W1 rms(x)) * W3 rms(x))``, ``silu(a) = a sigmoid(a)``."""
        h = self.mlp_norm(x)
        return self.w2(_SwiGLUFn.apply(self.w1(h), self.w3(h)))

    def post_attention(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """``x = x + Wo o``, then ``x = x + mlp(x)``. With ``mlp_recompute`` the norm and MLP keep only
        their input for backward and run again there (``torch.utils.checkpoint``, non-reentrant)."""
        x = x + self.wo(o.flatten(1))
        if self.mlp_recompute and torch.is_grad_enabled():
            return x + checkpoint(self.mlp, x, use_reentrant=False)
        return x + self.mlp(x)


# ---------------------------------------------------------------------------------------------------
# Chunked cross-entropy with the LM head
# ---------------------------------------------------------------------------------------------------

_MM_OUT_DTYPE = [True]   # whether torch.mm(..., out_dtype=float32) works here; cleared on first failure


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` as fp32: low-precision inputs are multiplied with fp32 accumulation and fp32 output
    where torch supports it (``mm(out_dtype=)`` on CUDA), else the low-precision product is upcast."""
    if a.dtype == torch.float32:
        return a @ b
    if _MM_OUT_DTYPE[0] and a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            _MM_OUT_DTYPE[0] = False
    return (a @ b).float()


class ChunkedCrossEntropy(torch.autograd.Function):
    """``sum_i [lse_i - z_{i, t_i}]`` over tokens with ``t_i != -100``, ``z_i = W h_i`` (fp32),
    ``lse_i = log sum_v exp(z_{i, v})``; chunk by chunk of ``chunk`` tokens.

    Forward keeps only ``hidden``, ``targets`` and the per-token ``lse`` (fp32 ``[n]``) for backward;
    backward recomputes each chunk's logits and uses ``dL/dz_i = g (softmax(z_i) - onehot(t_i))``::

        dh_i = (dL/dz_i) W,    dW = sum_i (dL/dz_i)^T h_i

    Peak extra memory is about two ``[chunk, vocab]`` fp32 buffers (logits and their exp), never
    ``[n, vocab]``; backward also holds dW as fp32 ``[vocab, hidden]`` (and, for a low-precision W,
    one more such buffer for each chunk's product): ~2 GiB each at llama3-8b's vocabulary."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int):
        n = hidden.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        valid = targets != IGNORE_INDEX
        safe = torch.where(valid, targets, torch.zeros_like(targets))
        wt = weight.t()
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            z = _mm_f32(hidden[s:e], wt)                                  # [c, V] fp32
            lse[s:e] = torch.logsumexp(z, dim=-1)
            zt = z.gather(1, safe[s:e, None]).squeeze(1)
            total += ((lse[s:e] - zt) * valid[s:e]).sum()
            del z
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, targets, lse = ctx.saved_tensors
        chunk, n = ctx.chunk, hidden.shape[0]
        valid = targets != IGNORE_INDEX
        safe = torch.where(valid, targets, torch.zeros_like(targets))
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh = torch.empty_like(hidden) if need_h else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        wt = weight.t()
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            h = hidden[s:e]
            p = _mm_f32(h, wt).sub_(lse[s:e, None]).exp_()                # softmax, [c, V] fp32
            p.scatter_add_(1, safe[s:e, None], -torch.ones(e - s, 1, dtype=p.dtype, device=p.device))
            p.mul_((valid[s:e].to(p.dtype) * grad)[:, None])              # dL/dz, zero on ignored rows
            g = p.to(hidden.dtype)
            del p
            if need_h:
                dh[s:e] = g @ weight
            if need_w and g.dtype == torch.float32:
                dw.addmm_(g.t(), h)                                       # in place, no [V, hidden] temp
            elif need_w:
                dw += _mm_f32(g.t(), h)
        return dh, (dw.to(weight.dtype) if need_w else None), None, None


# ---------------------------------------------------------------------------------------------------
# The decoder
# ---------------------------------------------------------------------------------------------------

class Decoder(nn.Module):
    """Llama-style decoder: ``embed -> layers -> norm``, untied ``lm_head``; core attention is a
    parameter of :meth:`forward`.

    ``spec`` (a :class:`~cadlib.core.cost.ModelSpec` or a model name) gives the sizes; ``n_layers``
    overrides its layer count. Weights are drawn N(0, 0.02) on the CPU from generators seeded by
    ``(seed, parameter name)``, so every data-parallel replica (and every layer count) builds
    identical weights for the same names, then moved to ``device`` in ``dtype``. No biases.
    RoPE is plain Llama RoPE with base ``rope_theta`` (no Llama-3.1 frequency scaling).

    ``stage=(s, pp)``: only pipeline stage ``s`` of ``pp``: its block of ``n_layers / pp`` layers
    (``layer_ids``), the embedding on the first stage, the final norm and LM head on the last
    (absent modules are None). Parameters keep the whole model's names (:meth:`global_name`), so a
    stage's weights are those of the same layers of the whole model."""

    def __init__(self, spec: "ModelSpec | str", n_layers: int | None = None, *, dtype=torch.float32,
                 device=None, mlp_recompute: bool = False, rope_theta: float = 500000.0, seed: int = 0,
                 stage: tuple[int, int] | None = None):
        super().__init__()
        spec = as_model(spec)
        if n_layers is not None:
            if int(n_layers) < 1:
                raise ValueError(f"n_layers must be >= 1 (or None for the spec's {spec.n_layers}); "
                                 f"got {n_layers}")
            spec = as_model(spec, n_layers=int(n_layers))
        if spec.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim; got {spec.head_dim}")
        if not rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0; got {rope_theta}")
        self.spec, self.rope_theta, self.seed = spec, float(rope_theta), int(seed)
        s, pp = (0, 1) if stage is None else stage
        self.layer_ids = split_layers(spec.n_layers, pp)[s] if 0 <= s < pp else None
        if self.layer_ids is None:
            raise ValueError(f"stage must be (s, pp) with 0 <= s < pp; got {stage}")
        self.first, self.last = s == 0, s == pp - 1
        device = torch.device(device) if device is not None else torch.device("cpu")
        meta = dict(dtype=dtype, device="meta")
        self.embed = nn.Embedding(spec.vocab, spec.hidden, **meta) if self.first else None   # [vocab, hidden]
        self.layers = nn.ModuleList(DecoderLayer(spec, mlp_recompute=mlp_recompute, **meta)
                                    for _ in self.layer_ids)
        self.norm = RMSNorm(spec.hidden, **meta) if self.last else None
        self.lm_head = nn.Linear(spec.hidden, spec.vocab, bias=False, **meta) if self.last else None
        self.to_empty(device=device)
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        for name, p in self.named_parameters():
            if p.dim() == 1:                                   # RMSNorm weights
                p.fill_(1.0)
                continue
            g = torch.Generator().manual_seed(_stable_seed(self.seed, zlib.crc32(self.global_name(name).encode())))
            p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, INIT_STD, generator=g))

    def global_name(self, name: str) -> str:
        """A parameter's name in the whole model (``layers.<i>.`` counts from this stage's first layer)."""
        if not name.startswith("layers."):
            return name
        i, rest = name[len("layers."):].split(".", 1)
        return f"layers.{self.layer_ids[int(i)]}.{rest}"

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].wq.weight.dtype

    @property
    def mlp_recompute(self) -> bool:
        return all(layer.mlp_recompute for layer in self.layers)

    def parameter_count(self) -> int:
        """Number of parameters (embedding and LM head included)."""
        return sum(p.numel() for p in self.parameters())

    def saved_bytes_per_token(self) -> int:
        """Bytes one layer's linear part keeps for backward per token, core attention's own excluded
        (it adds ``q, k, v, o`` and an fp32 lse with a flash kernel). ``b`` = bytes per element::

            plain:          (4 hidden + Hq D + 3 ffn) b + 2 * 4   (norm inputs and outputs, Wo input,
                                                                    gate, up, SwiGLU output; 2 fp32 rstd)
            mlp_recompute:  (3 hidden + Hq D) b + 4                 (the MLP keeps only its input)
        """
        sp, b = self.spec, torch.empty(0, dtype=self.dtype).element_size()
        if self.mlp_recompute:
            return (3 * sp.hidden + sp.q_dim) * b + 4
        return (4 * sp.hidden + sp.q_dim + 3 * sp.ffn) * b + 8

    def rope(self, positions: torch.Tensor):
        """``(cos, sin)`` each ``[n, D]``: angle ``m * theta_i`` with ``theta_i = rope_theta^(-2i/D)``
        for ``i < D/2``, repeated for both halves (rotate-half layout); fp32, then the model dtype."""
        if positions.dim() != 1:
            raise ValueError(f"positions must be 1-D [n]; got shape {tuple(positions.shape)}")
        d = self.spec.head_dim
        dev = self.layers[0].wq.weight.device
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=dev) / d))
        ang = positions.to(dev, torch.float32)[:, None] * inv[None, :]
        ang = torch.cat((ang, ang), dim=-1)
        return ang.cos().to(self.dtype), ang.sin().to(self.dtype)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                core_attention: CoreAttention) -> torch.Tensor:
        """``hidden [n, hidden]`` after the final RMSNorm. ``core_attention(q, k, v, i)`` is called
        once per layer ``i`` and must return ``o [n, Hq, D]`` (causal attention within documents)."""
        if not (self.first and self.last):
            raise ValueError("forward() runs the whole model; a pipeline stage runs its parts "
                             "(cadlib.runtime.pipeline)")
        if tokens.dim() != 1 or tokens.shape != positions.shape:
            raise ValueError(f"tokens and positions must be 1-D and of equal length; got shapes "
                             f"{tuple(tokens.shape)} and {tuple(positions.shape)}")
        cos, sin = self.rope(positions)
        return self.norm(self.run_layers(self.embed(tokens), cos, sin, core_attention))

    def run_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   core_attention: CoreAttention) -> torch.Tensor:
        """This model's (or pipeline stage's) layers on the residual stream ``x [n, hidden]``;
        ``core_attention(q, k, v, i)`` gets the whole model's layer index ``i``."""
        for i, layer in zip(self.layer_ids, self.layers):
            q, k, v = layer.pre_attention(x, cos, sin)
            x = layer.post_attention(x, core_attention(q, k, v, i))
        return x

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor, chunk_tokens: int = 4096):
        """``(loss_sum, n_valid)``: summed cross-entropy ``sum_i -log softmax(W_lm h_i)_{t_i}`` over
        targets ``!= -100`` (fp32 scalar with autograd), and how many targets counted (an int; a
        host sync when ``targets`` lives on the GPU -- count on the host beforehand to avoid it).
        Chunked over tokens; never holds ``[n, vocab]`` logits (see :class:`ChunkedCrossEntropy`)."""
        if hidden.dim() != 2 or hidden.shape[1] != self.spec.hidden:
            raise ValueError(f"hidden must be [n, {self.spec.hidden}]; got {tuple(hidden.shape)}")
        if targets.shape != hidden.shape[:1]:
            raise ValueError(f"targets must be [n] = [{hidden.shape[0]}]; got {tuple(targets.shape)}")
        if int(chunk_tokens) < 1:
            raise ValueError(f"chunk_tokens must be >= 1; got {chunk_tokens}")
        targets = targets.to(hidden.device, torch.int64)
        if not targets.is_cuda and targets.numel():
            bad = (targets != IGNORE_INDEX) & ((targets < 0) | (targets >= self.spec.vocab))
            if bool(bad.any()):
                raise ValueError(f"targets must be in [0, {self.spec.vocab}) or {IGNORE_INDEX}; got "
                                 f"{targets[bad][0].item()}")
        loss_sum = ChunkedCrossEntropy.apply(hidden, self.lm_head.weight, targets, int(chunk_tokens))
        return loss_sum, int((targets != IGNORE_INDEX).sum())


def _stable_seed(*parts: int) -> int:
    """One 63-bit seed from several integers, stable across runs and platforms."""
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFFFFFFFFFF for p in parts]).generate_state(
        1, np.uint64)[0] >> np.uint64(1))

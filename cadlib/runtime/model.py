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
so that the ``[tokens, vocab]`` logits never exist at once (:class:`ChunkedCrossEntropy`). Each block
(norm, QKV with RoPE, SwiGLU MLP, the head's loss) is a plain torch reference or, on a GPU, fused
kernels of the same result (:mod:`cadlib.runtime.blocks`, :mod:`cadlib.runtime.fused`).

A step's inputs (positions restarting at every document, synthetic tokens and targets from a layout)
and a reference core attention over whole documents are in :mod:`cadlib.runtime.batches`.
"""
from __future__ import annotations

import zlib
from typing import Callable, Protocol

import numpy as np
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..core.cost import ModelSpec, as_model
from ..core.pipeline import split_layers
from .blocks import IGNORE_INDEX, ChunkedCrossEntropy, RMSNorm, qkv_rope, swiglu_mlp
from .fused import BLOCKS

INIT_STD = 0.02
"""Standard deviation of every weight matrix at initialisation (norm weights start at 1)."""

CoreAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
"""``core_attention(q [n, Hq, D], k [n, Hkv, D], v [n, Hkv, D], layer_index) -> o [n, Hq, D]``."""


# ---------------------------------------------------------------------------------------------------
# One layer
# ---------------------------------------------------------------------------------------------------

RECOMPUTE = ("none", "mlp")
"""What a layer computes again in its backward: nothing, or its MLP (norm and SwiGLU MLP keep only their
input). The memory model's ``full`` (the whole layer, attention included) is not offered: attention
under CAD runs on other GPUs, and recomputing it would send its inputs again."""


class SequenceParallel(Protocol):
    """Megatron's sequence parallelism inside a tensor-parallel group: the norms and residuals run on
    the rank's ``n / tp`` tokens, the GEMMs on the group's ``n``. ``gather([n/tp, h]) -> [n, h]``
    (all-gather; its backward a reduce-scatter), ``scatter([n, h]) -> [n/tp, h]`` (reduce-scatter of the
    row-parallel GEMMs' partial sums; its backward an all-gather). :class:`cadlib.bench.shard.LocalSP`
    stands in for them on one GPU."""

    def gather(self, x: torch.Tensor) -> torch.Tensor: ...

    def scatter(self, x: torch.Tensor) -> torch.Tensor: ...


class DecoderLayer(nn.Module):
    """One pre-norm Llama block, split around core attention: :meth:`pre_attention` gives the
    layer's ``q, k, v``; :meth:`post_attention` takes the attention output ``o`` back. ``blocks``
    picks the fused kernels or the plain references (:mod:`cadlib.runtime.blocks`); ``recompute``
    one of :data:`RECOMPUTE`. ``sp`` (a :class:`SequenceParallel`, or None): the layer is one
    tensor-parallel rank's shard (``spec`` is :meth:`ModelSpec.shard`'s) under sequence parallelism."""

    def __init__(self, spec: ModelSpec, *, mlp_recompute: bool = False, recompute: str | None = None,
                 blocks: str = "auto", dtype=None, device=None):
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        h, d = spec.hidden, spec.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = spec.n_heads, spec.n_kv_heads, d
        self.recompute, self.blocks = _recompute(recompute, mlp_recompute), _blocks(blocks)
        self.attn_norm = RMSNorm(h, blocks=blocks, dtype=dtype, device=device)
        self.wq = nn.Linear(h, spec.n_heads * d, **kw)       # weight [Hq*D, hidden]
        self.wk = nn.Linear(h, spec.n_kv_heads * d, **kw)    # weight [Hkv*D, hidden]
        self.wv = nn.Linear(h, spec.n_kv_heads * d, **kw)
        self.wo = nn.Linear(spec.n_heads * d, h, **kw)       # weight [hidden, Hq*D]
        self.mlp_norm = RMSNorm(h, blocks=blocks, dtype=dtype, device=device)
        self.w1 = nn.Linear(h, spec.ffn, **kw)               # gate, weight [ffn, hidden]
        self.w3 = nn.Linear(h, spec.ffn, **kw)               # up,   weight [ffn, hidden]
        self.w2 = nn.Linear(spec.ffn, h, **kw)               # down, weight [hidden, ffn]

    @property
    def mlp_recompute(self) -> bool:
        return self.recompute == "mlp"

    def pre_attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      sp: SequenceParallel | None = None):
        """``h = rms(x)``; ``q = rope(Wq h)``, ``k = rope(Wk h)``, ``v = Wv h`` as ``[n, heads, D]``
        (under ``sp``: ``x`` holds ``n / tp`` tokens, ``h`` is gathered to ``n``)."""
        h = self.attn_norm(x)
        if sp is not None:
            h = sp.gather(h)
        return qkv_rope(h, self.wq.weight, self.wk.weight, self.wv.weight, cos, sin, self.n_heads,
                        self.n_kv_heads, self.blocks)

    def mlp(self, x: torch.Tensor, sp: SequenceParallel | None = None) -> torch.Tensor:
        """SwiGLU on the normed input: ``W2 (silu(W1 rms(x)) * W3 rms(x))``, ``silu(a) = a sigmoid(a)``."""
        h = self.mlp_norm(x)
        if sp is not None:
            h = sp.gather(h)
        y = swiglu_mlp(h, self.w1.weight, self.w3.weight, self.w2.weight, self.blocks)
        return y if sp is None else sp.scatter(y)

    def post_attention(self, x: torch.Tensor, o: torch.Tensor,
                       sp: SequenceParallel | None = None) -> torch.Tensor:
        """``x = x + Wo o``, then ``x = x + mlp(x)``. With ``recompute="mlp"`` the norm and MLP keep only
        their input for backward and run again there (``torch.utils.checkpoint``, non-reentrant)."""
        y = self.wo(o.flatten(1))
        x = x + (y if sp is None else sp.scatter(y))
        if self.recompute == "mlp" and torch.is_grad_enabled():
            return x + checkpoint(self.mlp, x, sp, use_reentrant=False)
        return x + self.mlp(x, sp)


def _recompute(recompute: str | None, mlp_recompute: bool) -> str:
    """``recompute``, or ``mlp``/``none`` from the older flag ``mlp_recompute``."""
    if recompute is None:
        return "mlp" if mlp_recompute else "none"
    if recompute not in RECOMPUTE:
        raise ValueError(f"unknown recompute {recompute!r}; choose one of: {', '.join(RECOMPUTE)}")
    if mlp_recompute and recompute != "mlp":
        raise ValueError(f"mlp_recompute=True contradicts recompute={recompute!r}; give one of them")
    return recompute


def _blocks(blocks: str) -> str:
    if blocks not in BLOCKS:
        raise ValueError(f"unknown blocks {blocks!r}; choose one of: {', '.join(BLOCKS)}")
    return blocks


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
    stage's weights are those of the same layers of the whole model.

    ``recompute`` (:data:`RECOMPUTE`; or the older ``mlp_recompute=True`` for ``"mlp"``) and ``blocks``
    (``auto``: the fused kernels on CUDA, the plain references elsewhere; :mod:`cadlib.runtime.blocks`)
    change how the layers compute, never what: the same weights give the same loss."""

    def __init__(self, spec: "ModelSpec | str", n_layers: int | None = None, *, dtype=torch.float32,
                 device=None, mlp_recompute: bool = False, recompute: str | None = None, blocks: str = "auto",
                 rope_theta: float = 500000.0, seed: int = 0, stage: tuple[int, int] | None = None):
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
        self.blocks, recompute = _blocks(blocks), _recompute(recompute, mlp_recompute)
        s, pp = (0, 1) if stage is None else stage
        self.layer_ids = split_layers(spec.n_layers, pp)[s] if 0 <= s < pp else None
        if self.layer_ids is None:
            raise ValueError(f"stage must be (s, pp) with 0 <= s < pp; got {stage}")
        self.first, self.last = s == 0, s == pp - 1
        device = torch.device(device) if device is not None else torch.device("cpu")
        meta = dict(dtype=dtype, device="meta")
        self.embed = nn.Embedding(spec.vocab, spec.hidden, **meta) if self.first else None   # [vocab, hidden]
        self.layers = nn.ModuleList(DecoderLayer(spec, recompute=recompute, blocks=blocks, **meta)
                                    for _ in self.layer_ids)
        self.norm = RMSNorm(spec.hidden, blocks=blocks, **meta) if self.last else None
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
    def recompute(self) -> str:
        return self.layers[0].recompute

    @property
    def mlp_recompute(self) -> bool:
        return self.recompute == "mlp"

    def parameter_count(self) -> int:
        """Number of parameters (embedding and LM head included)."""
        return sum(p.numel() for p in self.parameters())

    def saved_bytes_per_token(self) -> int:
        """Bytes one layer's linear part keeps for backward per token, core attention's own excluded
        (it adds ``q, k, v, o`` and an fp32 lse with a flash kernel). ``b`` = bytes per element::

            none:  (4 hidden + Hq D + 3 ffn) b + 2 * 4   (norm inputs and outputs, Wo input,
                                                           gate, up, SwiGLU output; 2 fp32 rstd)
            mlp:   (3 hidden + Hq D) b + 4                 (the MLP keeps only its input)

        The same for the fused blocks and the references (``tests/runtime/test_model.py``)."""
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
        loss_sum = ChunkedCrossEntropy.apply(hidden, self.lm_head.weight, targets, int(chunk_tokens),
                                             self.blocks)
        return loss_sum, int((targets != IGNORE_INDEX).sum())


def _stable_seed(*parts: int) -> int:
    """One 63-bit seed from several integers, stable across runs and platforms."""
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFFFFFFFFFF for p in parts]).generate_state(
        1, np.uint64)[0] >> np.uint64(1))

"""Cost model: model shapes, FLOPs of the linear layers and of core attention, bytes moved, memory.

Everything the scheduler, the simulator and the benchmarks count comes from here, so a number is
defined once. Conventions (docs/design.md):

* a causal CA-task over query tokens ``[a, b)`` of one document attends to the KV prefix ``[0, b)``;
  its **pair count** is ``sum_{i=a}^{b-1} (i + 1) = (b(b+1) - a(a+1)) / 2``;
* its forward FLOPs are ``4 * pairs * n_heads * head_dim`` (QK^T and PV, 2 FLOPs per MAC) and its
  backward FLOPs are ``ATTN_BWD_MULT = 2.5`` times that;
* a linear layer does ``2 * params`` FLOPs per token forward and twice that backward.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .paper import DISTCA_IB_GBPS
from .precision import DTYPE_BYTES

# ---------------------------------------------------------------------------------------------------
# Constants
# ---------------------------------------------------------------------------------------------------

ATTN_BWD_MULT = 2.5
"""Backward/forward FLOP ratio of flash attention (recomputes QK^T: 5 matmuls vs 2)."""
LINEAR_BWD_MULT = 2.0
"""Backward/forward FLOP ratio of a linear layer (dX and dW)."""

MIN_SHARD_TOKENS = 512
"""Default minimum query-shard size. Below it the fused fwd+bwd kernel loses efficiency (see below)."""

# H200 attention rates, measured on one H200 (TF/s; causal, 32 q / 8 kv heads, d=128, bf16): a 16K
# document cut into query shards of the given length, each shard carrying its own causal KV prefix,
# all shards in one fused varlen call; 16384 = the unsplit document (the table of docs/design.md).
# The 64-token forward point (0.46 of unsplit) was measured with the same kernel.
H200_ATTN_TFLOPS = {
    "fa2_fwd": {64: 0.46 * 320, 128: 304, 512: 320, 2048: 315, 16384: 320},
    "fa2_fwd_bwd": {128: 168, 512: 261, 2048: 305, 16384: 311},
    "fa4_fwd": {128: 559, 512: 592, 2048: 602, 16384: 669},
    "fa4_fwd_bwd": {128: 243, 512: 431, 2048: 533, 16384: 560},
}
WHOLE_DOC = 16384
H200_MATMUL_TFLOPS = 790.0
"""bf16 8192^3 matmul on one H200, measured: 769-798 TF/s on random data."""
H200_NVLINK_ALL_TO_ALL_GBPS = 300 * 1.073741824
"""NCCL all-to-all between two H200s over NVLink at 1 GiB per rank: ~300 GiB/s measured, in GB/s."""
IB_GBPS_PER_GPU = DISTCA_IB_GBPS
"""Inter-node bandwidth per GPU (one 400 Gb/s NIC per GPU), as the paper assumes; not measured here."""
CAD_A2A = ("in", "out", "out_bwd", "in_bwd")
"""CAD's all-to-alls of one layer, in the order they run: the dispatch, the return, the return's
backward (dO out), the dispatch's backward (gradients home); :meth:`ModelSpec.cad_a2a_bytes`."""
CAD_A2A_TO_SERVERS = ("in", "out_bwd")
"""The all-to-alls that go from the home ranks to the servers (the other two go back)."""


def _interp_log2(table: dict[int, float], x: float) -> float:
    """Piecewise-linear interpolation of ``table`` in log2(x): clamped above the last point,
    extrapolated along the first segment below the first point (floored at 5% of that point)."""
    keys = np.log2(np.array(sorted(table), dtype=float))
    vals = np.array([table[k] for k in sorted(table)], dtype=float)
    lx = np.log2(max(float(x), 1.0))
    if lx >= keys[0]:
        return float(np.interp(lx, keys, vals))
    slope = (vals[1] - vals[0]) / (keys[1] - keys[0])
    return float(max(vals[0] + slope * (lx - keys[0]), 0.05 * vals[0]))


def attention_tflops(shard_tokens: float, kernel: str = "fa2", backward: bool = True) -> float:
    """Measured H200 attention TF/s for fused query shards of ``shard_tokens`` tokens (interpolated)."""
    key = f"{kernel}_fwd_bwd" if backward else f"{kernel}_fwd"
    if key not in H200_ATTN_TFLOPS:
        raise ValueError(f"unknown attention kernel {kernel!r}; choose one of: fa2, fa4")
    return _interp_log2(H200_ATTN_TFLOPS[key], shard_tokens)


def shard_efficiency(shard_tokens: float, backward: bool = True, kernel: str = "fa2") -> float:
    """Fraction of the unsplit document's TF/s that fused query shards of ``shard_tokens`` keep:
    FA2 forward 0.95 at 128 tokens and 0.46 at 64; forward+backward 0.54 at 128, 0.84 at 512, 0.98
    at 2048 (H200). The backward loss comes from every shard re-reading its own KV prefix."""
    key = f"{kernel}_fwd_bwd" if backward else f"{kernel}_fwd"
    return min(1.0, attention_tflops(shard_tokens, kernel, backward) / H200_ATTN_TFLOPS[key][WHOLE_DOC])


# ---------------------------------------------------------------------------------------------------
# Model shapes
# ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelSpec:
    """A Llama-style decoder's shape. ``from_name`` knows ``tiny``, ``llama3-8b`` and ``llama-34b``."""

    name: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int

    def __post_init__(self):
        for f in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "ffn", "vocab"):
            if getattr(self, f) < 1:
                raise ValueError(f"ModelSpec.{f} must be >= 1, got {getattr(self, f)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")

    @classmethod
    def from_name(cls, name: str, **overrides) -> "ModelSpec":
        key = name.lower()
        if key not in MODELS:
            raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(MODELS)}")
        return replace(MODELS[key], **overrides) if overrides else MODELS[key]

    def shard(self, tp: int) -> "ModelSpec":
        """The part of the model one GPU of a tensor-parallel group of ``tp`` computes (Megatron's
        column- and row-parallel cut): ``n_heads / tp`` query and ``n_kv_heads / tp`` KV heads, an MLP of
        ``ffn / tp``, a vocabulary of ``vocab / tp``; the hidden size and the layers are the model's.
        ``tp = 1`` is the model itself."""
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tp must be an integer >= 1, got {tp!r}")
        if tp == 1:
            return self
        bad = [f"{f}={getattr(self, f)}" for f in ("n_heads", "n_kv_heads", "ffn", "vocab") if getattr(self, f) % tp]
        if bad:
            raise ValueError(f"tp={tp} must divide n_heads, n_kv_heads, ffn and vocab of {self.name}; "
                             f"it does not divide {', '.join(bad)}")
        return replace(self, name=f"{self.name}/tp{tp}", n_heads=self.n_heads // tp,
                       n_kv_heads=self.n_kv_heads // tp, ffn=self.ffn // tp, vocab=self.vocab // tp)

    # -- parameters and FLOPs of the linear layers ------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def linear_params_per_layer(self) -> int:
        """QKV + O projections + SwiGLU MLP (gate, up, down). Norms are negligible."""
        qkv = self.hidden * (self.q_dim + 2 * self.kv_dim)
        o = self.q_dim * self.hidden
        mlp = 3 * self.hidden * self.ffn
        return qkv + o + mlp

    def linear_flops_per_token(self, backward: bool = False, layers: int | None = None) -> float:
        """``2 * params`` FLOPs per token per layer forward, times (1 + 2) with backward."""
        n = self.n_layers if layers is None else layers
        f = 2.0 * self.linear_params_per_layer() * n
        return f * (1 + LINEAR_BWD_MULT) if backward else f

    def attention_flops(self, pairs, backward: bool = False, layers: int | None = None):
        """``4 * pairs * n_heads * head_dim`` per layer forward; times (1 + 2.5) with backward."""
        n = self.n_layers if layers is None else layers
        f = 4.0 * np.asarray(pairs, dtype=np.float64) * self.n_heads * self.head_dim * n
        f = f * (1 + ATTN_BWD_MULT) if backward else f
        return float(f) if np.ndim(f) == 0 else f

    # -- bytes moved per token (one layer) ---------------------------------------------------------
    def q_bytes(self, dtype: str = "bf16") -> int:
        return self.q_dim * _dtype_bytes(dtype)

    def kv_bytes(self, dtype: str = "bf16") -> int:
        """K and V together."""
        return 2 * self.kv_dim * _dtype_bytes(dtype)

    def o_bytes(self, dtype: str = "bf16") -> int:
        return self.q_dim * _dtype_bytes(dtype)

    def lse_bytes(self) -> int:
        """Log-sum-exp, fp32, one per query head."""
        return self.n_heads * 4

    def cad_a2a_bytes(self, resend: bool = False, dtype: str = "bf16") -> dict[str, tuple[int, int]]:
        """Bytes per query token and per KV token of CAD's four all-to-alls in one layer,
        ``{name: (per query token, per KV token)}`` (KV tokens: once per (server, document)):

        * ``in``, home -> server: Q, and K, V;  ``out``, server -> home: O;
        * ``out_bwd``, home -> server: dO;  ``in_bwd``, server -> home: dQ, and dK, dV (summed per
          (server, document)). Servers keep what they received until the backward (ours).

        ``resend``: DistCA's stateless servers (``from_planner_output(is_resend_qkv=True)``,
        ``distca/runtime/compute_metadata.py:642-692``, DistCA commit 2afd219): ``out`` carries the LSE
        as well (``is_send_lse_in_fwd``, L655), and ``out_bwd`` dO, O, LSE and Q per query token and K, V
        per KV token again (``get_per_token_bytes``, L49-75: ``(3 hq + lse) x element`` bytes per query
        token). The LSE is fp32, one per query head (:meth:`lse_bytes`)."""
        qb, kvb, ob = self.q_bytes(dtype), self.kv_bytes(dtype), self.o_bytes(dtype)
        if not resend:
            return {"in": (qb, kvb), "out": (ob, 0), "out_bwd": (ob, 0), "in_bwd": (qb, kvb)}
        lse = self.lse_bytes()
        return {"in": (qb, kvb), "out": (ob + lse, 0), "out_bwd": (2 * ob + lse + qb, kvb),
                "in_bwd": (qb, kvb)}

    def activation_bytes_per_token(self, dtype: str = "bf16") -> int:
        """Rough activation memory one token keeps for backward in one layer (no recompute):
        layer input, QKV, attention output + LSE, O-proj input, MLP gate/up/act."""
        b = _dtype_bytes(dtype)
        return (2 * self.hidden + self.q_dim + 2 * self.kv_dim + self.q_dim + 3 * self.ffn) * b \
            + self.lse_bytes()


def _dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


MODELS: dict[str, ModelSpec] = {
    "tiny": ModelSpec("tiny", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn=128,
                      vocab=256),
    "llama3-8b": ModelSpec("llama3-8b", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8, head_dim=128,
                           ffn=14336, vocab=128256),
    "llama-34b": ModelSpec("llama-34b", n_layers=48, hidden=8192, n_heads=64, n_kv_heads=16,
                           head_dim=128, ffn=22016, vocab=32000),
}


# ---------------------------------------------------------------------------------------------------
# Pair counts
# ---------------------------------------------------------------------------------------------------

def causal_pairs(q_start, q_end):
    """Causal attention pairs of query tokens ``[a, b)`` with KV prefix ``[0, b)``:
    ``sum_{i=a}^{b-1} (i + 1) = (b(b+1) - a(a+1)) / 2``. Works elementwise on arrays."""
    a = np.asarray(q_start, dtype=np.int64)
    b = np.asarray(q_end, dtype=np.int64)
    if np.any(a < 0) or np.any(b < a):
        raise ValueError("causal_pairs needs 0 <= q_start <= q_end")
    p = (b * (b + 1) - a * (a + 1)) // 2
    return int(p) if p.ndim == 0 else p


DEFAULT_MODEL = "llama3-8b"


def as_model(model: "ModelSpec | str | None" = None, **overrides) -> ModelSpec:
    """The one model-name -> :class:`ModelSpec` helper: a spec as it is, a name through
    :meth:`ModelSpec.from_name`, ``None`` as ``DEFAULT_MODEL``; anything else is a ValueError."""
    if model is None:
        model = DEFAULT_MODEL
    if isinstance(model, str):
        return ModelSpec.from_name(model, **overrides)
    if isinstance(model, ModelSpec):
        return replace(model, **overrides) if overrides else model
    raise ValueError(f"model must be a ModelSpec or one of {', '.join(MODELS)}; got {type(model).__name__} "
                     f"{model!r}")


def imbalance(values) -> float:
    """``max / mean`` of a per-rank (or per-server) load: 1.0 = perfectly balanced, and 1.0 for an
    all-zero load. The one imbalance measure of the library."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        raise ValueError("imbalance needs at least one value")
    mean = v.mean()
    return float(v.max() / mean) if mean > 0 else 1.0

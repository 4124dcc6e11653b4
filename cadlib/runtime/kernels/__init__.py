"""Core-attention kernels: several varlen flash backends behind one call, forward and backward.

An attention server runs ONE fused call over all the CA-tasks it received. The call packs segments:
segment ``i`` has ``Lq_i = cu_q[i+1] - cu_q[i]`` query tokens and ``Lk_i = cu_k[i+1] - cu_k[i]`` KV
tokens, and its query block is the *suffix* of its KV block (bottom-right causal alignment): query
``j`` sits at position ``p = Lk_i - Lq_i + j`` and attends KV ``[0, p]``. A CA-task with query tokens
``[a, b)`` and KV prefix ``[0, b)`` is exactly such a segment. For every query row and head::

    s_t = scale * q . k_t            (t over the visible KV tokens, scale = 1/sqrt(D) by default)
    lse = log sum_t exp(s_t)         (natural log, float32, token-major [total_q, Hq])
    out = sum_t exp(s_t - lse) v_t

and the backward, given ``dout`` (``P = exp(S - lse)``, ``Delta = rowsum(dout * out)``)::

    dV = P^T dout,  dP = dout V^T,  dS = P * (dP - Delta),  dQ = scale dS K,  dK = scale dS^T Q

GQA: query head ``h`` reads KV head ``h // (Hq / Hkv)``; dK and dV are summed over the query heads
sharing a KV head.

Backends (``BACKENDS``; the automatic choice is the fastest one available for the tensors' device):

* ``fa4``: FlashAttention-4 (package ``flash-attn-4``, CuTe DSL, Hopper/Blackwell); written against
  ``flash_attn.cute.interface`` of 4.0.0b36 (``_flash_attn_fwd`` / ``_flash_attn_bwd``). Used only
  for the head dims in ``FA4_HEAD_DIMS``: its interface accepts 8..256, but on an H200 its backward
  at head_dim 8 is wrong (see ``FA4_HEAD_DIMS``), so other head dims go to the next backend.
* ``flash_attn``: FlashAttention-2's ``flash_attn_varlen_func`` (package ``flash-attn``).
* ``torch_flash``: torch's built-in FA2 varlen (``aten._flash_attention_forward/backward``).
* ``sdpa_ref``: a per-segment reference in plain torch (fp32 math, CPU or GPU): correct and simple,
  the reference every other backend is tested against. It reads ``cu_q``/``cu_k`` on the host (a
  device sync on GPU) and checks them; the flash backends check shapes only, so the queue stays async.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from ...core.precision import TORCH_NAMES
from . import flash, reference

BACKENDS = ("fa4", "flash_attn", "torch_flash", "sdpa_ref")
"""All known backends, fastest first."""

TORCH_DTYPES = {name: getattr(torch, t) for name, t in TORCH_NAMES.items()}
"""The formats of :mod:`cadlib.core.precision` by name (``fp32``, ``bf16``, ``fp16``), as torch dtypes."""

_NEEDS = {
    "fa4": "CUDA with compute capability >= 9.0 (Hopper/Blackwell) and the flash-attn-4 package",
    "flash_attn": "CUDA and the flash-attn (FA2) package with flash_attn_varlen_func",
    "torch_flash": "CUDA with compute capability >= 8.0 and a torch build with flash attention",
    "sdpa_ref": "nothing (plain torch)",
}
_HALF = (torch.float16, torch.bfloat16)

FA4_HEAD_DIMS = (64, 128)
"""Head dims for which FA4 (4.0.0b36) was checked against ``sdpa_ref`` on an H200 (bf16, GQA 4:1 and
2:1, two causal segments of 20 and 41 tokens; rel. errors <= 5e-3 for o, dq, dk, dv). At head_dim 8
its forward is right but its backward is not: dq 0.83, dk 1.0, dv 1.0 (GQA 8:2), dq 0.94 (8:8);
torch_flash's 2.5e-3. Measured 2026-11-30 by scripts/probes/probe_fa4_head_dims.py:
results/fa4_head_dims_h200.txt."""

# ---------------------------------------------------------------------------------------------------
# Checks shared by all backends
# ---------------------------------------------------------------------------------------------------

def _check_inputs(q, k, v, cu_q, cu_k, max_q, max_k) -> None:
    """Shape/dtype checks that need no device synchronisation."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [tokens, heads, head_dim]; got shapes {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k head_dim differ: {q.shape[2]} vs {k.shape[2]}")
    if k.shape[1] < 1 or q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k.shape[1]})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    for name, cu in (("cu_q", cu_q), ("cu_k", cu_k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype != torch.int32 or cu.numel() < 1:
            raise ValueError(f"{name} must be a 1-D int32 tensor [n_seg + 1] of cumulative lengths")
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"cu_q and cu_k must describe the same number of segments; got "
                         f"{cu_q.numel() - 1} and {cu_k.numel() - 1}")
    if int(max_q) < 0 or int(max_k) < 0:
        raise ValueError(f"max_q and max_k must be >= 0; got {max_q}, {max_k}")


def _scale(softmax_scale, head_dim) -> float:
    return float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(head_dim)


# ---------------------------------------------------------------------------------------------------
# The registry and the public calls
# ---------------------------------------------------------------------------------------------------

def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _is_available(name: str, device: torch.device) -> bool:
    if name == "sdpa_ref":
        return True
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if name == "fa4":
        return _capability(device)[0] >= 9 and flash.fa4_module() is not None
    if name == "flash_attn":
        return _capability(device)[0] >= 8 and flash.fa2_module() is not None
    if name == "torch_flash":
        flash_built = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)()
        return _capability(device)[0] >= 8 and flash_built \
            and hasattr(torch.ops.aten, "_flash_attention_forward")
    return False


def _as_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def available_backends(device=None) -> list[str]:
    """Backends usable for tensors on ``device`` (default: CUDA if present, else CPU), fastest first."""
    dev = _as_device(device)
    return [b for b in BACKENDS if _is_available(b, dev)]


def _takes_head_dim(name: str, head_dim: int | None) -> bool:
    return name != "fa4" or head_dim is None or int(head_dim) in FA4_HEAD_DIMS


def resolve_backend(name_or_none, device=None, dtype: torch.dtype | None = None,
                    head_dim: int | None = None) -> str:
    """The backend to use: ``name_or_none`` checked for availability, or (None) the fastest available
    one for ``device`` that supports ``dtype`` (the flash kernels take only fp16/bf16, so fp32 tensors
    go to sdpa_ref) and ``head_dim`` (fa4: ``FA4_HEAD_DIMS`` only). Raises ValueError naming what is
    available here."""
    dev = _as_device(device)
    avail = available_backends(dev)
    if name_or_none is None:
        for b in avail:
            if b == "sdpa_ref" or (dtype is None or dtype in _HALF) and _takes_head_dim(b, head_dim):
                return b
        return "sdpa_ref"
    name = str(name_or_none)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of: {', '.join(BACKENDS)} "
                         f"(available here: {', '.join(avail)})")
    if name not in avail:
        raise ValueError(f"backend {name!r} is not available here (needs {_NEEDS[name]}); "
                         f"available: {', '.join(avail)}")
    if name != "sdpa_ref" and dtype is not None and dtype not in _HALF:
        raise ValueError(f"backend {name!r} takes float16/bfloat16 tensors, got {dtype}; use sdpa_ref "
                         "for other dtypes")
    if not _takes_head_dim(name, head_dim):
        raise ValueError(f"backend 'fa4' is used only for head_dim in {FA4_HEAD_DIMS} (its backward was "
                         f"checked there; at head_dim 8 it is wrong), got head_dim={head_dim}; leave the "
                         f"backend unset or pick one of: {', '.join(b for b in avail if b != 'fa4')}")
    return name


_FWD: dict[str, Callable] = {"fa4": flash.fa4_fwd, "flash_attn": flash.fa2_fwd,
                             "torch_flash": flash.torch_flash_fwd, "sdpa_ref": reference.sdpa_ref_fwd}
_BWD: dict[str, Callable] = {"fa4": flash.fa4_bwd, "flash_attn": flash.fa2_bwd,
                             "torch_flash": flash.torch_flash_bwd, "sdpa_ref": reference.sdpa_ref_bwd}


def attend(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, backend=None, softmax_scale=None):
    """Fused varlen core attention over packed segments (see the module docstring for the maths).

    ``q [total_q, Hq, D]``, ``k, v [total_k, Hkv, D]``, ``cu_q, cu_k`` int32 ``[n_seg + 1]``;
    segment ``i``'s queries are the suffix of its KV block (bottom-right causal). Returns
    ``(out, lse)``: ``out`` like ``q``; ``lse`` float32 ``[total_q, Hq]``, natural log, token-major
    (``-inf`` for a row that sees no key)."""
    _check_inputs(q, k, v, cu_q, cu_k, max_q, max_k)
    name = resolve_backend(backend, q.device, q.dtype, q.shape[2])
    scale = _scale(softmax_scale, q.shape[2])
    if q.shape[0] == 0 or name == "sdpa_ref":
        if q.shape[0] == 0:
            return (torch.empty_like(q),
                    torch.empty(0, q.shape[1], dtype=torch.float32, device=q.device))
        return reference.sdpa_ref_fwd(q, k, v, cu_q, cu_k, int(max_q), int(max_k), causal, scale)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    cu_q, cu_k = cu_q.to(q.device).contiguous(), cu_k.to(q.device).contiguous()
    return _FWD[name](q, k, v, cu_q, cu_k, int(max_q), int(max_k), causal, scale)


def attend_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal=True, backend=None,
                    softmax_scale=None):
    """Gradients of :func:`attend`: ``(dq, dk, dv)`` shaped like ``q, k, v``, with dK and dV summed
    over the query heads sharing a KV head. ``out`` and ``lse`` are the forward's (lse token-major)."""
    _check_inputs(q, k, v, cu_q, cu_k, max_q, max_k)
    if dout.shape != q.shape or out.shape != q.shape or tuple(lse.shape) != (q.shape[0], q.shape[1]):
        raise ValueError(f"dout and out must be shaped like q {tuple(q.shape)} and lse [total_q, Hq] = "
                         f"{(q.shape[0], q.shape[1])}; got {tuple(dout.shape)}, {tuple(out.shape)}, "
                         f"{tuple(lse.shape)}")
    name = resolve_backend(backend, q.device, q.dtype, q.shape[2])
    scale = _scale(softmax_scale, q.shape[2])
    if q.shape[0] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if name == "sdpa_ref":
        return reference.sdpa_ref_bwd(dout, q, k, v, out, lse, cu_q, cu_k, int(max_q), int(max_k), causal,
                                      scale)
    q, k, v, out = q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous()
    dout = dout.to(q.dtype)
    cu_q, cu_k = cu_q.to(q.device).contiguous(), cu_k.to(q.device).contiguous()
    return _BWD[name](dout, q, k, v, out, lse, cu_q, cu_k, int(max_q), int(max_k), causal, scale)

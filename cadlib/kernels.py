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
  ``flash_attn.cute.interface`` of 4.0.0b36 (``_flash_attn_fwd`` / ``_flash_attn_bwd``).
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

BACKENDS = ("fa4", "flash_attn", "torch_flash", "sdpa_ref")
"""All known backends, fastest first."""

_NEEDS = {
    "fa4": "CUDA with compute capability >= 9.0 (Hopper/Blackwell) and the flash-attn-4 package",
    "flash_attn": "CUDA and the flash-attn (FA2) package with flash_attn_varlen_func",
    "torch_flash": "CUDA with compute capability >= 8.0 and a torch build with flash attention",
    "sdpa_ref": "nothing (plain torch)",
}
_HALF = (torch.float16, torch.bfloat16)
_REF_BLOCK_ELEMS = 1 << 26
"""sdpa_ref works on query-row blocks whose fp32 score matrix has at most this many elements."""


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


def _segment_bounds(cu_q, cu_k, total_q, total_k, max_q, max_k, causal):
    """Host copies of the cumulative lengths, validated (used by sdpa_ref, which loops on the host)."""
    cq = [int(x) for x in cu_q.tolist()]
    ck = [int(x) for x in cu_k.tolist()]
    for name, cu, total in (("cu_q", cq, total_q), ("cu_k", ck, total_k)):
        if cu[0] != 0 or cu[-1] != total or any(b < a for a, b in zip(cu[:-1], cu[1:])):
            raise ValueError(f"{name} must start at 0, be non-decreasing and end at the token count "
                             f"{total}; got {cu[:4]}...{cu[-2:]}")
    lq = [b - a for a, b in zip(cq[:-1], cq[1:])]
    lk = [b - a for a, b in zip(ck[:-1], ck[1:])]
    if lq and (max(lq) > max_q or max(lk) > max_k):
        raise ValueError(f"max_q/max_k ({max_q}, {max_k}) are below the longest segments "
                         f"({max(lq)}, {max(lk)})")
    if causal:
        for i, (a, b) in enumerate(zip(lq, lk)):
            if a > b:
                raise ValueError(f"segment {i} has {a} query tokens but only {b} KV tokens; causal "
                                 "segments need Lq <= Lk (the queries are the suffix of the KV block)")
    return cq, ck


def _scale(softmax_scale, head_dim) -> float:
    return float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(head_dim)


# ---------------------------------------------------------------------------------------------------
# sdpa_ref: the per-segment reference
# ---------------------------------------------------------------------------------------------------

def _ref_blocks(lq: int, lk: int, hq: int):
    """Query-row blocks ``[r0, r1)`` of one segment, bounding the fp32 score matrix's size."""
    rows = max(1, _REF_BLOCK_ELEMS // max(1, hq * lk))
    return [(r0, min(lq, r0 + rows)) for r0 in range(0, lq, rows)]


def _ref_scores(qs, ks, r0, lq, lk, scale, causal):
    """Scaled fp32 scores ``[Hq, rows, Lk]`` of query rows ``r0..`` with the bottom-right mask."""
    s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
    if causal:
        rows = torch.arange(r0, r0 + qs.shape[0], device=qs.device)[:, None] + (lk - lq)
        cols = torch.arange(lk, device=qs.device)[None, :]
        s = s.masked_fill(cols > rows, float("-inf"))
    return s


def _sdpa_ref_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """Per segment, per query-row block: ``lse = logsumexp(S)``, ``out = softmax(S) V`` in fp32."""
    cq, ck = _segment_bounds(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k, causal)
    hq, group = q.shape[1], q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[0], hq), float("-inf"), dtype=torch.float32, device=q.device)
    for i in range(len(cq) - 1):
        lq, lk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        if lq == 0 or lk == 0:
            continue                       # no rows, or no visible key: out 0, lse -inf
        ks = k[ck[i]:ck[i + 1]].float().repeat_interleave(group, dim=1)
        vs = v[ck[i]:ck[i + 1]].float().repeat_interleave(group, dim=1)
        for r0, r1 in _ref_blocks(lq, lk, hq):
            qs = q[cq[i] + r0:cq[i] + r1].float()
            s = _ref_scores(qs, ks, r0, lq, lk, scale, causal)
            l_blk = torch.logsumexp(s, dim=-1)                               # [Hq, rows]
            p = torch.exp(s - l_blk[..., None])
            out[cq[i] + r0:cq[i] + r1] = torch.einsum("hqk,khd->qhd", p, vs).to(q.dtype)
            lse[cq[i] + r0:cq[i] + r1] = l_blk.transpose(0, 1)
    return out, lse


def _sdpa_ref_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    """The analytic backward (module docstring), per segment and query-row block, in fp32."""
    cq, ck = _segment_bounds(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k, causal)
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    group = hq // hkv
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    for i in range(len(cq) - 1):
        lq, lk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        if lq == 0 or lk == 0:
            continue
        ks = k[ck[i]:ck[i + 1]].float().repeat_interleave(group, dim=1)
        vs = v[ck[i]:ck[i + 1]].float().repeat_interleave(group, dim=1)
        dks = torch.zeros(lk, hq, d, dtype=torch.float32, device=q.device)
        dvs = torch.zeros(lk, hq, d, dtype=torch.float32, device=q.device)
        for r0, r1 in _ref_blocks(lq, lk, hq):
            sl = slice(cq[i] + r0, cq[i] + r1)
            qs, dos = q[sl].float(), dout[sl].float()
            s = _ref_scores(qs, ks, r0, lq, lk, scale, causal)
            p = torch.exp(s - lse[sl].transpose(0, 1)[..., None])             # [Hq, rows, Lk]
            delta = (dos * out[sl].float()).sum(-1).transpose(0, 1)           # [Hq, rows]
            dp = torch.einsum("qhd,khd->hqk", dos, vs)
            ds = p * (dp - delta[..., None])
            dq[sl] = torch.einsum("hqk,khd->qhd", ds, ks) * scale
            dks += torch.einsum("hqk,qhd->khd", ds, qs) * scale
            dvs += torch.einsum("hqk,qhd->khd", p, dos)
        dk[ck[i]:ck[i + 1]] = dks.view(lk, hkv, group, d).sum(2)
        dv[ck[i]:ck[i + 1]] = dvs.view(lk, hkv, group, d).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---------------------------------------------------------------------------------------------------
# LSE layouts: every backend hands back token-major [total_q, Hq] float32
# ---------------------------------------------------------------------------------------------------

def _token_segment(cu_q: torch.Tensor, total_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per packed query token: its segment index and its row inside the segment (on device)."""
    cu = cu_q.to(torch.int64)
    tok = torch.arange(total_q, device=cu.device)
    seg = torch.searchsorted(cu[1:], tok, right=True)
    return seg, tok - cu[seg]


_LSE_PADDED: dict[str, bool] = {}
"""Per backend, whether its forward returned the padded ``[n_seg, Hq, max_q]`` LSE (FA2 builds before
the unpadded ``[Hq, total_q]`` layout); its backward then gets the LSE back in that layout."""


def _lse_to_token_major(lse: torch.Tensor, cu_q: torch.Tensor, total_q: int) -> torch.Tensor:
    """``[Hq, total_q]`` (unpadded) or ``[n_seg, Hq, max_q]`` (padded, older FA2) -> ``[total_q, Hq]``."""
    if lse.dim() == 2:
        if lse.shape[1] != total_q:
            raise RuntimeError(f"kernel returned an LSE of shape {tuple(lse.shape)}; expected "
                               f"[heads, total_q={total_q}]")
        return lse.float().transpose(0, 1).contiguous()
    seg, row = _token_segment(cu_q, total_q)
    return lse.float()[seg, :, row].contiguous()


def _lse_from_token_major(lse_tm: torch.Tensor, like: tuple, cu_q: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_lse_to_token_major` into the layout ``like`` (a backend's shape)."""
    if len(like) == 2:
        return lse_tm.float().transpose(0, 1).contiguous()
    seg, row = _token_segment(cu_q, lse_tm.shape[0])
    out = torch.zeros(like, dtype=torch.float32, device=lse_tm.device)
    out[seg, :, row] = lse_tm.float()
    return out


# ---------------------------------------------------------------------------------------------------
# GPU backends
# ---------------------------------------------------------------------------------------------------

def _fa4_module():
    """``flash_attn.cute.interface`` when flash-attn-4 is importable, else None."""
    try:
        from flash_attn.cute import flash_attn_varlen_func  # noqa: F401  (the detection the brief asks)
        from flash_attn.cute import interface
    except Exception:                      # ImportError, or a CUDA/cutlass import failure
        return None
    return interface if hasattr(interface, "_flash_attn_fwd") and hasattr(interface, "_flash_attn_bwd") \
        else None


def _fa2_module():
    """``flash_attn.flash_attn_interface`` when FA2's varlen function is importable, else None.
    (With only flash-attn-4 installed, ``flash_attn`` is a namespace package holding ``cute``.)"""
    try:
        from flash_attn import flash_attn_varlen_func  # noqa: F401
        from flash_attn import flash_attn_interface
    except Exception:
        return None
    return flash_attn_interface


def _fa4_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """FA4 (4.0.0b36): ``_flash_attn_fwd(...) -> (out, lse[Hq, total_q], ...)``; bottom-right causal."""
    res = _fa4_module()._flash_attn_fwd(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
        softmax_scale=scale, causal=causal, return_lse=True)
    out, lse = res[0], res[1]
    return out, _lse_to_token_major(lse, cu_q, q.shape[0])


def _fa4_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    """FA4 (4.0.0b36): ``_flash_attn_bwd(q, k, v, out, dout, lse[Hq, total_q], scale, causal, ...,
    cu_seqlens_q=..., cu_seqlens_k=..., max_seqlen_q=..., max_seqlen_k=...) -> (dq, dk, dv)``."""
    res = _fa4_module()._flash_attn_bwd(
        q, k, v, out, dout.contiguous(), _lse_from_token_major(lse, (q.shape[1], q.shape[0]), cu_q),
        softmax_scale=scale, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        max_seqlen_q=max_q, max_seqlen_k=max_k)
    return res[0], res[1], res[2]


def _fa2_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """FA2 ``flash_attn_varlen_func(..., return_attn_probs=True) -> (out, lse, S_dmask)``."""
    from flash_attn import flash_attn_varlen_func
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0,
                                         softmax_scale=scale, causal=causal, return_attn_probs=True)
    _LSE_PADDED["flash_attn"] = lse.dim() == 3
    return out, _lse_to_token_major(lse, cu_q, q.shape[0])


def _backend_lse(name, lse, q, cu_q, max_q):
    """Token-major LSE back into the layout backend ``name`` returned it in."""
    like = (cu_q.numel() - 1, q.shape[1], max_q) if _LSE_PADDED.get(name) else (q.shape[1], q.shape[0])
    return _lse_from_token_major(lse, like, cu_q)


def _fa2_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    """FA2 ``_flash_attn_varlen_backward``; its arguments changed across 2.x (``window_size`` became
    ``window_size_left/right``, ``softcap`` and ``deterministic`` were added), so they are passed by
    name, only those its signature has. It writes dq, dk, dv in place."""
    import inspect
    fn = _fa2_module()._flash_attn_varlen_backward
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    lse_k = _backend_lse("flash_attn", lse, q, cu_q, max_q)
    known = dict(dout=dout.contiguous(), q=q, k=k, v=v, out=out, softmax_lse=lse_k, dq=dq, dk=dk, dv=dv,
                 cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                 dropout_p=0.0, softmax_scale=scale, causal=causal, window_size=(-1, -1),
                 window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                 deterministic=False, rng_state=None)
    # FA2 >= 2.7 wraps it in torch.library.custom_op: the Python signature is the wrapped function's
    params = inspect.signature(getattr(fn, "_init_fn", None) or inspect.unwrap(fn)).parameters
    missing = [n for n, p in params.items() if n not in known and p.default is inspect.Parameter.empty]
    if missing:
        raise ValueError(f"flash_attn._flash_attn_varlen_backward has arguments this module does not "
                         f"know ({missing}); use backend='torch_flash' or 'sdpa_ref'")
    fn(**{n: known[n] for n in params if n in known})
    return dq, dk, dv


def _torch_flash_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """``aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal,
    return_debug_mask, scale=) -> (out, lse[Hq, total_q], rng_state, unused, debug)``."""
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale)
    _LSE_PADDED["torch_flash"] = lse.dim() == 3
    return out, _lse_to_token_major(lse, cu_q, q.shape[0])


def _torch_flash_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    """``aten._flash_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p,
    is_causal, rng_state, unused, scale=)``; rng_state is only read with dropout (here 0)."""
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout.contiguous(), q, k, v, out, _backend_lse("torch_flash", lse, q, cu_q, max_q),
        cu_q, cu_k, max_q, max_k, 0.0, causal, rng, unused, scale=scale)
    return dq, dk, dv


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
        return _capability(device)[0] >= 9 and _fa4_module() is not None
    if name == "flash_attn":
        return _capability(device)[0] >= 8 and _fa2_module() is not None
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


def resolve_backend(name_or_none, device=None, dtype: torch.dtype | None = None) -> str:
    """The backend to use: ``name_or_none`` checked for availability, or (None) the fastest available
    one for ``device`` that supports ``dtype`` (the flash kernels take only fp16/bf16, so fp32 tensors
    go to sdpa_ref). Raises ValueError naming what is available here."""
    dev = _as_device(device)
    avail = available_backends(dev)
    if name_or_none is None:
        for b in avail:
            if b == "sdpa_ref" or dtype is None or dtype in _HALF:
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
    return name


_FWD: dict[str, Callable] = {"fa4": _fa4_fwd, "flash_attn": _fa2_fwd, "torch_flash": _torch_flash_fwd,
                             "sdpa_ref": _sdpa_ref_fwd}
_BWD: dict[str, Callable] = {"fa4": _fa4_bwd, "flash_attn": _fa2_bwd, "torch_flash": _torch_flash_bwd,
                             "sdpa_ref": _sdpa_ref_bwd}


def attend(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, backend=None, softmax_scale=None):
    """Fused varlen core attention over packed segments (see the module docstring for the maths).

    ``q [total_q, Hq, D]``, ``k, v [total_k, Hkv, D]``, ``cu_q, cu_k`` int32 ``[n_seg + 1]``;
    segment ``i``'s queries are the suffix of its KV block (bottom-right causal). Returns
    ``(out, lse)``: ``out`` like ``q``; ``lse`` float32 ``[total_q, Hq]``, natural log, token-major
    (``-inf`` for a row that sees no key)."""
    _check_inputs(q, k, v, cu_q, cu_k, max_q, max_k)
    name = resolve_backend(backend, q.device, q.dtype)
    scale = _scale(softmax_scale, q.shape[2])
    if q.shape[0] == 0 or name == "sdpa_ref":
        if q.shape[0] == 0:
            return (torch.empty_like(q),
                    torch.empty(0, q.shape[1], dtype=torch.float32, device=q.device))
        return _sdpa_ref_fwd(q, k, v, cu_q, cu_k, int(max_q), int(max_k), causal, scale)
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
    name = resolve_backend(backend, q.device, q.dtype)
    scale = _scale(softmax_scale, q.shape[2])
    if q.shape[0] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if name == "sdpa_ref":
        return _sdpa_ref_bwd(dout, q, k, v, out, lse, cu_q, cu_k, int(max_q), int(max_k), causal, scale)
    q, k, v, out = q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous()
    dout = dout.to(q.dtype)
    cu_q, cu_k = cu_q.to(q.device).contiguous(), cu_k.to(q.device).contiguous()
    return _BWD[name](dout, q, k, v, out, lse, cu_q, cu_k, int(max_q), int(max_k), causal, scale)

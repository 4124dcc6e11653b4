"""Adapters of the flash kernels to the one varlen call of :mod:`cadlib.runtime.kernels`: FlashAttention-4
(``fa4``), FlashAttention-2 (``flash_attn``) and torch's built-in FA2 (``torch_flash``), with the
version shims their LSE layouts need. Every adapter returns the LSE token-major ``[total_q, Hq]``.
"""
from __future__ import annotations

import warnings

import torch

# ---------------------------------------------------------------------------------------------------
# LSE layouts: every backend hands back token-major [total_q, Hq] float32
# ---------------------------------------------------------------------------------------------------

def _token_segment(cu_q: torch.Tensor, total_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per packed query token: its segment index and its row inside the segment (on device)."""
    cu = cu_q.to(torch.int64)
    tok = torch.arange(total_q, device=cu.device)
    seg = torch.searchsorted(cu[1:], tok, right=True)
    return seg, tok - cu[seg]


LSE_PADDED: dict[str, bool] = {}
"""Per backend, whether its forward returned the padded ``[n_seg, Hq, max_q]`` LSE (FA2 builds before
the unpadded ``[Hq, total_q]`` layout); its backward then gets the LSE back in that layout."""


def lse_to_token_major(lse: torch.Tensor, cu_q: torch.Tensor, total_q: int) -> torch.Tensor:
    """``[Hq, total_q]`` (unpadded) or ``[n_seg, Hq, max_q]`` (padded, older FA2) -> ``[total_q, Hq]``."""
    if lse.dim() == 2:
        if lse.shape[1] != total_q:
            raise RuntimeError(f"kernel returned an LSE of shape {tuple(lse.shape)}; expected "
                               f"[heads, total_q={total_q}]")
        return lse.float().transpose(0, 1).contiguous()
    seg, row = _token_segment(cu_q, total_q)
    return lse.float()[seg, :, row].contiguous()


def lse_from_token_major(lse_tm: torch.Tensor, like: tuple, cu_q: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`lse_to_token_major` into the layout ``like`` (a backend's shape)."""
    if len(like) == 2:
        return lse_tm.float().transpose(0, 1).contiguous()
    seg, row = _token_segment(cu_q, lse_tm.shape[0])
    out = torch.zeros(like, dtype=torch.float32, device=lse_tm.device)
    out[seg, :, row] = lse_tm.float()
    return out


# ---------------------------------------------------------------------------------------------------
# GPU backends
# ---------------------------------------------------------------------------------------------------

def fa4_module():
    """``flash_attn.cute.interface`` when flash-attn-4 is importable, else None."""
    try:
        from flash_attn.cute import (
            flash_attn_varlen_func,  # noqa: F401  (imported only to detect the varlen entry point)
            interface,
        )
    except Exception:                      # ImportError, or a CUDA/cutlass import failure
        return None
    # The CuTe DSL (nvidia-cutlass-dsl 4.8.1) warns at every kernel compile that FA4 4.0.0b36's aux_data
    # argument "cannot be converted to a JitArgument": harmless (the argument is None here), but it
    # printed four blocks per process into every executed notebook and log
    warnings.filterwarnings("ignore", message=r"Argument aux_data \(position \d+\) cannot be converted",
                            category=UserWarning)
    return interface if hasattr(interface, "_flash_attn_fwd") and hasattr(interface, "_flash_attn_bwd") \
        else None


def fa2_module():
    """``flash_attn.flash_attn_interface`` when FA2's varlen function is importable, else None.
    (With only flash-attn-4 installed, ``flash_attn`` is a namespace package holding ``cute``.)"""
    try:
        from flash_attn import (
            flash_attn_interface,
            flash_attn_varlen_func,  # noqa: F401
        )
    except Exception:
        return None
    return flash_attn_interface


def fa4_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """FA4 (4.0.0b36): ``_flash_attn_fwd(...) -> (out, lse[Hq, total_q], ...)``; bottom-right causal."""
    res = fa4_module()._flash_attn_fwd(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
        softmax_scale=scale, causal=causal, return_lse=True)
    out, lse = res[0], res[1]
    return out, lse_to_token_major(lse, cu_q, q.shape[0])


def fa4_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    """FA4 (4.0.0b36): ``_flash_attn_bwd(q, k, v, out, dout, lse[Hq, total_q], scale, causal, ...,
    cu_seqlens_q=..., cu_seqlens_k=..., max_seqlen_q=..., max_seqlen_k=...) -> (dq, dk, dv)``."""
    res = fa4_module()._flash_attn_bwd(
        q, k, v, out, dout.contiguous(), lse_from_token_major(lse, (q.shape[1], q.shape[0]), cu_q),
        softmax_scale=scale, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        max_seqlen_q=max_q, max_seqlen_k=max_k)
    return res[0], res[1], res[2]


def fa2_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """FA2 ``flash_attn_varlen_func(..., return_attn_probs=True) -> (out, lse, S_dmask)``."""
    from flash_attn import flash_attn_varlen_func
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0,
                                         softmax_scale=scale, causal=causal, return_attn_probs=True)
    LSE_PADDED["flash_attn"] = lse.dim() == 3
    return out, lse_to_token_major(lse, cu_q, q.shape[0])


def _backend_lse(name, lse, q, cu_q, max_q):
    """Token-major LSE back into the layout backend ``name`` returned it in."""
    like = (cu_q.numel() - 1, q.shape[1], max_q) if LSE_PADDED.get(name) else (q.shape[1], q.shape[0])
    return lse_from_token_major(lse, like, cu_q)


def fa2_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    """FA2 ``_flash_attn_varlen_backward``; its arguments changed across 2.x (``window_size`` became
    ``window_size_left/right``, ``softcap`` and ``deterministic`` were added), so they are passed by
    name, only those its signature has. It writes dq, dk, dv in place."""
    import inspect
    fn = fa2_module()._flash_attn_varlen_backward
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


def torch_flash_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """``aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal,
    return_debug_mask, scale=) -> (out, lse[Hq, total_q], rng_state, unused, debug)``."""
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale)
    LSE_PADDED["torch_flash"] = lse.dim() == 3
    return out, lse_to_token_major(lse, cu_q, q.shape[0])


def torch_flash_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    """``aten._flash_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p,
    is_causal, rng_state, unused, scale=)``; rng_state is only read with dropout (here 0)."""
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout.contiguous(), q, k, v, out, _backend_lse("torch_flash", lse, q, cu_q, max_q),
        cu_q, cu_k, max_q, max_k, 0.0, causal, rng, unused, scale=scale)
    return dq, dk, dv

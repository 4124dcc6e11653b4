"""One KV buffer for non-contiguous shards (an alternative to KV sharing's copies): can two segments of
one fused FA4 call read ONE KV buffer (overlapping KV via ``seqused_k``), and does the varlen backward
then SUM their dK/dV or overwrite them?

Two segments of one document: queries ``[a1, c1)`` over KV ``[0, c1)`` and ``[a2, c2)`` over
``[0, c2)`` (``c1 <= a2``: non-contiguous, they cannot merge), both pointing at offset 0 of one KV
tensor of ``c2`` rows (``cu_seqlens_k = [0, 0, c2]``, ``seqused_k = [c1, c2]``). Compared with the
copy layout's exact result (reference: two segments with their own copies, fp32): the forward error,
and whether the backward's dK equals the summed dK (``sums``), only one segment's (``overwrites``),
or neither. Never trusted without this check; the result goes to a JSON file.

    python scripts/probes/probe_kv_overlap.py --out $OUT/kv_overlap_probe.json     # 1x H200 with FA4
    python scripts/probes/probe_kv_overlap.py --device cpu --out /tmp/probe.json    # harness only (no FA4)
"""
from __future__ import annotations

import argparse
import inspect

import torch

from cadlib.infra.results import save_result
from cadlib.runtime import kernels
from cadlib.runtime.kernels import flash


def _call(fn, **kw):
    names = inspect.signature(fn).parameters
    missing = [k for k in ("seqused_k", "cu_seqlens_k") if k not in names]
    if missing:
        raise TypeError(f"{fn.__name__} has no {missing}")
    return fn(**{k: v for k, v in kw.items() if k in names})


def rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))


def probe(device, dtype, c1, a2, c2, heads, d) -> dict:
    hq, hkv = heads
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(c2, hq, d, generator=g, device=device).to(dtype)
    k, v = (torch.randn(c2, hkv, d, generator=g, device=device).to(dtype) for _ in range(2))
    a1 = max(0, c1 - 256)
    qs = torch.cat([q[a1:c1], q[a2:c2]])
    # reference: the copy layout in fp32 (sdpa_ref), dK of the two copies summed
    cu_q = torch.tensor([0, c1 - a1, c1 - a1 + c2 - a2], dtype=torch.int32, device=device)
    cu_kc = torch.tensor([0, c1, c1 + c2], dtype=torch.int32, device=device)
    kc, vc = torch.cat([k[:c1], k]).float(), torch.cat([v[:c1], v]).float()
    o_ref, lse_ref = kernels.attend(qs.float(), kc, vc, cu_q, cu_kc, c2 - a2, c2, backend="sdpa_ref")
    do = torch.randn_like(o_ref)
    _, dkc, _ = kernels.attend_backward(do, qs.float(), kc, vc, o_ref, lse_ref, cu_q, cu_kc, c2 - a2, c2,
                                        backend="sdpa_ref")
    dk_sum = dkc[c1:].clone()
    dk_sum[:c1] += dkc[:c1]
    rec = {"c1": c1, "a1": a1, "a2": a2, "c2": c2, "dtype": str(dtype)}
    fa4 = flash.fa4_module()
    if fa4 is None or device.type != "cuda":
        rec["status"] = "fa4 not available here: harness only"
        return rec
    cu_k = torch.tensor([0, 0, c2], dtype=torch.int32, device=device)
    used = torch.tensor([c1, c2], dtype=torch.int32, device=device)
    scale = d ** -0.5
    try:
        res = _call(fa4._flash_attn_fwd, q=qs, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=used,
                    max_seqlen_q=c2 - a2, max_seqlen_k=c2, softmax_scale=scale, causal=True, return_lse=True)
        out, lse = res[0], res[1]
        rec["fwd_rel_err"] = rel(out, o_ref)
    except Exception as e:
        rec["status"] = f"forward failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return rec
    try:
        res = _call(fa4._flash_attn_bwd, q=qs, k=k, v=v, out=out, dout=do.to(dtype).contiguous(), lse=lse,
                    softmax_scale=scale, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=used,
                    max_seqlen_q=c2 - a2, max_seqlen_k=c2)
        dk = res[1]
        rec["dk_vs_sum"] = rel(dk, dk_sum)
        rec["dk_vs_segment2_only"] = rel(dk, dkc[c1:])
        tol = 2e-2 if dtype != torch.float32 else 1e-4
        rec["status"] = ("sums" if rec["dk_vs_sum"] <= tol else
                         "overwrites" if rec["dk_vs_segment2_only"] <= tol else "neither")
    except Exception as e:
        rec["status"] = f"backward failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return rec


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cases = [(1024, 3072, 4096), (512, 8192, 16384)] if device.type == "cuda" else [(32, 64, 96)]
    heads, d = ((32, 8), 128) if device.type == "cuda" else ((4, 2), 16)
    rows = []
    for c1, a2, c2 in cases:
        rows.append(probe(device, dtype, c1, a2, c2, heads, d))
        print(rows[-1], flush=True)
    save_result(args.out, {"device": str(device), "heads": heads, "head_dim": d}, rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

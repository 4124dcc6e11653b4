"""``sdpa_ref``: the per-segment reference of the fused varlen call, in plain torch (fp32 maths).

Correct and simple; every other backend is tested against it. It reads ``cu_q``/``cu_k`` on the
host (a device sync on GPU) and checks them. See :mod:`cadlib.runtime.kernels` for the maths.
"""
from __future__ import annotations

import torch

REF_BLOCK_ELEMS = 1 << 26
"""sdpa_ref works on query-row blocks whose fp32 score matrix has at most this many elements."""


def segment_bounds(cu_q, cu_k, total_q, total_k, max_q, max_k, causal):
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


# ---------------------------------------------------------------------------------------------------
# sdpa_ref: the per-segment reference
# ---------------------------------------------------------------------------------------------------

def _ref_blocks(lq: int, lk: int, hq: int):
    """Query-row blocks ``[r0, r1)`` of one segment, bounding the fp32 score matrix's size."""
    rows = max(1, REF_BLOCK_ELEMS // max(1, hq * lk))
    return [(r0, min(lq, r0 + rows)) for r0 in range(0, lq, rows)]


def _ref_scores(qs, ks, r0, lq, lk, scale, causal):
    """Scaled fp32 scores ``[Hq, rows, Lk]`` of query rows ``r0..`` with the bottom-right mask."""
    s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
    if causal:
        rows = torch.arange(r0, r0 + qs.shape[0], device=qs.device)[:, None] + (lk - lq)
        cols = torch.arange(lk, device=qs.device)[None, :]
        s = s.masked_fill(cols > rows, float("-inf"))
    return s


def sdpa_ref_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """Per segment, per query-row block: ``lse = logsumexp(S)``, ``out = softmax(S) V`` in fp32."""
    cq, ck = segment_bounds(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k, causal)
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


def sdpa_ref_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    """The analytic backward (module docstring), per segment and query-row block, in fp32."""
    cq, ck = segment_bounds(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k, causal)
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

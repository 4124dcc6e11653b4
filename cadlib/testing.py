"""What the tests, the distributed checks and the benchmarks share: random layouts, plans and inputs
drawn from seeds, and the references the fast paths are compared with. A reference here is plain
torch (SDPA per document, or the textbook formulas in float64), never a :mod:`cadlib.runtime.kernels`
backend, whose ``sdpa_ref`` is itself under test on the CPU."""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from .core.layout import Layout, layout_from_lists
from .core.plan import CATask, Plan, layout_to_tasks

# ---------------------------------------------------------------------------------------------------
# Random layouts and plans
# ---------------------------------------------------------------------------------------------------

def random_tiny_layout(rng: np.random.Generator) -> tuple[Layout, int]:
    """A random tiny layout and a server count, for property checks of the scheduler: 1-8 ranks, 1-9
    documents of 1-399 tokens, each cut at up to 3 random points into chunks on random ranks (ranks
    may hold nothing); 1-8 servers. The tests and ``scripts/bench/bench_scheduler.py --random`` draw the
    same layouts from the same seeds."""
    R = int(rng.integers(1, 9))
    lens = rng.integers(1, 400, int(rng.integers(1, 10))).tolist()
    ranks: list[list[tuple[int, int, int]]] = [[] for _ in range(R)]
    for d, n in enumerate(lens):
        cuts = sorted({int(c) for c in rng.integers(1, max(2, n), int(rng.integers(0, 4))) if 0 < c < n})
        bounds = [0, *cuts, n]
        for s, e in zip(bounds[:-1], bounds[1:]):
            ranks[int(rng.integers(R))].append((d, s, e))
    return layout_from_lists(ranks, lens), int(rng.integers(1, 9))


def random_cp_layout(world: int, seed: int, max_len: int = 40) -> Layout:
    """Random documents (several of 1 token, one long one) cut into 1-3 pieces on random ranks, chunk
    order shuffled per rank. For even seeds the last rank (when ``world > 1``) holds only the last
    token of the longest document (which is then split across ranks); for odd seeds every rank takes
    pieces."""
    rng = np.random.default_rng(seed)
    lens = [int(x) for x in rng.integers(1, max_len, size=2 * world + 2)]
    lens += [1, 1, 1, int(rng.integers(world * 3, world * 3 + max_len))]
    rng.shuffle(lens)
    empty_ish = seed % 2 == 0 and world > 1
    busy = world - 1 if empty_ish else world
    ranks: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
    long_doc = int(np.argmax(lens))
    for d, n in enumerate(lens):
        if d == long_doc and empty_ish:
            ranks[world - 1].append((d, n - 1, n))      # the nearly empty rank: one token of a split doc
            n -= 1
        cuts = sorted(set(int(c) for c in rng.integers(1, n, size=int(rng.integers(0, 3))))) if n > 1 else []
        bounds = [0, *cuts, n]
        for s, e in zip(bounds[:-1], bounds[1:]):
            ranks[int(rng.integers(busy))].append((d, s, e))
    for r in ranks:
        rng.shuffle(r)
    return Layout(ranks, lens)


def random_plan(layout: Layout, seed: int, max_cuts: int = 3) -> Plan:
    """Every chunk cut at up to ``max_cuts`` random points, each piece on a random server."""
    rng = np.random.default_rng(seed)
    tasks = []
    for t in layout_to_tasks(layout):
        n_cuts = int(rng.integers(0, max_cuts + 1)) if t.n_q > 1 else 0
        cuts = np.unique(rng.integers(t.q_start + 1, t.q_end, size=n_cuts)) if n_cuts else []
        bounds = [t.q_start, *[int(c) for c in cuts], t.q_end]
        tasks += [CATask(t.doc, a, b, t.home, int(rng.integers(layout.n_ranks)))
                  for a, b in zip(bounds[:-1], bounds[1:])]
    return Plan(layout, tasks)


# ---------------------------------------------------------------------------------------------------
# Inputs and references
# ---------------------------------------------------------------------------------------------------

def random_inputs(total: int, heads, seed: int, dtype=torch.float32, device="cpu") -> list[torch.Tensor]:
    """Seeded ``q, k, v, dout`` of every token, documents laid end to end: ``[total, H, D]`` with
    ``H`` = query, KV, KV, query heads for ``heads = (Hq, Hkv, D)``. Drawn on the CPU in float32 (the
    same numbers on every rank and device), then moved to ``device`` and ``dtype``."""
    hq, hkv, d = heads
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(total, h, d, generator=gen).to(device=device, dtype=dtype)
            for h in (hq, hkv, hkv, hq)]


def rank_inputs(full, rows) -> tuple[torch.Tensor, ...]:
    """One rank's ``q, k, v, dout`` from :func:`random_inputs`: ``rows`` (its tokens' global rows,
    :func:`cadlib.core.layout.global_rows`) of each, with ``q, k, v`` leaves that require grad."""
    rows = torch.as_tensor(rows, device=full[0].device)
    q, k, v, dout = (t.index_select(0, rows) for t in full)
    return (*(t.requires_grad_(True) for t in (q, k, v)), dout)


def reference_errors(got, full, doc_lens, rows) -> list[float]:
    """Relative max errors of one rank's ``got = (o, dq, dk, dv)`` (its ``rows``) against
    :func:`reference` on ``full`` (:func:`random_inputs`), every document: the single-rank checks of
    the tests and notebooks."""
    rows = torch.as_tensor(rows)
    ref = reference(*full, doc_lens, range(len(doc_lens)))
    return [float((g.detach().float() - r.index_select(0, rows)).abs().max() / r.abs().max())
            for g, r in zip(got, ref)]


REF_SDPA_ELEMS = 1 << 27
"""Documents whose fp32 score matrix (heads x L x L) is larger than this are checked against
:func:`blocked_reference` (bounded memory) instead of torch SDPA's math path."""
REF_BLOCK = 1024
"""Query rows per block of :func:`blocked_reference`."""


def blocked_reference(q, k, v, dout) -> tuple[torch.Tensor, ...]:
    """Causal attention of ONE document and its gradients in float64, in query blocks (memory
    ``heads x REF_BLOCK x L``), written out from the textbook formulas and independent of
    :mod:`cadlib.runtime.kernels` (whose ``sdpa_ref`` is the backend under test on CPU)::

        S = scale Q K^T (j <= i),  lse = log sum_j exp S,  P = exp(S - lse),  O = P V
        Delta = rowsum(dO * O),  dV = P^T dO,  dS = P * (dO V^T - Delta),  dQ = scale dS K,
        dK = scale dS^T Q   (dK, dV summed over the query heads sharing a KV head)
    """
    n, hq, d = q.shape
    g = hq // k.shape[1]
    q, dout = q.double(), dout.double()
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    scale = 1.0 / math.sqrt(d)
    o, lse = torch.empty_like(q), torch.empty(n, hq, dtype=torch.float64, device=q.device)

    def probs(a, b):
        s = torch.einsum("qhd,khd->hqk", q[a:b], k[:b]) * scale
        mask = torch.arange(b, device=q.device)[None, :] > torch.arange(a, b, device=q.device)[:, None]
        s = s.masked_fill(mask, float("-inf"))
        return s, torch.logsumexp(s, dim=-1)

    for a in range(0, n, REF_BLOCK):
        b = min(n, a + REF_BLOCK)
        s, l_blk = probs(a, b)
        lse[a:b] = l_blk.transpose(0, 1)
        o[a:b] = torch.einsum("hqk,khd->qhd", torch.exp(s - l_blk[..., None]), v[:b])
    delta = (dout * o).sum(-1)                                          # [n, hq]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for a in range(0, n, REF_BLOCK):
        b = min(n, a + REF_BLOCK)
        s, l_blk = probs(a, b)
        p = torch.exp(s - l_blk[..., None])                             # [hq, rows, b]
        dv[:b] += torch.einsum("hqk,qhd->khd", p, dout[a:b])
        dp = torch.einsum("qhd,khd->hqk", dout[a:b], v[:b])
        ds = p * (dp - delta[a:b].transpose(0, 1)[..., None])
        dq[a:b] = torch.einsum("hqk,khd->qhd", ds, k[:b]) * scale
        dk[:b] += torch.einsum("hqk,qhd->khd", ds, q[a:b]) * scale
    hkv = hq // g
    dk, dv = (t.view(n, hkv, g, d).sum(2) for t in (dk, dv))
    return o.float(), dq.float(), dk.float(), dv.float()


def reference(q, k, v, dout, doc_lens, docs) -> tuple[torch.Tensor, ...]:
    """Per-document causal attention in fp32 (only documents in ``docs``; other rows 0):
    ``o_i = sum_{j<=i} softmax_j(q_i . k_j / sqrt(D)) v_j``. Torch SDPA with autograd per document,
    or for a long document :func:`blocked_reference` (float64, bounded memory). Neither is a
    :mod:`cadlib.runtime.kernels` backend. Returns o, dq, dk, dv."""
    q, k, v, dout = (t.float() for t in (q, k, v, dout))
    group = q.shape[1] // k.shape[1]
    outs = [torch.zeros_like(q), torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)]
    base = np.concatenate([[0], np.cumsum(doc_lens)])
    for d in docs:
        sl = slice(int(base[d]), int(base[d + 1]))
        n = sl.stop - sl.start
        if q.shape[1] * n * n > REF_SDPA_ELEMS:
            o, *grads = blocked_reference(q[sl], k[sl], v[sl], dout[sl])
        else:
            qd, kd, vd = (t[sl].detach().clone().requires_grad_(True) for t in (q, k, v))
            o = F.scaled_dot_product_attention(
                qd.transpose(0, 1), kd.repeat_interleave(group, 1).transpose(0, 1),
                vd.repeat_interleave(group, 1).transpose(0, 1), is_causal=True).transpose(0, 1)
            o.backward(dout[sl])
            grads = (qd.grad, kd.grad, vd.grad)
        for acc, val in zip(outs, (o.detach(), *grads)):
            acc[sl] = val
    return tuple(outs)


def reference_f64(q, k, v, dout, doc_lens, causal: bool):
    """Per-document attention in float64 with autograd: returns o, dq, dk, dv (global, doc-major)."""
    q, k, v, dout = (t.detach().double() for t in (q, k, v, dout))
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    outs, pos = [], 0
    for n in doc_lens:
        sl = slice(pos, pos + n)
        kd, vd = (t[sl].repeat_interleave(rep, 1).transpose(0, 1) for t in (k, v))
        o = F.scaled_dot_product_attention(q[sl].transpose(0, 1), kd, vd, is_causal=causal)
        outs.append(o.transpose(0, 1))
        pos += n
    o = torch.cat(outs)
    o.backward(dout)
    return o.detach(), q.grad, k.grad, v.grad

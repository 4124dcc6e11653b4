"""The baseline most stacks run today: context parallelism over the whole packed sequence, a zigzag ring
(Megatron's ``context_parallel``, Transformer Engine, torchtitan).

The packed sequence of ``T`` tokens (documents back to back, a multiple of ``2c``) is cut into ``2c``
equal chunks of ``C = T / 2c``; rank ``r`` of ``c`` holds chunks ``r`` and ``2c - 1 - r`` (zigzag: every
rank gets one early and one late chunk, so the causal work balances over a single document). At ring
step ``j = 0 .. c-1`` rank ``r`` attends its two query chunks to the K, V chunks of rank ``(r - j) mod c``
under the document (causal, per-document) mask, while passing those K, V on to rank ``r + 1``: the ring
passes K, V ``c - 1`` times. A query chunk ``[qa, qb)`` against a KV chunk ``[ka, kb)`` makes one
segment per document ``[d0, d1)`` both meet, ``q' = [qa, qb) n [d0, d1)``, ``k' = [ka, kb) n [d0, d1)``:

    diagonal (the same chunk):   pairs = |q'| (|q'| + 1) / 2
    full (k' wholly before q'):  pairs = |q'| |k'|                (k' after q': none)

A step's attention is one fused call over its segments, priced from the kernel table
(:class:`cadlib.core.measured.MeasuredCost`; a full block at the table's rate for a KV prefix of
``|k'| + |q'|``), and the ring overlaps it with the transfer, as ring attention does::

    t_step(j) = max(attention_j, comm_j)  (j < c - 1),    t_step(c - 1) = attention_{c-1}
    comm_j    = latency + 2 C kv_bytes / bandwidth        (forward: K, V of two chunks)

the backward passing K, V and their gradients dK, dV (twice the bytes). Bytes each rank sends per layer:
``(c - 1) 2 C kv_bytes`` forward and twice that backward.

As a row of the what-if (:func:`priced`): ``G = TP x PP x CP x DP'`` GPUs with ``DP' = dp / c``; a batch's
documents, in the order sampled, fill ``dp / c`` packed sequences of ``c x tokens_per_group`` tokens
(:func:`packed`; a document crossing a boundary is cut in two, as colocated's sequential packing cuts
it), so each rank holds ``T / c = tokens_per_group`` tokens. Its linear layers, TP collectives, LM head,
optimizer and gradient all-reduce (over all ``dp`` replicas, DP x CP) are colocated's at those tokens,
priced and composed by the same code (:mod:`cadlib.analysis.whatif.price`,
:func:`cadlib.analysis.model.compose.compose`); its attention is the ring's, above, with the ring's
transfers inside it (no other collective). The degree ``c`` (:func:`degrees`): every ``c`` dividing
``dp`` whose packed sequence holds the context (``c x tokens_per_group >= context``) and whose peak fits
the GPU (:func:`cadlib.analysis.whatif.fit.peak` at the least recompute that fits); the what-if prices
each and keeps the one of least mean step. The ring's link: in-node when its ``c`` DP groups share a
node, else the inter-node bandwidth per GPU.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ...core.cost import as_model
from ...core.measured import MeasuredCost, segment_pairs
from ...core.memory import GIB, RECOMPUTE
from ..model.compose import Link, Phases
from ..replay.phases import NCCL_LATENCY_S
from .fit import peak

KEY = "cp-ring"
"""The ring's name among the what-if's rows (:data:`cadlib.analysis.whatif.fit.METHODS`' too)."""
LABEL = "CP ring (zigzag)"


@dataclass(frozen=True)
class Segment:
    """One document's piece of a query chunk against a KV chunk: ``q`` queries, ``k`` keys, ``pairs``
    attended, ``diagonal`` when both are the same chunk."""

    q: int
    k: int
    pairs: int
    diagonal: bool


def chunks(total: int, c: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Per rank its two chunks ``[(a, b), (a', b')]`` of a packed sequence of ``total`` tokens."""
    if isinstance(c, bool) or int(c) != c or c < 1:
        raise ValueError(f"c must be an integer >= 1; got {c!r}")
    if total < 2 * c or total % (2 * c):
        raise ValueError(f"the packed sequence's {total} tokens must be a positive multiple of 2c = {2 * c}")
    size = total // (2 * c)
    return [((r * size, (r + 1) * size), ((2 * c - 1 - r) * size, (2 * c - r) * size)) for r in range(c)]


def _pieces(lo: int, hi: int, bounds: np.ndarray) -> dict[int, tuple[int, int]]:
    """Document index -> the part of ``[lo, hi)`` inside it."""
    out = {}
    first = int(np.searchsorted(bounds, lo, side="right")) - 1
    for d in range(first, bounds.size - 1):
        a, b = max(lo, int(bounds[d])), min(hi, int(bounds[d + 1]))
        if a >= hi:
            break
        if b > a:
            out[d] = (a, b)
    return out


def segments(lengths, c: int) -> list[list[list[Segment]]]:
    """``[rank][step]`` the segments of rank ``rank`` at ring step ``step`` (module docstring)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0 or np.any(lengths < 1):
        raise ValueError("lengths must be a non-empty sequence of integers >= 1")
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    ch = chunks(int(bounds[-1]), c)
    out = []
    for r in range(c):
        steps = []
        for j in range(c):
            src = (r - j) % c
            segs = []
            for qa, qb in ch[r]:
                qp = _pieces(qa, qb, bounds)
                for ka, kb in ch[src]:
                    for d, (k0, k1) in _pieces(ka, kb, bounds).items():
                        if d not in qp:
                            continue
                        q0, q1 = qp[d]
                        if (ka, kb) == (qa, qb):
                            n = q1 - q0
                            segs.append(Segment(n, n, n * (n + 1) // 2, True))
                        elif k1 <= q0:
                            segs.append(Segment(q1 - q0, k1 - k0, (q1 - q0) * (k1 - k0), False))
            steps.append(segs)
        out.append(steps)
    return out


def sent_bytes(total: int, c: int, spec) -> dict:
    """Bytes one rank sends per layer: ``fwd`` (K, V of its two chunks, ``c - 1`` times) and ``bwd``
    (K, V and dK, dV)."""
    size = chunks(total, c)[0][0][1]
    fwd = (c - 1) * 2 * size * as_model(spec).kv_bytes()
    return {"fwd": fwd, "bwd": 2 * fwd}


def segment_seconds(segs: list[Segment], cost: MeasuredCost, phase: str, spec) -> float:
    """One fused call over ``segs`` (0 with none): the call's overhead plus each segment's pairs at the
    table's rate (a full block at the rate of a KV prefix of ``k + q``)."""
    if not segs:
        return 0.0
    q = np.array([s.q for s in segs], dtype=np.float64)
    k = np.array([s.k if s.diagonal else s.k + s.q for s in segs], dtype=np.float64)
    t = np.atleast_1d(cost.task_seconds(q, k, phase, spec))
    pairs = np.array([s.pairs for s in segs], dtype=np.float64)
    return float(cost.call_overhead(phase) + np.sum(t * pairs / segment_pairs(q, k)))


def attention_seconds(lengths, c: int, cost: MeasuredCost, spec, gbps: float, latency_s: float = 0.0,
                      scale: float = 1.0) -> dict:
    """Per rank, one layer's ring attention, forward and backward, each step ``max(attention, comm)``
    but the last (module docstring): ``fwd``, ``bwd`` (arrays over ranks), ``compute`` (attention alone,
    fwd + bwd), ``sent_bytes``. ``gbps`` the ring link's GB/s per GPU; ``scale`` on the kernel table."""
    if not gbps > 0:
        raise ValueError(f"gbps must be > 0; got {gbps!r}")
    lengths = np.asarray(lengths, dtype=np.int64)
    segs = segments(lengths, c)
    sent = sent_bytes(int(lengths.sum()), c, spec)
    per_step = {"fwd": sent["fwd"] / max(c - 1, 1), "bwd": sent["bwd"] / max(c - 1, 1)}
    out = {"fwd": np.zeros(c), "bwd": np.zeros(c), "compute": np.zeros(c), "sent_bytes": sent}
    for r in range(c):
        for ph, tab in (("fwd", "fwd"), ("bwd", "bwd")):
            for j in range(c):
                a = scale * segment_seconds(segs[r][j], cost, tab, spec)
                comm = latency_s + per_step[ph] / (gbps * 1e9) if j < c - 1 else 0.0
                out[ph][r] += max(a, comm)
                out["compute"][r] += a
    return out


def packed(docs, groups: int, c: int) -> list[np.ndarray]:
    """The batch's documents, in order, cut into ``groups`` packed sequences of equal tokens (a document
    crossing a boundary in two pieces), each padded with one document to a multiple of ``2c``."""
    docs = np.asarray(docs, dtype=np.int64)
    total = int(docs.sum())
    if total % groups:
        raise ValueError(f"the batch's {total} tokens must divide into groups={groups} sequences")
    ends = np.cumsum(docs)
    cuts = np.arange(1, groups) * (total // groups)
    bounds = np.unique(np.concatenate([[0], ends, cuts]))
    pieces = np.diff(bounds)
    owner = np.searchsorted(cuts, bounds[:-1], side="right")
    out = []
    for g in range(groups):
        seq = pieces[owner == g]
        pad = -int(seq.sum()) % (2 * c)
        out.append(np.concatenate([seq, [pad]]) if pad else seq)
    return out


def degrees(model, gpus_per_node: int, tp: int, pp: int, dp: int, tokens: int, context: int, n_micro: int,
            gpu_mem_gib: float) -> list[dict]:
    """Every ring degree ``c`` dividing ``dp``: ``{"cp", "context"`` (its sequence holds the context),
    ``"recompute"`` (the least that fits, None when none), ``"peak_gib"``, ``"link"`` (``"in-node"``
    when its ``c`` DP groups share a node)}``."""
    spec = as_model(model)
    out = []
    for c in (d for d in range(1, dp + 1) if dp % d == 0):
        row = {"cp": c, "context": c * tokens >= context, "recompute": None, "peak_gib": None,
               "link": "in-node" if c * tp * pp <= gpus_per_node else "inter-node"}
        for rc in RECOMPUTE:
            e = peak(spec, KEY, tokens, tp=tp, pp=pp, cp=c, dp=dp // c, n_micro=n_micro, recompute=rc)
            row.update(peak_gib=e["peak"] / GIB)
            if e["peak"] <= gpu_mem_gib * GIB:
                row["recompute"] = rc
                break
        out.append(row)
    return out


def priced(docs, c: int, coloc: Phases, spec, cost: MeasuredCost, link: Link,
           scale: float = 1.0) -> tuple[Phases, dict]:
    """One layer of the ring at degree ``c`` for a batch ``docs`` over ``dp`` ranks, as :class:`Phases`:
    ``coloc``, colocated's phases priced at the ring's per-rank tokens (:func:`rank_tokens`; its linear
    layers, TP collectives, head, optimizer and all-reduce), with attention the ring's (:func:`attention_seconds`
    per packed sequence, the transfers inside) and no other collective; and per rank ``sent``, the bytes
    it sends in a layer."""
    dp = coloc.n_ranks
    fwd, bwd, sent = (np.zeros(dp) for _ in range(3))
    for g, seq in enumerate(packed(docs, dp // c, c)):
        a = attention_seconds(seq, c, cost, spec, link.gbps, link.latency_s, scale)
        r = slice(g * c, (g + 1) * c)
        fwd[r], bwd[r] = a["fwd"], a["bwd"]
        sent[r] = a["sent_bytes"]["fwd"] + a["sent_bytes"]["bwd"]
    z = np.zeros(dp)
    ph = replace(coloc, attn=fwd, attn_bwd=bwd, comm_in=z, comm_out=z, comm_in_bwd=z, comm_out_bwd=z)
    return ph, {"sent": sent}


def ring_link(c: int, where: str, intra_gbps: float, inter_gbps: float) -> Link:
    """The ring's link for degree ``c``: in-node or inter-node (:func:`degrees`' ``link``)."""
    return Link(intra_gbps if where == "in-node" or c == 1 else inter_gbps, NCCL_LATENCY_S, "ring")


def rank_tokens(docs, dp: int, c: int) -> np.ndarray:
    """Per rank the tokens it holds at degree ``c``: its packed sequence's (padding included) over ``c``."""
    return np.repeat([int(q.sum()) // c for q in packed(docs, dp // c, c)], c).astype(np.int64)

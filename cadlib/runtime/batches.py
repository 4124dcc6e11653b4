"""A step's data for the model, from a linear layout: positions, synthetic tokens, and a reference core
attention over whole documents.

* Positions restart at every document: token ``j`` of a chunk ``(doc, start, end)`` sits at position
  ``start + j``; RoPE is applied with them where the tokens live, before any dispatch.
* Synthetic tokens of document ``d`` come from a generator seeded by ``(seed, d)`` over the whole
  document, so every rank slices the same global tokens whatever the packing; each token's target is
  the next token of its document (``IGNORE_INDEX`` for a document's last token).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..core.layout import Layout
from .model import IGNORE_INDEX, CoreAttention


def document_attention(doc_lens) -> CoreAttention:
    """A single-process reference core attention for a buffer of whole documents laid end to end:
    ``o_i = sum_{j <= i, doc(j) = doc(i)} softmax_j(q_i . k_j / sqrt(D)) v_j`` (torch SDPA per
    document; GQA by repeating KV heads). Differentiable; for tests and small runs."""
    lens = [int(n) for n in doc_lens]
    if any(n < 1 for n in lens):
        raise ValueError(f"document lengths must be >= 1; got {lens}")

    def attn(q, k, v, layer_index):
        if q.shape[0] != sum(lens):
            raise ValueError(f"q has {q.shape[0]} tokens but the documents hold {sum(lens)}")
        rep = q.shape[1] // k.shape[1]
        outs = []
        for qd, kd, vd in zip(q.split(lens), k.split(lens), v.split(lens)):
            kd, vd = kd.repeat_interleave(rep, dim=1), vd.repeat_interleave(rep, dim=1)
            o = F.scaled_dot_product_attention(qd.transpose(0, 1), kd.transpose(0, 1), vd.transpose(0, 1),
                                               is_causal=True)
            outs.append(o.transpose(0, 1))
        return torch.cat(outs)

    return attn


def _check_rank(layout: Layout, rank: int) -> None:
    if not 0 <= int(rank) < layout.n_ranks:
        raise ValueError(f"rank must be in [0, {layout.n_ranks}); got {rank}")


def positions(layout: Layout, rank: int, device=None) -> torch.Tensor:
    """``[n_local]`` int64: the position of each of ``rank``'s tokens inside its document,
    ``chunk.start + offset`` for the rank's chunks in order (positions restart at every document)."""
    _check_rank(layout, rank)
    chunks = layout.ranks[rank]
    if not chunks:
        return torch.zeros(0, dtype=torch.int64, device=device)
    starts = np.array([c.start for c in chunks], dtype=np.int64)
    lens = np.array([c.length for c in chunks], dtype=np.int64)
    offs = np.cumsum(lens) - lens
    pos = np.arange(lens.sum(), dtype=np.int64) + np.repeat(starts - offs, lens)
    return torch.from_numpy(pos).to(device)


def document_tokens(doc: int, length: int, vocab: int, seed: int) -> np.ndarray:
    """The synthetic token ids of document ``doc`` (``length`` of them, uniform in ``[0, vocab)``),
    from a generator seeded by ``(seed, doc)``: identical on every rank and for every split."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), int(doc)])))
    return rng.integers(0, vocab, size=int(length), dtype=np.int64)


def synthetic_tokens(layout: Layout, rank: int, vocab: int, seed: int, device=None):
    """``(tokens [n_local], targets [n_local])`` int64 for ``rank``'s chunks: the tokens of document
    ``d`` are :func:`document_tokens` ``(d, ...)`` sliced to each chunk; ``target_i = token_{i+1}`` of
    the same document, ``-100`` for each document's last token (no prediction across documents)."""
    _check_rank(layout, rank)
    if int(vocab) < 1:
        raise ValueError(f"vocab must be >= 1; got {vocab}")
    cache: dict[int, np.ndarray] = {}
    toks, tgts = [], []
    for c in layout.ranks[rank]:
        if c.doc not in cache:
            cache[c.doc] = document_tokens(c.doc, layout.doc_lens[c.doc], vocab, seed)
        t = cache[c.doc]
        toks.append(t[c.start:c.end])
        nxt = t[c.start + 1:c.end + 1]
        tgts.append(np.append(nxt, IGNORE_INDEX) if c.end == len(t) else nxt)
    def cat(parts):
        return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np.int64)).to(device)
    return cat(toks), cat(tgts)


"""Workloads: named document-length distributions, sampling to a token budget, and packing the
documents into the **linear layout** (which rank holds which tokens for the linear layers).

* A distribution is a quantile function ``Q(u)``, ``u in [0, 1)``: the tabulated ones interpolate
  their published percentiles log-linearly (linear in percentile, linear in ``log(length)``);
  ``uniform`` is one fixed length; ``lognormal`` is ``exp(mu + sigma * Phi^-1(u))``. Documents are
  drawn by inverse CDF, ``length = max(1, round(elongate * Q(u)))``, optionally clipped.
* **Upsampling** (DistCA's "Pretrain" setting draws documents of >= 64K tokens twice as often)
  reweights the density: ``g(x) = f(x) * (upsample if x >= T else 1) / Z`` with
  ``Z = F(T) + upsample * (1 - F(T))``. It is sampled exactly by mapping a uniform ``v`` to the
  original quantile level ``u = vZ`` if ``vZ < F(T)``, else ``u = F(T) + (vZ - F(T)) / upsample``.
* **Packing**: ``sequential`` fills rank 0, then rank 1, ... and cuts a document that crosses a rank
  boundary into head/tail chunks (every rank holds exactly ``tokens_per_rank`` tokens); ``balanced``
  is WLB-LLM-style variable-length packing that evens out the estimated cost per rank under a cap.
"""
from __future__ import annotations

import math
from statistics import NormalDist
from typing import Sequence

import numpy as np

from .cost import ModelSpec, causal_pairs
from .shard import Chunk, Layout

# ---------------------------------------------------------------------------------------------------
# Published document-length distributions
# ---------------------------------------------------------------------------------------------------

PERCENTILES: tuple[float, ...] = (0, 1, 5, 10, 20, 30, 40, 50, 60, 70, 80, 90, 95, 98, 99, 99.5, 99.8,
                                  99.9, 100)
"""Percentile levels of every row of ``QUANTILE_TABLES``."""

# Document lengths in tokens at PERCENTILES. Source: the document-length quantile tables quoted for the
# DistCA paper (Zhuang et al., "Efficient Long-context Language Model Training by Core Attention
# Disaggregation", arXiv 2510.18121): "pretrain" is the WLB-LLM pretraining distribution DistCA uses;
# "prolong" / "prolong64k" / "prolong512k" are the ProLong data mixes; "pile" is The Pile.
QUANTILE_TABLES: dict[str, tuple[int, ...]] = {
    "pretrain": (1, 63, 324, 646, 1283, 1932, 2582, 3227, 3861, 4514, 5156, 5784, 6110, 10078, 26058,
                 69098, 99303, 119794, 124913),
    "prolong": (575, 678, 801, 919, 1130, 1347, 1594, 1914, 2362, 3018, 4050, 6051, 8378, 12309, 16270,
                21358, 32976, 47398, 340149),
    "pile": (1, 11, 42, 67, 115, 160, 206, 257, 331, 470, 765, 1711, 3438, 6211, 9080, 12387, 1037489,
             5180329, 9323168),
    "prolong64k": (1, 16, 69, 98, 155, 218, 292, 383, 497, 645, 885, 1441, 2382, 5415, 15286, 35941,
                   48335, 54312, 61920),
    "prolong512k": (1, 32, 66, 93, 145, 202, 269, 350, 455, 589, 805, 1279, 2034, 4161, 9203, 157911,
                    348688, 412280, 475872),
}

DISTRIBUTIONS: tuple[str, ...] = (*QUANTILE_TABLES, "uniform", "lognormal")
"""Every name ``sample_docs`` accepts."""

DEFAULT_UPSAMPLE_THRESHOLD = 64 * 1024
"""DistCA upsamples documents of at least 64K tokens (measured after elongation)."""

PRESETS: dict[str, dict] = {
    "distca-pretrain": {"dist": "pretrain", "upsample": 2.0,
                        "upsample_threshold": DEFAULT_UPSAMPLE_THRESHOLD},
}
"""Named keyword sets for ``sample_docs``. ``distca-pretrain`` is DistCA's "Pretrain" setting: the
WLB-LLM distribution with documents >= 64K tokens drawn twice as often. Use it as
``sample_docs(total_tokens=N, seed=s, **PRESETS["distca-pretrain"])``; add ``elongate=...`` to
stretch lengths for 256K/512K contexts."""

def sample_kwargs(distribution: str) -> dict:
    """``sample_docs`` keywords for a distribution name or a ``PRESETS`` name (e.g. for notebooks)."""
    if distribution in PRESETS:
        return dict(PRESETS[distribution])
    if distribution in DISTRIBUTIONS:
        return {"dist": distribution}
    raise ValueError(f"unknown distribution {distribution!r}; choose one of: "
                     f"{', '.join((*DISTRIBUTIONS, *PRESETS))}")


PACK_METHODS: tuple[str, ...] = ("sequential", "balanced")
DEFAULT_CAP_FACTOR = 1.25
"""``balanced`` packing lets a rank hold up to this many times ``tokens_per_rank`` tokens."""
PIECE_COST_FRACTION = 0.5
"""``balanced`` packing cuts a document costing more than this fraction of the mean rank cost into
equal-cost pieces: no placement of a whole document can bring a rank's cost below the document's own.
Half (not one) leaves LPT room to pair pieces; on 120 sampled batches (6 settings x 20 seeds) it
lowered max/mean attention FLOPs vs sequential by 35% on average and never raised total-FLOP max/mean."""

_NORMAL = NormalDist()
_U_EPS = 1e-12


# ---------------------------------------------------------------------------------------------------
# Quantile function, CDF, upsampling
# ---------------------------------------------------------------------------------------------------

def _check_params(dist: str, elongate: float, upsample: float, upsample_threshold: float,
                  max_doc_len: int | None, length, mu, sigma) -> None:
    if dist not in DISTRIBUTIONS:
        raise ValueError(f"unknown distribution {dist!r}; choose one of: {', '.join(DISTRIBUTIONS)}")
    if not elongate > 0:
        raise ValueError(f"elongate must be > 0 (a factor on every length), got {elongate}")
    if not upsample >= 1:
        raise ValueError(f"upsample must be >= 1 (1 = off; DistCA uses 2), got {upsample}")
    if not upsample_threshold >= 1:
        raise ValueError(f"upsample_threshold must be >= 1 token, got {upsample_threshold}")
    if max_doc_len is not None and max_doc_len < 1:
        raise ValueError(f"max_doc_len must be >= 1 token or None (no clipping), got {max_doc_len}")
    if dist == "uniform":
        if length is None or length < 1:
            raise ValueError(f"distribution 'uniform' needs length >= 1 (tokens per document), got {length}")
    elif length is not None:
        raise ValueError(f"length applies only to distribution 'uniform', not {dist!r}")
    if dist == "lognormal":
        if mu is None or sigma is None:
            raise ValueError("distribution 'lognormal' needs mu and sigma (mean and std of log-length)")
        if not sigma > 0 or not math.isfinite(mu):
            raise ValueError(f"lognormal needs a finite mu and sigma > 0, got mu={mu}, sigma={sigma}")
    elif mu is not None or sigma is not None:
        raise ValueError(f"mu and sigma apply only to distribution 'lognormal', not {dist!r}")


def _quantile(dist: str, u: np.ndarray, length=None, mu=None, sigma=None) -> np.ndarray:
    """Continuous length ``Q(u)`` before elongation. Tables: ``exp(interp(100u, P, log L))``."""
    u = np.asarray(u, dtype=np.float64)
    if dist in QUANTILE_TABLES:
        logl = np.log(np.asarray(QUANTILE_TABLES[dist], dtype=np.float64))
        return np.exp(np.interp(100.0 * u, PERCENTILES, logl))
    if dist == "uniform":
        return np.full(u.shape, float(length))
    uc = np.clip(u, _U_EPS, 1.0 - _U_EPS).ravel()
    z = np.fromiter((_NORMAL.inv_cdf(float(v)) for v in uc), dtype=np.float64, count=uc.size)
    return np.exp(mu + sigma * z).reshape(u.shape)


def _cdf_below(dist: str, x: float, length=None, mu=None, sigma=None) -> float:
    """``F(x) = P(Q(U) < x)`` before elongation; the inverse of ``_quantile`` (log-linear for tables)."""
    if x <= 0:
        return 0.0
    if dist in QUANTILE_TABLES:
        logl = np.log(np.asarray(QUANTILE_TABLES[dist], dtype=np.float64))
        return float(np.interp(math.log(x), logl, PERCENTILES, left=0.0, right=100.0)) / 100.0
    if dist == "uniform":
        return 1.0 if length < x else 0.0
    return _NORMAL.cdf((math.log(x) - mu) / sigma)


def _upsample_map(v: np.ndarray, f_t: float, upsample: float) -> np.ndarray:
    """Map uniform ``v`` of the upsampled distribution to the original quantile level ``u``:
    ``w = vZ``, ``Z = F(T) + upsample (1 - F(T))``; ``u = w`` if ``w < F(T)`` else
    ``F(T) + (w - F(T)) / upsample``. Long documents (``u >= F(T)``) get ``upsample`` times the mass."""
    if upsample == 1.0:
        return v
    z = f_t + upsample * (1.0 - f_t)
    w = v * z
    return np.where(w < f_t, w, f_t + (w - f_t) / upsample)


def long_doc_level(dist: str, *, elongate: float = 1.0,
                   upsample_threshold: float = DEFAULT_UPSAMPLE_THRESHOLD,
                   length=None, mu=None, sigma=None) -> float:
    """``F(T)``: the probability that a document (before upsampling) is shorter than the threshold
    ``T`` measured after elongation, i.e. ``F(T / elongate)`` of the base distribution."""
    _check_params(dist, elongate, 1.0, upsample_threshold, None, length, mu, sigma)
    return _cdf_below(dist, upsample_threshold / elongate, length, mu, sigma)


# ---------------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------------

def sample_docs(dist: str, total_tokens: int, seed: int = 0, *, elongate: float = 1.0,
                upsample: float = 1.0, upsample_threshold: int = DEFAULT_UPSAMPLE_THRESHOLD,
                max_doc_len: int | None = None, length: int | None = None, mu: float | None = None,
                sigma: float | None = None) -> list[int]:
    """Draw document lengths until they fill exactly ``total_tokens`` (the last one clipped).

    Each length is ``min(max_doc_len, max(1, round(elongate * Q(u))))`` with ``u`` from a seeded
    ``numpy.random.Generator``; with ``upsample > 1`` documents whose elongated (unclipped) length is
    ``>= upsample_threshold`` are drawn ``upsample`` times more often (see ``_upsample_map``).
    ``length`` is for ``uniform``; ``mu``/``sigma`` (of the natural log of length) for ``lognormal``.
    """
    _check_params(dist, elongate, upsample, upsample_threshold, max_doc_len, length, mu, sigma)
    if total_tokens < 1:
        raise ValueError(f"total_tokens must be >= 1, got {total_tokens}")
    total_tokens = int(total_tokens)
    rng = np.random.default_rng(seed)
    f_t = _cdf_below(dist, upsample_threshold / elongate, length, mu, sigma)
    out: list[int] = []
    filled, batch = 0, 64
    while filled < total_tokens:
        u = _upsample_map(rng.random(batch), f_t, float(upsample))
        lens = np.maximum(1, np.rint(elongate * _quantile(dist, u, length, mu, sigma))).astype(np.int64)
        if max_doc_len is not None:
            lens = np.minimum(lens, int(max_doc_len))
        csum = filled + np.cumsum(lens)
        k = int(np.searchsorted(csum, total_tokens))          # first index reaching the budget
        if k < len(lens):
            out.extend(int(n) for n in lens[:k])
            out.append(total_tokens - (int(csum[k - 1]) if k > 0 else filled))
            break
        out.extend(int(n) for n in lens)
        filled = int(csum[-1])
        mean = max(filled / len(out), 1.0)
        batch = int(min(1 << 20, max(64, 1.1 * (total_tokens - filled) / mean + 16)))
    return out


def doc_length_cdf(dist: str, *, elongate: float = 1.0, upsample: float = 1.0,
                   upsample_threshold: int = DEFAULT_UPSAMPLE_THRESHOLD, max_doc_len: int | None = None,
                   length: int | None = None, mu: float | None = None, sigma: float | None = None,
                   weight: str = "docs", n_points: int = 1024) -> tuple[np.ndarray, np.ndarray]:
    """``(lengths, cdf)`` of the (continuous, unrounded) length distribution, for plotting.

    ``weight="docs"``: ``cdf[i]`` is the fraction of documents of length ``<= lengths[i]``,
    ``G(u) = u / Z`` below ``F(T)`` and ``(F(T) + upsample (u - F(T))) / Z`` above it.
    ``weight="tokens"``: the fraction of tokens in such documents, ``int_0^u x dG / int_0^1 x dG``.
    Lengths above ``max_doc_len`` are clipped to it (the curve reaches 1 there)."""
    _check_params(dist, elongate, upsample, upsample_threshold, max_doc_len, length, mu, sigma)
    if weight not in ("docs", "tokens"):
        raise ValueError(f"unknown weight {weight!r}; choose one of: docs, tokens")
    if n_points < 2:
        raise ValueError(f"n_points must be >= 2, got {n_points}")
    f_t = _cdf_below(dist, upsample_threshold / elongate, length, mu, sigma)
    if dist == "lognormal":      # quantile levels dense in both tails
        z = np.linspace(-6.0, 6.0, n_points)
        u = np.array([_NORMAL.cdf(float(v)) for v in z])
    else:                        # uniform in u plus a geometric grid towards u = 1 (the long tail)
        u = np.concatenate([np.linspace(0.0, 1.0, n_points), 1.0 - np.geomspace(1e-6, 1.0, n_points // 2)])
    if dist in QUANTILE_TABLES:
        u = np.concatenate([u, np.asarray(PERCENTILES) / 100.0])
    u = np.unique(np.concatenate([u, [f_t]]))
    x = np.maximum(1.0, elongate * _quantile(dist, u, length, mu, sigma))
    if max_doc_len is not None:
        x = np.minimum(x, float(max_doc_len))
    z_norm = f_t + upsample * (1.0 - f_t)
    g = np.where(u <= f_t, u, f_t + upsample * (u - f_t)) / z_norm
    if dist == "lognormal":       # the grid leaves out the far tails; renormalise to [0, 1]
        g = (g - g[0]) / (g[-1] - g[0])
    if weight == "docs":
        return x, g
    mass = np.concatenate([[0.0], np.cumsum(0.5 * (x[1:] + x[:-1]) * np.diff(g))])
    return x, mass / mass[-1]


# ---------------------------------------------------------------------------------------------------
# Packing into the linear layout
# ---------------------------------------------------------------------------------------------------

def _check_docs(doc_lens: Sequence[int]) -> list[int]:
    lens = [int(n) for n in doc_lens]
    if not lens:
        raise ValueError("doc_lens is empty; pack needs at least one document")
    for i, (n, raw) in enumerate(zip(lens, doc_lens)):
        if n < 1 or n != raw:
            raise ValueError(f"document {i} has length {raw!r}; document lengths must be integers >= 1")
    return lens


def _model(model: ModelSpec | str | None) -> ModelSpec:
    if model is None:
        return ModelSpec.from_name("llama3-8b")
    return ModelSpec.from_name(model) if isinstance(model, str) else model


def pack(doc_lens: Sequence[int], n_ranks: int, tokens_per_rank: int | None = None,
         method: str = "sequential", model: ModelSpec | str | None = None,
         cap: int | None = None) -> Layout:
    """Place documents on ``n_ranks`` ranks for the linear layers; returns a validated ``Layout``.

    ``sequential``: documents in order fill rank 0, then rank 1, ...; a document crossing a rank
    boundary is cut into chunks, so every rank holds exactly ``tokens_per_rank`` tokens (default
    ``sum(doc_lens) / n_ranks``, which must be whole; ``sum(doc_lens) == n_ranks * tokens_per_rank``).

    ``balanced`` (WLB-LLM var-len packing): documents, costliest (= longest) first, go to the rank with
    the lowest estimated cost ``attention_flops(pairs) + linear_flops_per_token * tokens`` (fwd+bwd,
    all layers of ``model``, default llama3-8b) among ranks with room for the whole document, under a
    token cap per rank (default ``floor(1.25 * tokens_per_rank)``, ``tokens_per_rank`` defaulting to
    ``ceil(sum / n_ranks)``). A document costing more than ``PIECE_COST_FRACTION`` of the mean rank
    cost is first cut into consecutive equal-cost pieces (head/tail chunks), placed like documents.
    A piece that fits nowhere whole is cut again: its next chunk fills the rank with the most room
    (ties: lowest cost), and so on until nothing is left. Ranks hold between 0 and ``cap`` tokens.
    """
    lens = _check_docs(doc_lens)
    if n_ranks < 1:
        raise ValueError(f"n_ranks must be >= 1, got {n_ranks}")
    if method not in PACK_METHODS:
        raise ValueError(f"unknown pack method {method!r}; choose one of: {', '.join(PACK_METHODS)}")
    if tokens_per_rank is not None and tokens_per_rank < 1:
        raise ValueError(f"tokens_per_rank must be >= 1, got {tokens_per_rank}")
    n_ranks, total = int(n_ranks), sum(lens)
    if method == "sequential":
        if cap is not None:
            raise ValueError("cap applies only to method 'balanced'; sequential ranks hold exactly "
                             "tokens_per_rank tokens")
        if tokens_per_rank is None:
            if total % n_ranks:
                raise ValueError(f"{total} tokens do not split evenly over {n_ranks} ranks; pass "
                                 "tokens_per_rank, or documents whose total is a multiple of n_ranks")
            tokens_per_rank = total // n_ranks
        if total != n_ranks * tokens_per_rank:
            raise ValueError(f"sequential packing needs sum(doc_lens) == n_ranks * tokens_per_rank; got "
                             f"{total} != {n_ranks} * {tokens_per_rank}")
        return _pack_sequential(lens, n_ranks, int(tokens_per_rank))
    if tokens_per_rank is None:
        tokens_per_rank = -(-total // n_ranks)
    if cap is None:
        cap = int(DEFAULT_CAP_FACTOR * tokens_per_rank)
    if cap < tokens_per_rank:
        raise ValueError(f"cap ({cap}) must be >= tokens_per_rank ({tokens_per_rank})")
    if total > n_ranks * cap:
        raise ValueError(f"{total} tokens do not fit on {n_ranks} ranks of at most cap={cap} tokens; "
                         "raise cap or tokens_per_rank")
    return _pack_balanced(lens, n_ranks, int(cap), _model(model))


def _pack_sequential(lens: list[int], n_ranks: int, tokens_per_rank: int) -> Layout:
    """Cut the concatenated token stream at multiples of ``tokens_per_rank``."""
    ranks: list[list[Chunk]] = [[] for _ in range(n_ranks)]
    rank, room = 0, tokens_per_rank
    for d, n in enumerate(lens):
        pos = 0
        while pos < n:
            take = min(n - pos, room)
            ranks[rank].append(Chunk(d, pos, pos + take))
            pos += take
            room -= take
            if room == 0 and rank + 1 < n_ranks:
                rank, room = rank + 1, tokens_per_rank
    return Layout(ranks, lens)


def _pieces_by_cost(lens: list[int], n_ranks: int, a: float, b: float) -> list[tuple[float, int, int, int]]:
    """Cut every document costing more than ``target = PIECE_COST_FRACTION * sum C(n_d) / n_ranks``
    (half the mean rank cost) into ``k = ceil(C(n) / target)`` consecutive pieces of equal cost,
    where the cost of tokens ``[0, e)`` is ``C(e) = a e(e+1)/2 + b e`` (``a``: FLOPs per attention
    pair, ``b``: linear FLOPs per token), and the ``j``-th cut is ``C^-1(c), c = j C(n) / k``, with
    ``C^-1(c) = 2c / (h + sqrt(h^2 + 2ac))``, ``h = a/2 + b``.
    Returns ``(cost, doc, start, end)`` per piece."""
    def cum(e):
        return a * causal_pairs(0, e) + b * e

    target = PIECE_COST_FRACTION * sum(cum(n) for n in lens) / n_ranks
    h = a / 2 + b
    out = []
    for d, n in enumerate(lens):
        k = max(1, math.ceil(cum(n) / target - 1e-9))
        cuts = {min(n - 1, max(1, round(2 * c / (h + math.sqrt(h * h + 2 * a * c)))))
                for c in (j * cum(n) / k for j in range(1, k))}
        bounds = [0, *sorted(cuts), n] if n > 1 else [0, n]
        out += [(cum(e) - cum(s), d, s, e) for s, e in zip(bounds[:-1], bounds[1:])]
    return out


def _pack_balanced(lens: list[int], n_ranks: int, cap: int, model: ModelSpec) -> Layout:
    """Longest-cost-first greedy assignment to the cheapest rank with room (see ``pack``).

    Cost of a piece ``[s, e)``: ``attention_flops(pairs(s, e)) + linear_flops_per_token * (e - s)``,
    fwd+bwd over all layers. Causal pairs add up over consecutive pieces, so cutting a document moves
    its attention work between ranks without changing the total."""
    a = float(model.attention_flops(1, backward=True))
    b = model.linear_flops_per_token(backward=True)
    ranks: list[list[Chunk]] = [[] for _ in range(n_ranks)]
    tokens = np.zeros(n_ranks, dtype=np.int64)
    cost = np.zeros(n_ranks, dtype=np.float64)
    for _, d, pos, end in sorted(_pieces_by_cost(lens, n_ranks, a, b), key=lambda p: (-p[0], p[1], p[2])):
        while pos < end:
            room = cap - tokens
            fits = room >= end - pos
            if fits.any():
                r = int(np.argmin(np.where(fits, cost, np.inf)))
            else:
                r = int(np.lexsort((cost, -room))[0])         # most room, then lowest cost
            take = int(min(end - pos, room[r]))
            ranks[r].append(Chunk(d, pos, pos + take))
            cost[r] += a * causal_pairs(pos, pos + take) + b * take
            tokens[r] += take
            pos += take
    return Layout([_merge(r) for r in ranks], lens)


def _merge(chunks: list[Chunk]) -> list[Chunk]:
    """Sort a rank's chunks and join neighbours of one document (``[s, e)`` + ``[e, f)`` = ``[s, f)``)."""
    out: list[Chunk] = []
    for c in sorted(chunks):
        if out and out[-1].doc == c.doc and out[-1].end == c.start:
            out[-1] = Chunk(c.doc, out[-1].start, c.end)
        else:
            out.append(c)
    return out


# ---------------------------------------------------------------------------------------------------
# Per-rank costs of a layout
# ---------------------------------------------------------------------------------------------------

def rank_costs(layout: Layout, model: ModelSpec | str | None = None, backward: bool = False,
               layers: int | None = None) -> dict[str, np.ndarray]:
    """Per-rank load of a layout when every chunk runs where it lives (no CAD).

    A chunk ``(doc, s, e)`` is the causal CA-task ``[s, e)`` with KV prefix ``[0, e)``:
    ``pairs = (e(e+1) - s(s+1)) / 2``. Returns arrays ``tokens``, ``attention_pairs``,
    ``linear_flops`` (``tokens * linear_flops_per_token``), ``attention_flops``
    (``4 * pairs * n_heads * head_dim`` per layer, x3.5 with backward) and ``total_flops``;
    ``layers=None`` counts all of ``model``'s layers (default model llama3-8b)."""
    m = _model(model)
    tokens = layout.tokens_per_rank()
    pairs = np.array([sum(causal_pairs(c.start, c.end) for c in r) for r in layout.ranks], dtype=np.float64)
    lin = tokens * m.linear_flops_per_token(backward=backward, layers=layers)
    attn = np.asarray(m.attention_flops(pairs, backward=backward, layers=layers), dtype=np.float64)
    return {"tokens": tokens, "attention_pairs": pairs, "linear_flops": lin, "attention_flops": attn,
            "total_flops": lin + attn}


def imbalance(values) -> float:
    """``max / mean`` of a per-rank load (1.0 = perfectly balanced; 1.0 for an all-zero load)."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        raise ValueError("imbalance needs at least one value")
    mean = v.mean()
    return float(v.max() / mean) if mean > 0 else 1.0

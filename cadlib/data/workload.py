"""Workloads: named document-length distributions and sampling to a token budget.

* A distribution is a quantile function ``Q(u)``, ``u in [0, 1)``: the tabulated ones interpolate
  their published percentiles log-linearly (linear in percentile, linear in ``log(length)``);
  ``uniform`` is one fixed length; ``lognormal`` is ``exp(mu + sigma * Phi^-1(u))``. Documents are
  drawn by inverse CDF, ``length = max(1, round(elongate * Q(u)))``, optionally clipped.
* **Upsampling** (DistCA's "Pretrain" setting draws documents of >= 64K tokens twice as often)
  reweights the density: ``g(x) = f(x) * (upsample if x >= T else 1) / Z`` with
  ``Z = F(T) + upsample * (1 - F(T))``. It is sampled exactly by mapping a uniform ``v`` to the
  original quantile level ``u = vZ`` if ``vZ < F(T)``, else ``u = F(T) + (vZ - F(T)) / upsample``.

* **A user's lengths** ``x_1..x_n`` (:mod:`cadlib.data.lengths` reads them) are sampled by the inverse
  CDF of their order statistics, ``Q_n(u) = x_(floor(u n) + 1)`` (uniformly with replacement), by the
  same token-budget rule and uniforms (:func:`fill_budget`): a file of lengths drawn from a table gives,
  seed for seed, batches whose ``i``-th document is the empirical quantile at the level the table's
  sampler used for its ``i``-th, and ``Q_n(u) -> Q(u)`` as ``n`` grows.

Packing the sampled documents into the linear layout lives in :mod:`cadlib.data.packing`.
"""
from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

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
"""Named keyword sets for ``sample_docs``. ``distca-pretrain`` is our reading of the paper's text on its
"Pretrain" setting: the WLB-LLM distribution with documents >= 64K tokens drawn twice as often. DistCA's
code samples otherwise (``pretrain-distca`` and ``prolong-distca`` of :mod:`cadlib.data.sequences`). Use it as
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
    f_t = _cdf_below(dist, upsample_threshold / elongate, length, mu, sigma)

    def draw(v: np.ndarray) -> np.ndarray:
        u = _upsample_map(v, f_t, float(upsample))
        return np.maximum(1, np.rint(elongate * _quantile(dist, u, length, mu, sigma))).astype(np.int64)

    return fill_budget(draw, total_tokens, seed, max_doc_len)


def fill_budget(draw, total_tokens: int, seed: int = 0, max_doc_len: int | None = None) -> list[int]:
    """The token-budget rule of every sampler: lengths ``min(max_doc_len, draw(v))`` for uniforms ``v``
    of a seeded ``numpy.random.Generator`` (one double each, in order, however many are drawn at once),
    until they fill exactly ``total_tokens``; the last one is clipped to what is left. ``draw`` maps an
    array of uniforms in ``[0, 1)`` to integer lengths ``>= 1`` (an inverse CDF)."""
    if total_tokens < 1:
        raise ValueError(f"total_tokens must be >= 1, got {total_tokens}")
    if max_doc_len is not None and max_doc_len < 1:
        raise ValueError(f"max_doc_len must be >= 1 token or None (no clipping), got {max_doc_len}")
    total_tokens = int(total_tokens)
    rng = np.random.default_rng(seed)
    out: list[int] = []
    filled, batch = 0, 64
    while filled < total_tokens:
        lens = np.asarray(draw(rng.random(batch)), dtype=np.int64)
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


def empirical_draw(lengths, elongate: float = 1.0):
    """The inverse CDF of ``lengths``: ``u -> max(1, round(elongate * x_(floor(u n) + 1)))`` (a
    function of an array of uniforms, for :func:`fill_budget`)."""
    srt = np.sort(np.asarray(lengths, dtype=np.int64))
    if srt.size == 0 or srt[0] < 1:
        raise ValueError("lengths must be a non-empty array of integers >= 1")
    if not elongate > 0:
        raise ValueError(f"elongate must be > 0 (a factor on every length), got {elongate}")
    n = srt.size

    def draw(u: np.ndarray) -> np.ndarray:
        x = srt[np.minimum((np.asarray(u) * n).astype(np.int64), n - 1)]
        return x if elongate == 1.0 else np.maximum(1, np.rint(elongate * x)).astype(np.int64)

    return draw


def sample_lengths(lengths, total_tokens: int, seed: int = 0, *, elongate: float = 1.0,
                   max_doc_len: int | None = None) -> list[int]:
    """Documents drawn from the empirical distribution of ``lengths`` until they fill exactly
    ``total_tokens`` (the last one clipped), each ``min(max_doc_len, max(1, round(elongate * Q_n(u))))``
    with ``u`` from a seeded generator: :func:`sample_docs`' rule and uniforms."""
    return fill_budget(empirical_draw(lengths, elongate), total_tokens, seed, max_doc_len)


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

"""Tests for cadlib.data.workload: sampling document lengths and packing them into the linear layout."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cadlib.core.cost import ModelSpec, imbalance
from cadlib.core.layout import Chunk
from cadlib.data.packing import pack, rank_costs
from cadlib.data.workload import (
    DISTRIBUTIONS,
    PERCENTILES,
    PRESETS,
    QUANTILE_TABLES,
    doc_length_cdf,
    long_doc_level,
    sample_docs,
)

TABLES = tuple(QUANTILE_TABLES)
EXTRA = {"uniform": {"length": 700}, "lognormal": {"mu": 7.0, "sigma": 1.2}}
FAST = settings(max_examples=25, deadline=None)


def ref_quantile(table, p):
    """Scalar reference: log-length linear in percentile between the two bracketing table points."""
    for (p0, l0), (p1, l1) in zip(zip(PERCENTILES, table), zip(PERCENTILES[1:], table[1:])):
        if p0 <= p <= p1:
            return math.exp(math.log(l0) + (p - p0) / (p1 - p0) * (math.log(l1) - math.log(l0)))
    raise AssertionError(p)


@pytest.fixture(scope="module")
def big():
    """Large samples (>= 100K documents) per tabulated distribution, drawn once."""
    return {d: np.array(sample_docs(d, 600_000_000 if d != "pile" else 2_000_000_000, seed=7))
            for d in TABLES}


# ---------------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------------

def test_tables_are_well_formed():
    assert set(DISTRIBUTIONS) == set(TABLES) | {"uniform", "lognormal"}
    for name, t in QUANTILE_TABLES.items():
        assert len(t) == len(PERCENTILES), name
        assert all(a < b for a, b in zip(t, t[1:])), name


@FAST
@given(dist=st.sampled_from(DISTRIBUTIONS), total=st.integers(1, 300_000), seed=st.integers(0, 2**31))
def test_exact_fill(dist, total, seed):
    docs = sample_docs(dist, total, seed, **EXTRA.get(dist, {}))
    assert sum(docs) == total
    assert min(docs) >= 1
    assert all(isinstance(n, int) for n in docs)


@FAST
@given(dist=st.sampled_from(DISTRIBUTIONS), cap=st.integers(1, 5000), seed=st.integers(0, 1000))
def test_max_doc_len_clips(dist, cap, seed):
    docs = sample_docs(dist, 100_000, seed, max_doc_len=cap, **EXTRA.get(dist, {}))
    assert sum(docs) == 100_000 and max(docs) <= cap and min(docs) >= 1


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_deterministic_per_seed_and_different_across_seeds(dist):
    kw = EXTRA.get(dist, {})
    a = sample_docs(dist, 2_000_000, seed=3, **kw)
    assert a == sample_docs(dist, 2_000_000, seed=3, **kw)
    if dist != "uniform":
        assert a != sample_docs(dist, 2_000_000, seed=4, **kw)


def test_uniform_is_one_length():
    assert sample_docs("uniform", 10, length=4) == [4, 4, 2]
    assert sample_docs("uniform", 8, length=4, elongate=2) == [8]


@pytest.mark.parametrize("dist", TABLES)
def test_sample_quantiles_match_table(big, dist):
    x = big[dist]
    assert len(x) >= 100_000
    t = QUANTILE_TABLES[dist]
    for p in (50, 90):
        ref = t[PERCENTILES.index(p)]
        assert abs(np.percentile(x, p) / ref - 1) < 0.10, (dist, p)
    # the empirical CDF at every interior table point matches its percentile
    for p, length in zip(PERCENTILES[1:-1], t[1:-1]):
        assert abs(np.mean(x < length) - p / 100) < 0.01, (dist, p)


def test_interpolation_is_log_linear(big):
    """Between pile's 99.5th (12387) and 99.8th (1037489) percentiles the geometric mean sits at the
    99.65th percentile (a length-linear interpolation would put it at ~99.53)."""
    x = big["pile"]
    t = QUANTILE_TABLES["pile"]
    g = math.sqrt(t[15] * t[16])
    assert ref_quantile(t, 99.65) == pytest.approx(g)
    assert np.mean(x >= g) == pytest.approx(0.0035, abs=0.0006)


def test_lognormal_median():
    x = np.array(sample_docs("lognormal", 50_000_000, seed=1, mu=8.0, sigma=0.7))
    assert np.median(x) == pytest.approx(math.exp(8.0), rel=0.05)
    assert np.std(np.log(x[:-1])) == pytest.approx(0.7, rel=0.05)


def test_elongate_scales_lengths():
    a = np.array(sample_docs("prolong", 100_000_000, seed=2))
    b = np.array(sample_docs("prolong", 400_000_000, seed=2, elongate=4.0))
    for p in (10, 50, 90):
        assert np.percentile(b, p) / np.percentile(a, p) == pytest.approx(4.0, rel=0.05)
    # the upsampling threshold is measured after elongation
    assert long_doc_level("pretrain", elongate=2.0, upsample_threshold=65536) == pytest.approx(
        long_doc_level("pretrain", upsample_threshold=32768))


def test_long_doc_level_matches_table():
    t = QUANTILE_TABLES["pretrain"]
    for p, length in zip(PERCENTILES[1:-1], t[1:-1]):
        assert long_doc_level("pretrain", upsample_threshold=length) == pytest.approx(p / 100)
    assert long_doc_level("pretrain", upsample_threshold=10**9) == 1.0


@pytest.mark.parametrize("up", [2.0, 4.0])
def test_upsampling_multiplies_long_doc_share(up):
    thr = 65536
    p = 1 - long_doc_level("pretrain", upsample_threshold=thr)       # ~0.53% of documents
    base = np.array(sample_docs("pretrain", 1_000_000_000, seed=5))
    ups = np.array(sample_docs("pretrain", 1_000_000_000, seed=6, upsample=up, upsample_threshold=thr))
    f0, f1 = np.mean(base >= thr), np.mean(ups >= thr)
    assert f0 == pytest.approx(p, rel=0.12)
    assert f1 == pytest.approx(up * p / (1 - p + up * p), rel=0.12)
    assert f1 / f0 == pytest.approx(up, rel=0.2)
    # the long documents carry more of the tokens too
    assert ups[ups >= thr].sum() / ups.sum() > 1.5 * base[base >= thr].sum() / base.sum()


def test_upsampling_leaves_short_docs_shape_unchanged():
    """Below the threshold the density is only renormalised: conditional quantiles stay put."""
    base = np.array(sample_docs("pretrain", 500_000_000, seed=8))
    ups = np.array(sample_docs("pretrain", 500_000_000, seed=9, upsample=3.0))
    assert np.median(ups[ups < 65536]) == pytest.approx(np.median(base[base < 65536]), rel=0.03)


def test_distca_preset():
    docs = sample_docs(total_tokens=10_000_000, seed=0, **PRESETS["distca-pretrain"])
    assert sum(docs) == 10_000_000
    assert PRESETS["distca-pretrain"]["upsample"] == 2.0


# ---------------------------------------------------------------------------------------------------
# CDF helper
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_cdf_is_monotone_and_ends_at_one(dist):
    for weight in ("docs", "tokens"):
        x, c = doc_length_cdf(dist, weight=weight, upsample=2.0, **EXTRA.get(dist, {}))
        assert np.all(np.diff(x) >= 0) and np.all(np.diff(c) >= -1e-12)
        assert c[0] == pytest.approx(0, abs=1e-6) and c[-1] == pytest.approx(1)


@pytest.mark.parametrize("dist", TABLES)
def test_cdf_passes_through_table_points(dist):
    x, c = doc_length_cdf(dist)
    for p, length in zip(PERCENTILES, QUANTILE_TABLES[dist]):
        i = int(np.argmin(np.abs(c - p / 100)))
        assert c[i] == pytest.approx(p / 100) and x[i] == pytest.approx(max(length, 1))


def test_token_cdf_matches_sample(big):
    x = big["pretrain"][:-1]
    lx, lc = doc_length_cdf("pretrain", weight="tokens")
    for length in (1283, 3227, 5784, 26058):
        i = int(np.searchsorted(lx, length))
        assert lc[i] == pytest.approx(x[x <= length].sum() / x.sum(), abs=0.02)
    _, dc = doc_length_cdf("pretrain")
    assert np.all(lc <= dc + 1e-9)            # long documents hold more of the tokens than of the docs


def test_cdf_with_upsampling_and_clip():
    f = long_doc_level("pretrain")
    x, c = doc_length_cdf("pretrain", upsample=2.0, max_doc_len=100_000)
    i = int(np.argmin(np.abs(x - 65536)))
    assert x[i] == pytest.approx(65536) and c[i] == pytest.approx(f / (f + 2 * (1 - f)))
    assert x.max() == 100_000


# ---------------------------------------------------------------------------------------------------
# Packing
# ---------------------------------------------------------------------------------------------------

def test_sequential_head_tail_example():
    lay = pack([3, 5, 4], 3)
    assert lay.ranks == [[Chunk(0, 0, 3), Chunk(1, 0, 1)], [Chunk(1, 1, 5)], [Chunk(2, 0, 4)]]
    lay = pack([2, 9, 1], 3, tokens_per_rank=4)           # document 1 spans three ranks
    assert lay.ranks == [[Chunk(0, 0, 2), Chunk(1, 0, 2)], [Chunk(1, 2, 6)],
                         [Chunk(1, 6, 9), Chunk(2, 0, 1)]]


@FAST
@given(lens=st.lists(st.integers(1, 300), min_size=1, max_size=40), n_ranks=st.integers(1, 8))
def test_sequential_matches_token_stream(lens, n_ranks):
    lens = lens + [n_ranks - sum(lens) % n_ranks] if sum(lens) % n_ranks else lens
    lay = pack(lens, n_ranks)
    tpr = sum(lens) // n_ranks
    assert list(lay.tokens_per_rank()) == [tpr] * n_ranks
    stream = [(d, i) for d, n in enumerate(lens) for i in range(n)]          # reference
    for r, chunks in enumerate(lay.ranks):
        held = [(c.doc, i) for c in chunks for i in range(c.start, c.end)]
        assert held == stream[r * tpr:(r + 1) * tpr]


@FAST
@given(lens=st.lists(st.integers(1, 5000), min_size=1, max_size=60), n_ranks=st.integers(1, 8),
       slack=st.floats(1.0, 2.0))
def test_balanced_covers_every_token_under_cap(lens, n_ranks, slack):
    tpr = -(-sum(lens) // n_ranks)
    cap = int(slack * tpr)
    lay = pack(lens, n_ranks, method="balanced", cap=cap, model="tiny")   # Layout validates coverage
    assert lay.tokens_per_rank().max() <= cap
    assert lay.tokens_per_rank().sum() == sum(lens)


def test_balanced_default_cap():
    docs = sample_docs("prolong", 8 * 32768, seed=1, max_doc_len=32768)
    lay = pack(docs, 8, method="balanced")
    assert lay.tokens_per_rank().max() <= int(1.25 * 32768)


@pytest.mark.parametrize("dist,tpr,n_ranks", [("pretrain", 65536, 8), ("prolong64k", 65536, 8),
                                              ("pile", 16384, 16)])
def test_balanced_reduces_attention_imbalance(dist, tpr, n_ranks):
    ratios = []
    for seed in range(8):
        docs = sample_docs(dist, n_ranks * tpr, seed=seed, max_doc_len=tpr)
        seq = rank_costs(pack(docs, n_ranks), backward=True)
        bal = rank_costs(pack(docs, n_ranks, method="balanced"), backward=True)
        ratios.append(imbalance(bal["attention_flops"]) / imbalance(seq["attention_flops"]))
        assert imbalance(bal["total_flops"]) <= imbalance(seq["total_flops"]) + 1e-9
    assert np.mean(ratios) < 0.85 and max(ratios) < 1.05


def test_balanced_splits_a_dominant_document():
    """One 48K document among short ones: sequential leaves its tail on one rank; balanced cuts it."""
    docs = [48_000] + [2000] * 40
    seq = rank_costs(pack(docs, 8), backward=True)
    lay = pack(docs, 8, method="balanced")
    bal = rank_costs(lay, backward=True)
    assert sum(c.doc == 0 for r in lay.ranks for c in r) >= 2
    assert imbalance(bal["attention_flops"]) < imbalance(seq["attention_flops"])
    assert imbalance(bal["total_flops"]) < 1.1 < imbalance(seq["total_flops"])


def test_rank_costs_against_reference():
    lay = pack([5, 9, 3, 7], 3, tokens_per_rank=8)
    m = ModelSpec.from_name("tiny")
    got = rank_costs(lay, m)
    for r, chunks in enumerate(lay.ranks):
        pairs = sum(i + 1 for c in chunks for i in range(c.start, c.end))          # KV prefix [0, i]
        tokens = sum(c.length for c in chunks)
        assert got["tokens"][r] == tokens and got["attention_pairs"][r] == pairs
        attn = 4 * pairs * m.n_heads * m.head_dim * m.n_layers
        assert got["attention_flops"][r] == pytest.approx(attn)
        assert got["linear_flops"][r] == pytest.approx(tokens * 2 * m.linear_params_per_layer() * m.n_layers)
        assert got["total_flops"][r] == pytest.approx(got["attention_flops"][r] + got["linear_flops"][r])
    bwd = rank_costs(lay, m, backward=True, layers=1)
    assert bwd["attention_flops"] == pytest.approx(got["attention_flops"] * 3.5 / m.n_layers)


def test_imbalance():
    assert imbalance([1, 1, 1]) == 1.0
    assert imbalance([3, 1, 2]) == pytest.approx(1.5)
    assert imbalance([0, 0]) == 1.0


# ---------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    ({"dist": "prolog"}, "unknown distribution 'prolog'; choose one of: pretrain"),
    ({"total_tokens": 0}, "total_tokens must be >= 1"),
    ({"elongate": 0}, "elongate must be > 0"),
    ({"elongate": -2}, "elongate must be > 0"),
    ({"upsample": 0.5}, "upsample must be >= 1"),
    ({"upsample_threshold": 0}, "upsample_threshold must be >= 1"),
    ({"max_doc_len": 0}, "max_doc_len must be >= 1"),
    ({"dist": "uniform"}, "'uniform' needs length"),
    ({"dist": "uniform", "length": 0}, "'uniform' needs length"),
    ({"dist": "lognormal", "mu": 7.0}, "'lognormal' needs mu and sigma"),
    ({"dist": "lognormal", "mu": 7.0, "sigma": 0.0}, "sigma > 0"),
    ({"length": 5}, "length applies only to distribution 'uniform'"),
    ({"mu": 1.0, "sigma": 1.0}, "mu and sigma apply only to distribution 'lognormal'"),
])
def test_sample_errors(kwargs, match):
    args = {"dist": "pretrain", "total_tokens": 1000, **kwargs}
    with pytest.raises(ValueError, match=match):
        sample_docs(**args)


def test_cdf_errors():
    with pytest.raises(ValueError, match="unknown weight 'bytes'; choose one of: docs, tokens"):
        doc_length_cdf("pretrain", weight="bytes")
    with pytest.raises(ValueError, match="unknown distribution"):
        doc_length_cdf("nope")


@pytest.mark.parametrize("args,kwargs,match", [
    (([4, 0, 4], 2), {}, "document 1 has length 0; document lengths must be integers >= 1"),
    (([4, -3], 1), {}, "document 1 has length -3"),
    (([4, 2.5], 1), {}, "document 1 has length 2.5"),
    (([], 1), {}, "doc_lens is empty"),
    (([4, 4], 0), {}, "n_ranks must be an integer >= 1, got 0"),
    (([4, 4], 2.5), {}, "n_ranks must be an integer >= 1, got 2.5"),
    (([4, 4], "2"), {}, "n_ranks must be an integer >= 1, got '2'"),
    (([4, 4], True), {}, "n_ranks must be an integer >= 1, got True"),
    (([4, 4], 2), {"tokens_per_rank": 0}, "tokens_per_rank must be an integer >= 1"),
    (([5], 2, 2.5), {}, "tokens_per_rank must be an integer >= 1, got 2.5"),
    (([5], 2, 2.5), {"method": "balanced"}, "tokens_per_rank must be an integer >= 1, got 2.5"),
    (([4, 4], 2, "4"), {}, "tokens_per_rank must be an integer >= 1, got '4'"),
    (([4, 4], 2), {"method": "balanced", "cap": 4.5}, "cap must be an integer >= 1, got 4.5"),
    (([4, 4], 2), {"method": "zigzag"}, "unknown pack method 'zigzag'; choose one of: sequential, balanced"),
    (([4, 3], 2), {}, "7 tokens do not split evenly over 2 ranks"),
    (([4, 4], 2), {"tokens_per_rank": 3}, r"sum\(doc_lens\) == n_ranks \* tokens_per_rank"),
    (([4, 4], 2), {"cap": 5}, "cap applies only to method 'balanced'"),
    (([4, 4], 2), {"method": "balanced", "cap": 3}, r"cap \(3\) must be >= tokens_per_rank \(4\)"),
    (([4, 4], 2), {"method": "balanced", "tokens_per_rank": 2, "cap": 3}, "do not fit on 2 ranks"),
    (([4, 4], 2), {"method": "balanced", "model": "gpt5"}, "unknown model 'gpt5'"),
])
def test_pack_errors(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        pack(*args, **kwargs)

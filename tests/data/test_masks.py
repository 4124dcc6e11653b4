"""Masks as slices: every type's closed-form area and dense form against its definition written as a
brute-force predicate, the FlexAttention mask_mod against the dense mask, and the varlen form against
dense attention."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cadlib.core.cost import ATTN_BWD_MULT
from cadlib.core.paper import LONGCA_MASK_TYPES
from cadlib.data.masks import (
    ALL_TYPES,
    BICAUSAL,
    CAUSAL,
    FULL,
    INVCAUSAL,
    MASK_TYPES,
    Mask,
    band_slices,
    dense_reference,
    make_mask,
    slice_area,
)
from cadlib.runtime.kernels import flex as flex_masks


def test_twelve_types_plus_two_long_variants():
    assert len(MASK_TYPES) == LONGCA_MASK_TYPES.value == 12 and len(ALL_TYPES) == 14


@pytest.mark.parametrize("name", ALL_TYPES)
def test_area_and_dense_match_the_definition(name):
    for total in (1, 2, 5, 31, 130):
        for seed in range(3):
            for window in (1, 7, 200):
                m = make_mask(name, total, seed, dist="pile", window=window, block=8)
                want = dense_reference(m)
                assert m.area() == int(want.sum()), (name, total, seed, window)
                assert np.array_equal(m.to_dense(), want), (name, total, seed, window)


@pytest.mark.parametrize("lq,lk", [(1, 1), (3, 5), (5, 3), (4, 4), (1, 9), (9, 1)])
def test_slice_area_formulas(lq, lk):
    j, t = np.arange(lq)[:, None], np.arange(lk)[None, :]
    causal, inv = t <= j + lk - lq, t >= j
    for kind, dense in ((FULL, np.ones((lq, lk), bool)), (CAUSAL, causal), (INVCAUSAL, inv),
                        (BICAUSAL, causal & inv)):
        assert slice_area(lq, lk, kind) == dense.sum()


@pytest.mark.parametrize("length,left,right", [(10, 3, 0), (10, 3, 3), (10, 0, 0), (10, 20, 20),
                                               (10, 9, 1), (1, 4, 4), (6, 2, 10)])
def test_band_is_the_two_sided_window(length, left, right):
    m = Mask("band", length, *np.array(band_slices(0, length, left, right)).T)
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    want = (j >= i - left) & (j <= i + right)
    assert np.array_equal(m.to_dense(), want) and m.area() == want.sum()


@pytest.mark.parametrize("name", ALL_TYPES)
def test_mask_mod_equals_dense(name):
    m = make_mask(name, 97, seed=1, dist="pile", window=9, block=16)
    i, j = torch.arange(97)[:, None], torch.arange(97)[None, :]
    got = flex_masks.mask_mod(m)(0, 0, i, j).numpy()
    assert np.array_equal(got, m.to_dense())


def test_flex_attention_with_the_block_mask():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    m = make_mask("global_sliding_window", 96, seed=2)
    q, k, v = (torch.randn(1, 2, 96, 8) for _ in range(3))
    out = flex.flex_attention(q, k, v, block_mask=flex_masks.block_mask(m, "cpu", block_size=32))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.as_tensor(m.to_dense()))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


VARLEN = ("full", "causal", "full_document", "causal_document", "causal_blockwise", "block_causal_document",
          "full_document_long", "causal_document_long")


@pytest.mark.parametrize("name", ALL_TYPES)
def test_varlen_form_computes_the_mask(name):
    from cadlib.runtime.kernels import attend

    m = make_mask(name, 70, seed=3, doc_lens=[10, 20, 15, 25], window=5, block=16)
    assert m.is_varlen() == (name in VARLEN)
    if name not in VARLEN:
        with pytest.raises(ValueError, match="varlen"):
            m.to_varlen()
        return
    vf = m.to_varlen()
    q, k, v = (torch.randn(70, 2, 8) for _ in range(3))
    kk = k if vf.k_index is None else k[torch.as_tensor(vf.k_index)]
    vv = v if vf.k_index is None else v[torch.as_tensor(vf.k_index)]
    out, _ = attend(q, kk, vv, torch.as_tensor(vf.cu_q), torch.as_tensor(vf.cu_k), vf.max_q, vf.max_k,
                    causal=vf.causal, backend="sdpa_ref")
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=torch.as_tensor(m.to_dense())).transpose(0, 1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_flops_from_area():
    m = make_mask("causal", 1024)
    assert m.area() == 1024 * 1025 // 2
    assert m.flops(64, 128) == 4 * m.area() * 64 * 128
    assert m.flops(64, 128, "bwd") == ATTN_BWD_MULT * m.flops(64, 128)
    assert m.flops(64, 128, "fwd_bwd") == (1 + ATTN_BWD_MULT) * m.flops(64, 128)
    assert make_mask("full", 10).sparsity() == 1.0


def test_generators_follow_the_benchmark():
    long = make_mask("causal_document_long", 100_000, seed=0)
    lens = np.array(long.params["doc_lens"])
    assert lens.sum() == 100_000 and lens[(lens >= 8192) & (lens < 30 * 1024)].sum() >= 0.55 * 100_000
    sw = make_mask("sliding_window", 5000)
    assert sw.params["window"] == 1024
    g = make_mask("global_sliding_window", 3000, seed=5)
    assert 1 <= g.params["global_width"] < 1000
    b = make_mask("block_causal_document", 10_000, seed=1)
    assert all(n % 1024 == 0 for n in b.params["doc_lens"][:-1])
    assert max(b.params["doc_lens"]) <= 8 * 1024
    f = make_mask("prefix_lm_document", 20_000, seed=1)
    assert 1 <= f.params["prefix"] < f.params["doc_lens"][0] or f.params["doc_lens"][0] == 1


def test_errors_say_what_is_valid():
    with pytest.raises(ValueError, match="unknown mask type 'causl'; choose one of: full, causal"):
        make_mask("causl", 10)
    with pytest.raises(ValueError, match="summing to total_len=10"):
        make_mask("causal_document", 10, doc_lens=[3, 3])
    with pytest.raises(ValueError, match="to_dense of a"):
        make_mask("causal", 1 << 15).to_dense()

"""Context-parallel attention against a single-process reference.

In-process (no process group, one rank): the all-gather attention on shuffled multi-document
layouts, its metadata, error messages, and that the check notices a wrong index map. Multi-process
(``@pytest.mark.multiproc``): ONE gloo launch per world size of ``python -m cadlib.cp.check``, which
loops over random layouts (documents split across ranks, 1-token documents, an empty-ish rank) and
over every mechanism x mask of the protocol; fp32, rel. error <= 1e-5, no NaN."""
import numpy as np
import pytest
import torch

from cadlib.cp import contiguous_layout, layout_rows, zigzag_layout
from cadlib.cp.allgather import build_meta, gathered_tokens, layout_attention, prepare, shared_docs
from cadlib.cp.check import random_layout, reference
from cadlib.plan import Layout

FP32_RTOL = 1e-5


def run_one_rank(layout, causal=True, seed=0, heads=(4, 2, 8)):
    hq, hkv, d = heads
    gen = torch.Generator().manual_seed(seed)
    full = [torch.randn(layout.total_tokens, h, d, generator=gen) for h in (hq, hkv, hkv, hq)]
    rows = torch.as_tensor(layout_rows(layout, 0))
    q, k, v, dout = (t.index_select(0, rows).clone() for t in full)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    o, lse = layout_attention(q, k, v, layout, None, causal=causal, return_lse=True)
    o.backward(dout)
    ref = reference(*full, layout.doc_lens, causal)
    got = (o.detach(), q.grad, k.grad, v.grad)
    errs = [float((g.double() - r.index_select(0, rows)).abs().max() / r.abs().max())
            for g, r in zip(got, ref)]
    return errs, lse


@pytest.mark.parametrize("causal", [True, False])
def test_one_rank_shuffled_chunks_match_reference(causal):
    layout = Layout([[(1, 30, 70), (0, 0, 50), (2, 0, 1), (1, 0, 30)]], [50, 70, 1])
    errs, lse = run_one_rank(layout, causal)
    assert max(errs) <= FP32_RTOL, errs
    assert lse.shape == (121, 4) and lse.dtype == torch.float32 and torch.isfinite(lse).all()
    assert prepare(layout, None, "cpu") is prepare(layout, None, "cpu")     # built once per layout


def test_meta_of_a_split_layout():
    layout = Layout([[(0, 0, 3), (1, 0, 2)], [(0, 3, 10)], []], [10, 2])
    assert shared_docs(layout).tolist() == [True, False]
    assert gathered_tokens(layout) == 10
    m0, m1, m2 = (build_meta(layout, r) for r in range(3))
    assert m0.pad == m1.pad == 7 and m0.send_index.tolist() == [0, 1, 2]
    # rank 1's chunk (0, 3, 10) reads the document's prefix [0, 10) from the gathered buffer
    assert m1.cu_q.tolist() == [0, 7] and m1.cu_k.tolist() == [0, 10]
    assert m1.kv_rows.tolist() == [7 + i for i in (0, 1, 2)] + [7 + 7 + i for i in range(7)]
    assert m2.n_local == 0 and m2.cu_q.tolist() == [0] and m2.active
    assert not build_meta(Layout([[(0, 0, 2)], [(1, 0, 1)]], [2, 1]), 0).active


def test_a_wrong_index_map_is_detected():
    layout = Layout([[(0, 5, 9), (0, 0, 5)]], [9])
    m = build_meta(layout, 0)
    m.kv_rows = m.kv_rows.copy()
    m.kv_rows[[5, 6]] = m.kv_rows[[6, 5]]         # query token 5 would see token 6
    layout.__dict__["_cp_allgather_meta"] = {(0, True): m}
    errs, _ = run_one_rank(layout)
    assert max(errs) > 1e-3, errs


def test_errors_before_any_collective():
    layout = Layout([[(0, 0, 4)]], [4])
    q = torch.zeros(4, 4, 8)
    with pytest.raises(ValueError, match="n_local=4"):
        layout_attention(q[:3], q[:3, :2], q[:3, :2], layout, None)
    with pytest.raises(ValueError, match="Hq a multiple of Hkv"):
        layout_attention(q, q[:, :3], q[:, :3], layout, None)
    with pytest.raises(ValueError, match="share one floating dtype"):
        layout_attention(q, q.double(), q.double(), layout, None)
    with pytest.raises(ValueError, match="layout has 2 ranks but the process group has 1"):
        layout_attention(q, q, q, Layout([[(0, 0, 2)], [(0, 2, 4)]], [4]), None)
    with pytest.raises(ValueError, match="must be a cadlib.plan.Layout"):
        layout_attention(q, q, q, [[(0, 0, 4)]], None)


def test_zigzag_and_contiguous_layouts_cover_every_token():
    for world in (1, 2, 3, 8):
        for lens in ([5], [1, 1, 1], [7, 1, 30, 2], [100]):
            for lay in (zigzag_layout(lens, world), contiguous_layout(lens, world)):
                rows = np.concatenate([layout_rows(lay, r) for r in range(world)])
                assert sorted(rows.tolist()) == list(range(sum(lens)))
                assert lay.tokens_per_rank().max() - lay.tokens_per_rank().min() <= 2
    z = zigzag_layout([16], 2)
    assert [tuple(c) for c in z.ranks[0]] == [(0, 0, 4), (0, 12, 16)]


def test_random_layouts_split_documents_and_leave_a_rank_nearly_empty():
    lay = random_layout(4, seed=0)
    assert shared_docs(lay).sum() >= 1 and 1 in lay.doc_lens
    assert lay.tokens_per_rank()[-1] == 1
    assert (random_layout(4, seed=1).tokens_per_rank() > 0).all()


# ------------------------------------------------------------------------------------ multi-process
def launch(world, args):
    launch_mod = pytest.importorskip("cadlib.launch")
    df = launch_mod.run_torchrun("cadlib.cp.check", world, args, timeout=300, pg_backend="gloo",
                                 echo=False, progress=False)
    assert len(df) == world
    cases = df.attrs["results"][0]["cases"]
    for c in cases:
        assert max(c["rel_err"].values()) <= FP32_RTOL and not c["nan"], c
    assert df["passed"].all()
    return cases


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4])
def test_layout_attention_matches_reference(world):
    cases = launch(world, ["--suite", "layout", "--seeds", "4"])
    assert len(cases) == 4 and all(c["shared_docs"] >= 1 for c in cases)

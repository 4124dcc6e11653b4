"""Context-parallel attention against a single-process reference.

In-process (no process group, one rank): the all-gather attention on shuffled multi-document
layouts, its metadata, error messages, and that the check notices a wrong index map. Multi-process
(``@pytest.mark.multiproc``): ONE gloo launch per world size of ``python -m cadlib.cp.check``, which
loops over random layouts (documents split across ranks, 1-token documents, an empty-ish rank) and
over every mechanism x mask of the protocol; fp32, rel. error <= 1e-5, no NaN."""
import numpy as np
import pytest
import ranks
import torch

from cadlib.core.layout import Layout, global_rows
from cadlib.core.precision import RTOL
from cadlib.cp import MECHANISMS, make
from cadlib.cp.allgather import build_meta, gathered_tokens, layout_attention, prepare, shared_docs
from cadlib.cp.check import PROTOCOL_MASKS
from cadlib.cp.loongtrain import build_double_ring_meta, default_window, window_sources
from cadlib.cp.protocol import contiguous_layout, zigzag_layout
from cadlib.cp.ring import build_ring_meta
from cadlib.cp.ulysses import kv_head_map
from cadlib.testing import random_cp_layout, reference_f64

FP32_RTOL = RTOL["fp32"]


def run_one_rank(layout, causal=True, seed=0, heads=(4, 2, 8)):
    hq, hkv, d = heads
    gen = torch.Generator().manual_seed(seed)
    full = [torch.randn(layout.total_tokens, h, d, generator=gen) for h in (hq, hkv, hkv, hq)]
    rows = torch.as_tensor(global_rows(layout, 0))
    q, k, v, dout = (t.index_select(0, rows).clone() for t in full)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    o, lse = layout_attention(q, k, v, layout, None, causal=causal, return_lse=True)
    o.backward(dout)
    ref = reference_f64(*full, layout.doc_lens, causal)
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
    assert [gathered_tokens(layout, r) for r in range(3)] == [7, 3, 10]
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
    with pytest.raises(ValueError, match="must be a cadlib.core.layout.Layout"):
        layout_attention(q, q, q, [[(0, 0, 4)]], None)


def test_zigzag_and_contiguous_layouts_cover_every_token():
    for world in (1, 2, 3, 8):
        for lens in ([5], [1, 1, 1], [7, 1, 30, 2], [100]):
            for lay in (zigzag_layout(lens, world), contiguous_layout(lens, world)):
                rows = np.concatenate([global_rows(lay, r) for r in range(world)])
                assert sorted(rows.tolist()) == list(range(sum(lens)))
                assert lay.tokens_per_rank().max() - lay.tokens_per_rank().min() <= 2
    z = zigzag_layout([16], 2)
    assert [tuple(c) for c in z.ranks[0]] == [(0, 0, 4), (0, 12, 16)]


def test_random_layouts_split_documents_and_leave_a_rank_nearly_empty():
    lay = random_cp_layout(4, seed=0)
    assert shared_docs(lay).sum() >= 1 and 1 in lay.doc_lens
    assert lay.tokens_per_rank()[-1] == 1
    assert (random_cp_layout(4, seed=1).tokens_per_rank() > 0).all()


def test_ring_steps_see_earlier_chunks_in_full_and_their_own_causally():
    lay = zigzag_layout([16], 2)                  # rank 0: [0, 4) and [12, 16); rank 1: [4, 8), [8, 12)
    m0 = build_ring_meta(lay, 0, causal=True)
    s0, s1 = m0.steps
    assert s0.causal and not s1.causal and s1.src == 1
    assert s0.cu_k.tolist() == [0, 4, 12]        # [0, 4) alone; [12, 16) after [0, 4) ...
    assert s1.q_rows.tolist() == list(range(4, 8)) and s1.cu_k.tolist() == [0, 8]   # ... and all of rank 1
    m1 = build_ring_meta(lay, 1, causal=True)
    assert m1.steps[1].cu_k.tolist() == [0, 4, 8]   # both of rank 1's chunks see rank 0's head only


def test_double_ring_steps_visit_every_block_once_own_first():
    """12 = 3 windows x 4: position (a, j) holds ((a - t) mod 3, (j - i) mod 4) at window step t, inner i."""
    for p in range(12):
        src = window_sources(p, 12, 4)
        assert src[0] == p and sorted(src) == list(range(12))
        a, j = divmod(p, 4)
        assert src[4 * 1 + 2] == ((a - 1) % 3) * 4 + (j - 2) % 4
        assert {s // 4 for s in src[4:8]} == {(a - 1) % 3}        # a window step stays in one window
    assert window_sources(3, 4, 4) == [3, 2, 1, 0] and window_sources(2, 4, 1) == [2, 1, 0, 3]   # rings
    assert default_window(12) == 2 and default_window(4) == 2 and default_window(3) == 3
    lay = zigzag_layout([40], 4)
    m = build_double_ring_meta(lay, 3, True, 2)
    assert [s.src for s in m.steps] == [3, 2, 1, 0] and m.steps[0].causal and not m.steps[1].causal
    assert (m.inner_next, m.inner_prev, m.outer_next, m.outer_prev) == (2, 2, 1, 1)
    with pytest.raises(ValueError, match="window_size must divide the 4 ring positions"):
        build_double_ring_meta(lay, 0, True, 3)
    with pytest.raises(ValueError, match="window_size must divide"):
        make("loongtrain", None, [4], window_size=2)


def test_ulysses_head_map_replicates_kv_heads():
    assert kv_head_map(8, 8, 4) is None
    assert kv_head_map(8, 2, 4) == [0, 0, 1, 1]
    assert kv_head_map(8, 1, 8) == [0] * 8
    with pytest.raises(ValueError, match="query heads"):
        kv_head_map(6, 2, 4)
    with pytest.raises(ValueError, match="multiple or a divisor"):
        kv_head_map(12, 3, 4)


@pytest.mark.parametrize("name", MECHANISMS)
def test_every_mechanism_on_one_rank(name):
    """World 1 (no process group): each mechanism is plain per-document attention."""
    doc_lens = [5, 1, 9]
    mech = make(name, None, doc_lens, causal=True, **({"min_shard": 2} if name == "cad" else {}))
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(15, h, 8, generator=gen) for h in (4, 2, 2, 4)]
    q, k, v = (mech.dispatch(t).clone().requires_grad_(True) for t in full[:3])
    out, lse = mech.apply_attn(q, k, v)
    out.backward(mech.dispatch(full[3]))
    ref = reference_f64(*full, doc_lens, True)
    for g, r in zip((out, q.grad, k.grad, v.grad), ref):
        assert float((mech.undispatch(g.detach()).double() - r).abs().max() / r.abs().max()) <= FP32_RTOL
    assert torch.isfinite(lse).all()


def test_protocol_errors():
    with pytest.raises(ValueError, match="unknown CP mechanism 'rings'; choose one of: allgather, ring"):
        make("rings", None, [4])
    with pytest.raises(ValueError, match="CAD serves causal masks only"):
        make("cad", None, [4], causal=False)
    with pytest.raises(ValueError, match="ulysses_size must divide"):
        make("usp", None, [4], ulysses_size=3)
    mech = make("ring", None, [4, 4])
    with pytest.raises(ValueError, match="n_local=8"):
        mech.apply_attn(*(torch.zeros(3, 2, 4) for _ in range(3)))
    with pytest.raises(ValueError, match="T=8 rows"):
        mech.dispatch(torch.zeros(3))


# ------------------------------------------------------------------------------------ multi-process
def launch(world, args):
    df = ranks.run("cadlib.cp.check", world, args)
    assert len(df) == world
    cases = df.attrs["results"][0]["cases"]
    for c in (c for c in cases if "skipped" not in c):
        if c["suite"] == "volume":
            assert c["max_diff"] == 0, c
        else:
            assert max(c["rel_err"].values()) <= FP32_RTOL and not c["nan"], c
    assert df["passed"].all()
    return cases


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4, 8])
def test_cp_mechanisms_match_reference(world):
    """One launch per world size: random layouts for layout_attention, then every mechanism x mask, then
    the bytes every mechanism sends per rank against its closed form (cadlib.cp.volume)."""
    cases = launch(world, ["--suite", "layout,protocol,volume", "--seeds", "4"])
    layout = [c for c in cases if c["suite"] == "layout"]
    assert len(layout) == 4 and all(c["shared_docs"] >= 1 for c in layout)
    proto = [c for c in cases if c["suite"] == "protocol"]
    ran = {(c["mechanism"], c["mask"]) for c in proto if "skipped" not in c}
    want = {(m, k) for m in MECHANISMS for k in PROTOCOL_MASKS}
    assert ran == want - {("cad", "full"), ("cad", "full_document")}
    assert all(c["undispatch_ok"] for c in proto if "skipped" not in c)
    assert any(0 in c["tokens_per_rank"] for c in proto if "skipped" not in c) or world == 2
    assert any(c["min_doc"] < world for c in proto)
    vol = [c for c in cases if c["suite"] == "volume" and "skipped" not in c]
    assert {(c["mechanism"], c["mask"]) for c in vol} == want - {("cad", "full"), ("cad", "full_document")}
    for c in vol:                      # counted == per-rank closed form (and the equal-shard one) on every rank
        assert c["max_diff"] == 0 and (c["max_sent"] > 0 or c["mask"].endswith("document") or c["mechanism"] == "cad")
        assert (c["equal_shard"] is not None) == (c["mask"] in ("full", "causal") and c["mechanism"] != "cad")
    loong = next(c for c in proto if c["mechanism"] == "loongtrain")
    if world >= 4:                     # inner and outer rings both carry blocks (world 8: Ulysses too)
        positions = world // loong["ulysses_size"]
        assert 1 < loong["window"] < positions and loong["ulysses_size"] == (2 if world == 8 else 1)


def test_errors_of_an_exactly_zero_reference_stay_finite(tmp_path):
    """A one-token document has dq = dk = 0 exactly; bf16 rounding on a GPU gives ~5e-7 there. The
    check's relative error must compare that with the other gradients' scale, not divide by zero
    (it reported 5e23 on 2 H200s before)."""
    import torch.distributed as dist

    from cadlib.cp.check import ZERO_REF_FLOOR, _errors

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        rows = torch.arange(1)
        ref = [torch.full((1, 2, 4), 0.5, dtype=torch.float64), torch.zeros(1, 2, 4, dtype=torch.float64),
               torch.zeros(1, 1, 4, dtype=torch.float64), torch.full((1, 1, 4), 2.0, dtype=torch.float64)]
        got = [ref[0].float(), torch.full((1, 2, 4), 5e-7), torch.full((1, 1, 4), -5e-7), ref[3].float()]
        rel = _errors(got, ref, rows, None, torch.device("cpu"))["rel_err"]
        assert rel["dq"] == pytest.approx(5e-7 / (2.0 * ZERO_REF_FLOOR)) and rel["dq"] < 1e-3
        assert rel["o"] == 0 and rel["dv"] == 0
        got[1] = torch.full((1, 2, 4), 0.1)          # a real error on a zero reference still fails
        assert _errors(got, ref, rows, None, torch.device("cpu"))["rel_err"]["dq"] > 1
    finally:
        dist.destroy_process_group()


def test_allgather_metadata_is_freed_without_a_garbage_collection():
    """The device copy refers to the host metadata, not the other way round: dropping the layout frees
    both at once (a reference cycle kept every finished step's metadata until a full gc pass)."""
    import gc
    import weakref

    layout = Layout([[(0, 0, 3), (1, 0, 2)]], [3, 2])
    dm = prepare(layout, None, "cpu")
    assert prepare(layout, None, "cpu") is dm                  # cached on the layout, per device
    ref = weakref.ref(dm.meta)
    gc.disable()
    try:
        del layout, dm
        assert ref() is None
    finally:
        gc.enable()

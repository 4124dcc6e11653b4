"""The Llama-style decoder: document isolation, the split-layer loop, chunked cross-entropy, MLP
recompute, RoPE, and the layout helpers (CPU, fp32, tiny sizes)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cadlib.core.cost import as_model
from cadlib.core.layout import Chunk, Layout
from cadlib.runtime.batches import document_attention, positions, synthetic_tokens
from cadlib.runtime.kernels import attend
from cadlib.runtime.blocks import RMSNormFn, SwiGLUFn, apply_rope
from cadlib.runtime.model import IGNORE_INDEX, ChunkedCrossEntropy, Decoder

DOCS = [5, 9, 3, 7]


def _batch(model, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, model.spec.vocab, (sum(lens),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens])
    return toks, pos


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_documents_are_isolated():
    model = Decoder("tiny", n_layers=2)
    toks, pos = _batch(model, DOCS)
    with torch.no_grad():
        packed = model(toks, pos, document_attention(DOCS))
        alone = [model(t, torch.arange(len(t)), document_attention([len(t)])) for t in toks.split(DOCS)]
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-5, atol=1e-5)


def test_reference_attention_matches_the_kernel_reference():
    model = Decoder("tiny")
    toks, pos = _batch(model, DOCS)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(DOCS)]), dtype=torch.int32)

    def kernel_attn(q, k, v, i):
        return attend(q, k, v, cu, cu, max(DOCS), max(DOCS), causal=True, backend="sdpa_ref")[0]

    with torch.no_grad():
        torch.testing.assert_close(model(toks, pos, kernel_attn), model(toks, pos, document_attention(DOCS)),
                                   rtol=1e-5, atol=1e-5)


def test_split_layer_loop_equals_forward():
    model = Decoder("tiny", n_layers=3, seed=3)
    toks, pos = _batch(model, DOCS)
    attn = document_attention(DOCS)
    calls = []

    def counting(q, k, v, i):
        calls.append(i)
        return attn(q, k, v, i)

    with torch.no_grad():
        ref = model(toks, pos, counting)
        x = model.embed(toks)
        cos, sin = model.rope(pos)
        for i, layer in enumerate(model.layers):
            q, k, v = layer.pre_attention(x, cos, sin)
            x = layer.post_attention(x, attn(q, k, v, i))
        torch.testing.assert_close(model.norm(x), ref, rtol=0, atol=0)
    assert calls == [0, 1, 2]


@pytest.mark.parametrize("chunk", [1, 3, 7, 16, 24, 100])
def test_chunked_cross_entropy_matches_full_logits(chunk):
    torch.manual_seed(0)
    n, hdim, vocab = 24, 16, 37
    h = torch.randn(n, hdim, requires_grad=True)
    w = (0.3 * torch.randn(vocab, hdim)).requires_grad_()
    t = torch.randint(0, vocab, (n,))
    t[[0, 5, 6, 23]] = IGNORE_INDEX
    ref = F.cross_entropy(h @ w.t(), t, reduction="sum", ignore_index=IGNORE_INDEX)
    gh, gw = torch.autograd.grad(ref * 1.7, (h, w))
    got = ChunkedCrossEntropy.apply(h, w, t, chunk)
    assert got.dtype == torch.float32 and got.dim() == 0
    dh, dw = torch.autograd.grad(got * 1.7, (h, w))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dh, gh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dw, gw, rtol=1e-5, atol=1e-6)


def test_model_loss_counts_valid_targets_and_matches_reference():
    model = Decoder("tiny")
    toks, pos = _batch(model, DOCS)
    tgt = toks.roll(-1).clone()
    tgt[np.cumsum(DOCS) - 1] = IGNORE_INDEX
    hidden = model(toks, pos, document_attention(DOCS))
    loss, n_valid = model.loss(hidden, tgt, chunk_tokens=5)
    assert n_valid == sum(DOCS) - len(DOCS)
    ref = F.cross_entropy(model.lm_head(hidden), tgt, reduction="sum")
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)


def test_loss_saves_no_token_by_vocab_tensor():
    """What the forward keeps for backward: hidden, the weight, targets, the per-token lse."""
    n, hdim, vocab = 64, 8, 500
    h = torch.randn(n, hdim, requires_grad=True)
    w = torch.randn(vocab, hdim, requires_grad=True)
    t = torch.randint(0, vocab, (n,))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(tuple(x.shape)) or x, lambda x: x):
        ChunkedCrossEntropy.apply(h, w, t, 16)
    assert sorted(saved) == sorted([(n, hdim), (vocab, hdim), (n,), (n,)])


def test_mlp_recompute_gives_identical_loss_and_gradients():
    out = []
    for recompute in (False, True):
        model = Decoder("tiny", n_layers=2, mlp_recompute=recompute)
        toks, pos = _batch(model, DOCS)
        hidden = model(toks, pos, document_attention(DOCS))
        loss, _ = model.loss(hidden, toks.roll(-1), chunk_tokens=8)
        loss.backward()
        out.append((loss.detach(), _grads(model)))
    torch.testing.assert_close(out[0][0], out[1][0], rtol=0, atol=0)
    for name, g in out[0][1].items():
        torch.testing.assert_close(out[1][1][name], g, rtol=0, atol=0, msg=name)


def test_gqa_shapes_and_sizes():
    spec = as_model("tiny", n_heads=4, n_kv_heads=1, head_dim=8)
    model = Decoder(spec, n_layers=1)
    x = torch.randn(6, spec.hidden)
    cos, sin = model.rope(torch.arange(6))
    q, k, v = model.layers[0].pre_attention(x, cos, sin)
    assert q.shape == (6, 4, 8) and k.shape == (6, 1, 8) and v.shape == (6, 1, 8)
    assert model.layers[0].post_attention(x, q).shape == x.shape
    assert model.lm_head.weight.shape == model.embed.weight.shape == (spec.vocab, spec.hidden)
    per_layer = spec.linear_params_per_layer() + 2 * spec.hidden
    assert model.parameter_count() == per_layer + 2 * spec.vocab * spec.hidden + spec.hidden


def test_rope_depends_on_relative_position_only():
    model = Decoder("tiny", n_layers=1, rope_theta=10000.0)
    d = model.spec.head_dim
    q, k = torch.randn(1, 1, d, dtype=torch.float64), torch.randn(1, 1, d, dtype=torch.float64)

    def score(m, n):
        cq, sq = (t.double() for t in model.rope(torch.tensor([m])))
        ck, sk = (t.double() for t in model.rope(torch.tensor([n])))
        return float((apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum())

    for m, n in [(5, 2), (17, 0), (3, 3)]:
        for shift in (1, 40, 1000):
            assert score(m, n) == pytest.approx(score(m + shift, n + shift), rel=1e-4, abs=1e-4)
    assert score(5, 2) != pytest.approx(score(5, 3), rel=1e-3)
    cos, sin = model.rope(torch.tensor([0]))
    assert torch.all(cos == 1) and torch.all(sin == 0)


def test_weights_are_deterministic_in_seed():
    a, b, c = Decoder("tiny", seed=1), Decoder("tiny", seed=1), Decoder("tiny", seed=2)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if pa.dim() > 1:
            assert not torch.equal(pa, pc), name
            assert 0.015 < float(pa.detach().std()) < 0.025, name
    deeper = Decoder("tiny", n_layers=3, seed=1)
    assert torch.equal(deeper.layers[1].wq.weight, a.layers[1].wq.weight)


SPLIT = Layout(ranks=[[Chunk(0, 0, 6), Chunk(2, 4, 9), Chunk(1, 0, 2)],
                      [Chunk(0, 6, 11), Chunk(2, 0, 4), Chunk(1, 2, 3), Chunk(3, 0, 4)]],
               doc_lens=[11, 3, 9, 4])
WHOLE = Layout(ranks=[[Chunk(d, 0, n) for d, n in enumerate(SPLIT.doc_lens)]], doc_lens=SPLIT.doc_lens)


def _by_doc_position(layout, vocab, seed):
    """``{(doc, position): (token, target)}`` over all ranks."""
    out = {}
    for r in range(layout.n_ranks):
        pos = positions(layout, r)
        toks, tgts = synthetic_tokens(layout, r, vocab, seed)
        docs = np.repeat([c.doc for c in layout.ranks[r]], [c.length for c in layout.ranks[r]])
        assert len(pos) == len(toks) == len(tgts) == len(docs) == layout.tokens_per_rank()[r]
        for d, p, t, y in zip(docs, pos.tolist(), toks.tolist(), tgts.tolist()):
            assert (d, p) not in out
            out[(int(d), p)] = (t, y)
    return out


def test_positions_restart_per_document():
    assert positions(SPLIT, 0).tolist() == [0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 8, 0, 1]
    assert positions(SPLIT, 1).tolist() == [6, 7, 8, 9, 10, 0, 1, 2, 3, 2, 0, 1, 2, 3]
    assert positions(WHOLE, 0).tolist() == [p for n in SPLIT.doc_lens for p in range(n)]


def test_synthetic_tokens_are_the_same_global_tokens_for_any_split():
    split, whole = _by_doc_position(SPLIT, 50, seed=7), _by_doc_position(WHOLE, 50, seed=7)
    assert split == whole
    toks, tgts = synthetic_tokens(WHOLE, 0, 50, seed=7)
    ends = np.cumsum(SPLIT.doc_lens) - 1
    assert (tgts[ends] == IGNORE_INDEX).all()
    keep = np.setdiff1d(np.arange(len(toks)), ends)
    assert torch.equal(tgts[keep], toks[keep + 1])
    assert int(toks.min()) >= 0 and int(toks.max()) < 50
    again, _ = synthetic_tokens(WHOLE, 0, 50, seed=7)
    other, _ = synthetic_tokens(WHOLE, 0, 50, seed=8)
    assert torch.equal(toks, again) and not torch.equal(toks, other)


def test_split_layout_forward_matches_whole_documents():
    """The training-loop path: per-rank tokens and positions reassembled into whole documents give
    the same per-token loss as the single-rank layout."""
    model = Decoder("tiny")
    toks, tgts = synthetic_tokens(WHOLE, 0, model.spec.vocab, seed=1)
    hidden = model(toks, positions(WHOLE, 0), document_attention(WHOLE.doc_lens))
    ref, n_ref = model.loss(hidden, tgts)
    total, n_total = 0.0, 0
    for r in range(SPLIT.n_ranks):
        t, y = synthetic_tokens(SPLIT, r, model.spec.vocab, seed=1)
        h = hidden[_global_index(SPLIT, WHOLE, r)]
        loss, n = model.loss(h, y, chunk_tokens=3)
        assert torch.equal(t, toks[_global_index(SPLIT, WHOLE, r)])
        total, n_total = total + loss, n_total + n
    assert n_total == n_ref
    torch.testing.assert_close(total, ref, rtol=1e-5, atol=1e-5)


def _global_index(layout, whole, rank):
    offs = np.concatenate([[0], np.cumsum(whole.doc_lens)])
    return torch.tensor(np.concatenate([np.arange(c.start, c.end) + offs[c.doc] for c in layout.ranks[rank]]))


def test_bad_input_raises_value_error():
    with pytest.raises(ValueError, match="n_layers"):
        Decoder("tiny", n_layers=0)
    with pytest.raises(ValueError, match="unknown model"):
        Decoder("tinyy")
    model = Decoder("tiny")
    with pytest.raises(ValueError, match="targets"):
        model.loss(torch.zeros(3, model.spec.hidden), torch.tensor([0, 1, model.spec.vocab]))
    with pytest.raises(ValueError, match="chunk_tokens"):
        model.loss(torch.zeros(3, model.spec.hidden), torch.tensor([0, 1, 2]), chunk_tokens=0)
    with pytest.raises(ValueError, match="rank"):
        positions(SPLIT, 2)


def test_bf16_runs_and_stays_close_to_fp32():
    losses = []
    for dtype in (torch.float32, torch.bfloat16):
        model = Decoder("tiny", dtype=dtype)
        toks, tgts = synthetic_tokens(WHOLE, 0, model.spec.vocab, seed=0)
        hidden = model(toks, positions(WHOLE, 0), document_attention(WHOLE.doc_lens))
        assert hidden.dtype == dtype
        loss, n = model.loss(hidden, tgts, chunk_tokens=8)
        loss.backward()
        assert loss.dtype == torch.float32 and model.lm_head.weight.grad.dtype == dtype
        losses.append(loss.item() / n)
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)
    assert losses[0] == pytest.approx(np.log(256), rel=0.05)   # near-uniform predictions at init


def _saved_bytes(model, n):
    """Bytes of the distinct non-parameter storages autograd keeps after a forward + loss."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    toks = torch.randint(0, model.spec.vocab, (n,))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hidden = model(toks, torch.arange(n), lambda q, k, v, i: q + 0)   # attention that saves nothing
        model.loss(hidden, toks, chunk_tokens=16)
    return sum(seen.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_bytes_per_layer_match_the_formula(dtype):
    """Per token and layer, autograd keeps exactly what ``saved_bytes_per_token`` says (measured as
    the difference between a 3-layer and a 2-layer model, so the shared embedding, RoPE tables, final
    norm and LM head cancel)."""
    n = 40
    spec = as_model("tiny", vocab=64)
    two, three = Decoder(spec, 2, dtype=dtype), Decoder(spec, 3, dtype=dtype)
    per_layer = _saved_bytes(three, n) - _saved_bytes(two, n)
    assert per_layer == n * three.saved_bytes_per_token()
    assert three.saved_bytes_per_token() < as_model("tiny").activation_bytes_per_token("fp32")


def test_custom_norm_and_swiglu_gradients():
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: RMSNormFn.apply(x, w, 1e-5), (x, w))
    a = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(SwiGLUFn.apply, (a, b))
    torch.testing.assert_close(SwiGLUFn.apply(a, b), F.silu(a) * b)


def test_a_rank_without_tokens_gets_empty_tensors():
    layout = Layout(ranks=[[Chunk(0, 0, 4)], []], doc_lens=[4])
    assert positions(layout, 1).shape == (0,)
    toks, tgts = synthetic_tokens(layout, 1, 10, seed=0)
    assert toks.shape == tgts.shape == (0,) and toks.dtype == tgts.dtype == torch.int64

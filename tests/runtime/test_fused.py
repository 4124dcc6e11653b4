"""The fused blocks (``cadlib.runtime.fused``, ``fused_head``) against their plain references
(``cadlib.runtime.blocks``): outputs and gradients, fp32 and bf16, on the CPU in Triton's interpreter
(``tests/conftest.py`` turns it on without CUDA) and, marked ``gpu``, compiled on CUDA.

In fp32 the fused and the reference path agree to rounding. In bf16 both round, differently, so each
is compared with the same block in float64: the fused error may be at most twice the reference's (or
``BF16_FLOOR``, two bf16 ulps of the result's largest magnitude, where the reference happens to be
nearly exact)."""
import pytest
import torch
import torch.nn.functional as F

from cadlib.core.cost import as_model
from cadlib.runtime import blocks, fused
from cadlib.runtime.batches import document_attention
from cadlib.runtime.model import IGNORE_INDEX, Decoder

if not fused.HAVE_TRITON:
    pytest.skip("triton is not importable: the fused kernels' tests need it (pip install triton; without "
                "CUDA they run in Triton's interpreter)", allow_module_level=True)

DEVICES = [pytest.param("cpu", id="cpu-interpreter"), pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.float32, torch.bfloat16]
FP32_TOL = 2e-5
BF16_FLOOR = 2 ** -6


def _device(device: str) -> torch.device:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if device == "cpu" and not fused.INTERPRET:
        pytest.skip("the CPU runs Triton kernels only with TRITON_INTERPRET=1 (set by tests/conftest.py "
                    "when there is no CUDA)")
    return torch.device(device)


def _err(got, truth) -> float:
    """Largest absolute error relative to the truth's largest magnitude, or absolute where the truth is
    (mathematically) zero: the input gradient of RMSNorm over one feature is 0 up to rounding, and two
    roundings of 0 differ relatively by anything (seen on the H200: fp32, 3 rows of width 1)."""
    got, truth = got.detach(), truth.detach().double()
    return float((got.double() - truth).abs().max() / truth.abs().max().clamp_min(1e-6))


def _check(fn, inputs, grads_of, dtype):
    """``fn(*inputs, blocks)``'s outputs and the gradients of ``grads_of`` (indices into ``inputs``), fused
    against the reference: in fp32 directly, in bf16 both against float64."""
    def run(xs, blocks_):
        xs = [x.detach().clone().requires_grad_(i in grads_of) for i, x in enumerate(xs)]
        out = fn(*xs, blocks_)
        outs = out if isinstance(out, tuple) else (out,)
        gen = torch.Generator().manual_seed(5)
        douts = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o) for o in outs]
        grads = torch.autograd.grad(outs, [xs[i] for i in grads_of], douts)
        return [*outs, *grads]

    got = run(inputs, "fused")
    ref = run(inputs, "reference")
    if dtype == torch.float32:
        for i, (g, r) in enumerate(zip(got, ref)):
            assert _err(g, r) <= FP32_TOL, f"tensor {i}: {_err(g, r):.2e}"
        return
    truth = run([x.double() if x.is_floating_point() else x for x in inputs], "reference")
    for i, (g, r, t) in enumerate(zip(got, ref, truth)):
        assert g.dtype == r.dtype
        ef, er = _err(g, t), _err(r, t)
        assert ef <= max(2 * er, BF16_FLOOR), f"tensor {i}: fused {ef:.2e}, reference {er:.2e}"


def _randn(*shape, device, dtype, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(device, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(9, 64), (5, 48), (3, 1)])
def test_rms_norm(device, dtype, rows, width):
    dev = _device(device)
    x = _randn(rows, width, device=dev, dtype=dtype, scale=3.0)
    w = 1 + _randn(width, device=dev, dtype=dtype, scale=0.2, seed=1)
    _check(lambda x, w, b: blocks.rms_norm(x, w, 1e-5, b), [x, w], (0, 1), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_backward_in_runs_of_rows(device, monkeypatch):
    """Programs of the backward take a run of rows each (the last one shorter), summing ``dw`` over it."""
    dev = _device(device)
    monkeypatch.setattr(fused, "NORM_BWD_PROGRAMS", 3)
    x = _randn(11, 32, device=dev, dtype=torch.float32, scale=2.0)
    w = 1 + _randn(32, device=dev, dtype=torch.float32, scale=0.2, seed=1)
    _check(lambda x, w, b: blocks.rms_norm(x, w, 1e-5, b), [x, w], (0, 1), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 2, 8), (3, 1, 16), (2, 2, 4)])
def test_qkv_with_rope(device, dtype, heads):
    dev = _device(device)
    hq, hk, d = heads
    n, hidden = 7, 24
    h = _randn(n, hidden, device=dev, dtype=dtype)
    wq, wk, wv = (_randn(o, hidden, device=dev, dtype=dtype, scale=0.3, seed=s)
                  for s, o in enumerate((hq * d, hk * d, hk * d), 1))
    ang = torch.rand(n, d // 2, generator=torch.Generator().manual_seed(9)) * 50
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos().to(dev, dtype), ang.sin().to(dev, dtype)

    def fn(h, wq, wk, wv, b):
        return blocks.qkv_rope(h, wq, wk, wv, cos, sin, hq, hk, b)
    _check(fn, [h, wq, wk, wv], (0, 1, 2, 3), dtype)
    q, k, v = blocks.qkv_rope(h, wq, wk, wv, cos, sin, hq, hk, "fused")
    assert q.shape == (n, hq, d) and k.shape == v.shape == (n, hk, d)
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_mlp_and_swiglu_alone(device, dtype):
    dev = _device(device)
    n, hidden, ffn = 6, 16, 40
    h = _randn(n, hidden, device=dev, dtype=dtype, scale=2.0)
    w1, w3 = (_randn(ffn, hidden, device=dev, dtype=dtype, scale=0.4, seed=s) for s in (1, 2))
    w2 = _randn(hidden, ffn, device=dev, dtype=dtype, scale=0.3, seed=3)
    _check(blocks.swiglu_mlp, [h, w1, w3, w2], (0, 1, 2, 3), dtype)
    a = _randn(n, ffn, device=dev, dtype=dtype, scale=3.0, seed=4)
    b = _randn(n, ffn, device=dev, dtype=dtype, seed=5)

    def alone(a, b, blocks_):
        return (fused.SwiGLUFn if blocks_ == "fused" else blocks.SwiGLUFn).apply(a, b)
    _check(alone, [a, b], (0, 1), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk", [1, 4, 16])
def test_linear_cross_entropy(device, dtype, chunk):
    dev = _device(device)
    n, hidden, vocab = 11, 16, 300                  # vocab > CE_BLOCK is checked on the GPU below
    h = _randn(n, hidden, device=dev, dtype=dtype)
    w = _randn(vocab, hidden, device=dev, dtype=dtype, scale=0.5, seed=1)
    t = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(2)).to(dev)
    t[[0, 4]] = IGNORE_INDEX

    def fn(h, w, b):
        return blocks.ChunkedCrossEntropy.apply(h, w, t, chunk, b) * 0.37
    _check(fn, [h, w], (0, 1), dtype)
    ref = F.cross_entropy(h.double() @ w.double().t(), t, reduction="sum", ignore_index=IGNORE_INDEX)
    with torch.no_grad():                            # no gradient wanted: the loss alone
        loss = blocks.ChunkedCrossEntropy.apply(h.requires_grad_(), w, t, chunk, "fused")
    assert loss.dtype == torch.float32 and not loss.requires_grad
    assert float(loss) == pytest.approx(float(ref), rel=1e-5 if dtype == torch.float32 else 1e-2)
    dh, = torch.autograd.grad(blocks.ChunkedCrossEntropy.apply(h, w, t, chunk, "fused"), (h,))
    assert dh.shape == h.shape                       # a frozen weight: only dh


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recompute", ["none", "mlp"])
def test_decoder_fused_equals_reference(device, recompute):
    """A whole tiny model in fp32: the same loss and every parameter gradient (the CPU trains with the
    references, so this is what keeps CPU and GPU runs of the same step comparable)."""
    dev = _device(device)
    docs = [5, 9, 3]
    out = {}
    for b in ("reference", "fused"):
        model = Decoder("tiny", n_layers=2, recompute=recompute, blocks=b, device=dev, seed=4)
        g = torch.Generator().manual_seed(0)
        toks = torch.randint(0, model.spec.vocab, (sum(docs),), generator=g).to(dev)
        pos = torch.cat([torch.arange(n) for n in docs]).to(dev)
        hidden = model(toks, pos, document_attention(docs))
        loss, _ = model.loss(hidden, toks.roll(-1), chunk_tokens=8)
        loss.backward()
        out[b] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(out["fused"][0], out["reference"][0], rtol=1e-5, atol=1e-5)
    for name, g in out["reference"][1].items():
        torch.testing.assert_close(out["fused"][1][name], g, rtol=1e-4, atol=1e-5, msg=name)


def _saved_bytes(model, n, dev):
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t
    toks = torch.randint(0, model.spec.vocab, (n,)).to(dev)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.run_layers(model.embed(toks), *model.rope(torch.arange(n).to(dev)), lambda q, k, v, i: q + 0)
    return sum(seen.values())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recompute", ["none", "mlp"])
def test_fused_layers_save_what_the_formula_says(device, recompute):
    """Per token and layer the fused blocks keep exactly ``saved_bytes_per_token`` (the references' count,
    which the memory model uses): the norm's output is shared by the three projections, and no
    concatenated weight or fp32 activation is kept."""
    dev = _device(device)
    spec = as_model("tiny", vocab=64)
    n = 24
    two, three = (Decoder(spec, k, dtype=torch.bfloat16, recompute=recompute, blocks="fused", device=dev)
                  for k in (2, 3))
    assert _saved_bytes(three, n, dev) - _saved_bytes(two, n, dev) == n * three.saved_bytes_per_token()


def test_blocks_choice_and_its_errors():
    x = torch.zeros(2, 4)
    assert not fused.use_fused("auto", x) and not fused.use_fused("reference", x)
    with pytest.raises(ValueError, match="unknown blocks 'fast'; choose one of: auto, fused, reference"):
        fused.use_fused("fast", x)
    with pytest.raises(ValueError, match="blocks='fused' needs triton"):
        fused.use_fused("fused", x.double())
    with pytest.raises(ValueError, match="unknown blocks"):
        Decoder("tiny", n_layers=1, blocks="triton")
    with pytest.raises(ValueError, match="unknown recompute 'full'"):
        Decoder("tiny", n_layers=1, recompute="full")
    with pytest.raises(ValueError, match="contradicts"):
        Decoder("tiny", n_layers=1, recompute="none", mlp_recompute=True)
    assert Decoder("tiny", n_layers=1, mlp_recompute=True).recompute == "mlp"


@pytest.mark.gpu
def test_gpu_offsets_past_two_to_the_31_and_a_real_vocabulary():
    """The row offsets of [256K tokens, ffn]-sized tensors pass 2^31 elements; a vocabulary of several
    loop steps of the cross-entropy kernel."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev, dt = torch.device("cuda"), torch.bfloat16
    n, width = (1 << 31) // 4096 + 4, 4096                    # even: viewed as rows of 8192 below
    x = torch.randn(n, width, device=dev, dtype=dt, requires_grad=True)
    w = torch.ones(width, device=dev, dtype=dt)
    y = blocks.rms_norm(x, w, 1e-5, "fused")
    tail = x[-3:].detach().requires_grad_()
    y_ref = blocks.rms_norm(tail, w, 1e-5, "reference")
    torch.testing.assert_close(y[-3:], y_ref)
    dy = torch.randn_like(y)
    dx, = torch.autograd.grad(y, x, dy)
    torch.testing.assert_close(dx[-3:], torch.autograd.grad(y_ref, tail, dy[-3:])[0])
    del dx, dy
    x = x.detach()
    a, b = x.view(-1, 8192), torch.ones(n // 2, 8192, device=dev, dtype=dt)
    torch.testing.assert_close(fused.SwiGLUFn.apply(a[: n // 2], b)[-2:], F.silu(a[n // 2 - 2: n // 2]))
    del x, y, a, b
    torch.cuda.empty_cache()
    h = torch.randn(300, 512, device=dev, dtype=dt, requires_grad=True)
    wl = (0.05 * torch.randn(16032, 512, device=dev, dtype=dt)).requires_grad_()
    t = torch.randint(0, 16032, (300,), device=dev)
    _check(lambda h, w, b: blocks.ChunkedCrossEntropy.apply(h, w, t, 128, b), [h, wl], (0, 1), dt)

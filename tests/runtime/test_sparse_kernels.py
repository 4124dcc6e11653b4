"""Block-sparse kernels (cadlib.runtime.kernels.sparse) against the dense masked reference.

CPU (CI): the tile classification against a brute-force one, the reference against per-head SDPA with
the dense mask, and FlexAttention's forward (it has no CPU backward) at small sizes, fp32 to 1e-5. GPU
(marked ``gpu``): FlexAttention and FA4 forward and backward in bf16 against the fp32 reference."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cadlib.data.sparse import dense_reference, uniform_block_sparse, variable_block_sparse
from cadlib.runtime.kernels import sparse

FP32_TOL = 1e-5
BF16_TOL = 2e-2


def inputs(T, hq, hkv, d, seed=0, device="cpu", dtype=torch.float32, grad=False):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(T, h, d, generator=g).to(device=device, dtype=dtype) for h in (hq, hkv, hkv, hq)]
    for t in out[:3]:
        t.requires_grad_(grad)
    return out


def rel(a, b):
    return float((a.detach().float() - b.detach().float()).abs().max() / b.detach().float().abs().max())


def brute_status(m, h, tile):
    dense = dense_reference(m, h)
    n = -(-m.total // tile)
    out = np.zeros((n, n), dtype=np.uint8)
    for i in range(n):
        for j in range(n):
            blk = dense[i * tile:(i + 1) * tile, j * tile:(j + 1) * tile]
            out[i, j] = 2 if blk.all() else int(blk.any())
    return out


@pytest.mark.parametrize("mask", [
    uniform_block_sparse(512, 64, 0.5, heads=2, seed=1),
    variable_block_sparse(1024, 256, 0.3, heads=2, seed=2),                 # blocks >= 128: <= 2 per tile
    variable_block_sparse(1000, 50, 0.5, heads=1, min_block=20, seed=3)])   # many blocks per tile, ragged end
def test_tile_status_matches_a_brute_force(mask):
    tile = sparse.flex_tile(mask)
    got = sparse.tile_status(mask, tile).numpy()
    for h in range(mask.heads):
        assert (got[h] == brute_status(mask, h, tile)).all()


def test_reference_equals_per_head_sdpa_with_the_dense_mask():
    m = variable_block_sparse(512, 128, 0.4, heads=2, seed=4)
    q, k, v, _ = inputs(512, 4, 2, 16)
    out, lse = sparse.reference_attention(q, k, v, m)
    dense = sparse.dense_mask(m, 4)
    assert (dense[1] == torch.as_tensor(dense_reference(m, 0))).all() and (dense[3] == dense[2]).all()
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1),
                                         v.repeat_interleave(2, 1).transpose(0, 1), attn_mask=dense)
    assert rel(out, ref.transpose(0, 1)) <= FP32_TOL and lse.shape == (512, 4)


@pytest.mark.parametrize("heads", [(4, 2, 2), (4, 4, 4)])                  # GQA (masks per KV head), MHA
@pytest.mark.parametrize("make", [lambda h: uniform_block_sparse(256, 64, 0.5, heads=h, seed=5),
                                  lambda h: variable_block_sparse(512, 128, 0.6, heads=h, seed=6)])
def test_flex_forward_on_the_cpu_matches_the_reference(heads, make):
    hq, hkv, mh = heads
    m = make(mh)
    q, k, v, _ = inputs(m.total, hq, hkv, 16, seed=7)
    got = sparse.setup("flex", m, q, k, v)()
    ref, _ = sparse.reference_attention(q, k, v, m)
    assert rel(got, ref) <= FP32_TOL


def test_unsupported_and_bad_input_say_why():
    m = variable_block_sparse(512, 128, 0.5, seed=0)
    q, k, v, _ = inputs(512, 2, 1, 16)
    with pytest.raises(sparse.SparseUnsupported, match="FA4 needs CUDA"):
        sparse.setup("fa4", m, q, k, v)
    with pytest.raises(sparse.SparseUnsupported, match="variable blocks"):
        sparse.fa4_block_sparse_tensors(m, 2, "cpu")
    with pytest.raises(ValueError, match="unknown sparse kernel 'flash'"):
        sparse.setup("flash", m, q, k, v)
    with pytest.raises(ValueError, match=r"T=512"):
        sparse.setup("flex", m, q[:10], k, v)
    with pytest.raises(ValueError, match="multiple of the mask's heads"):
        sparse.setup("flex", uniform_block_sparse(512, 64, 0.5, heads=2), q[:, :1], k, v)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,make", [
    ("flex", lambda: uniform_block_sparse(1024, 128, 0.5, heads=2, seed=8)),
    ("flex", lambda: uniform_block_sparse(1024, 64, 0.3, heads=2, seed=9)),
    ("flex", lambda: variable_block_sparse(2048, 256, 0.5, heads=2, seed=10)),
    ("fa4", lambda: uniform_block_sparse(1024, 128, 0.5, heads=2, seed=8))])
def test_gpu_kernels_forward_and_backward_match_the_reference(kernel, make):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    m = make()
    q, k, v, dout = inputs(m.total, 8, 2, 128, device="cuda", dtype=torch.bfloat16, grad=True)
    try:
        fn = sparse.setup(kernel, m, q, k, v,
                          flex_fn=torch.compile(sparse.flex_attention) if kernel == "flex" else None)
    except sparse.SparseUnsupported as e:
        pytest.skip(str(e))
    out = fn()
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref, _ = sparse.reference_attention(q, k, v, m)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    assert rel(out, ref) <= BF16_TOL
    for g, r in zip(grads, ref_grads):
        assert rel(g, r) <= BF16_TOL

"""cadlib.bench.shard.LocalSP: a TP shard's layer under sequence parallelism on one GPU. Its norms and
residuals run on the rank's rows; its row-wise results on those rows are the layer's without SP, and
with one rank (nothing to gather) everything is, gradients included."""
import pytest
import torch

from cadlib.bench.shard import LocalSP
from cadlib.core.cost import as_model
from cadlib.runtime import fused
from cadlib.runtime.model import DecoderLayer

SPEC = as_model("tiny").shard(2)
BLOCKS = ["reference", pytest.param("fused", marks=pytest.mark.skipif(
    not fused.INTERPRET, reason="the fused blocks on the CPU need triton's interpreter (tests/conftest.py)"))]


def _inputs(n, rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, SPEC.hidden, generator=g)
    ang = torch.rand(n, SPEC.head_dim // 2, generator=g) * 9
    ang = torch.cat([ang, ang], -1)
    o = torch.randn(n, SPEC.n_heads, SPEC.head_dim, generator=g)
    return x, ang.cos(), ang.sin(), o


def _run(layer, x, cos, sin, o, sp):
    x = x.clone().requires_grad_()
    o = o.clone().requires_grad_()
    q, k, v = layer.pre_attention(x, cos, sin, sp)
    y = layer.post_attention(x, o, sp)
    (q.square().sum() + k.sum() + v.sum() + y.square().sum()).backward()
    return q, k, v, y, x.grad, o.grad


@pytest.mark.parametrize("blocks", BLOCKS)
@pytest.mark.parametrize("recompute", ["none", "mlp"])
def test_one_rank_is_the_layer_without_sp(blocks, recompute):
    layer = DecoderLayer(SPEC, recompute=recompute, blocks=blocks)
    x, cos, sin, o = _inputs(12, 12)
    got = _run(layer, x, cos, sin, o, LocalSP(1, 12, SPEC.hidden, "cpu", torch.float32))
    grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    want = _run(layer, x, cos, sin, o, None)
    for a, b in zip(got + tuple(grads), want + tuple(p.grad for p in layer.parameters())):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("blocks", BLOCKS)
def test_a_ranks_rows_are_the_layers_rows(blocks):
    n, tp, rank = 16, 4, 2
    sp = LocalSP(tp, n, SPEC.hidden, "cpu", torch.float32, rank=rank)
    lo, hi = sp.lo, sp.hi
    layer = DecoderLayer(SPEC, blocks=blocks)
    x, cos, sin, o = _inputs(n, n // tp)
    q, k, v, y, dx, do = _run(layer, x, cos, sin, o, sp)
    assert q.shape[0] == n and y.shape == x.shape == dx.shape and do.shape == o.shape
    q0, k0, v0, y0, dx0, do0 = _run(layer, x, cos[lo:hi], sin[lo:hi], o[lo:hi], None)
    for a, b in ((q[lo:hi], q0), (k[lo:hi], k0), (v[lo:hi], v0), (y, y0), (do[lo:hi], do0)):
        torch.testing.assert_close(a, b)
    assert not torch.equal(q[:lo], q[lo:hi][:lo])      # the other rows: the pool's random values


def test_bad_arguments_name_the_parameter():
    with pytest.raises(ValueError, match="tp must be an integer >= 1 dividing the tokens n=10"):
        LocalSP(4, 10, 8, "cpu", torch.float32)
    with pytest.raises(ValueError, match="rank must be in"):
        LocalSP(2, 10, 8, "cpu", torch.float32, rank=2)
    sp = LocalSP(2, 10, 8, "cpu", torch.float32)
    with pytest.raises(ValueError, match="gather expects this GPU's 5 rows; got 10"):
        sp.gather(torch.zeros(10, 8))
    with pytest.raises(ValueError, match="scatter expects the group's 10 rows"):
        sp.scatter(torch.zeros(5, 8))

"""The memory model's bytes per layer (:func:`cadlib.core.memory.layer_bytes`) against what the real
decoder keeps for its backward: the live tensor bytes after a forward, counted by a dispatch mode that
sees every tensor the ops create and when its storage is freed (CPU, bf16)."""
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from cadlib.core.memory import OURS, Rows, layer_bytes
from cadlib.runtime.model import Decoder


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created under the mode and still alive (``known``: tensors made before,
    e.g. the weights, whose views the ops return)."""

    def __init__(self, known=()):
        super().__init__()
        self.live, self.seen = 0, {t.untyped_storage().data_ptr() for t in known}

    def _free(self, key, n):
        self.live -= n
        self.seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st.data_ptr()
                if st.nbytes() and key not in self.seen:
                    self.seen.add(key)
                    self.live += st.nbytes()
                    weakref.finalize(st, self._free, key, st.nbytes())
        return out


class FlashLike(torch.autograd.Function):
    """Core attention that keeps what a flash kernel keeps: q, k, v, o and an fp32 LSE per head."""

    @staticmethod
    def forward(ctx, q, k, v):
        o = torch.zeros_like(q)
        lse = torch.zeros(q.shape[:2], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, o, lse)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


def _kept_after_forward(n_layers: int, n: int, mlp_recompute: bool) -> int:
    model = Decoder("tiny", n_layers=n_layers, dtype=torch.bfloat16, mlp_recompute=mlp_recompute)
    tokens, pos = torch.randint(0, model.spec.vocab, (n,)), torch.arange(n)
    mode = LiveBytes(known=model.parameters())
    with mode:
        cos, sin = model.rope(pos)
        out = model.run_layers(model.embed(tokens), cos, sin, lambda q, k, v, i: FlashLike.apply(q, k, v))
        kept = mode.live
    del out
    return kept


@pytest.mark.parametrize("recompute", ["mlp", "none"])
def test_one_layer_keeps_what_the_model_says(recompute):
    n = 96
    mlp = recompute == "mlp"
    # one more layer keeps its saved tensors; its output replaces the previous one, of the same size
    per_layer = _kept_after_forward(3, n, mlp) - _kept_after_forward(2, n, mlp)
    assert per_layer == sum(layer_bytes("tiny", Rows(n), recompute, OURS).values())

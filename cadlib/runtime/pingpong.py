"""Ping-pong: two nano-batches per rank, so one's all-to-all hides behind the other's compute.

Every rank's tokens form two **nano-batches** A and B. By default a document lies wholly in one of
them (a query's KV prefix never crosses nano-batches), and each nano-batch has its own layout and its
own plan, as DistCA plans its ping and pong batches independently.
:func:`cadlib.scheduling.nanosplit.split_nano_batches` assigns
documents so that every rank's two halves carry about the same tokens (so the linear layers of one
can cover the communication of the other), or the same attention work (``balance="attention"``).
With ``split_docs=True`` it may also cut a document: its prefix in A, the rest in B, whose attention
then reads A's K, V of the prefix as KV-only context (:mod:`cadlib.scheduling.nanosplit`; B's send at tick 2
runs after A's q, k, v of tick 0, and the backward sums both nano-batches' dK, dV into A's k, v).
With ``--sent-last`` each nano-batch's rows are re-ordered for its own plan
(:func:`cadlib.scheduling.sentlast.sent_last_nanos`; B's context indices follow A's new order).

Per layer, the tick order of DistCA (compute stream | communication stream)::

    tick 0   linear A (pre-attention)            |
    tick 1   linear B                            |  send A (q, k, v -> servers)
    tick 2   attention A (servers)               |  send B
    tick 3   attention B                         |  return A (o -> homes)
    tick 4   linear A (post, then next pre)      |  return B
             ... next layer's tick 1 runs B's post-attention linear beside A's send

Between ticks a two-way stream barrier (each stream waits for the other; no host synchronisation).
The barrier is an autograd node that takes the live tensors of BOTH nano-batches and returns them:
it joins the two chains at every tick, so the backward (plain ``loss.backward()``) meets the same
barriers in mirror order, and each backward tick overlaps one nano-batch's communication (on the
stream its forward used) with the other's compute. On CPU/gloo the same schedule runs in order.
"""
from __future__ import annotations

import torch

from .stages import check_inputs, ret, send, serve
from .streams import OFF, Streams, Timeline, as_tuple, spanned


class _Barrier(torch.autograd.Function):
    """Identity on the live tensors of both nano-batches; a two-way stream barrier forward and
    backward."""

    @staticmethod
    def forward(ctx, streams: Streams, *tensors):
        streams.barrier()
        ctx.streams = streams
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.streams.barrier()
        return (None, *grads)


class _NanoBatch:
    """One nano-batch on this rank: its ``name`` (A or B), ``rope`` (cos, sin) and device dispatch
    ``dd``, and its live tensors between ticks (None where nothing is live): the residual stream
    ``x``; ``q``, ``k``, ``v`` before the send; ``qb``, ``kb``, ``vb`` on its servers; ``out`` their
    output; ``o`` back home; and on A, ``kc``, ``vc``: B's KV-only context rows of A's ``k``, ``v``."""

    TENSORS = ("x", "q", "k", "v", "qb", "kb", "vb", "out", "o", "kc", "vc")
    __slots__ = ("name", "rope", "dd", *TENSORS)

    def __init__(self, name: str, x: torch.Tensor, rope, dd):
        self.name, self.rope, self.dd = name, rope, dd
        for f in self.TENSORS:
            setattr(self, f, None)
        self.x = x

    def take(self, *fields: str) -> tuple:
        """The tensors of ``fields``, which stop being live here."""
        out = tuple(getattr(self, f) for f in fields)
        for f in fields:
            setattr(self, f, None)
        return out

    def live(self) -> list[str]:
        """The fields whose tensors autograd tracks (the ones a barrier must join)."""
        return [f for f in self.TENSORS if getattr(self, f) is not None and getattr(self, f).requires_grad]


def pingpong_layers(model, xs, ropes, dds, comm, streams: Streams, attn_backend=None,
                    tl: Timeline = OFF, context=None):
    """Run every decoder layer of ``model`` over nano-batches A and B in DistCA's tick order.

    ``xs``: the two nano-batches' embeddings ``[n_A, hidden]``, ``[n_B, hidden]``; ``ropes``: their
    ``(cos, sin)``; ``dds``: their :class:`~cadlib.runtime.device.DeviceDispatch` (one plan each).
    ``context``: B's KV-only context on this rank (an int64 tensor of rows of A's local buffer,
    :attr:`cadlib.scheduling.nanosplit.NanoBatch.context`; None or empty: none). B's plan then expects
    ``n_B + len(context)`` local rows: q is padded with zeros, k and v take A's rows.
    Returns the two residual streams after the last layer (before the final norm)."""
    layers = list(model.layers)
    A, B = nanos = [_NanoBatch(name, x, rope, dd) for name, x, rope, dd in zip("AB", xs, ropes, dds)]
    ctx = context if context is not None and context.numel() else None
    n_ctx, n_b = (0 if ctx is None else ctx.numel()), xs[1].shape[0]

    def barrier():
        live = [(nb, f) for nb in nanos for f in nb.live()]
        if live:
            joined = as_tuple(_Barrier.apply(streams, *[getattr(nb, f) for nb, f in live]))
            for (nb, f), t in zip(live, joined):
                setattr(nb, f, t)
        else:
            streams.barrier()

    def pre(i, nb):
        q, k, v = spanned(tl, f"linear {nb.name}", lambda x: layers[i].pre_attention(x, *nb.rope), nb.x)
        if ctx is not None and nb is A:            # B's context rows, before A's send takes k, v
            A.kc, A.vc = k.index_select(0, ctx), v.index_select(0, ctx)
        elif ctx is not None:
            kc, vc = A.take("kc", "vc")
            q = torch.cat([q, q.new_zeros((n_ctx, *q.shape[1:]))])
            k, v = torch.cat([k, kc]), torch.cat([v, vc])
        nb.q, nb.k, nb.v = q, k, v

    def post(i, nb):
        nb.x = spanned(tl, f"linear {nb.name}", layers[i].post_attention, nb.x, *nb.take("o"))

    def send_(nb):
        nb.qb, nb.kb, nb.vb = send(*nb.take("q", "k", "v"), nb.dd, comm, streams, tl, nb.name)

    def serve_(nb):
        nb.out = serve(*nb.take("qb", "kb", "vb"), nb.dd, attn_backend, tl, nb.name)

    def ret_(nb):
        o = ret(*nb.take("out"), nb.dd, comm, streams, tl, nb.name)
        nb.o = o[:n_b] if nb is B and ctx is not None else o

    pre(0, A)                                          # tick 0
    # every rank checks, before the first all-to-all: A's tensors fully, B's row count (B's q, k, v
    # come from the same layer, so they share A's dtype, heads and head_dim)
    attn_backend = check_inputs(A.q, A.k, A.v, dds[0].meta.n_local, attn_backend, comm.group)
    for s, n, d in zip("AB", (xs[0].shape[0], n_b + n_ctx), dds):
        if n != d.meta.n_local:
            extra = f" ({n_b} tokens + {n_ctx} context rows)" if s == "B" and n_ctx else " tokens"
            raise ValueError(f"nano-batch {s} has {n}{extra} on this rank but its plan expects "
                             f"n_local={d.meta.n_local}")
    for i in range(len(layers)):
        barrier()                                      # tick 1: send A | linear B
        send_(A)
        if i > 0:
            post(i - 1, B)
        pre(i, B)
        barrier()                                      # tick 2: send B | attention A
        send_(B)
        serve_(A)
        barrier()                                      # tick 3: return A | attention B
        ret_(A)
        serve_(B)
        barrier()                                      # tick 4: return B | linear A
        ret_(B)
        post(i, A)
        if i + 1 < len(layers):
            pre(i + 1, A)
    barrier()
    post(len(layers) - 1, B)
    return A.x, B.x

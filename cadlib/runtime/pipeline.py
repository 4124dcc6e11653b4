"""Pipeline stages at run time: what neighbouring stages send each other, and a stage's layers under
CAD's lock-step ticks, forward and backward.

**Point to point** (:func:`p2p`): a stage's output activations go to the next stage and the gradients
of its inputs to the previous one, in one ``batch_isend_irecv`` per boundary of the schedule
(:func:`cadlib.core.pipeline.p2p_1f1b`, :func:`~cadlib.core.pipeline.p2p_lockstep`).

**A stage under CAD** (:class:`CadStage`): in a lock-step tick all stages run the same phase, and each
layer's core attention is one all-to-all over every GPU with the tick's plan. The forward of a
microbatch and its backward run in different ticks with different plans, so the servers are stateless
(:mod:`cadlib.runtime.resend`), and the stage runs its layers' backward itself, layer by layer, instead
of one ``loss.backward()``: each layer's input is a leaf ``x_in`` and its attention output a leaf
``o``, so::

    forward   q, k, v = pre(x_in)      o = attention(q, k, v)      x_out = post(x_in, o)
    backward  backward(x_out, g)  -> o.grad (and x_in.grad, the weights' grads)
              dq, dk, dv = attention'(o.grad)          (the backward tick's servers)
              backward((q, k, v), (dq, dk, dv))  -> x_in.grad += ..., the weights' grads
              g = x_in.grad                                                  (the layer below)

Every rank then issues its collectives in the same order, whatever autograd would have chosen, and a
stage with nothing to run in a tick (a dummy: warm-up, drain) runs the same loop on zero rows: it
moves and computes nothing of its own but serves its share of the other stages' attention.

With two nano-batches (ping-pong) the layer loop interleaves them in DistCA's tick order
(:mod:`cadlib.runtime.pingpong`) forward, and in its mirror image backward; nano-batch B may read A's
K, V rows as context (:mod:`cadlib.scheduling.nanosplit`), whose gradients go back into A's dK, dV.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .resend import TickAttention
from .streams import OFF, Streams, Timeline


def p2p(sends, recvs, group) -> list[torch.Tensor]:
    """One batched exchange with the neighbouring stages: ``sends`` ``[(tensor, dst)]``, ``recvs``
    ``[(like, src)]`` (a tensor of the shape and dtype to receive; ranks are global ranks of
    ``group``), posted together with ``torch.distributed.batch_isend_irecv`` and waited for (under
    NCCL ``wait()`` orders streams; no host synchronisation). Zero-row tensors are not sent (both
    sides know the sizes). Returns the received tensors, in ``recvs``' order."""
    bufs = [torch.empty_like(like) for like, _ in recvs]
    ops = [dist.P2POp(dist.isend, t.contiguous(), dst, group) for t, dst in sends if t.numel()]
    ops += [dist.P2POp(dist.irecv, b, src, group) for b, (_, src) in zip(bufs, recvs) if b.numel()]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return bufs


@dataclass
class Saved:
    """One layer of one nano-batch, kept from the forward for the backward (see the module doc)."""

    x_in: torch.Tensor
    qkv: tuple
    o: torch.Tensor
    x_out: torch.Tensor
    att: TickAttention


class CadStage:
    """A pipeline stage's decoder layers with core attention on the tick's attention servers.

    ``layers``: the stage's :class:`~cadlib.runtime.model.DecoderLayer` blocks; ``comm``: the
    all-to-all over every GPU (:class:`~cadlib.runtime.comm.AllToAll` or the signal-only control);
    ``heads``: ``(Hq, Hkv, D)``, for the zero-row tensors of a dummy."""

    def __init__(self, layers, comm, streams: Streams, attn_backend: str, heads, dtype, device,
                 tl: Timeline = OFF, kv_share: str | None = None):
        self.layers, self.comm, self.streams, self.backend = list(layers), comm, streams, attn_backend
        self.heads, self.dtype, self.device, self.tl, self.kv_share = heads, dtype, device, tl, kv_share

    def _attention(self, name: str) -> TickAttention:
        return TickAttention(self.comm, self.streams, self.backend, self.tl, name, self.kv_share)

    @staticmethod
    def _names(n: int) -> list[str]:
        """The nano-batches' names in spans: ``A``, ``B`` under ping-pong, none for one."""
        return ["A", "B"] if n == 2 else [""]

    @staticmethod
    def _linear(name: str, backward: bool = False) -> str:
        return ("linear " + name).strip() + ("'" if backward else "")

    # -- forward ------------------------------------------------------------------------------------
    def forward(self, xs, ropes, dds, context=None, grad: bool = True):
        """Run the layers over the nano-batches' inputs ``xs`` (1 or 2 tensors ``[n, hidden]``, their
        RoPE ``ropes``) with the forward tick's dispatches ``dds``. ``grad=False``: a dummy (zero rows,
        nothing kept). Returns the outputs (graph-free) and, with ``grad``, what the backward needs."""
        with torch.set_grad_enabled(grad):
            return self._forward(xs, ropes, dds, context, grad)

    def _forward(self, xs, ropes, dds, context, grad):
        names, L, st = self._names(len(xs)), len(self.layers), self.streams
        ctx = context if context is not None and context.numel() else None
        x = list(xs)
        saved = [[None] * len(xs) for _ in range(L)]
        live: dict = {}

        def pre(i, j):
            x_in = x[j].detach().requires_grad_(grad)
            with self.tl.span("compute", self._linear(names[j])):
                q, k, v = self.layers[i].pre_attention(x_in, *ropes[j])
            sq, sk, sv = q.detach(), k.detach(), v.detach()
            if ctx is not None and j == 0:             # B's context rows of A's k, v
                live["ctx"] = (sk.index_select(0, ctx), sv.index_select(0, ctx))
            elif ctx is not None:
                kc, vc = live.pop("ctx")
                sq = torch.cat([sq, sq.new_zeros((ctx.numel(), *sq.shape[1:]))])
                sk, sv = torch.cat([sk, kc]), torch.cat([sv, vc])
            live[j] = [x_in, (q, k, v), self._attention(names[j]), (sq, sk, sv)]

        def send(j):
            live[j][2].send(*live[j].pop(), dds[j])

        def serve(j):
            live[j][2].serve()

        def ret(j):
            o = live[j][2].ret()
            live[j].append(o[:xs[j].shape[0]].detach().requires_grad_(grad))

        def post(i, j):
            x_in, qkv, att, o = live.pop(j)
            with self.tl.span("compute", self._linear(names[j])):
                x[j] = self.layers[i].post_attention(x_in, o)
            if grad:
                saved[i][j] = Saved(x_in, qkv, o, x[j], att)

        if len(xs) == 1:
            for i in range(L):
                pre(i, 0)
                st.barrier()
                send(0)
                st.barrier()
                serve(0)
                st.barrier()
                ret(0)
                st.barrier()
                post(i, 0)
        else:                                          # DistCA's ping-pong ticks, as pingpong_layers
            pre(0, 0)
            for i in range(L):
                st.barrier()
                send(0)
                if i > 0:
                    post(i - 1, 1)
                pre(i, 1)
                st.barrier()
                send(1)
                serve(0)
                st.barrier()
                ret(0)
                serve(1)
                st.barrier()
                ret(1)
                post(i, 0)
                if i + 1 < L:
                    pre(i + 1, 0)
            st.barrier()
            post(L - 1, 1)
        return [t.detach() for t in x], (saved if grad else None)

    # -- backward -----------------------------------------------------------------------------------
    def backward(self, saved, grads, dds, n_nano: int, context=None):
        """The layers' backward with the backward tick's dispatches ``dds``: ``grads`` are the
        gradients of the forward's outputs; returns those of its inputs. ``saved=None``: a dummy
        (zero rows, serving attention only). Parameter gradients accumulate in ``.grad``."""
        names, L, st = self._names(n_nano), len(self.layers), self.streams
        ctx = context if context is not None and context.numel() else None
        g = list(grads) if grads is not None else [None] * n_nano
        hq, hkv, d = self.heads
        out: dict = {}

        def post_(i, j):
            e = saved[i][j] if saved is not None else None
            if e is None:                                   # a dummy: zero rows of each
                z = torch.zeros((0, hkv, d), dtype=self.dtype, device=self.device)
                zq = torch.zeros((0, hq, d), dtype=self.dtype, device=self.device)
                att = self._attention(names[j])
                att.saved = (zq, z, z, zq, torch.zeros((0, hq), dtype=torch.float32, device=self.device))
                out[j] = [None, att, zq]
                return
            with self.tl.span("compute", self._linear(names[j], True)):
                torch.autograd.backward(e.x_out, g[j])
            do = e.o.grad
            if j == 1 and ctx is not None:                  # B's context rows had no output
                do = torch.cat([do, do.new_zeros((ctx.numel(), *do.shape[1:]))])
            out[j] = [e, e.att, do]

        def send_(j):
            e, att, do = out[j]
            att.send_grad(do, dds[j])

        def serve_(j):
            out[j][1].serve_grad()

        def ret_(j):
            out[j].append(out[j][1].ret_grad())

        def pre_(i):
            es = [out[j][0] for j in range(n_nano)]
            grads_qkv = [list(out[j][3]) for j in range(n_nano)]
            if ctx is not None:                             # B's context rows: A's dK, dV
                n_b = grads_qkv[1][0].shape[0] - ctx.numel()
                for c in (1, 2):
                    grads_qkv[0][c] = grads_qkv[0][c].index_add(0, ctx, grads_qkv[1][c][n_b:])
                grads_qkv[1] = [t[:n_b] for t in grads_qkv[1]]
            if es[0] is not None:
                with self.tl.span("compute", self._linear("".join(names), True)):
                    torch.autograd.backward([t for e in es for t in e.qkv],
                                            [t for gs in grads_qkv for t in gs])
                for j, e in enumerate(es):
                    g[j] = e.x_in.grad
                    saved[i][j] = None                      # free the layer
            out.clear()

        for i in reversed(range(L)):
            if n_nano == 1:
                post_(i, 0)
                st.barrier()
                send_(0)
                st.barrier()
                serve_(0)
                st.barrier()
                ret_(0)
                st.barrier()
            else:                                           # the forward's ticks in mirror order
                post_(i, 1)
                st.barrier()
                send_(1)
                post_(i, 0)
                st.barrier()
                send_(0)
                serve_(1)
                st.barrier()
                ret_(1)
                serve_(0)
                st.barrier()
                ret_(0)
                st.barrier()
            pre_(i)
        return g

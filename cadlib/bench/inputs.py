"""Random inputs of the right sizes: a standard-normal tensor, and one attention server's serve stage.

A server's serve stage (:func:`cadlib.runtime.stages.serve`) reads its query buffer, ``q_keep`` kept
rows and ``n_recv_q`` received ones, and its KV buffer, ``n_local`` local rows and ``n_recv_kv``
received ones, and returns O in task-row order: ``cu_q[-1]`` rows (the query buffer itself when the
server reads it in place, ``q_identity``). :class:`ServeCall` draws those buffers and the gradient
of O from one generator, in the order q, k, v, dO, so a seed gives the same inputs on every run.
"""
from __future__ import annotations

import torch

from ..runtime.stages import serve


def rand(gen: torch.Generator, n: int, heads: int, head_dim: int, device, dtype) -> torch.Tensor:
    """Standard-normal ``[n, heads, head_dim]`` drawn on ``device`` (``gen`` is a generator there) in
    float32, then cast to ``dtype``."""
    return torch.randn(n, heads, head_dim, generator=gen, device=device).to(dtype)


class ServeCall:
    """One server's serve stage on random buffers of its dispatch's sizes: :meth:`ServeCall.forward`
    gives O, :meth:`ServeCall.backward` runs its backward with a random dO, :meth:`ServeCall.zero_grad`
    drops the gradients, and :meth:`ServeCall.run` does all three. ``dd`` is the server's dispatch on
    the device (:func:`cadlib.runtime.device.to_device`); ``spec`` gives ``n_heads``, ``n_kv_heads`` and
    ``head_dim`` (:class:`cadlib.core.cost.ModelSpec`)."""

    def __init__(self, dd, spec, device, dtype, backend: str | None, gen: torch.Generator):
        m = dd.meta
        self.dd, self.backend = dd, backend
        n_q, n_kv = m.q_keep + m.n_recv_q, m.n_local + m.n_recv_kv
        self.q = rand(gen, n_q, spec.n_heads, spec.head_dim, device, dtype).requires_grad_()
        self.k = rand(gen, n_kv, spec.n_kv_heads, spec.head_dim, device, dtype).requires_grad_()
        self.v = rand(gen, n_kv, spec.n_kv_heads, spec.head_dim, device, dtype).requires_grad_()
        n_out = n_q if m.q_identity else int(m.cu_q[-1])
        self.dout = rand(gen, n_out, spec.n_heads, spec.head_dim, device, dtype)
        self.served_q_rows, self.kv_rows = int(m.cu_q[-1]), n_kv

    def forward(self) -> torch.Tensor:
        return serve(self.q, self.k, self.v, self.dd, self.backend)

    def backward(self, out: torch.Tensor) -> None:
        out.backward(self.dout)

    def zero_grad(self) -> None:
        self.q.grad = self.k.grad = self.v.grad = None

    def run(self) -> None:
        """Forward, backward, and the gradients dropped."""
        self.backward(self.forward())
        self.zero_grad()

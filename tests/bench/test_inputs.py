"""cadlib.bench.inputs: a serve stage's random buffers have its dispatch's sizes, come from the seed
alone, and run forward and backward."""
import torch
from helpers import random_scattered_plan

from cadlib.bench.inputs import ServeCall, rand
from cadlib.core.cost import ModelSpec
from cadlib.dispatch.build import build_dispatch
from cadlib.runtime.device import to_device
from cadlib.scheduling import scheduler

SPEC = ModelSpec.from_name("tiny")


def calls(plan, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for rank in range(plan.layout.n_ranks):
        dd = to_device(build_dispatch(plan, rank), "cpu")
        if dd.meta.n_tasks:
            out.append(ServeCall(dd, SPEC, "cpu", torch.float32, "sdpa_ref", gen))
    return out


def test_buffers_have_the_dispatchs_sizes_and_run_forward_and_backward():
    plan = random_scattered_plan(3, 3)
    served = calls(plan) + calls(scheduler.colocated(plan.layout))
    assert {c.dd.meta.q_identity for c in served} == {True, False}     # both kinds of server are here
    for c in served:
        m = c.dd.meta
        assert c.q.shape == (m.q_keep + m.n_recv_q, SPEC.n_heads, SPEC.head_dim)
        assert c.k.shape == c.v.shape == (m.n_local + m.n_recv_kv, SPEC.n_kv_heads, SPEC.head_dim)
        assert c.served_q_rows == int(m.cu_q[-1]) and c.kv_rows == c.k.shape[0]
        out = c.forward()
        assert out.shape == c.dout.shape
        c.backward(out)
        assert all(t.grad is not None and t.grad.shape == t.shape for t in (c.q, c.k, c.v))
        c.run()
        assert c.q.grad is c.k.grad is c.v.grad is None


def test_a_seed_gives_the_same_buffers_drawn_in_the_order_q_k_v_dout():
    plan = random_scattered_plan(5, 2)
    a, b = calls(plan, seed=7), calls(plan, seed=7)
    gen = torch.Generator().manual_seed(7)
    for x, y in zip(a, b):
        want = [rand(gen, t.shape[0], t.shape[1], t.shape[2], "cpu", torch.float32)
                for t in (x.q, x.k, x.v, x.dout)]
        for t, u, w in zip((x.q, x.k, x.v, x.dout), (y.q, y.k, y.v, y.dout), want):
            assert torch.equal(t, u) and torch.equal(t, w)
    assert not torch.equal(calls(plan, seed=8)[0].q, a[0].q)

"""The step composition: hand-counted steps of one stream and of ping-pong's ticks, waits at
collectives, the link model, and bad input."""
import numpy as np
import pytest

from cadlib.analysis.model.compose import Link, Phases, compose


def one_stream(R=2, comm=0.5):
    z = np.zeros(R)
    return Phases(pre=z + 1, post=z + 1, pre_bwd=z + 2, post_bwd=z + 2, attn=np.array([1.0, 3.0]),
                  attn_bwd=np.array([2.0, 6.0]), comm_in=z + comm, comm_out=z + comm, comm_in_bwd=z + comm,
                  comm_out_bwd=z + comm, head=z + 1, optimizer=0.1, allreduce=0.2)


def test_one_stream_step_is_the_slowest_rank_at_every_collective():
    # per layer: pre 1 + comm .5 + slowest attention 3 + comm .5 + post 1 = 6 forward, 2+.5+6+.5+2 = 11
    # backward; two layers, head 1, all-reduce .2, optimizer .1
    c = compose("cad", one_stream(), 2)
    assert c.step == pytest.approx(2 * 6 + 1 + 2 * 11 + 0.3)
    assert c.busy.tolist() == pytest.approx([23.3, 35.3])
    assert c.idle.tolist() == pytest.approx([12.0, 0.0])
    assert c.breakdown["exposed_comm_s"] == pytest.approx(8 * 0.5 + 0.2)


def test_pingpong_hides_what_the_other_nano_batch_covers():
    R = 2
    half = one_stream(R, comm=0.0)
    two = {f: np.stack([getattr(half, f) / 2] * 2) for f in ("pre", "post", "pre_bwd", "post_bwd", "attn",
                                                             "attn_bwd")}
    small = np.full((2, R), 0.1)              # every collective shorter than the compute beside it
    ph = Phases(**two, comm_in=small, comm_out=small, comm_in_bwd=small, comm_out_bwd=small, head=half.head)
    pp = compose("cad-pingpong", ph, 3)
    sig = compose("signal-only", ph, 3)
    assert pp.step == pytest.approx(sig.step)
    # and the same work without overlap pays every collective
    one = Phases(**{k: v.sum(0) for k, v in two.items()}, comm_in=small.sum(0), comm_out=small.sum(0),
                 comm_in_bwd=small.sum(0), comm_out_bwd=small.sum(0), head=half.head)
    assert compose("cad", one, 3).step > pp.step


def test_a_collective_longer_than_the_compute_beside_it_is_exposed():
    R = 2
    ones = np.ones((2, R))
    ph = Phases(pre=ones, post=ones, pre_bwd=ones, post_bwd=ones, attn=ones, attn_bwd=ones,
                comm_in=ones * 3, comm_out=ones * 0, comm_in_bwd=ones * 0, comm_out_bwd=ones * 0,
                head=np.zeros(R))
    c = compose("cad-pingpong", ph, 1)
    # forward: tick0 1, tick1 max(1, 3) = 3, tick2 max(1, 3) = 3, tick3 1, tick4 1, post B 1; backward 6
    assert c.step == pytest.approx(10 + 6)
    assert c.breakdown["exposed_comm_s"] == pytest.approx(4.0)


def test_link_seconds_and_a_collective_that_moves_nothing():
    link = Link(100.0, 1e-5)
    assert link.seconds([2e9, 0], [0, 1e9]).tolist() == pytest.approx([0.02001, 0.01001])
    assert link.seconds([0, 0]).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="gbps"):
        Link(0)


def test_bad_input():
    with pytest.raises(ValueError, match="unknown method"):
        compose("ring", one_stream(), 1)
    with pytest.raises(ValueError, match="n_layers"):
        compose("cad", one_stream(), 0)
    with pytest.raises(ValueError, match=r"\[2, R\]"):
        compose("cad-pingpong", one_stream(), 1)
    with pytest.raises(ValueError, match="attn"):
        Phases(**{**vars(one_stream()), "attn": np.array([-1.0, 1.0])})


def test_lockstep_of_one_stage_is_the_plain_step():
    # one stage, one microbatch: the F tick then the B tick is compose()'s step (head split in two)
    from cadlib.analysis.model.compose import compose_lockstep
    ph = one_stream()
    plain = compose("cad", ph, 2)
    fwd_head, bwd_head = ph.head * 0.25, ph.head * 0.75
    c = compose_lockstep("cad", [("F", ph, fwd_head), ("B", ph, bwd_head)], 2, ph.allreduce, ph.optimizer)
    assert c.step == pytest.approx(plain.step)
    assert c.busy.tolist() == pytest.approx(plain.busy.tolist())


def test_lockstep_ticks_wait_for_the_slowest_stage_and_idle_ranks_serve():
    from cadlib.analysis.model.compose import compose_lockstep
    z = np.zeros(2)
    # rank 0 a dummy (no linear work) that serves attention 1.0 per layer, rank 1 a real stage
    ph = Phases(pre=np.array([0.0, 1.0]), post=np.array([0.0, 1.0]), pre_bwd=z, post_bwd=z,
                attn=np.array([1.0, 1.0]), attn_bwd=z, comm_in=z + 0.5, comm_out=z + 0.5, comm_in_bwd=z,
                comm_out_bwd=z, head=z)
    c = compose_lockstep("cad", [("F", ph, z)], 1, 0.0, 0.0, p2p=0.1)
    # p2p .1, pre 1 (rank 1), send .5 (everyone waits for rank 1), attention 1, return .5, post 1
    assert c.step == pytest.approx(0.1 + 1 + 0.5 + 1 + 0.5 + 1)
    assert c.busy.tolist() == pytest.approx([0.1 + 0.5 + 1 + 0.5, 0.1 + 1 + 0.5 + 1 + 0.5 + 1])


def test_compose_pass_is_half_of_the_plain_step():
    from cadlib.analysis.model.compose import compose_pass
    ph = one_stream()
    end_f, busy_f, _ = compose_pass("cad", ph, 2)
    end_b, busy_b, _ = compose_pass("cad", ph, 2, backward=True)
    assert end_f.max() == pytest.approx(12.0) and end_b.max() == pytest.approx(22.0)
    assert (busy_f + busy_b).tolist() == pytest.approx((compose("cad", ph, 2).busy - 1.3).tolist())

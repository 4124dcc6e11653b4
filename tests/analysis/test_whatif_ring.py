"""The zigzag CP ring (cadlib.analysis.whatif.ring): its chunks, segments and bytes by hand on 2 ranks
and 2 documents, the balance zigzag buys on one document, and max(attention, comm) per ring step."""
import numpy as np
import pytest

from cadlib.analysis.whatif import ring
from cadlib.analysis.whatif.ring import Segment
from cadlib.core.cost import as_model


def test_two_ranks_two_documents_by_hand():
    """Documents [6, 2]: chunks of 2, rank 0 holds [0,2) and [6,8), rank 1 [2,4) and [4,6)."""
    assert ring.chunks(8, 2) == [((0, 2), (6, 8)), ((2, 4), (4, 6))]
    s = ring.segments([6, 2], 2)
    assert s[0][0] == [Segment(2, 2, 3, True), Segment(2, 2, 3, True)]     # doc A's start, doc B whole
    assert s[0][1] == []                                                   # rank 1's K, V come after
    assert s[1][0] == [Segment(2, 2, 3, True), Segment(2, 2, 4, False), Segment(2, 2, 3, True)]
    assert s[1][1] == [Segment(2, 2, 4, False), Segment(2, 2, 4, False)]   # [2,4) and [4,6) on [0,2)
    total = sum(x.pairs for r in s for st in r for x in st)
    assert total == 6 * 7 // 2 + 2 * 3 // 2                                # every causal pair once
    tiny = as_model("tiny")                                                # K, V: 2 x 32 x 2 = 128 B/token
    assert ring.sent_bytes(8, 2, tiny) == {"fwd": 1 * 2 * 2 * 128, "bwd": 2 * 2 * 2 * 128}


def test_zigzag_balances_one_document():
    s = ring.segments([4096], 4)
    pairs = [sum(x.pairs for st in r for x in st) for r in s]
    assert len(set(pairs)) == 1 and sum(pairs) == 4096 * 4097 // 2


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="multiple of 2c"):
        ring.chunks(10, 2)
    with pytest.raises(ValueError, match="lengths"):
        ring.segments([0, 8], 2)


def test_each_step_is_the_slower_of_attention_and_the_transfer():
    from cadlib.analysis.whatif.price import KERNELS_FILE, load_cost
    if not KERNELS_FILE.exists():
        pytest.skip("no committed kernel table")
    cost, spec = load_cost(), as_model("llama3-8b").shard(8)
    lengths = [65536, 32768, 32768]
    fast = ring.attention_seconds(lengths, 4, cost, spec, gbps=1e6)
    slow = ring.attention_seconds(lengths, 4, cost, spec, gbps=0.01)
    both = fast["fwd"] + fast["bwd"]                  # a fast link: attention (empty steps: the transfer)
    assert np.all(both >= fast["compute"] * (1 - 1e-12)) and np.all(both <= fast["compute"] * (1 + 1e-4))
    comm = ring.sent_bytes(sum(lengths), 4, spec)
    for r in range(4):                                 # every step but the last waits for its transfer
        last = ring.segment_seconds(ring.segments(lengths, 4)[r][3], cost, "fwd", spec)
        assert slow["fwd"][r] == pytest.approx(comm["fwd"] / 0.01e9 + last, rel=1e-6)
    assert np.all(slow["fwd"] > fast["fwd"])


class _PairCost:
    """A kernel table by hand: 1 ns per causal pair, 1 us per call."""

    def task_seconds(self, q, k, phase="fwd", spec=None):
        from cadlib.core.measured import segment_pairs
        return segment_pairs(q, k) * 1e-9

    def call_overhead(self, phase="fwd"):
        return 1e-6


def test_the_ring_row_prices_each_step_by_hand():
    """Documents [6, 2] on one ring of 2 ranks (tiny: K, V 128 B a token): rank 0 attends 6 pairs at
    step 0 and nothing at step 1, rank 1 10 then 8 pairs; step 0 waits for the slower of its call and
    the 2 x 2 tokens' K, V over a 1e-6 GB/s link (512 B: 512 us, plus 5 us latency), step 1 does not."""
    from cadlib.analysis.model.compose import Link, Phases
    tiny = as_model("tiny")
    comm = 5e-6 + 2 * 2 * 128 / 1e3                                          # latency + bytes / (1e-6 GB/s)
    z = np.zeros(2)
    coloc = Phases(pre=np.ones(2), post=np.ones(2), pre_bwd=np.ones(2), post_bwd=np.ones(2), attn=z,
                   attn_bwd=z, comm_in=np.full(2, 7.0), comm_out=z, comm_in_bwd=z, comm_out_bwd=z,
                   head=np.ones(2), allreduce=0.5)
    ph, st = ring.priced([6, 2], 2, coloc, tiny, _PairCost(), Link(1e-6, 5e-6, "ring"))
    by_hand_fwd = [max(1e-6 + 6e-9, comm) + 0.0, max(1e-6 + 10e-9, comm) + (1e-6 + 8e-9)]
    assert ph.attn == pytest.approx(by_hand_fwd, rel=1e-12)
    assert ph.attn_bwd == pytest.approx([max(1e-6 + 6e-9, 2 * comm - 5e-6), max(1e-6 + 10e-9, 2 * comm - 5e-6)
                                         + 1e-6 + 8e-9], rel=1e-12)   # dK, dV too: twice the bytes
    assert np.all(ph.comm_in == 0) and np.all(ph.pre == 1) and ph.allreduce == 0.5   # colocated's linear
    assert st["sent"].tolist() == [3 * 512, 3 * 512]                      # 512 B forward, 1024 backward
    fast, _ = ring.priced([6, 2], 2, coloc, tiny, _PairCost(), Link(1e6, 0.0, "ring"))
    assert fast.attn == pytest.approx([1e-6 + 6e-9, 2e-6 + 18e-9], rel=1e-12)   # the calls alone


def test_packing_cuts_at_group_boundaries_and_pads_to_2c():
    assert [q.tolist() for q in ring.packed([5, 3, 4, 4], 2, 2)] == [[5, 3], [4, 4]]
    assert [q.tolist() for q in ring.packed([6, 6, 4], 2, 2)] == [[6, 2], [4, 4]]   # the 2nd document cut
    assert [q.tolist() for q in ring.packed([3, 3], 1, 2)] == [[3, 3, 2]]          # padded to 8
    assert ring.rank_tokens([3, 3], 2, 1).tolist() == [4, 4]                        # 3 + 1 of padding each
    with pytest.raises(ValueError, match="groups=4"):
        ring.packed([3, 3], 4, 1)


def test_the_ring_is_a_row_of_the_whatif(tmp_path):
    """Its degree the fastest of those that hold the context and fit; a row of the table, JSON and page."""
    from cadlib.analysis.whatif import page, planner
    from cadlib.analysis.whatif.setup import Cluster, Documents, Training
    res = planner.plan("tiny", Cluster(gpus=4, gpus_per_node=4, tp=1),
                       Training(context=64, tokens_per_group=32, steps=2, min_shard=4),
                       Documents(lengths=np.array([64, 16, 8, 40, 4, 4])), with_sweep=False)
    rg = res["ring"]
    assert rg["priced"] == [2, 4] and rg["chosen"] == min(rg["mean_step_s"], key=rg["mean_step_s"].get)
    row = res["methods"]["cp-ring"]
    assert row["cp"] == [rg["chosen"]] * 2 and row["step_s"] > 0
    assert res["methods"]["cad-pingpong"]["speedup_over_cp-ring"] > 0
    assert f"CP ring (zigzag, CP {rg['chosen']})" in page.text(res)
    assert "CP ring (zigzag" in page.page(res)
    import json
    assert json.loads(json.dumps(res))["methods"]["cp-ring"]["cp"] == row["cp"]

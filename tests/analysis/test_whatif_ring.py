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

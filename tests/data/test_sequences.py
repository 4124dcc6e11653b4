"""DistCA's data pipeline (cadlib.data.sequences): sequences cut as batch_documents cuts them, the two
samplers' semantics read from DistCA's code, and steps drawn in stream order."""
import numpy as np
import pytest

from cadlib.core.paper import DISTCA_SAMPLER
from cadlib.data import sequences as S
from cadlib.data.packing import pack


def test_pack_sequences_cuts_a_document_where_a_sequence_ends():
    assert S.pack_sequences([5, 9, 3, 1], 8) == [[5, 3], [6, 2], [1, 1]]        # 9 = 3 + 6: two documents
    assert S.pack_sequences([5, 9], 8, multiple_of=4) == [[8], [8], [4]]         # 5 -> 8, 9 -> 12
    assert S.pack_sequences([20], 8) == [[8], [8], [4]]
    with pytest.raises(ValueError, match="seq_len"):
        S.pack_sequences([1], 0)


def test_elongation_is_maxdoclen_over_64k():
    assert [S.elongation(n) for n in (32768, 131072, 262144, 524288)] == [1, 2, 4, 8]


def test_pretrain_sampler_upsamples_raw_long_documents_and_elongates_everything():
    c = DISTCA_SAMPLER
    docs = S.corpus("pretrain", 0)
    raw_long = docs[docs >= c["filter_threshold"]]
    stream = np.array(S.distca_stream("pretrain-distca", 131072, 0))
    assert stream.size == c["draw"] and np.all(stream % 2 == 0)            # every length x 2 at 128K
    pool_long_share = (c["upsample"] * raw_long.size) / (c["upsample"] * raw_long.size
                                                         + int((docs < c["filter_threshold"]).sum() * c["filter_ratio"]))
    got = float(np.mean(stream >= 2 * c["filter_threshold"]))
    assert abs(got - pool_long_share) < 0.01                                # drawn without replacement
    assert stream.max() <= 2 * docs.max()


def test_prolong_sampler_puts_long_documents_first_unshuffled():
    c = DISTCA_SAMPLER
    docs = S.corpus("prolong", 0)
    n_long = c["upsample"] * int((docs >= c["filter_threshold"]).sum())
    stream = np.array(S.distca_stream("prolong-distca", 262144, 0))
    head, tail = stream[:n_long], stream[n_long:]
    assert np.all(head >= c["filter_threshold"]) and np.all(tail < c["filter_threshold"])
    set_to_ctx = float(np.mean(head == 4 * c["elongate_unit"]))
    assert 0.15 < set_to_ctx < 0.45                                         # ~30% set to MaxDocLen
    short = docs[docs < c["filter_threshold"]]
    assert np.array_equal(tail, short[:int(len(short) * c["filter_ratio"])])  # the first half, in order


def test_steps_take_consecutive_full_sequences_and_continue_past_a_stream():
    a = S.step_sequences("prolong-distca", 131072, 8, 0)
    b = S.step_sequences("prolong-distca", 131072, 8, 1)
    assert len(a) == len(b) == 8 and all(sum(s) == 131072 for s in a + b)
    assert a != b
    n = len(S._sequences("prolong", 4096, 0, 0, None))
    far = S.step_sequences("prolong", 4096, n, 1)                        # the whole second stream
    assert far == [list(s) for s in S._sequences("prolong", 4096, 0, 1, None)]
    with pytest.raises(ValueError, match="unknown distribution"):
        S.step_sequences("prolog", 4096, 2, 0)


def test_distca_packing_deals_a_crossing_document_head_and_tail():
    lay = pack([10, 30, 8], 3, 16, method="distca").validate()
    assert lay.ranks[1] == [(1, 3, 11), (1, 19, 27)]                    # 16 tokens: 8 from the front, 8 from the back
    assert list(lay.tokens_per_rank()) == [16, 16, 16]

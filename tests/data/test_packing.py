"""WLB-LLM's packer and per-document CP as DistCA runs them: hand-checked small cases (the cap rule,
deferred documents, the empty replica's dummy), a reference transcription of DistCA's loop on random
batches, and the whole-replica all-gather."""
import numpy as np
import pytest

from cadlib.core.paper import DISTCA_WLB_BREAKPOINT, DISTCA_WLB_EMPTY_PAD
from cadlib.data.packing import (per_doc_cp_layout, per_doc_gather_tokens, replica_gather_tokens,
                                 wlb_breakpoint, wlb_distca_buckets, wlb_distca_layout)


def _reference(docs, n, cap, bk):
    """DistCA's ``balance_data_for_wlbllm`` loop as written (workloads recomputed from scratch for
    every document), returning per bucket its document lengths."""
    def workload(b):
        return sum((x / bk) ** 2 + x / bk for x in b)
    new = [[] for _ in range(n)]
    left = []
    for d in sorted(docs, reverse=True):
        w, ln = [workload(b) for b in new], [sum(b) for b in new]
        i, j = w.index(min(w)), ln.index(min(ln))
        if ln[i] + d <= cap:
            new[i].append(d)
        elif ln[j] + d <= cap:
            new[j].append(d)
        else:
            left.append(d)
    for d in left:
        w = [workload(b) for b in new]
        new[w.index(min(w))].append(d)
    return [b or [DISTCA_WLB_EMPTY_PAD] for b in new]


def test_longest_first_to_least_workload_then_fewest_tokens():
    docs = [100_000, 60_000, 50_000, 30_000, 20_000]     # Lmax = 260000 // 2 = 130000, Bk = 64000
    buckets, lens = wlb_distca_buckets(docs, 2, model="llama3-8b")
    # 100K -> 0 (tie, the first); 60K -> 1 (W 0.94^2+0.94 < 4.00); 50K -> 1 (110K <= 130K);
    # 30K: least workload is 1 (3.21 < 4.00) but 140K > Lmax, so the fewest tokens: 0 (130K);
    # 20K -> 1 (W 3.21 < 4.69), 130K
    assert buckets == [[0, 3], [1, 2, 4]] and lens == docs


def test_a_document_fitting_nowhere_is_deferred_and_placed_without_cap():
    buckets, lens = wlb_distca_buckets([90, 60, 50], 2)          # Lmax = 100
    # 90 -> 0; 60 -> 1; 50 fits neither (140, 110 > 100): deferred, then to the least workload (1)
    assert buckets == [[0], [1, 2]]
    assert sum(lens[d] for d in buckets[1]) == 110 > 100


def test_an_explicit_cap_a_dummy_for_an_empty_replica_and_one_replica():
    buckets, lens = wlb_distca_buckets([10], 3)
    assert buckets == [[0], [1], [2]] and lens == [10, DISTCA_WLB_EMPTY_PAD, DISTCA_WLB_EMPTY_PAD]
    assert wlb_distca_buckets([3, 9, 5], 1) == ([[0, 1, 2]], [3, 9, 5])      # the order as given
    # DistCA's 4D call: Lmax = mean / micro-batches, so step 1 stops early and step 2 places the rest
    docs = [40, 30, 20, 10]
    capped, _ = wlb_distca_buckets(docs, 2, cap=50 // 2)
    assert capped == [[2, 1], [3, 0]]    # 40 and 30 deferred; 20 -> 0, 10 -> 1; then 40 -> 1, 30 -> 0
    with pytest.raises(ValueError, match="cap must be an integer >= 1"):
        wlb_distca_buckets(docs, 2, cap=0)
    with pytest.raises(ValueError, match="n_buckets must be an integer >= 1"):
        wlb_distca_buckets(docs, 0)


@pytest.mark.parametrize("seed", range(6))
def test_buckets_equal_distcas_loop_on_random_batches(seed):
    rng = np.random.default_rng(seed)
    docs = [int(x) for x in rng.integers(1, 200_000, size=int(rng.integers(1, 60)))]
    n = int(rng.choice([2, 3, 4, 8]))
    cap = sum(docs) // n // int(rng.choice([1, 1, 2]))
    buckets, lens = wlb_distca_buckets(docs, n, cap=cap, model="llama-34b")
    assert [[lens[d] for d in b] for b in buckets] == _reference(docs, n, cap, 131_072)
    assert sorted(d for b in buckets for d in b if d < len(docs)) == list(range(len(docs)))


def test_breakpoints_are_the_run_scripts():
    assert wlb_breakpoint("llama3-8b") == DISTCA_WLB_BREAKPOINT["llama3-8b"] == 64_000
    assert wlb_breakpoint("llama-34b") == 131_072 and wlb_breakpoint("tiny") == 131_072
    from cadlib.core.cost import as_model
    assert wlb_breakpoint(as_model("llama3-8b").shard(8)) == 64_000


def test_per_document_cp_cuts_every_document_into_2cp_shards_with_a_running_remainder():
    # cp=2, K=4. Document 0 (5 tokens): 1 each, remainder 1 -> shard 0: [0,2) [2,3) [3,4) [4,5).
    # Document 1 (3 tokens): 0 each, remainder 3 from shard 1: [0,0) [0,1) [1,2) [2,3).
    lay = per_doc_cp_layout([[0, 1]], [5, 3], 2)
    assert lay.ranks[0] == [(0, 0, 2), (0, 4, 5), (1, 2, 3)]           # shards 0 and 3
    assert lay.ranks[1] == [(0, 2, 3), (1, 0, 1), (0, 3, 4), (1, 1, 2)]  # shards 1 and 2
    # cp=1: two shards on the one rank, shard 0 of every document first
    one = per_doc_cp_layout([[0, 1]], [5, 3], 1)
    assert one.ranks[0] == [(0, 0, 3), (1, 0, 1), (0, 3, 5), (1, 1, 3)]


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_shards_are_equal_when_the_replica_is_a_multiple_of_2cp(cp):
    rng = np.random.default_rng(cp)
    docs = [int(x) for x in rng.integers(1, 5000, size=40)]
    docs[-1] += -sum(docs) % (2 * cp)            # DistCA pads so; then its assert holds: equal shards
    lay = per_doc_cp_layout([list(range(len(docs)))], docs, cp)
    assert (lay.tokens_per_rank() == sum(docs) // cp).all()
    ch = lay.chunk_array()
    for d in range(len(docs)):                    # each document's shards tile it, heads and tails
        mine = ch[ch[:, 0] == d]
        assert (mine[:, 2] - mine[:, 1]).sum() == docs[d]


def test_layout_and_the_whole_replica_gather():
    docs = [100_000, 60_000, 50_000, 30_000, 20_000]
    lay = wlb_distca_layout(docs, 4, 2, model="llama3-8b")
    assert lay.doc_lens == docs and lay.total_tokens == sum(docs)
    ch = lay.chunk_array()
    assert {int(r) // 2 for r in ch[ch[:, 0] == 0, 3]} == {0} and set(ch[ch[:, 0] == 1, 3]) == {2, 3}
    sent, recv = replica_gather_tokens(lay, 2)
    own = lay.tokens_per_rank()
    assert (sent == own).all() and (recv == own.reshape(2, 2)[:, ::-1].ravel()).all()
    # every document on every rank of its group: the replica's gather is the sharing ranks' gather
    pairs = zip(replica_gather_tokens(lay, 2), per_doc_gather_tokens(lay))
    assert all(np.array_equal(a, b) for a, b in pairs)
    lone = wlb_distca_layout([6000, 1, 1], 4, 2)     # a 1-token document lies on one rank of its group
    assert replica_gather_tokens(lone, 2)[1].sum() > per_doc_gather_tokens(lone)[1].sum()
    assert lone.doc_lens == [6000, 1, 1] and len(wlb_distca_layout([6000], 4, 2).doc_lens) == 2   # a dummy
    with pytest.raises(ValueError, match="cp=3 must divide n_ranks=4"):
        wlb_distca_layout(docs, 4, 3)


def test_the_replica_gather_of_documents_cut_over_replicas():
    from cadlib.data.packing import wlb_layout
    docs = [30_000, 500, 9_000, 700, 2_000, 1_184, 20_000]
    for cp in (1, 2):
        lay = wlb_layout(docs, 4, cp, 16_000)         # ours: costly documents cut over replicas
        sent, recv = replica_gather_tokens(lay, cp)
        ps, pr = per_doc_gather_tokens(lay)
        assert sent.sum() == recv.sum() and (recv >= pr).all() and (sent >= ps).all()
        if cp == 1:                                   # one rank a group: the sharing ranks' gather
            assert np.array_equal(sent, ps) and np.array_equal(recv, pr)
        ch = lay.chunk_array()
        for r in range(4):                            # every token of every document of the group but its own
            mine = {int(d) for d in ch[ch[:, 3] // cp == r // cp, 0]}
            assert recv[r] == sum(docs[d] for d in mine) - lay.tokens_per_rank()[r]

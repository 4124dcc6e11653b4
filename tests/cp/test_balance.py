"""Balance metrics of the CP dispatches (cadlib.cp.balance) and the closed-form volumes' equal-shard forms
(cadlib.cp.volume) on hand-sized cases; the bytes the implementations really send are pinned to them in
tests/cp/test_cp.py (the gloo check's volume suite)."""
import numpy as np
import pytest

from cadlib.cp.balance import balance_metrics, entropy, gini, rank_work
from cadlib.cp.volume import equal_shard, grid, kv_heads_per_rank, per_rank
from cadlib.data.masks import make_mask

MECHS = ("allgather", "ring", "ulysses", "usp", "loongtrain", "cad")


def test_metrics_of_even_and_lopsided_work():
    even = balance_metrics([5, 5, 5, 5], [2, 2, 2, 2])
    assert even["area_entropy"] == pytest.approx(1) and even["area_gini"] == pytest.approx(0.75)
    assert even["max_total"] == 0.25 and even["max_mean"] == 1 and even["range_gini"] == pytest.approx(0.75)
    one = balance_metrics([0, 8, 0, 0], [0, 4, 0, 0])
    assert one["area_entropy"] == 0 and one["area_gini"] == 0 and one["max_total"] == 1 and one["max_mean"] == 4
    assert entropy([1, 3]) == pytest.approx(-(0.25 * np.log(0.25) + 0.75 * np.log(0.75)) / np.log(2))
    assert gini([1, 3]) == pytest.approx(1 - 0.25 ** 2 - 0.75 ** 2)


@pytest.mark.parametrize("mask", ["causal", "full", "causal_document", "full_document"])
@pytest.mark.parametrize("world", [4, 8])
def test_every_mechanism_spreads_exactly_the_mask_area(mask, world):
    m = make_mask(mask, 512 * world, seed=3)
    causal = mask.startswith("causal")
    for name in MECHS:
        if name == "cad" and not causal:
            with pytest.raises(ValueError, match="causal masks only"):
                rank_work(name, m.document_lengths(), world, causal)
            continue
        area, tok = rank_work(name, m.document_lengths(), world, causal, min_shard=16)
        assert area.sum() == pytest.approx(m.area()) and tok.sum() == pytest.approx(m.total), name
    # the zigzag balances a single causal document exactly; the contiguous Ulysses split too (by heads)
    for name in ("ring", "ulysses", "usp", "loongtrain"):
        if mask == "causal":
            assert balance_metrics(*rank_work(name, [512 * world], world))["max_mean"] == pytest.approx(1)


def test_equal_shard_forms_by_hand():
    """4 ranks, T = 64 (n = 16), Hq:Hkv = 8:2, D = 8, bf16 (b = 2): the module docstring's table."""
    h = dict(total=64, world=4, heads=(8, 2), head_dim=8, elem_bytes=2)
    kv_blk = 16 * 2 * 2 * 8                               # n 2Hkv D = 512 elements
    assert equal_shard("ring", **h) == {"fwd": 3 * kv_blk * 2, "bwd": 3 * kv_blk * 2 + 4 * kv_blk * 4}
    assert equal_shard("allgather", **h) == {"fwd": 3 * kv_blk * 2, "bwd": 6 * kv_blk * 2}
    # Ulysses over 4 ranks with 2 KV heads: one replicated KV head per rank (h = 1), 2 query heads
    assert kv_heads_per_rank(8, 2, 4) == 1 and grid("ulysses", 4) == (4, 1, 1)
    assert equal_shard("ulysses", **h) == {"fwd": 3 * 16 * (2 * 2 * 8 * 2 + 2 * 8 * 2 + 2 * 4),
                                           "bwd": 3 * 16 * (2 * 2 * 8 * 2 + 2 * 8 * 2)}
    # LoongTrain on 4 ranks: u = 1, windows of 2: the KV of the ring, the accumulators 4 inner + 2 outer hops
    assert grid("loongtrain", 4) == (1, 4, 2)
    lt = equal_shard("loongtrain", **h)
    assert lt["fwd"] == equal_shard("ring", **h)["fwd"] and lt["bwd"] == 3 * kv_blk * 2 + 6 * kv_blk * 4
    for name in ("ring", "allgather", "ulysses", "usp", "loongtrain"):     # the exact per-rank form agrees
        pr = per_rank(name, [64], 4, (8, 2), 8, 2)
        assert pr["fwd"] == [equal_shard(name, **h)["fwd"]] * 4 and pr["bwd"] == [equal_shard(name, **h)["bwd"]] * 4
    with pytest.raises(ValueError, match="multiple of 2 \\* world"):
        equal_shard("ring", 60, 4, (8, 2), 8, 2)
    with pytest.raises(ValueError, match="cad: per_rank with its plan"):
        equal_shard("cad", **h)

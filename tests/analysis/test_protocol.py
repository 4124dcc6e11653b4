"""The paper's protocol as replay settings (cadlib.analysis.replay.protocol): its choices, WLB's degrees,
and a waterfall of our variants that ends exactly at the replay's earlier settings."""
from dataclasses import fields

import pytest

from cadlib.analysis.replay import protocol as P
from cadlib.analysis.replay.settings import paper_3d_settings


def test_wlb_degrees_are_the_two_largest_admissible():
    assert P.wlb_degrees(8, 8) == (8, 4)
    assert P.wlb_degrees(32, 32) == (32, 16)
    assert P.wlb_degrees(8, 2) == (8, 4)          # 512K on 64 GPUs: 2 sequences, at most 2 replicas
    assert P.wlb_degrees(4, 1, top=3) == (4,)
    with pytest.raises(ValueError, match="no CP degree"):
        P.wlb_degrees(3, 1)


def test_protocol_settings_follow_table_3():
    ss = P.paper_3d("pretrain")
    assert len(ss) == 9 and all(s.tokens == 131072 and s.sequence_len == s.max_doc_len for s in ss)
    assert all(s.batches == P.PAPER_BATCHES_3D and s.nano_split == "distca" and not s.optimizer for s in ss)
    with pytest.raises(ValueError, match="unknown dataset"):
        P.paper_3d("pile")


@pytest.mark.parametrize("dataset", ["pretrain", "prolong"])
def test_the_waterfall_ends_at_the_earlier_replay(dataset):
    old = {s.name: s for s in paper_3d_settings(P.PAPER_BATCHES_3D)}
    for s in P.paper_3d(dataset):
        v = P.variant(s, P.VARIANTS[-1].name)
        o = old[s.name]
        same = [f.name for f in fields(o) if f.name not in ("name", "methods")]   # the paper's methods: a subset
        assert [f for f in same if getattr(o, f) != getattr(v, f)] == []
        assert set(v.methods) <= set(o.methods)


def test_variants_change_one_thing_and_name_themselves():
    s = P.paper_3d("prolong")[0]
    assert P.one_change(s, "backward").backward == "stateful" and P.one_change(s, "backward").nano_split == "distca"
    assert P.one_change(s, "samplers").dist == "prolong" and P.one_change(s, "samplers").sequence_len is None
    assert P.variant(s, "nano").name == s.name + "@upto-nano"
    assert P.one_change(s, "nano").name == s.name + "@nano"
    with pytest.raises(ValueError, match="unknown variant"):
        P.one_change(s, "kernel")

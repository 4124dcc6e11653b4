"""The layout's array form (cadlib.core.layout): ``Layout.from_chunks`` is the same layout as ``Layout``
from per-rank lists, validated alike, and the per-rank lists it materialises on demand are the
original ones."""
import pickle

import numpy as np
import pytest
from helpers import random_scattered_plan

from cadlib.core.layout import Chunk, Layout
from cadlib.data.packing import per_doc_zigzag_layout


@pytest.mark.parametrize("seed", range(20))
def test_from_chunks_is_the_list_layout(seed):
    lay = random_scattered_plan(seed, 1 + seed % 5).layout                 # some ranks empty
    ch = lay.chunk_array()
    arr = Layout.from_chunks(np.array(ch), lay.doc_lens, lay.n_ranks)
    assert arr == lay and arr.ranks == lay.ranks and arr.local_offsets() == lay.local_offsets()
    assert all(type(c) is Chunk and type(c.doc) is int for r in arr.ranks for c in r)
    assert np.array_equal(arr.tokens_per_rank(), lay.tokens_per_rank())
    shuffled = np.array(ch)[np.random.default_rng(seed).permutation(len(ch))]
    by_rank = shuffled[np.argsort(shuffled[:, 3], kind="stable")]
    assert Layout.from_chunks(shuffled, lay.doc_lens, lay.n_ranks) == Layout.from_chunks(
        by_rank, lay.doc_lens, lay.n_ranks)                      # rows grouped by rank, stably
    s = lay.sorted_chunks()
    assert np.array_equal(s.key, np.sort(ch[:, 0] * s.big + ch[:, 1]))
    assert np.array_equal(s.doc, ch[s.order, 0]) and np.array_equal(s.rank, ch[s.order, 3])
    assert pickle.loads(pickle.dumps(arr)) == lay


def test_arrays_are_read_only_and_immutable_ones_are_shared():
    lay = per_doc_zigzag_layout([5, 9, 1], 3)
    ch = lay.chunk_array()
    with pytest.raises(ValueError):
        ch[0, 0] = 1
    assert Layout.from_chunks(ch, lay.doc_lens, 3).chunk_array() is ch      # read-only: no copy
    mine = np.array(ch)
    other = Layout.from_chunks(mine, lay.doc_lens, 3)
    mine[0, 2] = 0                                               # the caller's copy, not the layout's
    assert other == lay


def test_from_chunks_errors_name_the_parameter():
    with pytest.raises(ValueError, match=r"chunks must be an integer array \[n_chunks, 4\]"):
        Layout.from_chunks(np.zeros((2, 3), dtype=np.int64), [1], 1)
    with pytest.raises(ValueError, match="chunks must be an integer array"):
        Layout.from_chunks(np.zeros((1, 4)), [1], 1)
    with pytest.raises(ValueError, match=r"names rank 2; valid ranks are 0\.\.1 \(n_ranks=2\)"):
        Layout.from_chunks([[0, 0, 1, 2]], [1], 2)
    with pytest.raises(ValueError, match="n_ranks must be an integer >= 1"):
        Layout.from_chunks([[0, 0, 1, 0]], [1], 1.0)
    with pytest.raises(ValueError, match=r"tokens \[2, 4\) are held by no rank"):
        Layout.from_chunks([[0, 0, 2, 0]], [4], 1)
    with pytest.raises(ValueError, match="held twice"):
        Layout.from_chunks([[0, 0, 3, 0], [0, 2, 4, 1]], [4], 2)
    with pytest.raises(ValueError, match="a layout needs at least one rank"):
        Layout.from_chunks(np.zeros((0, 4), dtype=np.int64), [1], 0)

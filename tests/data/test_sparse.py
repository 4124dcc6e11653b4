"""Block-sparse masks (cadlib.data.sparse): exact areas against dense counts, the benchmark's top-k and
block-size rules, seeds, and the mask-slice form."""
import numpy as np
import pytest

from cadlib.data.sparse import (SPARSITIES, UNIFORM, VARIABLE, BlockSparseMask, dense_reference, kept_blocks,
                                make_sparse_mask, random_partition, uniform_block_sparse, variable_block_sparse)


@pytest.mark.parametrize("sparsity", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("block", [8, 16])
def test_uniform_area_equals_the_dense_count(sparsity, block):
    m = uniform_block_sparse(128, block, sparsity, heads=3, seed=1)
    n = 128 // block
    k = kept_blocks(n, sparsity)
    assert (m.blocks.sum(-1) == k).all()                        # every row block keeps exactly k
    for h in range(m.heads):
        dense = dense_reference(m, h)
        assert (m.to_dense(h) == dense).all()
        assert m.head_areas()[h] == dense.sum() == n * k * block * block
    assert m.area() == sum(dense_reference(m, h).sum() for h in range(3))
    assert m.flops(12, 16) == 4 * 16 * 4 * m.area() and m.flops(12, 16, "bwd") == 2.5 * m.flops(12, 16)


@pytest.mark.parametrize("sparsity", [0.2, 0.8])
def test_variable_blocks_are_random_at_least_the_minimum_and_exact(sparsity):
    m = variable_block_sparse(1024, 64, sparsity, heads=2, min_block=32, seed=3)
    assert m.blocks.shape == (2, 16, 16)
    assert (m.rows >= 32).all() and (m.cols >= 32).all() and (m.rows.sum(1) == 1024).all()
    assert len({tuple(r) for r in m.rows}) == 2 and not (m.rows == m.cols).all()   # sizes drawn per head
    for h in range(2):
        dense = dense_reference(m, h)
        assert m.head_areas()[h] == dense.sum()
        assert (m.head_mask(h).to_dense() == dense).all()
        assert m.head_mask(h).area() == dense.sum()


def test_the_benchmark_top_k_rule():
    assert [kept_blocks(128, s) for s in (0.1, 0.5, 0.9, 1.0)] == [12, 64, 115, 128]
    assert kept_blocks(4, 0.1) == 1                              # at least one block
    assert SPARSITIES[0] == 0.1 and SPARSITIES[-1] == 0.9


def test_a_draw_is_keyed_by_its_parameters():
    a = uniform_block_sparse(256, 16, 0.5, heads=2, seed=42)
    assert (a.blocks == uniform_block_sparse(256, 16, 0.5, heads=2, seed=42).blocks).all()
    assert (a.blocks != uniform_block_sparse(256, 16, 0.5, heads=2, seed=43).blocks).any()
    assert (a.blocks[0] != a.blocks[1]).any()                    # one pattern per (KV) head
    v = make_sparse_mask(VARIABLE, 1024, 256, 0.5, heads=1, seed=0)
    assert v.name == VARIABLE and (v.rows >= 128).all()          # the benchmark's minimum block, 128


def test_a_4x4_block_mask_by_hand():
    blocks = np.array([[[1, 0, 0, 1], [0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 1]]], dtype=bool)
    m = BlockSparseMask(UNIFORM, 8, blocks, np.full((1, 4), 2), np.full((1, 4), 2))
    assert m.area() == 9 * 4 and m.sparsity() == 36 / 64
    assert [s[:2] for s in m.head_mask(0).slices()] == [((0, 2), (0, 2)), ((0, 2), (6, 8)), ((2, 4), (2, 6)),
                                                         ((4, 6), (0, 8)), ((6, 8), (6, 8))]


def test_errors_name_the_parameter():
    with pytest.raises(ValueError, match="multiple of block"):
        uniform_block_sparse(100, 64, 0.5)
    with pytest.raises(ValueError, match="sparsity"):
        uniform_block_sparse(128, 64, 0.0)
    with pytest.raises(ValueError, match="min_block"):
        variable_block_sparse(1024, 64, 0.5)
    with pytest.raises(ValueError, match="unknown block-sparse mask 'dense'"):
        make_sparse_mask("dense", 128, 64, 0.5)
    with pytest.raises(ValueError, match="at least 4"):
        random_partition(np.random.default_rng(0), 10, 3, 4)
    with pytest.raises(ValueError, match="multiple of the mask's 2 heads"):
        uniform_block_sparse(128, 64, 0.5, heads=2).flops(3, 16)

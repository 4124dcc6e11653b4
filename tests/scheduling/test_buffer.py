"""DistCA's all-to-all buffer and tolerance rule (cadlib.scheduling.buffer): the bytes a plan needs,
own rows included, with either backward's bytes per token, and the first tolerance whose plans fit,
or tolerance 1.0 and a grown buffer."""
import pytest

from cadlib.core.cost import ModelSpec
from cadlib.core.layout import layout_from_lists
from cadlib.core.paper import DISTCA_TOLERANCE_FACTORS
from cadlib.core.plan import Plan
from cadlib.scheduling.buffer import GIB, RECORD_KEYS, a2a_need, fit_buffer
from cadlib.scheduling.distca import distca_plan

SPEC = ModelSpec.from_name("llama3-8b").shard(8)   # Q 1024 B, K+V 512 B, LSE 16 B per token


def test_need_counts_every_rank_s_own_rows_and_the_backward_s_bytes():
    # rank 0 holds doc 0 [0, 8), rank 1 doc 1 [0, 2); server 0 serves doc 0's [0, 5), server 1 its
    # [5, 8) and doc 1. With own rows, rank 0 sends Q 5 + 3 and KV 5 (prefix [0, 5) to itself) + 8
    # (prefix [0, 8) to server 1); server 1 receives Q 3 + 2 and KV 8 + 2.
    lay = layout_from_lists([[(0, 0, 8)], [(1, 0, 2)]], [8, 2])
    plan = Plan.from_arrays(lay, [0, 0, 1], [0, 5, 0], [5, 8, 2], [0, 0, 1], [0, 1, 1], n_servers=2)
    q, kv = plan.token_matrices(local=True)
    assert q.tolist() == [[5, 3], [0, 2]] and kv.tolist() == [[5, 8], [0, 2]]
    assert [m.tolist() for m in plan.token_matrices()] == [[[0, 3], [0, 0]], [[0, 8], [0, 0]]]
    # stateful: the dispatch (Q 1024, KV 512) is the largest: rank 0 sends 8 x 1024 + 13 x 512
    assert a2a_need([plan], SPEC) == 8 * 1024 + 13 * 512 == 14848
    # resend: the backward's dispatch carries dO, O, LSE, Q per query token (2 x 1024 + 16 + 1024)
    assert a2a_need([plan], SPEC, resend=True) == 8 * 3088 + 13 * 512 == 31360
    assert a2a_need([plan, plan], SPEC, resend=True) == 31360           # the max over the plans


def _skewed():
    # rank 0: 20 documents of 10 tokens (1100 pairs); rank 1: 300 documents of 1 token (300 pairs).
    # Mean 700: rank 1 needs 400 and takes whole documents of 55 pairs while its need is above
    # tolerance x 700: 7 at 0.05-0.09 (need 15 left), 6 at 0.1 (70 <= 70), 5 at 0.2 (125 <= 140).
    # Rank 1 receives the most, its own 300 rows and 10 per document taken: 370, 360, 350 tokens.
    lay = layout_from_lists([[(d, 0, 10) for d in range(20)], [(20 + i, 0, 1) for i in range(300)]],
                            [10] * 20 + [1] * 300)
    return lay, lambda tol: [distca_plan(lay, model=SPEC, tolerance=tol)]


def test_the_first_tolerance_that_fits_is_chosen():
    lay, plan_at = _skewed()
    per = 3088 + 512                                 # resend: the backward's dispatch per token
    needs = [a2a_need(plan_at(t), SPEC, resend=True) / per for t in (0.05, 0.09, 0.1, 0.2)]
    assert needs == [370, 370, 360, 350]
    fit = fit_buffer(plan_at, SPEC, buffer_gib=355 * per / GIB, resend=True)
    assert fit.tolerance == 0.2 and not fit.grown and fit.need == 350 * per
    assert fit.tried == (0.05, 0.06, 0.07, 0.08, 0.09, 0.1, 0.2) and fit.made[0].meta["n_moves"] == 5
    assert fit.meta() == {"tolerance": 0.2, "buffer_need_gib": 350 * per / GIB, "buffer_gib": 355 * per / GIB,
                          "buffer_grown": False, "tolerances_tried": 7}
    assert set(fit.meta()) == set(RECORD_KEYS)
    # the stateful backward's bytes (1024 + 512 per token) fit the same buffer at 0.05 already
    assert fit_buffer(plan_at, SPEC, buffer_gib=355 * per / GIB).tolerance == 0.05
    # a larger minimum (DistCA's MIN_TOLERANCE_FACTOR) starts the list there
    assert fit_buffer(plan_at, SPEC, buffer_gib=1.0, min_tolerance=0.3).tried == (0.3,)


def test_nothing_fits_runs_tolerance_one_with_a_grown_buffer():
    lay, plan_at = _skewed()
    fit = fit_buffer(plan_at, SPEC, buffer_gib=1e6 / GIB, resend=True)
    # even at 1.0 (no move) rank 1's own 300 rows need 300 x 3600 = 1,080,000 bytes > 1e6
    assert fit.tolerance == 1.0 and fit.grown and fit.need == 1_080_000
    assert fit.tried == tuple(t for t in DISTCA_TOLERANCE_FACTORS if t >= 0.05)
    assert fit.buffer == 1.5 * GIB                    # ceil(0.001 GiB) + 0.5, DistCA's growth
    assert fit.made[0].meta["n_moves"] == 0 and fit.meta()["buffer_grown"] is True


def test_bad_arguments_are_named():
    _, plan_at = _skewed()
    with pytest.raises(ValueError, match="buffer_gib must be a finite number > 0"):
        fit_buffer(plan_at, SPEC, buffer_gib=0)
    with pytest.raises(ValueError, match="min_tolerance must be a finite number >= 0"):
        fit_buffer(plan_at, SPEC, min_tolerance=-1)
    with pytest.raises(ValueError, match="above every tolerance tried"):
        fit_buffer(plan_at, SPEC, min_tolerance=1.5)

"""Pipeline schedules: 1F1B and DistCA's lock-step ticks run every microbatch once in a valid order,
their point-to-point batches cannot deadlock, and the lock-step ticks are what DistCA's code runs."""
import pytest

from cadlib.core.pipeline import (Msg, Op, check_deadlock_free, check_order, lockstep, lockstep_orders,
                                  one_f_one_b, p2p_1f1b, p2p_lockstep, split_layers)


@pytest.mark.parametrize("pp", range(1, 7))
@pytest.mark.parametrize("n_micro", range(1, 11))
def test_schedules_are_valid_and_deadlock_free(pp, n_micro):
    orders = one_f_one_b(pp, n_micro)
    check_order(orders, n_micro)
    check_deadlock_free(p2p_1f1b(orders))
    for s, ops in enumerate(orders):     # 1F1B keeps at most w_s + 1 microbatches in flight
        live = peak = 0
        for op in ops:
            live += 1 if op.kind == "F" else -1
            peak = max(peak, live)
        assert peak <= min(pp - s, n_micro)
    ticks = lockstep(pp, n_micro)
    assert len(ticks) == 2 * n_micro + 2 * (pp - 1)          # as many slots as 1F1B
    check_order(lockstep_orders(ticks), n_micro)
    check_deadlock_free(p2p_lockstep(ticks), collectives=True)


def test_lockstep_matches_distca_figure_8():
    # 3 stages, 4 microbatches: 2 warm-up forward ticks, 4 (F, B) pairs, 2 drain ticks; every tick
    # one phase; stage 0's first backward is deferred into the end
    got = [(t.phase, t.micro) for t in lockstep(3, 4)]
    assert got == [("F", (0, None, None)), ("F", (1, 0, None)),
                   ("F", (2, 1, 0)), ("B", (None, None, 0)),
                   ("F", (3, 2, 1)), ("B", (None, 0, 1)),
                   ("F", (None, 3, 2)), ("B", (0, 1, 2)),
                   ("F", (None, None, 3)), ("B", (1, 2, 3)),
                   ("B", (2, 3, None)), ("B", (3, None, None))]


def test_one_f_one_b_is_megatrons_order():
    assert one_f_one_b(2, 3) == [[Op("F", 0), Op("F", 1), Op("B", 0), Op("F", 2), Op("B", 1), Op("B", 2)],
                                 [Op("F", 0), Op("B", 0), Op("F", 1), Op("B", 1), Op("F", 2), Op("B", 2)]]


def test_checks_catch_broken_schedules():
    orders = one_f_one_b(2, 2)
    with pytest.raises(ValueError, match="exactly once"):
        check_order([orders[0][:-1], orders[1]], 2)
    swapped = [orders[0], [orders[1][1], orders[1][0], *orders[1][2:]]]    # B(0) before F(0)
    with pytest.raises(ValueError, match="deadlocks"):
        check_order(swapped, 2)
    batches = p2p_1f1b(orders)
    batches[1][0] = [Msg("act", 1, 0, 1)]            # stage 1 waits for microbatch 1 first
    with pytest.raises(ValueError, match="deadlock"):
        check_deadlock_free(batches)


def test_split_layers_and_bad_input():
    assert split_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    with pytest.raises(ValueError, match="pp=3 must divide the model's 8 layers"):
        split_layers(8, 3)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="pp must be an integer >= 1"):
            one_f_one_b(bad, 2)
        with pytest.raises(ValueError, match="n_micro must be an integer >= 1"):
            lockstep(2, bad)

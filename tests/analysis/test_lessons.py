"""The lessons' hand-sized examples: what the notebooks tell a reader to count by hand."""
import numpy as np
import pandas as pd
import pytest

from cadlib import ModelSpec, pack, schedule
from cadlib.analysis.runs import e2e, timelines
from cadlib.analysis.lessons import cad, exercises, toys
from cadlib.analysis.figures import plots, static as figures_html
from cadlib.core import spans
from cadlib.cp import protocol


def test_unit_step_of_the_stragglers_toy():
    step = toys.unit_step(pack([8, 2, 2, 2, 2], 2, 8))
    assert step.pairs.tolist() == [36, 12] and step.busy.tolist() == [44, 20]
    assert step.attrs["step"] == 44 and step.attrs["idle_fraction"] == pytest.approx(24 / 88)
    assert toys.unit_step(protocol.zigzag_layout([32], 4)).pairs.tolist() == [132] * 4


def test_one_move_by_hand():
    model = ModelSpec.from_name("llama3-8b")
    two = pack([16], 2, 8)
    hand = cad.shard_candidates(two, donor=1, receiver=0, model=model)
    assert hand.loc["start shard", "shard"] == "[8, 11)" and hand.loc["start shard", "bytes added"] == 36864
    assert hand.loc["end shard", "shard"] == "[14, 16)" and hand.loc["end shard", "bytes added"] == 49152
    plan = schedule(two, model=model, tolerance=0.05, min_shard=1)
    assert [(t.q_start, t.q_end) for t in plan.tasks if t.server != t.home] == [(8, 11)]


def test_the_three_rank_toy_token_by_token():
    plan = schedule(pack([24, 8, 8, 8], 3, 16), model="tiny", tolerance=0.1, min_shard=4)
    sends = cad.dispatch_table(plan)
    kv02 = sends[(sends["from"] == 0) & (sends.to == 2) & (sends.what == "KV")].iloc[0]
    assert kv02.tokens == 16 and kv02.which == "d0[0:16)"
    call, seqlens = cad.server_call(plan, 2)
    assert seqlens["cu_seqlens_q"] == [0, 8, 16, 20] and len(call) == 3
    assert cad.token_runs([16, 17, 18, 1000, 1001]) == "d0[16:19) d1[0:2)"
    with pytest.raises(ValueError, match="documents up to 1000 tokens"):
        cad.token_ids(pack([2000], 1, 2000))


def test_the_end_to_end_measures_by_hand():
    runs = toys.toy_runs({"colocated": 10, "cad": 8.8, "cad-pingpong": 8.4, "signal-only": 8.2}, [6, 2])
    b = e2e.summarise(runs, {}, 2)["per_batch"][0]
    assert b["saving_frac"] == pytest.approx(0.2) and b["recovered"] == pytest.approx(0.8)
    assert b["exposed_comm_frac"] == pytest.approx(0.2 / 8.4)
    assert b["pingpong_gain"] == pytest.approx(8.8 / 8.4)


def test_the_tick_table_as_a_timeline():
    one, two = (timelines.ideal_timeline(2, pingpong=p) for p in (False, True))
    assert one.end_ms.max() == 14 and two.end_ms.max() == 10
    assert spans.overlap(one.to_dict("records"))["overlap_ratio"] == 0
    assert spans.overlap(two.to_dict("records"))["overlap_ratio"] == 1
    slow = timelines.ideal_timeline(2, comm=1.5)
    assert slow.end_ms.max() == 14
    assert spans.overlap(slow.to_dict("records"))["overlap_ratio"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="n_layers must be >= 1"):
        timelines.ideal_timeline(0)


def test_linear_gaps_give_one_stream_the_same_stages():
    tf = pd.DataFrame([
        {"rank": 0, "method": "cad", "lane": "step", "phase": "forward", "start_ms": 0.0, "end_ms": 10.0,
         "direction": "step"},
        {"rank": 0, "method": "cad", "lane": "comm", "phase": "send ", "start_ms": 2.0, "end_ms": 3.0,
         "direction": "forward"},
        {"rank": 0, "method": "cad", "lane": "compute", "phase": "attn ", "start_ms": 3.00001, "end_ms": 5.0,
         "direction": "forward"}])
    out = timelines.stage_frame(timelines.with_linear_gaps(tf))
    lin = out[out.stage == "linear"]
    assert lin[["start_ms", "end_ms"]].values.tolist() == [[0.0, 2.0], [5.0, 10.0]] and lin.inferred.all()
    assert set(out.stage) == {"linear", "send", "attn"}


def test_exercises_check_and_solve(capsys):
    assert exercises.check(None, 3, what="e") is None and "not answered yet" in capsys.readouterr().out
    assert exercises.check(3, 3, what="e") and not exercises.check(4, 3, what="e", hint="h")
    assert exercises.check(0.333, 1 / 3, what="e", rel=0.01)
    exercises.solve({"a": (1 + 2, 3), "b": (0.5, 0.5000001, 1e-3)})
    with pytest.raises(AssertionError, match="exercise 'c'"):
        exercises.solve({"c": (1, 2)})


def test_maths_is_rendered_offline_and_code_is_left_alone():
    out = figures_html.render_math("pairs $n(n+1)/2$ in `$code$`, and $$\\sum_i i$$, \\$5")
    assert out.count("<math") == 2 and "`$code$`" in out and "\\$5" in out and 'display="block"' in out


def test_picker_shows_one_figure_at_a_time():
    figs = {k: plots.rank_loads({"x": np.arange(3) + i}, k) for i, k in enumerate(("a", "b"))}
    fig = plots.with_picker(figs)
    assert [t.visible for t in fig.data] == [True, False]
    assert [b.label for b in fig.layout.updatemenus[0].buttons] == ["a", "b"]
    with pytest.raises(ValueError, match="at least one figure"):
        plots.with_picker({})


def test_block_sparse_pictures_and_areas():
    from cadlib.data import sparse

    m = sparse.variable_block_sparse(1024, 256, 0.5, heads=2, min_block=16)
    assert np.array_equal(toys.block_picture(m, 1, 1024), sparse.dense_reference(m, 1))   # one pixel a token
    u = sparse.uniform_block_sparse(4096, 64, 0.3, heads=1)
    assert np.array_equal(toys.block_picture(u, 0, 64), u.blocks[0])                       # one pixel a block
    assert np.array_equal(toys.block_picture(u, 0, 16, span=1024), u.blocks[0][:16, :16])
    with pytest.raises(ValueError, match="span in 1..4096"):
        toys.block_picture(u, 0, 16, span=5000)
    areas = toys.sparse_areas(4096, (0.1, 0.5), {sparse.UNIFORM: (64,), sparse.VARIABLE: (512,)}, heads=4)
    uni, var = areas[areas.family == sparse.UNIFORM], areas[areas.family == sparse.VARIABLE]
    assert np.allclose(uni["area / T^2"], uni["k / N"]) and (uni["kept k"] == [6, 32]).all()
    assert (var["head min"] < var["head max"]).all()          # random block sizes: each head its own area


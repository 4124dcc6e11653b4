"""The end-to-end helpers: overlap of communication by compute, the tick-order check, timeline frames,
committed result files as tables, and the paper-beside-ours rows."""
import math

import pandas as pd
import pytest

from cadlib.analysis.report import metrics
from cadlib.analysis.runs import e2e, timelines
from cadlib.core import defaults, spans


def span(lane, phase, a, b):
    return {"lane": lane, "phase": phase, "start_ms": float(a), "end_ms": float(b)}


def test_overlap_ratio_counts_unions_once():
    rows = [span("comm", "send A", 0, 10), span("comm", "send B", 5, 15),      # comm union [0, 15)
            span("compute", "linear B", 2, 6), span("compute", "attn A", 4, 8),  # compute union [2, 8)
            span("compute", "linear A", 12, 20), span("step", "forward", 0, 20)]
    o = spans.overlap(rows)
    assert o["comm_ms"] == 15 and o["overlapped_ms"] == 6 + 3
    assert spans.overlap_ratio(rows) == pytest.approx(9 / 15)
    assert spans.overlap_ratio(pd.DataFrame(rows)) == pytest.approx(9 / 15)


def test_overlap_by_direction_and_without_comm():
    rows = [span("comm", "send A", 0, 4), span("compute", "linear B", 0, 4),
            span("comm", "send' A", 10, 14), span("compute", "linear B'", 14, 20)]
    assert spans.overlap_ratio(rows, "forward") == 1.0
    assert spans.overlap_ratio(rows, "backward") == 0.0
    assert math.isnan(spans.overlap_ratio([span("compute", "attn", 0, 1)]))
    with pytest.raises(ValueError, match="direction"):
        spans.overlap(rows, "sideways")


def _pingpong_rows(n_layers, swap=None):
    fwd = [p for _ in range(n_layers) for p in spans.PINGPONG_STAGES]
    bwd = [p for _ in range(n_layers) for p in spans.PINGPONG_STAGES[::-1]]
    if swap is not None:
        fwd[swap], fwd[swap + 1] = fwd[swap + 1], fwd[swap]
    rows, t = [span("compute", "linear A", 0, 1)], 1
    for p in fwd:
        verb, nano = p.split()
        rows.append(span("compute" if verb == "attn" else "comm", p, t, t + 1))
        t += 1
    for p in bwd:
        verb, nano = p.split()
        rows.append(span("compute" if verb == "attn" else "comm", f"{verb}' {nano}", t, t + 1))
        rows.append(span("compute", f"linear {nano}'", t, t + 1))
        t += 1
    return rows


def test_tick_order_accepts_the_schedule_and_names_the_first_difference():
    spans.check_tick_order(_pingpong_rows(3), 3, pingpong=True)
    with pytest.raises(ValueError, match="layer 1"):
        spans.check_tick_order(_pingpong_rows(3, swap=7), 3)
    with pytest.raises(ValueError, match="stages recorded"):
        spans.check_tick_order(_pingpong_rows(2), 3)
    one = [span("comm", "send ", 0, 1), span("compute", "attn ", 1, 2), span("comm", "return ", 2, 3),
           span("comm", "return' ", 3, 4), span("compute", "attn' ", 4, 5), span("comm", "send' ", 5, 6)]
    spans.check_tick_order(one, 1, pingpong=False)
    with pytest.raises(ValueError, match="n_layers"):
        spans.check_tick_order(one, 0)


def test_timeline_frame_from_files_and_runs_takes_the_last_step():
    rows = [span("compute", "attn A", 0, 1), span("comm", "send' A", 1, 2), span("step", "forward", 0, 1)]
    f1 = timelines.timeline_frame({"rank0": {"cad": rows}, "rank1": {"cad": [rows[:1], rows]}})
    assert len(f1) == 6 and set(f1["rank"]) == {0, 1}
    assert f1.direction.tolist()[:3] == ["forward", "backward", "step"]
    f2 = timelines.timeline_frame([{"rank": 3, "timelines": {"cad": rows}}])
    assert f2["rank"].unique().tolist() == [3]


def test_committed_results_load_as_settings():
    loaded = e2e.load_committed()
    if not loaded:
        pytest.skip("no committed bench_e2e results")
    table = e2e.settings_table(loaded)
    assert len(table) == len(loaded) and table.batches.min() >= 1
    for item in loaded:
        s = e2e.speedups(item["results"]["per_batch"], item["kernel_only_spans"])
        assert set(s.method) >= {"cad-pingpong"} and (s.speedup > 0).all()
        if not item["kernel_only_spans"]:
            assert s.predicted.isna().all()


def test_kernel_only_spans_is_read_from_the_colocated_timeline():
    cp = {"rank0": {"colocated": [span("compute", "cp", 0, 2), span("compute", "attn", 0, 1)]}}
    old = {"rank0": {"colocated": [span("compute", "attn", 0, 1)]}}
    assert e2e.kernel_only_spans({"timelines": cp}, {"colocated_impl": "allgather"})
    assert not e2e.kernel_only_spans({"timelines": old}, {"colocated_impl": "allgather"})
    assert not e2e.kernel_only_spans({"timelines": cp}, {"colocated_impl": "all-to-all"})


def test_record_metrics_keeps_rows_without_a_value():
    out = metrics.record_metrics([{"metric": "a", "ours": 1.2, "paper": 1.35, "unit": "x", "kind": "measured"},
                              {"metric": "b", "ours": float("nan"), "paper": None, "kind": "measured"}])
    assert list(out.metric) == ["a", "b"]


def test_layer_window_clips_one_layer_and_starts_at_zero():
    rows = _pingpong_rows(3)
    w = timelines.layer_window(rows, 1, "forward")
    assert w.start_ms.min() == 0 and spans.stage_sequence(w) == list(spans.PINGPONG_STAGES)
    wb = timelines.layer_window(rows, 2, "backward")
    assert spans.stage_sequence(wb, "backward") == list(spans.PINGPONG_STAGES[::-1])
    with pytest.raises(ValueError, match="layer must be in"):
        timelines.layer_window(rows, 3)


def test_exposed_by_stage_names_where_communication_waited():
    def span(lane, phase, a, b):
        return {"lane": lane, "phase": phase, "start_ms": a, "end_ms": b}
    rows = [span("comm", "send A", 0, 4), span("compute", "linear B", 2, 10),      # 2 ms exposed
            span("comm", "send B", 9, 15), span("compute", "attn A", 10, 12),      # 9-15 vs 9-12: 3 exposed
            span("comm", "send B", 20, 21), span("step", "forward", 0, 30)]        # 1 more
    df = timelines.exposed_by_stage(rows)
    assert df.phase.tolist() == ["send B", "send A"]
    assert df.set_index("phase").loc["send B"].tolist() == [2, 7.0, 4.0]
    assert df.set_index("phase").loc["send A", "exposed_ms"] == 2.0
    assert timelines.exposed_by_stage([span("compute", "attn", 0, 1)]).empty


def test_setting_label_names_what_differs_from_the_defaults():
    cfg = {"dist": "pretrain", "tokens_per_rank": 65536, "link": "nvlink", "nproc": 2,
           "tolerance": defaults.DEFAULT_TOLERANCE, "nano_split": defaults.DEFAULT_NANO_SPLIT,
           "comm_ctas": defaults.DEFAULT_COMM_CTAS["nvlink"], "sent_last": defaults.DEFAULT_SENT_LAST}
    assert e2e.setting_label(cfg) == "pretrain 64K nvlink x2"
    other = "no sent-last" if defaults.DEFAULT_SENT_LAST else "sent-last"
    label = e2e.setting_label({**cfg, "sent_last": not defaults.DEFAULT_SENT_LAST})
    assert label == f"pretrain 64K nvlink x2 {other}"
    assert e2e.setting_label({**cfg, "tolerance": 0.05, "comm_ctas": None}) == \
        "pretrain 64K nvlink x2 eps 0.05 NCCL's CTAs"

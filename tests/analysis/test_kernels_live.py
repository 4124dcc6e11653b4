"""cadlib.analysis.runs.kernels.live_beside_committed: 4.2's live subset of the kernel x mask table."""

import pandas as pd

from cadlib.analysis.runs import kernels


def rows(*cells):
    return pd.DataFrame(
        [dict(zip(("mask", "seqlen", "direction", "backend", "status", "tflops"), c)) for c in cells]
    )


def test_live_cells_sit_beside_the_committed_ones_with_their_devices():
    committed = rows(
        ("causal", 8192, "fwd", "fa4", "ok", 400.0),
        ("causal", 8192, "fwd", "flex", "ok", 200.0),
        ("causal", 32768, "fwd", "fa4", "ok", 500.0),
        ("causal_document", 8192, "fwd", "fa4", "X", None),
    )
    live = rows(
        ("causal", 8192, "fwd", "fa4", "ok", 380.0),
        ("causal", 8192, "fwd", "flex", "-", None),
        ("causal_document", 8192, "fwd", "fa4", "X", None),
        ("share_question", 8192, "fwd", "fa4", "X", None),
    )
    t = kernels.live_beside_committed(committed, "1x NVIDIA H200", live, "1x NVIDIA H100")
    assert list(t.columns) == ["committed (1x NVIDIA H200)", "live (1x NVIDIA H100)", "live / committed"]
    assert len(t) == 4  # the live run's cells
    assert tuple(t.loc[("causal", 8192, "fwd", "fa4")]) == ("400", "380", "0.95")
    assert tuple(t.loc[("causal", 8192, "fwd", "flex")]) == ("200", "-", "")  # not reached live
    assert tuple(t.loc[("share_question", 8192, "fwd", "fa4")]) == ("", "X", "")  # not in the committed file


def test_without_a_live_run_the_committed_subset_is_shown():
    committed = rows(
        ("causal", 8192, "fwd", "fa4", "ok", 400.0),
        ("causal", 32768, "bwd", "fa4", "ok", 500.0),
        ("full", 8192, "fwd", "fa4", "ok", 600.0),
    )
    t = kernels.live_beside_committed(committed, "1x NVIDIA H200", masks=["causal"], seqlens=[8192, 32768])
    assert list(t.columns) == ["committed (1x NVIDIA H200)"] and len(t) == 2
    assert kernels.live_beside_committed(None, "").empty


def test_a_live_run_where_no_kernel_ran_shows_its_symbols():
    committed = rows(("causal", 8192, "fwd", "fa4", "ok", 400.0))
    live = pd.DataFrame([{"mask": "causal", "seqlen": 8192, "direction": "fwd", "backend": "fa4", "status": "X"}])
    t = kernels.live_beside_committed(committed, "1x NVIDIA H200", live, "CPU")
    assert tuple(t.loc[("causal", 8192, "fwd", "fa4")]) == ("400", "X", "")

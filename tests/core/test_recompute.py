"""The least recompute that fits (cadlib.core.recompute): no recompute while it fits, the MLP's when
the memory model's peak without it passes the headroom, and what a run records of the choice."""
import pytest

from cadlib.core.cost import as_model
from cadlib.core.memory import GIB, OURS, OURS_FUSED, estimate, method_rows
from cadlib.core.recompute import HEADROOM, least_recompute

SPEC = as_model("llama3-8b", n_layers=4)
METHODS = ["colocated", "cad-pingpong"]


def test_no_recompute_while_it_fits_and_the_mlp_when_it_does_not():
    small = least_recompute(SPEC, METHODS, 65536, 1, 140 * GIB)
    assert (small["recompute"], small["fits"]) == ("none", True) and list(small["peak_gib"]) == ["none"]
    big = least_recompute(SPEC, METHODS, 262144, 1, 140 * GIB)
    assert big["recompute"] == "mlp" and big["fits"]
    assert max(big["peak_gib"]["none"].values()) > HEADROOM * 140 >= max(big["peak_gib"]["mlp"].values())
    worst = least_recompute(SPEC, METHODS, 1 << 22, 1, 140 * GIB)
    assert (worst["recompute"], worst["fits"]) == ("mlp", False)
    assert least_recompute(SPEC, METHODS, 1 << 22, 1, None)["recompute"] == "none"      # the CPU


def test_the_peak_is_the_models_for_the_method_and_profile():
    got = least_recompute(SPEC, ["cad-pingpong"], 131072, 1, 1e15, fused=False)
    want = estimate(SPEC, method_rows("cad", 131072, profile=OURS), recompute="none", profile=OURS)
    assert got["peak_gib"]["none"]["cad-pingpong"] == pytest.approx(want["peak"] / GIB)
    assert got["profile"] == "cadlib"
    fused = least_recompute(SPEC, ["colocated"], 131072, 1, 1e15)
    assert fused["profile"] == "cadlib-fused"


def test_fused_profile_drops_only_the_swiglu_row_blocks():
    rows = method_rows("cad", 131072, profile=OURS)
    ref, fu = (estimate(SPEC, rows, recompute="mlp", profile=p) for p in (OURS, OURS_FUSED))
    assert fu["activations"] == ref["activations"] and fu["moments"]["mlp"] < ref["moments"]["mlp"]
    assert {k: v for k, v in fu["moments"].items() if k != "mlp"} == \
        {k: v for k, v in ref["moments"].items() if k != "mlp"}


def test_bad_arguments_name_the_parameter():
    with pytest.raises(ValueError, match="headroom"):
        least_recompute(SPEC, METHODS, 1024, 1, GIB, headroom=1.5)
    with pytest.raises(ValueError, match="unknown method 'ring'"):
        least_recompute(SPEC, ["ring"], 1024, 1, GIB)

"""The one vocabulary: each module's subset of the methods comes from cadlib.core.methods, and the dtype
names from cadlib.core.precision match the runtime's torch dtypes."""
import pytest
import torch

from cadlib import train_args
from cadlib.analysis.model import band
from cadlib.analysis.replay import pipelined
from cadlib.analysis.whatif import planner, verdict
from cadlib.core.methods import METHODS, method, names
from cadlib.core.precision import DTYPE_BYTES, DTYPES, RTOL, TRAIN_DTYPES
from cadlib.runtime.kernels import TORCH_DTYPES


def test_subsets_are_derived_from_the_properties():
    assert tuple(METHODS) == ("colocated", "wlb", "varlen", "cad", "cad-pingpong", "signal-only")
    assert train_args.METHODS == names(trainable=True) == \
        ("colocated", "wlb", "cad", "cad-pingpong", "signal-only")
    assert planner.METHODS == ("colocated", "wlb", "cad-pingpong")
    assert planner.BASELINES == ("colocated", "wlb")
    assert verdict.LABELS["wlb"] == "WLB-ideal" and verdict.LABELS["cad-pingpong"] == "CAD (ping-pong)"
    assert pipelined.METHODS_4D == ("colocated", "wlb", "cad-pingpong", "signal-only")
    assert band.METHODS == ("colocated", "wlb", "cad", "cad-pingpong") and band.BASES == ("colocated", "wlb")
    assert names(pingpong=True) == ("cad-pingpong", "signal-only")
    assert all(METHODS[m].cad for m in names(pingpong=True))          # ping-pong is a CAD schedule
    assert names(signal_only=True) == ("signal-only",)


def test_unknown_names_and_properties_are_named():
    with pytest.raises(ValueError, match="unknown method 'ring'; choose one of: colocated, wlb, varlen"):
        method("ring")
    with pytest.raises(ValueError, match="unknown method properties \\['overlap'\\]"):
        names(overlap=True)


def test_dtype_names_tolerances_and_torch_dtypes_agree():
    assert set(TRAIN_DTYPES) <= set(DTYPES) == set(RTOL) == set(TORCH_DTYPES)
    for name in DTYPES:
        assert torch.finfo(TORCH_DTYPES[name]).bits == 8 * DTYPE_BYTES[name]
    assert RTOL["fp32"] < RTOL["fp16"] < RTOL["bf16"]

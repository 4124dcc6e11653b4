"""Cost-model formulas against hand-computed cases."""
import numpy as np
import pytest

from cadlib.core.cost import (ATTN_BWD_MULT, CAD_A2A, CAD_A2A_TO_SERVERS, ModelSpec, attention_tflops,
                              causal_pairs, shard_efficiency)


def test_causal_pairs_hand_cases():
    assert causal_pairs(0, 1) == 1                      # token 0 sees itself
    assert causal_pairs(0, 4) == 1 + 2 + 3 + 4
    assert causal_pairs(2, 4) == 3 + 4                  # tokens 2, 3 see [0,2] and [0,3]
    assert causal_pairs(5, 5) == 0
    n = 131072
    assert causal_pairs(0, n) == n * (n + 1) // 2
    # splitting a query range never changes the total
    assert causal_pairs(0, 100) == causal_pairs(0, 37) + causal_pairs(37, 100)
    np.testing.assert_array_equal(causal_pairs([0, 2], [4, 4]), [10, 7])


def test_causal_pairs_rejects_bad_ranges():
    with pytest.raises(ValueError):
        causal_pairs(4, 2)
    with pytest.raises(ValueError):
        causal_pairs(-1, 2)


def test_llama3_8b_linear_flops():
    m = ModelSpec.from_name("llama3-8b")
    # QKV 4096*(4096+2*1024) + O 4096*4096 + MLP 3*4096*14336 = 218_103_808 params per layer
    assert m.linear_params_per_layer() == 4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336
    assert m.linear_flops_per_token(layers=1) == 2 * 218_103_808
    assert m.linear_flops_per_token(layers=1, backward=True) == 3 * 2 * 218_103_808
    assert m.linear_flops_per_token() == 32 * 2 * 218_103_808


def test_cad_all_to_all_bytes_per_token_follow_the_backward():
    m = ModelSpec.from_name("llama3-8b").shard(8)           # 4 query heads, 1 KV head of 128
    assert m.cad_a2a_bytes() == {"in": (1024, 512), "out": (1024, 0), "out_bwd": (1024, 0),
                                 "in_bwd": (1024, 512)}
    # DistCA's get_per_token_bytes with resend: query part (3 hq + lse) x 2 bytes, lse = 4 heads x fp32
    # in bf16 elements (8): (3 x 512 + 8) x 2 = 3088; the forward's return O + LSE, (512 + 8) x 2
    r = m.cad_a2a_bytes(resend=True)
    assert r == {"in": (1024, 512), "out": (1040, 0), "out_bwd": (3088, 512), "in_bwd": (1024, 512)}
    assert list(r) == list(CAD_A2A) and set(CAD_A2A_TO_SERVERS) < set(CAD_A2A)


def test_attention_flops_and_bytes():
    m = ModelSpec.from_name("llama3-8b")
    assert m.attention_flops(10, layers=1) == 4 * 10 * 32 * 128
    assert m.attention_flops(10, layers=1, backward=True) == 4 * 10 * 32 * 128 * (1 + ATTN_BWD_MULT)
    assert m.q_bytes("bf16") == 32 * 128 * 2
    assert m.kv_bytes("bf16") == 2 * 8 * 128 * 2
    assert m.kv_bytes("fp32") == 2 * 8 * 128 * 4
    assert m.lse_bytes() == 32 * 4
    assert m.activation_bytes_per_token() > m.q_bytes()


def test_model_lookup_and_validation():
    assert ModelSpec.from_name("LLaMA-34B").n_heads == 64
    assert ModelSpec.from_name("tiny", n_layers=4).n_layers == 4
    with pytest.raises(ValueError, match="choose one of: tiny, llama3-8b, llama-34b"):
        ModelSpec.from_name("llama2")
    with pytest.raises(ValueError, match="multiple"):
        ModelSpec("x", 1, 64, 4, 3, 16, 128, 10)
    with pytest.raises(ValueError, match="dtype"):
        ModelSpec.from_name("tiny").q_bytes("int3")


def test_measured_rates_and_shard_efficiency():
    # the measured table is reproduced at its own points
    assert attention_tflops(512, "fa2", backward=True) == 261
    assert attention_tflops(16384, "fa4", backward=False) == 669
    assert attention_tflops(1 << 20, "fa2") == 311                      # clamped above
    assert shard_efficiency(64, backward=False) == pytest.approx(0.46)  # the measured 64-token point
    assert 0.9 <= shard_efficiency(128, backward=False) <= 0.96
    assert shard_efficiency(128) == pytest.approx(168 / 311)
    assert shard_efficiency(512) == pytest.approx(261 / 311)
    assert shard_efficiency(2048) == pytest.approx(305 / 311)
    assert 0 < shard_efficiency(32) < shard_efficiency(128)            # extrapolated, still positive
    with pytest.raises(ValueError, match="fa2, fa4"):
        attention_tflops(512, "fa3")

"""The memory model against hand-computed cases, its monotonicity, and its input checks."""
import pytest

from cadlib.core.cost import as_model
from cadlib.core.memory import (CAPACITY, MEGATRON, OURS, Rows, configs, estimate, fits, in_flight,
                                layer_bytes, max_tokens, method_rows, stage_params)

TINY = as_model("tiny")          # 2 layers, hidden 64, 4 q / 2 kv heads of 16, ffn 128, vocab 256


def test_params_of_the_tiny_model_by_hand():
    layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64     # q, k, v, o, MLP, two norms
    assert stage_params(TINY) == 2 * layer + 256 * 64 + (256 * 64 + 64)  # + embedding, head, final norm
    # the pipeline's stages hold the same parameters between them
    assert sum(stage_params(TINY, pp=2, stage=s) for s in range(2)) == stage_params(TINY)
    # TP=2: half the heads and of the MLP, half the vocabulary; the norms whole
    layer2 = 64 * 32 + 2 * 64 * 16 + 32 * 64 + 3 * 64 * 64 + 2 * 64
    assert stage_params(TINY, tp=2) == 2 * layer2 + 128 * 64 + (128 * 64 + 64)


def test_params_of_the_measured_runs():
    # the end-to-end runs recorded sum(p.numel()) of their llama3-8b with 4 layers
    assert stage_params(as_model("llama3-8b", n_layers=4)) == 1_923_125_248


def test_layer_bytes_by_hand():
    n = 10
    # mlp recompute: layer input, norm output, MLP input (bf16) and one fp32 rstd per token
    # attention: q (64 b), k and v (32 b each), o (64 b) and the fp32 lse of 4 heads
    assert layer_bytes(TINY, Rows(n), "mlp") == {"linear": n * (3 * 64 * 2 + 4),
                                                  "attention": n * (64 * 2 + 2 * 32 * 2 + 64 * 2 + 16)}
    assert layer_bytes(TINY, Rows(n), "none")["linear"] == n * (4 * 64 * 2 + 8 + 3 * 128 * 2)
    assert layer_bytes(TINY, Rows(n), "full") == {"linear": n * 64 * 2, "attention": 0}
    # a CAD server's received rows and the home's own O
    cad = layer_bytes(TINY, Rows(n, q=n + 3, kv=n + 5, out=n + 3, home_o=n), "mlp")["attention"]
    assert cad == (n + 3) * 128 + (n + 5) * 128 + (n + 3) * 144 + n * 128
    # sequence parallelism shards the hidden-sized tensors, TP the heads
    assert layer_bytes(TINY, Rows(n), "mlp", MEGATRON, tp=2)["linear"] == n * (3 * 32 * 2 + 4)


def test_state_and_optimizer_moment_by_hand():
    p = stage_params(TINY)
    e = estimate(TINY, [Rows(0)])                      # no tokens: the optimizer step is the peak
    assert (e["weights"], e["init_copy"], e["optimizer"]) == (2 * p, 2 * p, 4 * p)
    assert e["moment"] == "opt" and e["peak"] == 12 * p   # + bf16 grads and the foreach sqrt copy
    m = estimate(TINY, [Rows(0)], profile=MEGATRON, dp=4)
    assert m["optimizer"] == 12 * p // 4 and m["grads"] == 4 * p   # sharded fp32 master + moments


def test_in_flight():
    assert in_flight(4, 8) == (4, 3, 2, 1)             # 1F1B: stage s keeps min(p - s, m)
    assert in_flight(4, 2) == (2, 2, 2, 1)
    assert in_flight(1, 5) == (1,)
    assert all(a >= b for a, b in zip(in_flight(4, 8, "lockstep"), in_flight(4, 8)))


def test_monotone():
    spec = as_model("llama3-8b", n_layers=4)
    peaks = [estimate(spec, [Rows(n)])["peak"] for n in (1024, 8192, 65536, 131072)]
    assert peaks == sorted(peaks)
    acts = [estimate(spec, [Rows(65536)], recompute=r)["activations"] for r in ("full", "mlp", "none")]
    assert acts == sorted(acts) and len(set(acts)) == 3
    cps = [fits("llama3-8b", "wlb", 65536, tp=8, cp=c)["activations"] for c in (1, 2, 4, 8)]
    assert cps == sorted(cps) and len(set(cps)) == 4   # Megatron keeps the gathered K, V
    pp = [fits("llama3-8b", "wlb", 65536, tp=8, pp=4, n_micro=m, stage=0)["activations"] for m in (1, 2, 4)]
    assert pp == sorted(pp) and len(set(pp)) == 3      # more micro-batches in flight on stage 0
    # ping-pong's two halves need less than one whole batch (the MLP backward's working set halves)
    assert estimate(spec, [Rows(65536), Rows(65536)])["peak"] < estimate(spec, [Rows(131072)])["peak"]


def test_max_tokens_is_the_edge():
    kw = dict(tp=8, cp=4, dp=2, recompute="mlp")
    n = max_tokens("llama3-8b", "wlb", step=4096, **kw)
    assert n > 0 and fits("llama3-8b", "wlb", n, **kw)["fits"]
    assert not fits("llama3-8b", "wlb", n + 4096, **kw)["fits"]
    assert fits("llama3-8b", "wlb", n, **kw)["peak"] <= CAPACITY
    assert max_tokens("llama3-8b", "wlb", capacity=1e9, tp=8) == 0      # the weights alone do not fit


def test_configs_for_both_methods():
    rows = configs("llama3-8b", 64, 8 * 524288, max_micro=8)
    assert {r["method"] for r in rows} == {"wlb", "cad"}
    assert all(r["tp"] * r["pp"] * r["cp"] * r["dp"] == 64 for r in rows)
    assert all(r["cp"] == 1 for r in rows if r["method"] == "cad")
    assert all(r["fits"] == (r["peak"] <= CAPACITY) for r in rows)
    assert any(r["fits"] for r in rows) and not all(r["fits"] for r in rows)
    assert not any(r["recompute"] == "full" for r in rows if r["method"] == "cad")   # DistCA has none


def test_method_rows():
    assert method_rows("wlb", 100, cp=4, profile=MEGATRON) == [Rows(100, kv=400)]
    assert method_rows("wlb", 100, cp=4, profile=OURS) == [Rows(100, call_kv=400, regather=400)]
    assert [r.tokens for r in method_rows("cad", 101)] == [50, 51]


@pytest.mark.parametrize("call, name", [
    (lambda: stage_params(TINY, tp=0), "tp"),
    (lambda: stage_params(TINY, pp=3), "stage must be"),
    (lambda: estimate(TINY, [Rows(4)], recompute="some"), "recompute"),
    (lambda: estimate(TINY, [Rows(4)], profile="deepspeed"), "profile"),
    (lambda: estimate(TINY, []), "nanos"),
    (lambda: estimate(TINY, [Rows(4)], ce_chunk=0), "ce_chunk"),
    (lambda: Rows(-1), "Rows.tokens"),
    (lambda: Rows(4, kv=2.5), "Rows.kv"),
    (lambda: in_flight(2, 2, "gpipe"), "schedule"),
    (lambda: method_rows("ring", 10), "method"),
    (lambda: configs(TINY, 0, 10), "gpus"),
])
def test_bad_input_raises_naming_it(call, name):
    with pytest.raises(ValueError, match=name):
        call()

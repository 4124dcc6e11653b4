"""CAD attention against the single-process reference.

In-process (one rank, no process group): shared KV prefixes, the byte packing, error messages, and
that the check notices a wrong dispatch. Multi-process (``@pytest.mark.multiproc``): gloo on CPU via
``cadlib.verify`` on 1-4 ranks (forked by ``tests/ranks.py``), every distribution, 1-token documents, an empty
rank and a document spanning all ranks, scheduler plans and random plans; fp32 rel err <= 1e-5."""
import numpy as np
import pytest
import ranks
import torch

from cadlib import testing
from cadlib.core.cost import ModelSpec
from cadlib.core.layout import Layout, global_rows
from cadlib.core.plan import CATask, Plan
from cadlib.core.precision import RTOL
from cadlib.data.workload import DISTRIBUTIONS
from cadlib.dispatch.build import build_dispatch
from cadlib.infra.launch import TorchrunError
from cadlib.runtime.comm import pack_rows, unpack_rows
from cadlib.runtime.stages import cad_attention, prepare
from cadlib.testing import random_inputs, random_plan, rank_inputs, reference, reference_errors

TINY = ModelSpec.from_name("tiny")
TINY_HEADS = (TINY.n_heads, TINY.n_kv_heads, TINY.head_dim)
FP32_RTOL = RTOL["fp32"]


def one_rank_problem(seed=0):
    """One rank holding three documents in shuffled chunks; tasks cut so several share a KV prefix."""
    layout = Layout([[(1, 30, 70), (0, 0, 50), (2, 0, 1), (1, 0, 30)]], [50, 70, 1])
    tasks = [CATask(0, 0, 7, 0, 0), CATask(0, 7, 33, 0, 0), CATask(0, 33, 50, 0, 0),
             CATask(1, 0, 30, 0, 0), CATask(1, 30, 31, 0, 0), CATask(1, 31, 70, 0, 0), CATask(2, 0, 1, 0, 0)]
    plan = Plan(layout, tasks)
    return layout, plan, random_inputs(layout.total_tokens, TINY_HEADS, seed)


def run_one_rank(plan, full, dispatch=None, kv_share=None):
    rows = global_rows(plan.layout, 0)
    q, k, v, dout = rank_inputs(full, rows)
    o, lse = cad_attention(q, k, v, dispatch or plan, None, return_lse=True, kv_share=kv_share)
    o.backward(dout)
    return reference_errors((o, q.grad, k.grad, v.grad), full, plan.layout.doc_lens, rows), lse


@pytest.mark.parametrize("kv_share", ["merged", "copy"])
def test_one_rank_shared_prefixes_match_reference(kv_share):
    layout, plan, full = one_rank_problem()
    errs, lse = run_one_rank(plan, full, kv_share=kv_share)
    assert max(errs) <= FP32_RTOL, errs
    assert lse.dtype == torch.float32 and lse.shape == (layout.total_tokens, TINY.n_heads)
    assert torch.isfinite(lse).all()
    assert prepare(plan, None, "cpu") is prepare(plan, None, "cpu")     # built once per plan


@pytest.mark.parametrize("kv_share", ["merged", "copy"])
def test_wrong_dispatch_is_detected(kv_share):
    from cadlib.core.plan import merge_groups
    layout, plan, full = one_rank_problem(1)
    d = build_dispatch(plan, 0)
    d.kv_rows = d.kv_rows.copy()
    j = next(j for j, i in enumerate(d.tasks) if plan.tasks[i].q_start == 0 and plan.tasks[i].q_end > 5)
    if kv_share == "merged":                       # the merged segment reads its group's last KV copy
        g = merge_groups(d.task_doc, d.task_start, d.task_end)
        j = int(np.flatnonzero(g == g[j])[-1])
    k0 = int(d.cu_k[j])                            # a segment whose queries see KV tokens 3 and 4 apart
    d.kv_rows[[k0 + 3, k0 + 4]] = d.kv_rows[[k0 + 4, k0 + 3]]
    errs, _ = run_one_rank(plan, full, d, kv_share)
    assert max(errs) > 1e-3, errs


def test_home_rows_view_only_when_the_rest_is_small():
    from cadlib.runtime.buffers import home_rows

    out = torch.arange(18.0).view(18, 1)
    assert home_rows(out, 16).data_ptr() == out.data_ptr()          # 2 rows after 16: a view
    own = home_rows(out, 8)                                          # 10 rows after 8: a copy
    assert own.data_ptr() != out.data_ptr() and own.flatten().tolist() == list(range(8))


def test_pack_rows_round_trip_mixed_dtypes():
    a = torch.randn(5, 3, 4, dtype=torch.bfloat16)
    b = torch.randn(5, 3, dtype=torch.float32)
    c = torch.randn(5, 2, 4, dtype=torch.float64)
    buf = pack_rows([a, b, c])
    assert buf.dtype == torch.uint8 and buf.shape == (5, 3 * 4 * 2 + 3 * 4 + 2 * 4 * 8)
    for x, y in zip(unpack_rows(buf, [a, b, c]), (a, b, c)):
        assert x.dtype == y.dtype and torch.equal(x, y)
    empty = [a[:0], b[:0]]
    assert [t.shape for t in unpack_rows(pack_rows(empty), empty)] == [(0, 3, 4), (0, 3)]


@pytest.mark.parametrize("n", [0, 1, 2, 5])
def test_unpack_rows_with_odd_half_widths(n):
    # bf16 with an odd heads x head_dim puts the next part at an odd byte offset; a 0/1-row slice is
    # already "contiguous", so the unpack must copy before viewing it as float32
    a = torch.randn(n, 3, 5).to(torch.bfloat16)
    b = torch.randn(n, 3, dtype=torch.float32)
    c = torch.randn(n, 1, 3).to(torch.float16)
    got = unpack_rows(pack_rows([a, b, c]), [a[:0], b[:0], c[:0]])
    assert all(torch.equal(x, y) for x, y in zip(got, (a, b, c)))


def test_blocked_reference_matches_sdpa():
    gen = torch.Generator().manual_seed(0)
    n = 37
    q, dout = torch.randn(n, 4, 8, generator=gen), torch.randn(n, 4, 8, generator=gen)
    k, v = torch.randn(n, 2, 8, generator=gen), torch.randn(n, 2, 8, generator=gen)
    old, testing.REF_BLOCK = testing.REF_BLOCK, 10
    try:
        got = testing.blocked_reference(q, k, v, dout)
    finally:
        testing.REF_BLOCK = old
    want = reference(q, k, v, dout, [n], [0])
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("argv, fragment", [
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--tokens-per-rank", "0"], "--tokens-per-rank must be >= 1"),
    (["--dist", "prolog"], "unknown distribution 'prolog'"),
    (["--model", "gpt5"], "unknown --model 'gpt5'"),
    (["--tolerance-eps", "-1"], "--tolerance-eps"),
    (["--rtol", "0"], "--rtol must be > 0"),
])
def test_verify_rejects_bad_flags(argv, fragment, capsys):
    from cadlib import verify
    with pytest.raises(SystemExit):
        verify.parse_args(argv)
    assert fragment in capsys.readouterr().err


def test_errors_say_what_is_valid():
    layout, plan, full = one_rank_problem()
    q = torch.zeros(3, TINY.n_heads, TINY.head_dim)
    with pytest.raises(ValueError, match=r"q has 3 rows, but this rank holds n_local=121 tokens"):
        cad_attention(q, q, q, plan, None)
    rows = torch.as_tensor(global_rows(layout, 0))
    qq, kk, vv = (t.index_select(0, rows) for t in full[:3])
    for bad, what in (((qq.long(), kk.long(), vv.long()), "dtype torch.int64; cad_attention takes"),
                      ((qq, kk[:, :1, :3], vv[:, :1, :3]), "q and k must share head_dim"),
                      ((qq[:, :3], kk, vv), r"query heads \(3\) must be a multiple of KV heads"),
                      ((qq[0], kk, vv), "q must be a 3-D tensor"),
                      ((qq.half(), kk, vv), "q, k, v must share a dtype")):
        with pytest.raises(ValueError, match=what):
            cad_attention(*bad, plan, None)
    with pytest.raises(ValueError, match="unknown attention backend 'fa9'"):
        cad_attention(qq, kk, vv, plan, None, attn_backend="fa9")
    two = Plan(Layout([[(0, 0, 4)], [(0, 4, 8)]], [8]), [CATask(0, 0, 4, 0, 0), CATask(0, 4, 8, 1, 1)])
    with pytest.raises(ValueError, match="plan is for rank 0 of 2 but this process is rank 0 of a group of"):
        cad_attention(q, q, q, two, None)
    with pytest.raises(ValueError, match="must be a cadlib.core.plan.Plan or a cadlib.dispatch.meta.Dispatch"):
        cad_attention(q, q, q, "plan", None)


def test_random_plan_keeps_every_query_once():
    layout = Layout([[(0, 0, 20), (1, 0, 5)], [], [(0, 20, 64)]], [64, 5])
    plan = random_plan(layout, seed=3)
    assert plan.n_servers == 3 and len(plan.tasks) >= 3
    assert {t.server for t in plan.tasks} <= {0, 1, 2}


# ------------------------------------------------------------------------------------ multi-process
COMMON = ["--tokens-per-rank", "512", "--max-doc-len", "700", "--min-shard", "32", "--dtype", "fp32",
          "--dist", ",".join(DISTRIBUTIONS)]


def launch(world, args, rtol=FP32_RTOL):
    df = ranks.run("cadlib.verify", world, COMMON + args)
    assert len(df) == world and df["passed"].all()
    cases = [c for c in df.attrs["results"][0]["cases"] if "skipped" not in c]
    for c in cases:
        assert max(c["rel_err"].values()) <= rtol, c
        assert np.isclose(sum(c["load_before"]), sum(c["load_after"]))
    return df, cases


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_cad_matches_reference_scheduler_plans(world):
    df, cases = launch(world, ["--case", "random,one-token,empty-rank,spanning"])
    n_dists = len(DISTRIBUTIONS)
    assert len(df.attrs["results"][0]["cases"]) == 4 * n_dists
    assert len(cases) == (3 if world == 1 else 4) * n_dists
    assert sum(c["identity_servers"] for c in cases) > 0
    if world > 1:
        # the scheduler really rebalanced: something moved, and no case got worse than before
        assert any(c["q_tokens_sent"] > 0 for c in cases)
        for c in cases:
            before = max(c["load_before"]) / np.mean(c["load_before"])
            assert c["imbalance_after"] <= before + 1e-9
        # the servers that read their buffers without gather/scatter (Dispatch.q_identity) ran,
        # among them servers that also received other ranks' queries
        assert sum(c["identity_receiving"] for c in cases) > 0
        empty = [c for c in cases if c["case"] == "empty-rank"]
        assert all(min(c["load_before"]) == 0 for c in empty)


@pytest.mark.multiproc
def test_cad_matches_reference_random_plans():
    # random splits on random servers, several seeds: far more irregular than the scheduler's plans
    _, cases = launch(3, ["--plan", "random", "--case", "random,one-token,empty-rank,spanning",
                          "--dist", "pretrain,pile,uniform", "--repeats", "2"])
    assert len(cases) == 3 * 4 * 2 and all(c["kv_tokens_sent"] > 0 for c in cases)


@pytest.mark.multiproc
def test_bad_input_raises_on_every_rank_before_the_all_to_all():
    # rank 0 passes bf16, rank 1 float32 (and, second round, every rank passes integers): each rank
    # must raise a ValueError; none may hang in a collective
    from pathlib import Path
    target = Path(__file__).resolve().parents[1] / "launch_targets" / "cad_bad_input.py"
    df = ranks.run(target, 2, timeout=120)
    assert len(df) == 2
    for errs in df["errors"]:
        assert "ranks disagree" in errs[0] and "dtype torch.int64" in errs[1], errs


@pytest.mark.multiproc
def test_verify_fails_when_it_checked_nothing():
    with pytest.raises(TorchrunError) as err:
        ranks.run("cadlib.verify", 1, ["--case", "empty-rank", "--tokens-per-rank", "64"], timeout=120)
    assert "FAILED: no case was checked" in (err.value.run_dir / "ranks" / "0" / "stdout.log").read_text()


@pytest.mark.multiproc
def test_cad_bf16_within_tolerance():
    _, cases = launch(2, ["--dtype", "bf16", "--dist", "pretrain", "--case", "random,spanning"], rtol=2e-2)
    assert all(max(c["rel_err"].values()) > 0 for c in cases)


@pytest.mark.multiproc
@pytest.mark.parametrize("kv_share", ["copy", "merged"])
def test_cad_kv_share_modes_match_reference_random_plans(kv_share):
    # the plain copy path stays the reference beside the merged one: both on the same random plans
    _, cases = launch(2, ["--plan", "random", "--case", "random,spanning", "--dist", "pretrain,uniform",
                          "--repeats", "2", "--kv-share", kv_share])
    assert len(cases) == 2 * 2 * 2 and all(c["kv_share"] == kv_share for c in cases)


@pytest.mark.multiproc
@pytest.mark.parametrize("plan", ["scheduler", "random"])
def test_cad_sent_last_matches_reference(plan):
    # plans re-ordered so that each rank's rows sent away come last (cadlib.scheduling.sentlast): donors' servers
    # read their query buffers (and the kept documents' KV) in place, their homes send and get back
    # a slice; random plans also make ranks that send, keep and receive at once
    _, cases = launch(3, ["--plan", plan, "--case", "random,one-token,empty-rank,spanning",
                          "--dist", "pretrain,uniform", "--sent-last"])
    assert all(c["sent_last"] for c in cases) and len(cases) == 2 * 4
    assert sum(c["identity_donors"] for c in cases) > 0
    if plan == "scheduler":               # kept documents whose sent part was their end: KV prefixes
        assert sum(c["kv_prefix_servers"] for c in cases) > 0

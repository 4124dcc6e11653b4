"""Server-side KV sharing (cadlib.dispatch.kvshare + cadlib.runtime.server), single process on CPU, fp32.

Every server of a random plan is run with the merged and the copy layout on buffers built from the
dispatch's global token ids (the exchanges simulated with numpy); outputs and dQ per query token, and
dK/dV summed over servers per KV token, are compared with each other and with the per-document fp32
SDPA reference of :func:`cadlib.testing.reference`."""
import numpy as np
import pytest
import torch
from helpers import random_scattered_plan

from cadlib.analysis.runs.server_bench import sharing_stats
from cadlib.core.cost import ModelSpec
from cadlib.core.layout import Layout, global_rows
from cadlib.core.plan import CATask, Plan, merge_groups
from cadlib.core.precision import RTOL as TOLERANCES
from cadlib.dispatch.build import build_all, build_dispatch, simulate_exchange
from cadlib.dispatch.kvshare import build_shared, check_mode, kv_accounting
from cadlib.runtime.device import to_device
from cadlib.runtime.server import add_rows, serve_backward, serve_forward
from cadlib.runtime.stages import cad_attention
from cadlib.testing import reference

TINY = ModelSpec.from_name("tiny")
RTOL = TOLERANCES["fp32"]


def run_servers(plan, full, kv_share, backend="sdpa_ref"):
    """Every server's forward and backward; returns global o, dq, dk, dv (dK/dV summed over servers)."""
    layout = plan.layout
    q, k, v, dout = full
    ds = build_all(plan)
    ids = [global_rows(layout, r) for r in range(layout.n_ranks)]
    recv_q = simulate_exchange(ds, ids, "q")
    recv_kv = simulate_exchange(ds, ids, "kv")
    o, dq = torch.zeros_like(q), torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for r, d in enumerate(ds):
        dd = to_device(d, "cpu")
        qid = torch.as_tensor(np.concatenate([ids[r], recv_q[r]]).astype(np.int64))
        kid = torch.as_tensor(np.concatenate([ids[r], recv_kv[r]]).astype(np.int64))
        qb, kb, vb = q[qid], k[kid], v[kid]
        out, lse = serve_forward(qb, kb, vb, dd, backend, kv_share)
        rows = qid[dd.q_rows]
        o[rows] = out
        g_q, g_k, g_v = serve_backward(qb, kb, vb, out, dout[qid][dd.q_rows], lse, dd, backend, kv_share)
        assert g_k.dtype == kb.dtype and g_k.shape == kb.shape
        dq[rows] = g_q
        dk.index_add_(0, kid, g_k)
        dv.index_add_(0, kid, g_v)
    return o, dq, dk, dv


def make_full(plan, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = plan.layout.total_tokens
    return [torch.randn(n, h, TINY.head_dim, generator=gen)
            for h in (TINY.n_heads, TINY.n_kv_heads, TINY.n_kv_heads, TINY.n_heads)]


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(0.1))   # 1-token documents: dq = 0 exactly


@pytest.mark.parametrize("seed", range(40))
def test_merged_equals_copy_equals_reference_on_random_plans(seed):
    plan = random_scattered_plan(seed, 1 + seed % 4)
    full = make_full(plan, seed)
    ref = reference(*full, plan.layout.doc_lens, range(plan.layout.n_docs))
    merged = run_servers(plan, full, "merged")
    copy = run_servers(plan, full, "copy")
    for name, m, c, r in zip(("o", "dq", "dk", "dv"), merged, copy, ref):
        assert rel(m, r) <= RTOL, (name, rel(m, r))
        assert rel(c, r) <= RTOL, (name, rel(c, r))
        assert rel(m, c) <= RTOL, (name, rel(m, c))


def test_contiguous_shards_merge_and_head_tail_stay_split():
    # doc 0 (32 tokens) on rank 0; server 0 holds [0, 8) [8, 16) [16, 24) (contiguous: one segment)
    # and doc 1's head [0, 4) and tail [12, 16) (DistCA pairing: two segments, prefix [0, 4) shared)
    layout = Layout([[(0, 0, 32), (1, 0, 16)], []], [32, 16])
    tasks = [CATask(0, 16, 24, 0, 0), CATask(0, 0, 8, 0, 0), CATask(0, 8, 16, 0, 0), CATask(0, 24, 32, 0, 1),
             CATask(1, 0, 4, 0, 0), CATask(1, 4, 12, 0, 1), CATask(1, 12, 16, 0, 0)]
    plan = Plan(layout, tasks)
    d = build_dispatch(plan, 0)
    sh = d.shared()
    assert sh.n_segments == 3 and sh.split_docs == 1
    assert np.diff(sh.cu_q).tolist() == [24, 4, 4] and np.diff(sh.cu_k).tolist() == [24, 16, 4]
    assert sh.rep_rows.size == 4                   # doc 1's tokens [0, 4): read by both of its segments
    acc = kv_accounting(d, TINY.kv_bytes("fp32"))
    assert acc["copy_kv_tokens"] == 8 + 16 + 24 + 4 + 16 and acc["merged_kv_tokens"] == 24 + 16 + 4
    assert acc["unique_kv_tokens"] == 24 + 16
    assert acc["merged_bwd_bytes"] < acc["copy_bwd_bytes"]
    full = make_full(plan, 1)
    ref = reference(*full, layout.doc_lens, [0, 1])
    for got, want in zip(run_servers(plan, full, "merged"), ref):
        assert rel(got, want) <= RTOL


def test_one_local_document_reads_the_buffer_itself():
    layout = Layout([[(0, 0, 64)]], [64])
    plan = Plan(layout, [CATask(0, a, a + 16, 0, 0) for a in range(0, 64, 16)])
    d = build_dispatch(plan, 0)
    sh = d.shared()
    assert sh.kv_identity and sh.all_once and sh.n_segments == 1
    acc = kv_accounting(d, 1)
    assert acc["merged_kv_tokens"] == acc["unique_kv_tokens"] == 64 and acc["merged_fwd_bytes"] == 0
    assert acc["copy_kv_tokens"] == 16 + 32 + 48 + 64


def test_merged_memory_equals_unique_kv_when_every_document_merges():
    layout = Layout([[(0, 0, 40), (1, 0, 30)], [(0, 40, 50)]], [50, 30])
    tasks = [CATask(0, 0, 20, 0, 1), CATask(0, 20, 40, 0, 1), CATask(0, 40, 50, 1, 1),
             CATask(1, 0, 10, 0, 0), CATask(1, 10, 30, 0, 0)]
    plan = Plan(layout, tasks)
    for d in build_all(plan):
        acc = kv_accounting(d, 1)
        assert acc["merged_kv_tokens"] == acc["unique_kv_tokens"] and acc["split_docs"] == 0


def test_call_order_keeps_groups_adjacent_and_longest_first():
    plan = random_scattered_plan(5, 3)
    for d in build_all(plan):
        g = merge_groups(d.task_doc, d.task_start, d.task_end)
        ends = [d.task_end[g == i].max() for i in range(int(g.max(initial=-1)) + 1)]
        assert ends == sorted(ends, reverse=True)
        for i in range(len(ends)):                 # inside a group: ascending, contiguous
            a, b = d.task_start[g == i], d.task_end[g == i]
            assert np.array_equal(a[1:], b[:-1])


@pytest.mark.parametrize("kv_share", ["merged", "copy"])
def test_cad_attention_one_rank_random_plans(kv_share):
    for seed in range(6):
        plan = random_scattered_plan(100 + seed, 1)
        full = make_full(plan, seed)
        rows = torch.as_tensor(global_rows(plan.layout, 0))
        q, k, v, dout = (t.index_select(0, rows).clone() for t in full)
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
        cad_attention(q, k, v, plan, None, kv_share=kv_share).backward(dout)
        ref = reference(*full, plan.layout.doc_lens, range(plan.layout.n_docs))
        for got, want in zip((q.grad, k.grad, v.grad), ref[1:]):
            assert rel(got, want.index_select(0, rows)) <= RTOL


def test_add_rows_sums_repeated_rows_in_fp32():
    dst = torch.zeros(4, 2, dtype=torch.bfloat16)
    index = torch.tensor([1, 3, 1, 1])
    uniq, slot = torch.tensor([1, 3]), torch.tensor([0, 1, 0, 0])
    src = torch.tensor([[256.0, 1], [1, 1], [1, 0], [1, 0]], dtype=torch.bfloat16)
    add_rows(dst, index, uniq, slot, src)
    assert dst[1].tolist() == [258.0, 1.0]           # bf16 one by one would give 256 + 1 + 1 = 256
    assert dst[3].tolist() == [1.0, 1.0] and dst[0].abs().sum() == 0


def test_bad_inputs_name_the_parameter():
    with pytest.raises(ValueError, match="kv_share must be one of merged, copy"):
        check_mode("paged")
    with pytest.raises(ValueError, match=r"diff\(cu_k\) != q_end"):
        build_shared([0], [0], [4], [0, 4], [0, 3], np.arange(3), 4)
    with pytest.raises(ValueError, match="one entry per task"):
        build_shared([0, 0], [0], [4], [0, 4], [0, 4], np.arange(4), 4)
    plan = random_scattered_plan(1, 1)
    with pytest.raises(ValueError, match="kv_share must be one of"):
        q = torch.zeros(plan.layout.total_tokens, TINY.n_heads, TINY.head_dim)
        k = torch.zeros(plan.layout.total_tokens, TINY.n_kv_heads, TINY.head_dim)
        cad_attention(q, k, k, plan, None, kv_share="nope")


def test_sharing_stats_counts_split_documents():
    layout = Layout([[(0, 0, 16)], []], [16])
    tasks = [CATask(0, 0, 4, 0, 1), CATask(0, 4, 12, 0, 0), CATask(0, 12, 16, 0, 1)]
    st = sharing_stats(Plan(layout, tasks))
    assert st["split_docs"] == 1 and st["server_doc_pairs_with_several_tasks"] == 1
    assert st["copy_kv_tokens"] == 4 + 12 + 16 and st["merged_kv_tokens"] == 4 + 12 + 16
    assert st["unique_kv_tokens"] == 12 + 16

"""End-to-end training under CAD against the colocated baseline, and the ping-pong pieces.

In-process: the staged CAD attention (send / serve / return) equals the per-document reference with
its gradients; nano-batches keep documents whole and partition every rank's rows; the train flags are
checked. Multi-process (``@pytest.mark.multiproc``, gloo, fp32): ``python -m cadlib.train`` on 2 and 4
ranks, 5 steps from the same weights and batches: the losses of wlb, cad and cad-pingpong (nano-batches
of whole documents on 2 ranks, cut documents on 4) equal colocated's within 1e-4, and every parameter
gradient of the first step matches."""
import numpy as np
import pytest
import ranks
import torch

from cadlib.core.cost import ModelSpec
from cadlib.core.layout import Layout, global_rows
from cadlib.data.packing import pack
from cadlib.data.workload import sample_docs
from cadlib.runtime.stages import cad_attention
from cadlib.scheduling import recipes, scheduler
from cadlib.scheduling.nanosplit import split_nano_batches
from cadlib.testing import random_inputs, rank_inputs, reference_errors

TINY = ModelSpec.from_name("tiny")
TINY_HEADS = (TINY.n_heads, TINY.n_kv_heads, TINY.head_dim)


def test_staged_attention_matches_reference_one_rank():
    layout = Layout([[(1, 30, 70), (0, 0, 50), (2, 0, 1), (1, 0, 30)]], [50, 70, 1])
    plan = scheduler.schedule(layout, model=TINY, tolerance=0.0, min_shard=8)
    full = random_inputs(layout.total_tokens, TINY_HEADS, seed=0)
    rows = global_rows(layout, 0)
    q, k, v, dout = rank_inputs(full, rows)
    o = cad_attention(q, k, v, plan, None)
    o.backward(dout)
    assert max(reference_errors((o, q.grad, k.grad, v.grad), full, layout.doc_lens, rows)) <= 1e-5


@pytest.mark.parametrize("balance", ["tokens", "attention"])
@pytest.mark.parametrize("seed", range(4))
def test_nano_batches_keep_documents_whole(balance, seed):
    docs = sample_docs("pretrain", 4 * 2048, seed, max_doc_len=3000)
    layout = pack(docs, 4, 2048)
    a, b = split_nano_batches(layout, balance)
    assert sorted([*a.docs.tolist(), *b.docs.tolist()]) == list(range(len(docs)))   # each doc once
    for r in range(4):
        rows = np.sort(np.concatenate([a.rows[r], b.rows[r]]))
        assert rows.tolist() == list(range(2048))                                    # rows partitioned
        for nb in (a, b):
            got = [(int(nb.docs[c.doc]), c.start, c.end) for c in nb.layout.ranks[r]]
            assert set(got) <= {tuple(c) for c in layout.ranks[r]}
    if balance == "tokens":
        ta, tb = a.layout.tokens_per_rank(), b.layout.tokens_per_rank()
        assert np.abs(ta - tb).sum() < np.abs(ta + tb).sum()                          # better than all-in-one


def test_comm_group_rejects_bad_ctas():
    from cadlib.infra.groups import comm_group
    for bad in (0, -2, 2.5, True, "4"):
        with pytest.raises(ValueError, match="max_ctas must be a positive int"):
            comm_group(None, bad)
    assert comm_group("g", None) == "g"               # no limit: the group itself


def test_train_rejects_bad_flags(capsys):
    from cadlib import train_args
    for argv, fragment in ((["--methods", "cad,ringx"], "unknown method 'ringx'"),
                           (["--tokens-per-rank", "0"], "--tokens-per-rank must be >= 1"),
                           (["--model", "gpt5"], "unknown model 'gpt5'"),
                           (["--dist", "prolog"], "unknown distribution 'prolog'"),
                           (["--tolerance", "-0.1"], "--tolerance"),
                           (["--steps", "0"], "--steps must be >= 1"),
                           (["--comm-ctas", "0"], "--comm-ctas must be >= 1"),
                           (["--timeline-batches", "worst"], "--timeline-batches must be")):
        with pytest.raises(SystemExit):
            train_args.parse_args(argv)
        assert fragment in capsys.readouterr().err


def test_timeline_batches_auto_picks_the_two_worst_stragglers():
    from cadlib import train, train_args
    args = train_args.parse_args(["--tokens-per-rank", "4096", "--steps", "6", "--timeline-batches", "auto"])
    picked = train.timeline_batches(args, 2)
    imb = {b: scheduler.colocated(pack(recipes.batch_docs(args.recipe, b, 2), 2, 4096, method="sequential",
                                             model=args.model)).imbalance() for b in range(6)}
    assert len(picked) == 2 and min(imb[b] for b in picked) >= max(imb[b] for b in set(imb) - picked)
    assert train.timeline_batches(train_args.parse_args(["--timeline-batches", "3,1"]), 2) == {1, 3}
    assert train.timeline_batches(train_args.parse_args([]), 2) == set()


@pytest.mark.multiproc
@pytest.mark.parametrize("world,split,sent_last,planner", [
    (2, "whole", False, "ours"), (2, "whole", True, "ours"), (4, "docs", False, "ours"),
    (4, "docs", True, "ours"), (2, "distca", False, "ours"), (4, "docs", False, "distca")])
def test_methods_agree_on_loss_and_gradients(world, split, sent_last, planner, tmp_path):
    """Every nano-batch formation: per-rank halves of whole documents, halves that cut documents, and
    DistCA's (ping and pong from separate sequences, each over all ranks); and DistCA's planner."""
    methods = ["colocated", "wlb", "cad", "cad-pingpong"]
    own = ["--comm-ctas", "2"] if world == 4 else []    # CAD's all-to-alls on a group of their own
    own += ["--planner", planner]
    if sent_last:                                       # donors' rows sent last (cadlib.scheduling.sentlast)
        methods, own = ["colocated", "cad", "cad-pingpong"], own + ["--sent-last"]
    if split == "distca":                               # 4 sequences of 128 tokens a step, 2 for ping
        own += ["--dist", "pile", "--sequence-len", "128"]
    else:
        own += ["--max-doc-len", "400"]
    df = ranks.run("cadlib.train", world,
                   own + ["--methods", ",".join(methods), "--nano-split", split,
                          "--tokens-per-rank", "256", "--min-shard", "16",
                          "--steps", "5", "--warmup", "0", "--dtype", "fp32", "--dump-grads", str(tmp_path)])
    recs = [r for res in df.attrs["results"] for r in res["records"] if r["rank"] == 0]
    loss = {m: [r["loss"] for r in recs if r["method"] == m] for m in methods}
    assert len(loss["colocated"]) == 5 and loss["colocated"][-1] < loss["colocated"][0]   # it trains
    for m in methods[1:]:
        assert np.allclose(loss[m], loss["colocated"], atol=1e-4, rtol=0), (m, loss[m], loss["colocated"])
    ref = torch.load(tmp_path / "colocated.pt")
    for m in methods[1:]:
        got = torch.load(tmp_path / f"{m}.pt")
        assert got.keys() == ref.keys()
        for name, g in got.items():
            scale = float(ref[name].abs().max())
            assert torch.allclose(g, ref[name], rtol=1e-4, atol=1e-6 * scale), (m, name)
    # the plans really moved work: CAD's plan is at least as balanced as the colocated placement
    assert all(r["plan_imbalance"][0] >= 1.0 for r in recs)
    # per plan (sent rows, gathered query rows, gathered KV rows): donors' servers gather, except
    # with --sent-last, where they read their query buffers in place
    donors = [s for res in df.attrs["results"] for r in res["records"] if r["method"] in methods[-2:]
              for s in r["sent_gathered_rows"] if s[0] > 0]
    assert donors and all((s[1] == 0) == sent_last for s in donors), donors


def test_signal_only_receives_real_values_not_zeros():
    """The control's received rows are the receiver's own rows, cycled and packed as the sender packs:
    on zeros a GPU's attention runs ~16% faster (scripts/probes/probe_input_values.py)."""
    from functools import partial

    from cadlib.runtime.comm import cycled_rows, pack_rows, received_like, unpack_rows
    k = torch.randn(5, 2, 4)
    lse = torch.randn(5, 3)                        # another dtype width, packed beside k as bytes
    send = pack_rows([k[:2], lse[:2]])
    likes = [k[:0], lse[:0]]
    got_k, got_lse = unpack_rows(received_like(send, 7, partial(cycled_rows, [k, lse], likes)), likes)
    idx = torch.arange(7) % 5
    assert torch.equal(got_k, k[idx]) and torch.equal(got_lse, lse[idx])
    assert received_like(send, 0, partial(cycled_rows, [k, lse], likes)).shape == (0, send.shape[1])
    empty = received_like(send, 3, partial(cycled_rows, [k[:0], lse[:0]], likes))  # no local row: zeros
    assert empty.shape == (3, send.shape[1]) and not empty.any()
    # a source in another dtype (fp32 gradient buffers) is cast to the sent parts' dtype
    half = cycled_rows([k.double()], [k[:0]], 4)
    assert half.dtype == k.dtype and torch.equal(half, k[torch.arange(4)])
    with pytest.raises(ValueError, match="fill must pack rows like send"):
        received_like(send, 3, partial(cycled_rows, [k], [k[:0]]))


def test_recompute_flag_and_the_auto_choice():
    """``--recompute auto`` (the default) asks the memory model; ``--mlp-recompute`` still means mlp; on
    the CPU there is no device memory to fit, so auto keeps everything."""
    from cadlib.train import layer_settings
    from cadlib.train_args import parse_args
    args = parse_args(["--model", "tiny"])
    assert args.recompute == "auto"
    layer_settings(args, torch.device("cpu"), 2)
    assert (args.recompute, args.mlp_recompute, args.linear_blocks) == ("none", False, "reference")
    assert args.recompute_auto["capacity_gib"] is None
    assert parse_args(["--mlp-recompute"]).recompute == "mlp"
    with pytest.raises(SystemExit):
        parse_args(["--mlp-recompute", "--recompute", "none"])
    with pytest.raises(SystemExit):
        parse_args(["--recompute", "full"])

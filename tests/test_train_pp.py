"""A lock-step tick's plans: every stage's current microbatch stacked over all GPUs, dummies serving."""
import numpy as np
import pytest
import ranks

from cadlib import train_args
from cadlib.core.layout import Layout, stack_layouts
from cadlib.core.pipeline import lockstep
from cadlib.infra.launch import TorchrunError
from cadlib.scheduling.pipeline import micro_nanos, stack_nanos, tick_micro, tick_plans
from cadlib.train_pp import check_config, micro_layouts


def test_stack_layouts_renumbers_documents_and_keeps_empty_stages():
    a = Layout([[(0, 0, 5)], [(0, 5, 8), (1, 0, 2)]], [8, 2])
    b = Layout([[(0, 0, 3)], [(1, 0, 4)]], [3, 4])
    s = stack_layouts([a, None, b], 2)
    assert s.n_ranks == 6 and s.doc_lens == [8, 2, 3, 4]
    assert s.ranks[2] == [] and s.ranks[3] == []
    assert [tuple(c) for c in s.ranks[5]] == [(3, 0, 4)]
    with pytest.raises(ValueError, match="n_ranks_each=3"):
        stack_layouts([a], 3)


def test_tick_plans_schedule_every_stage_and_let_dummies_serve():
    args = train_args.parse_args(["--pp", "2", "--microbatches", "3", "--tokens-per-rank", "256", "--max-doc-len",
                             "400", "--min-shard", "16", "--tolerance", "0.0"])
    lays = micro_layouts(args, "cad", 0, 3, 2)
    ticks = lockstep(2, 3)
    plans = tick_plans(ticks, lays, args.recipe, args.spec)
    for t, (tick, (plan,)) in enumerate(zip(ticks, plans)):
        parts = tick_micro(tick, lays)
        tok = plan.layout.tokens_per_rank()
        for s, part in enumerate(parts):          # a stage's ranks hold its microbatch, or nothing
            want = part.tokens_per_rank() if part is not None else np.zeros(2)
            assert np.array_equal(tok[2 * s:2 * s + 2], want)
        q, _ = plan.token_matrices()
        if None in parts:                         # warm-up/drain: the idle stage's GPUs serve attention
            idle = 2 * parts.index(None)
            assert q[:, idle:idle + 2].sum() > 0, t
    nanos = micro_nanos(lays, args.recipe)
    pp_plans = tick_plans(ticks, lays, args.recipe, args.spec, nanos)
    assert all(len(ps) == 2 for ps in pp_plans)
    stacked = stack_nanos([nanos[0][1], None], 2)
    assert stacked.layout.n_ranks == 4 and [len(r) for r in stacked.rows[2:]] == [0, 0]


def test_check_config_names_the_parameter():
    assert check_config(4, 4, 2, 3) == 2
    cases = ((dict(n_layers=3, world=4, pp=2, n_micro=2), "--pp 2 must divide the model's 3 layers"),
             (dict(n_layers=4, world=3, pp=2, n_micro=2), "--pp/--dp: pp=2 must divide the world size 3"),
             (dict(n_layers=4, world=4, pp=2, n_micro=2, dp=1), "--pp/--dp: dp x pp = 1 x 2 = 2"),
             (dict(n_layers=4, world=4, pp=2, n_micro=0), "--microbatches must be an integer >= 1"),
             (dict(n_layers=4, world=4, pp=0, n_micro=2), "--pp must be an integer >= 1"),
             (dict(n_layers=4, world=4, pp=2, n_micro=2, sent_last=True), "--sent-last"))
    for kw, fragment in cases:
        with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
            check_config(**kw)


# ------------------------------------------------------------------ end to end, against no pipeline
FLAGS = ["--tokens-per-rank", "256", "--max-doc-len", "400", "--min-shard", "16", "--layers", "4",
         "--steps", "3", "--warmup", "0", "--dtype", "fp32", "--lr", "1e-3"]


def reference_run(args, method: str, dp: int):
    """The same model without pipeline parallelism, in this process: every microbatch's documents
    end to end through the whole decoder with per-document SDPA (fp32), the loss the batch's summed
    cross-entropy over its predicted tokens, AdamW; returns the losses per step and the first step's
    gradients by parameter name."""
    import torch

    from cadlib.runtime.batches import document_attention, document_tokens
    from cadlib.runtime.model import IGNORE_INDEX, Decoder
    from cadlib.scheduling.recipes import micro_seed

    model = Decoder(args.spec, dtype=torch.float32, seed=args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses, grads = [], None
    for b in range(args.steps):
        total, n_valid = 0.0, 0
        for m, lay in enumerate(micro_layouts(args, method, b, args.microbatches, dp)):
            seed = micro_seed(args.recipe, b, m)
            toks = [document_tokens(d, n, args.spec.vocab, seed) for d, n in enumerate(lay.doc_lens)]
            tok = torch.from_numpy(np.concatenate(toks))
            tgt = torch.from_numpy(np.concatenate([np.append(t[1:], IGNORE_INDEX) for t in toks]))
            pos = torch.from_numpy(np.concatenate([np.arange(n) for n in lay.doc_lens]))
            hidden = model(tok, pos, document_attention(lay.doc_lens))
            loss_sum, n = model.loss(hidden, tgt)
            total, n_valid = total + loss_sum, n_valid + n
        (total / n_valid).backward()
        losses.append(float(total.detach()) / n_valid)
        if grads is None:
            grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads


@pytest.mark.multiproc
@pytest.mark.parametrize("pp,dp,methods", [(2, 2, ["colocated", "cad", "cad-pingpong"]),
                                           (4, 1, ["colocated", "cad-pingpong"])])
def test_pipeline_matches_the_model_without_pp(pp, dp, methods, tmp_path):
    import torch
    argv = FLAGS + ["--pp", str(pp), "--microbatches", "3", "--nano-split", "docs"]
    df = ranks.run("cadlib.train", pp * dp, argv + ["--methods", ",".join(methods), "--dump-grads", str(tmp_path)])
    args = train_args.parse_args(argv)
    # the batches include a microbatch holding one document longer than all its others together
    lays = [lay for b in range(3) for lay in micro_layouts(args, "cad", b, 3, dp)]
    assert any(2 * max(lay.doc_lens) > sum(lay.doc_lens) for lay in lays)
    recs = [r for res in df.attrs["results"] for r in res["records"] if r["rank"] == 0]
    for m in methods:
        losses, ref = reference_run(args, m, dp)
        got = [r["loss"] for r in recs if r["method"] == m]
        assert np.allclose(got, losses, rtol=1e-4, atol=0), (m, got, losses)
        grads = {}
        for s in range(pp):
            grads.update(torch.load(tmp_path / f"{m}.stage{s}.pt"))
        assert grads.keys() == ref.keys(), m
        for name, g in grads.items():
            scale = float(ref[name].abs().max())
            assert torch.allclose(g, ref[name], rtol=1e-4, atol=1e-6 * scale), (m, name)
    # CAD's ticks: every tick scheduled over all GPUs, the idle stages' GPUs serving the others
    cad = [r for res in df.attrs["results"] for r in res["records"] if r["method"] == "cad-pingpong"]
    assert all(len(r["schedule"]) == 2 * 3 + 2 * (pp - 1) for r in cad)
    served_idle = [sum(map(sum, srv)) for r in cad
                   for (_, m), srv in zip(r["schedule"], r["served_rows_by_stage"]) if m is None]
    assert served_idle and sum(served_idle) > 0


@pytest.mark.multiproc
def test_bad_pipeline_config_fails_on_every_rank_before_any_collective():
    with pytest.raises(TorchrunError) as err:
        ranks.run("cadlib.train", 2, ["--pp", "3", "--layers", "3", "--steps", "1"], timeout=120)
    # torchrun stops the other ranks once one has failed, so a rank that got there later may leave no
    # traceback; every traceback there is must be this ValueError (none a collective's error or timeout).
    # That every rank decides the same, from its arguments and the world size alone, is check_config's.
    logs = sorted(err.value.run_dir.rglob("*std*"))
    raised = [t.split("Traceback")[-1].strip().splitlines()[-1] for t in (p.read_text() for p in logs)
              if "Traceback" in t]
    assert raised and all(r.startswith("ValueError: --pp/--dp: pp=3 must divide the world size 2")
                          for r in raised), raised

"""A run's recipe: built from train's flags, a committed configuration or a replay setting, the same
batches and plans; bad fields named."""
import pytest

from cadlib import train_args
from cadlib.analysis.replay.settings import Setting
from cadlib.data.packing import pack
from cadlib.scheduling.recipes import Recipe, batch_docs, cad_plan, nano_plans


def test_train_flags_and_their_recipe_give_the_same_batches_and_plans():
    args = train_args.parse_args(["--tokens-per-rank", "512", "--max-doc-len", "600", "--min-shard", "32",
                             "--nano-split", "docs", "--seed", "3"])
    r = args.recipe
    assert (r.dist, r.tokens_per_rank, r.seed, r.max_doc_len, r.min_shard, r.nano_split) == \
        ("pretrain", 512, 3, 600, 32, "docs")
    for b in range(3):
        docs = batch_docs(r, b, 2)
        assert docs == batch_docs(args, b, 2)             # the namespace has the fields too
        layout = pack(docs, 2, 512)
        assert cad_plan(layout, r, args.spec).imbalance() == cad_plan(layout, args, args.spec).imbalance()
        assert [p.n_tasks for p in nano_plans(layout, r, args.spec)[1]] == \
            [p.n_tasks for p in nano_plans(layout, args, args.spec)[1]]


def test_from_config_reads_what_a_file_says_and_fills_what_old_files_lack():
    cfg = {"dist": "prolong", "tokens_per_rank": 4096, "seed": 1, "tolerance": 0.05, "model": "tiny",
           "methods": ["cad"]}
    r = Recipe.from_config(cfg)
    assert (r.dist, r.tokens_per_rank, r.tolerance) == ("prolong", 4096, 0.05)
    assert r.nano_split == "whole" and r.sent_last is False     # files without them kept documents whole
    assert Recipe.from_config({**cfg, "nano_split": "docs", "sent_last": None}).nano_split == "docs"
    # a replay setting: the committed run's configuration where it says, else the setting's fields
    s = Setting("x", "pretrain", 4, tokens=1024, min_shard=64, config={"doc_len": 300, "dist": "uniform"})
    assert (s.recipe().dist, s.recipe().doc_len, s.recipe().tokens_per_rank, s.recipe().min_shard) == \
        ("uniform", 300, 1024, 64)


@pytest.mark.parametrize("field,value,fragment", [("tokens_per_rank", 0, "Recipe.tokens_per_rank"),
                                                  ("min_shard", 2.5, "Recipe.min_shard"),
                                                  ("tolerance", -0.1, "Recipe.tolerance"),
                                                  ("nano_balance", "flops", "tokens, attention"),
                                                  ("nano_split", "half", "whole, docs"),
                                                  ("planner", "greedy", "ours, distca")])
def test_bad_fields_are_named(field, value, fragment):
    with pytest.raises(ValueError, match=fragment):
        Recipe(**{"dist": "pretrain", "tokens_per_rank": 1024, field: value})


def test_the_planner_places_cads_tasks_with_distcas_planner_or_ours():
    args = train_args.parse_args(["--tokens-per-rank", "512", "--max-doc-len", "600", "--min-shard", "32",
                             "--nano-split", "docs", "--planner", "distca"])
    r = args.recipe
    assert r.planner == "distca" and Recipe(dist="pretrain", tokens_per_rank=512).planner == "ours"
    layout = pack(batch_docs(r, 0, 2), 2, 512)
    p = cad_plan(layout, r, args.spec)
    assert p.meta["method"] == "distca" and p.meta["min_shard"] == 1       # DistCA's: no minimum shard
    nanos, plans = nano_plans(layout, r, args.spec)
    assert [q.meta["method"] for q in plans] == ["distca", "distca"]
    assert sum(int((q.q_end - q.q_start).sum()) for q in plans) == layout.total_tokens   # every query once
    assert cad_plan(layout, Recipe(dist="pretrain", tokens_per_rank=512), args.spec).meta["method"] == "cad"
    # a replay setting passes its cad_planner on
    assert Setting("x", "pretrain", 4, tokens=1024, cad_planner="distca").recipe().planner == "distca"

"""The scale replay's host side: the paper's settings, every method's work for a batch (the bytes its
collectives move balance), WLB's context-parallel layout, and a whole time-and-compose run on the CPU."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cadlib.analysis import replay, replay_phases
from cadlib.core.cost import ModelSpec
from cadlib.data.packing import per_doc_gather_tokens, wlb_layout

ROOT = Path(__file__).resolve().parents[2]


def test_paper_settings_are_table_3_at_128k_tokens_per_group():
    ss = replay.paper_3d_settings()
    assert len(ss) == 18 and {s.dp for s in ss} == {8, 16, 32}
    assert all(s.tokens == replay.TOKENS_PER_GROUP and s.tp == 8 for s in ss)
    assert {s.max_doc_len for s in ss} == {131072, 262144, 524288}
    assert ss[0].spec == ModelSpec.from_name("llama3-8b").shard(8)


def test_shard_and_its_errors():
    sh = ModelSpec.from_name("llama3-8b").shard(8)
    assert (sh.n_heads, sh.n_kv_heads, sh.ffn, sh.vocab, sh.hidden) == (4, 1, 1792, 16032, 4096)
    with pytest.raises(ValueError, match="tp=3 must divide"):
        ModelSpec.from_name("llama3-8b").shard(3)


def test_batch_work_balances_bytes_and_covers_every_method():
    s = replay.Setting("t", "pretrain", 4, tokens=4096, max_doc_len=4096, tp=1, model="tiny", batches=1,
                       wlb_cp=(1, 2), min_shard=32, link="nvlink")
    works = replay_phases.batch_work(s, 0)
    assert set(works) == {"colocated", "wlb/1", "wlb/2", "cad", "cad-pingpong", "signal-only"}
    for k, w in works.items():
        for name, (sent, recv) in w.bytes.items():
            assert np.sum(sent) == np.sum(recv), (k, name)
        assert w.tokens.sum() == 4 * 4096
    assert works["cad-pingpong"].tokens.shape == (2, 4)


def test_wlb_layout_splits_every_chunk_over_its_group():
    docs = [3000, 500, 9000, 700, 2000, 1184]
    lay = wlb_layout(docs, 4, 2, 4096)
    assert lay.total_tokens == sum(docs)
    ch = lay.chunk_array()
    for d in range(len(docs)):                    # every document's pieces on one group of 2 ranks
        groups = {r // 2 for r in ch[ch[:, 0] == d, 3]}
        assert len(groups) >= 1
    sent, recv = per_doc_gather_tokens(lay)
    assert sent.sum() == recv.sum() and recv.min() >= 0
    with pytest.raises(ValueError, match="cp=3 must divide"):
        wlb_layout(docs, 4, 3, 4096)


def test_time_and_compose_on_the_cpu(tmp_path):
    cache, out = tmp_path / "t.json", tmp_path / "out"
    for cmd in (["time", "--smoke", "--cache", str(cache)],
                ["compose", "--smoke", "--cache", str(cache), "--out", str(out)]):
        p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_replay.py"), *cmd], cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads((out / "replay_summary.json").read_text())["results"]
    methods = {r["method"] for r in summary}
    assert {"colocated", "wlb", "cad", "cad-pingpong", "signal-only"} <= methods
    assert all(r["batches"] == 2 and r["step_s_mean"] > 0 for r in summary)
    rows = json.loads((out / "replay_smoke_pretrain_dp4.json").read_text())["results"]["per_batch"]
    assert all(r["sim_step_s"] > 0 for r in rows)

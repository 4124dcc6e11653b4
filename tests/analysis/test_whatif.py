"""Tests for the what-if planner (cadlib.analysis.whatif.planner, its page and the ``python -m cadlib.whatif``
CLI): the simulator's composition reproduced, a file of a table's lengths predicting what the table
predicts, the error band, pipelines, and every bad input stopped before any work with exit status 2."""
import json

import numpy as np
import pytest

from cadlib import whatif as cli
from cadlib.analysis.replay import calls as replay_calls, phases as replay_phases, times as replay_times
from cadlib.analysis.whatif import page as whatif_page, planner as whatif, price as price_mod
from cadlib.data.lengths import write_lengths
from cadlib.data.workload import sample_docs
from cadlib.infra.results import RESULTS_DIR

OK = ["--lengths", "{d}/ok.txt"]
CALIBRATION = RESULTS_DIR / "calibration_h200.json"
"""A ``python -m cadlib.calibrate`` table of one H200 (llama3-8b, TP 8, torch_flash)."""
SMALL = ["--gpus", "8", "--gpus-per-node", "2", "--tp", "2", "--context", "131072", "--tokens-per-group",
         "65536", "--steps", "2", "--no-sweep", "--quiet"]


def _cluster(**kw):
    return whatif.Cluster(**{"gpus": 8, "gpus_per_node": 2, "tp": 2, **kw})


def _training(**kw):
    return whatif.Training(**{"context": 131072, "tokens_per_group": 65536, "steps": 1, **kw})


# ---------------------------------------------------------------------------------------------------
# The composition
# ---------------------------------------------------------------------------------------------------

def test_one_stage_one_micro_batch_is_the_replays_composition_priced_from_the_tables():
    """The paper's 3D setting (64 GPUs, TP 8, 128K prolong): the what-if's step of a batch is the
    replay's composition (:func:`cadlib.analysis.replay.phases.compose_work`) of the same batch, its
    linear layers from the timed grid and its attention from the kernel table."""
    if not price_mod.TIMES_FILE.exists():
        pytest.skip("no committed timing cache")
    cl = whatif.Cluster(gpus=64, gpus_per_node=8, tp=8)
    tr = whatif.Training(context=131072, steps=1)
    docs = whatif.Documents(dist="prolong")
    price = whatif.make_pricing(cl)
    sim = whatif.simulate("llama3-8b", cl, tr, docs, price=price)
    assert not sim["pricing"]["fallback"] and "timed token grid" in sim["pricing"]["source"]
    s = price.prepare(whatif.setting("llama3-8b", cl, tr, docs))
    ref = price.compose(s, replay_phases.batch_work(s, 0), cl.links())
    for m in whatif.METHODS:
        assert sim["methods"][m]["steps_s"][0] == pytest.approx(ref[m].step, rel=1e-9), m


def test_a_model_without_a_timed_grid_falls_back_to_the_cost_model_and_says_so():
    cl = whatif.Cluster(gpus=8, gpus_per_node=8, tp=8)
    tr = whatif.Training(context=65536, tokens_per_group=65536, steps=1)
    sim = whatif.simulate("llama-34b", cl, tr, whatif.Documents(dist="pretrain"))
    assert sim["pricing"]["fallback"] and "no timed token grid" in sim["pricing"]["source"]


def test_the_band_is_the_three_known_errors_in_quadrature():
    from cadlib.analysis.whatif import band
    known = {"composition": {"step": 0.03, "saving_over_wlb": 0.02, "saving_over_colocated": 0.02},
             "replay": {"step": 0.03, "saving": 0.01}}
    rng = np.random.default_rng(0)
    ratios = 1.06 + 0.02 * rng.standard_normal(40)
    b = band.saving_band(ratios, "wlb", known)
    x = ratios.mean()
    samp = band.t975(39) * ratios.std(ddof=1) / np.sqrt(40) / x ** 2
    assert b["parts"]["sampling"] == pytest.approx(samp)
    assert b["half_width"] == pytest.approx(np.sqrt(samp ** 2 + 0.02 ** 2 + 0.01 ** 2))
    assert b["saving_band"] == pytest.approx([1 - 1 / x - b["half_width"], 1 - 1 / x + b["half_width"]])
    assert b["dominant"] == "composition"
    few = band.saving_band(ratios[:5], "wlb", known)                # fewer steps: a wider sampling error
    assert few["parts"]["sampling"] > b["parts"]["sampling"]
    st = band.step_band([10.0, 10.0, 10.0], known)
    assert st["band"] == pytest.approx([10 * (1 - np.sqrt(0.0018)), 10 * (1 + np.sqrt(0.0018))])


def test_dp_link_mixes_in_node_and_inter_node_peers():
    one_node = _cluster(gpus=2, gpus_per_node=8, tp=1)
    assert one_node.dp_gbps() == pytest.approx(one_node.intra_node_gbps)
    cl = whatif.Cluster(gpus=16, gpus_per_node=8, tp=2, intra_node_gbps=300, inter_node_gbps=50)
    k, dp = 4, 8                                          # 4 DP groups to a node, 8 in all
    assert cl.dp == dp and cl.groups_per_node == k
    assert cl.dp_gbps() == pytest.approx(1 / max((k - 1) / (dp - 1) / 300, (dp - k) / (dp - 1) / 50))


def test_pipeline_and_micro_batches_compose_by_1f1b():
    docs, L = whatif.Documents(dist="pretrain"), "llama3-8b"
    tr = lambda **kw: _training(context=32768, tokens_per_group=16384, **kw)     # noqa: E731
    two = whatif.simulate(L, _cluster(), tr(steps=2), docs)["methods"]            # batches 0, 1 as steps
    acc = whatif.simulate(L, _cluster(), tr(micro_batches=2), docs)["methods"]    # ... as micro-batches
    ar = replay_phases.allreduce_seconds(whatif.setting(L, _cluster(), tr(), docs), _cluster().links().dp)
    acc4 = whatif.simulate(L, _cluster(), tr(micro_batches=4), docs)["methods"]
    pipe = whatif.simulate(L, _cluster(gpus=16, pp=2), tr(), docs)["methods"]
    pipe4 = whatif.simulate(L, _cluster(gpus=16, pp=2), tr(micro_batches=4), docs)["methods"]
    two_stages = whatif.setting(L, _cluster(gpus=16, pp=2), tr(), docs)
    ar2 = replay_phases.allreduce_seconds(two_stages, _cluster().links().dp)
    for m in whatif.METHODS:
        # gradient accumulation: the micro-batches one after the other, one all-reduce
        assert acc[m]["step_s"] == pytest.approx(sum(two[m]["steps_s"]) - ar, rel=1e-9)
        # two stages of half the layers and one micro-batch run one after the other: the one-stage step
        # (each stage's all-reduce of half the layers' gradients apart)
        assert pipe[m]["step_s"] - ar2 == pytest.approx(two[m]["steps_s"][0] - ar, rel=0.01)
        assert pipe[m]["idle_fraction"] > 0.35                        # each stage waits about half the step
        # four micro-batches fill the pipeline: (m + p - 1) / (m p) = 5/8 of them in sequence, ideally
        assert 0.5 * acc4[m]["step_s"] < pipe4[m]["step_s"] < 0.75 * acc4[m]["step_s"]
        assert pipe4[m]["idle_fraction"] < pipe[m]["idle_fraction"]


# ---------------------------------------------------------------------------------------------------
# The CLI
# ---------------------------------------------------------------------------------------------------

def _run(argv, capsys):
    rc = cli.main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_a_file_of_a_tables_lengths_predicts_what_the_table_predicts(tmp_path, capsys):
    """200,000 lengths drawn from ``pretrain``, written to a file: seed for seed the batches hold the
    same documents within the empirical quantile's error (tests/data/test_lengths.py: 95% within 3%, all
    within 10%), so the simulator's speedups agree within 3%: one document off by 4% changes its
    attention by 8% and the step by less, the straggler's attention being part of it."""
    big = sample_docs("pretrain", 2_000_000_000, seed=12345)[:200_000]
    path = write_lengths(tmp_path / "pretrain.txt", big, header="drawn from pretrain, seed 12345")
    got = {}
    for name, src in (("table", ["--dist", "pretrain"]), ("file", ["--lengths", str(path)])):
        rc, out, err = _run(src + SMALL + ["--json", str(tmp_path / f"{name}.json")], capsys)
        assert rc == 0, err
        got[name] = json.loads((tmp_path / f"{name}.json").read_text())
    assert "200,000 lengths" in out
    for m in whatif.METHODS:
        a, b = got["table"]["methods"][m], got["file"]["methods"][m]
        for base in whatif.BASELINES:
            key = f"speedup_over_{base}"
            assert b[key] == pytest.approx(a[key], rel=0.03), (m, base)
    assert got["table"]["verdict"]["baseline"] == got["file"]["verdict"]["baseline"]


def test_cli_prints_the_table_verdict_and_sweep_and_writes_json_and_html(tmp_path, capsys):
    argv = ["--dist", "pretrain", "--gpus", "4", "--gpus-per-node", "2", "--tp", "2", "--context", "65536",
            "--tokens-per-group", "32768", "--steps", "1", "--quiet", "--json", str(tmp_path / "o.json"),
            "--html", str(tmp_path / "o.html")]
    rc, out, err = _run(argv, capsys)
    assert rc == 0, err
    res = json.loads((tmp_path / "o.json").read_text())
    for m in whatif.METHODS:
        r = res["methods"][m]
        assert r["step_s"] > 0 and r["tokens_per_s"] > 0 and 0 <= r["idle_fraction"] < 1
        assert r["sent_bytes_mean"] >= 0 and r["activation_bytes_max"] > 0
        lo, hi = r["step_s_band"]
        assert lo <= r["step_s"] <= hi
    assert res["verdict"]["line"] in out and "the straggler is" in res["verdict"]["line"]
    assert {(p["dp"], p["context"]) for p in res["sweep"]} == {(d, c) for d in (1, 2, 4)
                                                              for c in (32768, 65536, 131072)} - {(2, 65536)}
    assert "Where the answer flips" in out and "DP \\ context" in out
    page = (tmp_path / "o.html").read_text()
    assert page.count("class='plotly-graph-div'") == len(whatif_page.figures(res)) >= 4
    assert "cadlib-plotlyjs" in page                        # plotly.js packed in: self-contained


def test_kernel_table_prices_attention_and_says_the_band_was_not_measured_with_it(tmp_path, capsys):
    table = RESULTS_DIR / "kernel_profile_h200.json"
    if not table.exists():
        pytest.skip("no committed kernel profile")
    argv = ["--dist", "pretrain", "--kernels", str(table), "--json", str(tmp_path / "k.json")] + SMALL[:-4]
    rc, out, err = _run(argv + ["--steps", "1", "--no-sweep", "--quiet"], capsys)
    assert rc == 0, err
    assert "a kernel table of your own" in out
    res = json.loads((tmp_path / "k.json").read_text())
    assert res["inputs"]["cluster"]["kernels"] == str(table)


def test_gpu_table_prices_with_its_own_times_and_kernel_and_names_its_gpu(tmp_path, capsys):
    """``--gpu-table`` prices with the calibration's linear grid and kernel table (the same steps as
    :func:`planner.plan` given them), and the output names the table's GPU."""
    if not CALIBRATION.exists():
        pytest.skip("no committed calibration")
    from cadlib.analysis.whatif import gpu_table
    argv = ["--dist", "pretrain", "--gpus", "16", "--context", "65536", "--tokens-per-group", "65536",
            "--steps", "1", "--no-sweep", "--quiet"]
    rc, out, err = _run(argv + ["--gpu-table", str(CALIBRATION), "--json", str(tmp_path / "g.json")], capsys)
    assert rc == 0, err
    t = gpu_table.load(CALIBRATION)
    assert "1x NVIDIA H200" in t.label() and t.label() in out
    res = json.loads((tmp_path / "g.json").read_text())
    assert res["pricing"]["gpu_table"] == {"path": str(CALIBRATION), "label": t.label()}
    assert any("your GPU's calibration" in n for n in res["band"]["notes"])
    cl = whatif.Cluster(gpus=16, gpus_per_node=8, tp=8)
    tr = whatif.Training(context=65536, tokens_per_group=65536, steps=1)
    docs = whatif.Documents(dist="pretrain")
    same = whatif.plan("llama3-8b", cl, tr, docs, with_sweep=False, times=t.times, cost=t.measured_cost())
    committed = whatif.plan("llama3-8b", cl, tr, docs, with_sweep=False)
    for m in whatif.METHODS:
        assert res["methods"][m]["steps_s"] == pytest.approx(same["methods"][m]["steps_s"], rel=1e-12)
    assert res["methods"]["colocated"]["steps_s"] != committed["methods"]["colocated"]["steps_s"]


@pytest.fixture
def files(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "words.txt").write_text("512\n1024\ntwelve\n")
    (tmp_path / "zero.txt").write_text("512\n0\n")
    (tmp_path / "neg.txt").write_text("512\n-4\n")
    (tmp_path / "long.txt").write_text("512\n200000\n300000\n")
    (tmp_path / "ok.txt").write_text("512\n4096\n")
    (tmp_path / "t.csv").write_text("id,n_tokens\n1,512\n")
    return tmp_path


@pytest.mark.parametrize("argv, message", [
    (["--lengths", "{d}/empty.txt", "--gpus", "8"], "--lengths: {d}/empty.txt holds no lengths"),
    (["--lengths", "{d}/words.txt", "--gpus", "8"], "line 3 holds 'twelve', not an integer"),
    (["--lengths", "{d}/zero.txt", "--gpus", "8"], "line 2 holds 0; give one integer length >= 1"),
    (["--lengths", "{d}/neg.txt", "--gpus", "8"], "line 2 holds -4"),
    (["--lengths", "{d}/t.csv", "--column", "len", "--gpus", "8"], "--column: {d}/t.csv has no column 'len'; "
     "its columns are: id, n_tokens"),
    (["--lengths", "{d}/long.txt", "--gpus", "8"], "2 of 3 lengths are longer than --context 131072 (the "
     "longest is 300,000); pass --clip to cut them to the context, or raise --context"),
    (OK + ["--gpus", "60"], "--gpus 60: must be a multiple of --tp x --pp = 8 x 1 = 8"),
    (OK + ["--gpus", "64", "--pp", "3"], "--gpus 64: must be a multiple of --tp x --pp"),
    (OK + ["--gpus", "64", "--inter-node-gbps", "0"], "--inter-node-gbps 0.0: must be > 0"),
    (OK + ["--gpus", "64", "--intra-node-gbps", "-5"], "--intra-node-gbps -5.0: must be > 0"),
    (OK + ["--gpus", "64", "--model", "llama9"], "--model llama9: unknown model; choose one of: tiny, "
     "llama3-8b, llama-34b"),
    (OK + ["--gpus", "64", "--tp", "3"], "--gpus 64: must be a multiple of --tp x --pp = 3"),
    (OK + ["--gpus", "48", "--tp", "3"], "--tp 3: must divide the model's heads (32)"),
    (OK + ["--gpus", "64", "--pp", "8", "--layers", "12"], "--pp 8: must divide the model's 12 layers"),
    (["--lengths", "{d}/nothing.txt", "--gpus", "8"], "--lengths: {d}/nothing.txt does not exist"),
    (["--gpus", "8"], "--lengths: give a lengths file (--lengths FILE) or a named distribution"),
    (["--dist", "prolog", "--gpus", "8"], "--dist prolog: not one of the named tables; choose one of: "
     "pretrain, prolong"),
    (OK, "--gpus: give the GPU count (or --nodes)"),
    (OK + ["--gpus", "8", "--kernels", "{d}/ok.txt"], "--kernels {d}/ok.txt: not a kernel latency table"),
    (OK + ["--gpus", "8", "--steps", "0"], "--steps 0: must be an integer >= 1"),
    (OK + ["--gpus", "eight"], "argument --gpus: invalid int value: 'eight'"),
    (OK + ["--gpus", "8", "--gpu-table", "{d}/ok.txt"],
     "--gpu-table {d}/ok.txt: not a JSON calibration file"),
    (OK + ["--gpus", "8", "--gpu-table", "{d}/nothing.json"], "--gpu-table {d}/nothing.json: no such file"),
    (OK + ["--gpus", "8", "--gpu-table", "{d}/t.csv", "--kernels", "{d}/t.csv"], "give --gpu-table or "
     "--kernels, not both"),
    (OK + ["--gpus", "8", "--backend", "fa4"], "--backend fa4: applies to a --gpu-table"),
    (OK + ["--gpus", "8", "--model", "llama-34b", "--gpu-table", str(CALIBRATION)],
     "calibrated for model 'llama3-8b', not 'llama-34b'"),
    (OK + ["--gpus", "8", "--gpu-table", str(CALIBRATION), "--backend", "fa4"],
     "calibrated with the 'torch_flash' attention kernel, not 'fa4'"),
])
def test_bad_input_exits_2_with_one_line_before_any_work(files, monkeypatch, capsys, argv, message):
    def no_work(*a, **k):
        raise AssertionError("planning started on bad input")
    monkeypatch.setattr(whatif, "plan", no_work)
    monkeypatch.setattr(whatif, "simulate", no_work)
    argv = [a.format(d=files) for a in argv]
    rc, out, err = _run(argv, capsys)
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("python -m cadlib.whatif: error: ")
    assert message.format(d=files) in lines[0], lines[0]


def test_clip_lets_long_lengths_through(files, capsys):
    rc, out, err = _run(["--lengths", str(files / "long.txt"), "--clip"] + SMALL[:-4] + ["--steps", "1",
                        "--no-sweep", "--quiet"], capsys)
    assert rc == 0, err
    assert "long.txt (3 lengths)" in out


def test_named_model_fields_can_be_overridden(capsys, tmp_path):
    dims = ["--layers", "4", "--hidden", "1024", "--heads", "8", "--kv-heads", "2", "--ffn", "4096",
            "--vocab", "32000"]
    argv = ["--dist", "pretrain", *dims, "--gpu-mem-gib", "0.5", "--json", str(tmp_path / "m.json")]
    rc, out, err = _run(argv + SMALL, capsys)
    assert rc == 0, err
    assert "note: activations exceed the GPU's 0.5 GiB under colocated, WLB-ideal, CAD (ping-pong)" in out
    m = json.loads((tmp_path / "m.json").read_text())["inputs"]["model"]
    got = [m[k] for k in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "ffn", "vocab")]
    assert got == [4, 1024, 8, 2, 128, 4096, 32000]


def test_documents_need_exactly_one_source():
    with pytest.raises(ValueError, match="exactly one of dist"):
        whatif.Documents()
    with pytest.raises(ValueError, match="integers >= 1"):
        whatif.Documents(lengths=np.array([3, 0]))
    with pytest.raises(ValueError, match="must be a multiple of tp x pp"):
        whatif.Cluster(gpus=6, tp=4)


def test_without_the_committed_error_files_the_band_says_what_it_leaves_out(tmp_path):
    tr = _training(context=32768, tokens_per_group=16384, steps=3)
    res = whatif.plan("llama3-8b", _cluster(gpus=4), tr,
                      whatif.Documents(dist="pretrain"), with_sweep=False, results_dir=tmp_path)
    assert "left out of the band" in res["band"]["notes"][-1]
    v = res["verdict"]
    assert v["parts"]["composition"] == v["parts"]["replay"] == 0 and v["dominant"] == "sampling"
    assert "left out of the band" in whatif_page.text(res)
    assert whatif_page.page(res).count("class='plotly-graph-div'") == 3


def test_uniform_and_lognormal_need_a_lengths_file(capsys):
    rc, out, err = _run(["--dist", "uniform", "--gpus", "8"], capsys)
    assert rc == 2 and "--dist uniform: not one of the named tables; choose one of: pretrain" in err


def test_a_grid_falling_at_its_end_prices_past_it_at_the_clipped_slope():
    """A calibration's two smoke points may fall (post 6.6 -> 4.9 ms): past the grid the what-if prices
    the last value (the slope clipped at zero), a rising field along its slope, and never below zero."""
    from cadlib.analysis.replay.times import LINEAR_GRID, interp

    a, b = LINEAR_GRID[:2]
    times = {f"linear|x|{a}": {"post_ms": 6.6, "pre_ms": 1.0},
             f"linear|x|{b}": {"post_ms": 4.9, "pre_ms": 2.0}}
    clipped = price_mod.clip_grid_ends(times)
    key = lambda n: f"linear|x|{n}"                                          # noqa: E731
    far = [b, 4 * b, 64 * b]
    assert np.allclose(interp(clipped, key, far, "post_ms"), 4.9e-3)
    assert np.allclose(interp(clipped, key, far, "pre_ms"), (2.0 + (np.array(far) - b) / (b - a)) * 1e-3)
    assert np.all(interp(times, key, [64 * b], "post_ms") < 0)                # the replay's own line
    assert np.allclose(interp(clipped, key, [a, (a + b) // 2], "post_ms"), [6.6e-3, 5.75e-3])


def test_call_model_recovers_a_known_per_call_error_and_prices_with_it():
    """Server calls whose times are ``a x table + b + c x gathered rows / 1000`` (``+ d x longest KV / 1000``
    in the forward: the form the fit assumes): :func:`cadlib.analysis.replay.calls.call_model` recovers the
    coefficients per direction and :func:`~cadlib.analysis.replay.calls.modelled_calls` gives the times back;
    a three-term forward (a model fitted before the fourth term) prices as it did."""
    cost = price_mod.load_cost()
    cl = whatif.Cluster(gpus=64, gpus_per_node=8, tp=8)
    tr = whatif.Training(context=131072, steps=1)
    s = whatif.setting("llama3-8b", cl, tr, whatif.Documents(dist="prolong"))
    works = replay_phases.batch_work(s, 0)
    truth = {"fwd": [1.1, 0.5, 0.02, 0.015], "bwd": [0.95, 2.0, 0.05]}
    times = replay_calls.modelled_calls(works.values(), s.spec, price_mod.BACKEND, cost, truth)
    for t in times.values():
        t.pop("modelled")                                   # as if timed
    fit = replay_calls.call_model([s], times, cost, price_mod.BACKEND, None, batches=1)
    assert fit["calls"] == len(times) > 3
    for f in ("fwd", "bwd"):
        assert fit[f] == pytest.approx(truth[f], rel=1e-6, abs=1e-9)
    again = replay_calls.modelled_calls(works.values(), s.spec, price_mod.BACKEND, cost, fit)
    assert all(again[k]["fwd_ms"] == pytest.approx(times[k]["fwd_ms"]) for k in times)
    old = replay_calls.modelled_calls(works.values(), s.spec, price_mod.BACKEND, cost,
                                      {"fwd": truth["fwd"][:3], "bwd": truth["bwd"]})
    longest = {k: float(np.diff(d.shared().cu_k).max()) / 1e3
               for k, d in replay_times.attention_jobs(works.values(), s.spec, price_mod.BACKEND).items()}
    assert all(old[k]["fwd_ms"] == pytest.approx(times[k]["fwd_ms"] - 0.015 * longest[k]) for k in times)
    negative = replay_calls.modelled_calls(works.values(), s.spec, price_mod.BACKEND, cost,
                                        {"fwd": [0.0, -1.0, 0.0], "bwd": [1.0, 0.0, 0.0]})
    assert all(t["fwd_ms"] == 0.0 and t["bwd_ms"] > 0 for t in negative.values())      # never below 0
    with pytest.raises(ValueError, match="no timed torch_flash call"):
        replay_calls.call_model([s], {}, cost, price_mod.BACKEND, None, batches=1)

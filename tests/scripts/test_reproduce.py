"""scripts/reproduce.py and cadlib.analysis.report.writer: parameters checked up front, a real papermill run of tiny
notebooks, metrics recorded by cells, and figures in the HTML."""
import importlib.util
import json
import pathlib
import subprocess
import sys

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from cadlib.analysis.figures import static as figures_html

from cadlib.analysis.report import metrics
from cadlib.core import paper

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("reproduce", ROOT / "scripts" / "reproduce.py")
reproduce = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reproduce)

FIGURE = ("import plotly.graph_objects as go\n"
          "go.Figure(go.Bar(x=[1, 2], y=[n, 2 * n]), layout=dict(title='tiny bars')).show()")


def tiny_notebook(path, fail=False, params="n = 3\nlabel = 'x'\nsizes = [1, 2]", extra=()):
    path.parent.mkdir(parents=True, exist_ok=True)
    cell = new_code_cell(params)
    cell.metadata["tags"] = ["parameters"]
    body = new_code_cell("assert n > 0, 'n must be positive'\nresult = n * 2")
    summary = new_code_cell("print(f'{label}: doubled to {result}')")
    summary.metadata["tags"] = ["summary"]
    cells = [cell, body, summary, *extra] + ([new_code_cell("raise RuntimeError('boom')")] if fail else [])
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A repository root with notebooks/a.ipynb and notebooks/sub/b.ipynb."""
    monkeypatch.setattr(reproduce, "ROOT", tmp_path)
    tiny_notebook(tmp_path / "notebooks" / "a.ipynb")
    tiny_notebook(tmp_path / "notebooks" / "sub" / "b.ipynb", params="n_ranks = 4  # ranks = x\nseed = 0")
    return tmp_path


def test_parameters_cell_reads_names_defaults_comments_and_rules(repo):
    nb = tiny_notebook(repo / "notebooks" / "c.ipynb", params=(
        "steps = 10        # how many; default = 10 (papermill's inspector drops this line)\n"
        "mode = 'auto'\nPARAMETER_RULES = {'steps': {'min': 5, 'max': 20}, 'mode': {'choices': ['a', 'b']}}"))
    defaults, helps, rules = reproduce.parameters_cell(nb)
    assert defaults == {"steps": 10, "mode": "auto"} and "PARAMETER_RULES" not in defaults
    assert helps["steps"].startswith("how many")
    assert rules == {"steps": {"min": 5, "max": 20}, "mode": {"choices": ["a", "b"]}}
    nbs = [nb]
    assert reproduce.plan_parameters(nbs, {}, {"steps": 7, "mode": "b"})[0][nb] == {"steps": 7, "mode": "b"}
    assert reproduce.plan_parameters(nbs, {}, {"mode": "auto"})[0][nb] == {"mode": "auto"}   # its default
    with pytest.raises(reproduce.ParameterError, match=r"c.ipynb: -p steps=30 is invalid: must be <= 20"):
        reproduce.plan_parameters(nbs, {}, {"steps": 30})
    with pytest.raises(reproduce.ParameterError, match=r"'z' is not one of: a, b"):
        reproduce.plan_parameters(nbs, {}, {"mode": "z"})


def test_overrides_apply_only_to_notebooks_that_define_them(repo):
    a, b = repo / "notebooks" / "a.ipynb", repo / "notebooks" / "sub" / "b.ipynb"
    over = reproduce.parse_overrides(["n=5", "label=hello", "seed=2"])
    assert over == {"n": 5, "label": "hello", "seed": 2}
    params, notes = reproduce.plan_parameters([a, b], {"*": {"n": 7}}, over)
    assert params == {a: {"n": 5, "label": "hello"}, b: {"seed": 2}} and notes == []
    assert reproduce.params_for(a, {"*": {"n": 7}}, {"label": "y"}) == {"n": 7, "label": "y"}
    with pytest.raises(reproduce.ParameterError, match="name=value"):
        reproduce.parse_overrides(["oops"])


@pytest.mark.parametrize("override, message", [
    ({"nosuchparam": 3}, r"unknown parameter 'nosuchparam': no selected notebook defines it. Valid names: "
                         r"a.ipynb: label, n, sizes; sub/b.ipynb: n_ranks, seed"),
    ({"n_ranks": -3}, r"sub/b.ipynb: -p n_ranks=-3 is invalid: must be >= 1"),
    ({"n_ranks": 2.5}, r"sub/b.ipynb: -p n_ranks=2.5 is invalid: must be an integer \(default 4\)"),
    ({"n": "3"}, r"a.ipynb: -p n='3' is invalid: must be an integer"),
    ({"label": 3}, r"a.ipynb: -p label=3 is invalid: must be a string"),
    ({"sizes": [1, 2.5]}, r"a.ipynb: -p sizes=\[1, 2.5\] is invalid: must be a list of integers"),
    ({"sizes": 4}, r"must be a list"),
])
def test_bad_overrides_are_rejected_before_anything_runs(repo, override, message, capsys):
    a, b = repo / "notebooks" / "a.ipynb", repo / "notebooks" / "sub" / "b.ipynb"
    with pytest.raises(reproduce.ParameterError, match=message):
        reproduce.plan_parameters([a, b], {}, override)
    argv = [f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in override.items()]
    rc = reproduce.main(["--out", str(repo / "runs"), *sum((["-p", x] for x in argv), [])])
    assert rc == 2 and not (repo / "runs").exists()               # nothing ran, no run folder
    assert "nothing was run" in capsys.readouterr().err


def test_unknown_name_is_checked_against_the_selected_notebooks_only(repo, capsys):
    rc = reproduce.main(["--out", str(repo / "runs"), "--only", "sub/", "-p", "n=3"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "unknown parameter 'n'" in err and "sub/b.ipynb: n_ranks, seed" in err and "a.ipynb" not in err


def test_profiles_check_their_entries_and_skip_notebooks_not_present(repo):
    a, b = repo / "notebooks" / "a.ipynb", repo / "notebooks" / "sub" / "b.ipynb"
    profile = {"sub/b": {"n_ranks": 16}, "later/notebook": {"whatever": 1}, "a.ipynb": {}}
    params, notes = reproduce.plan_parameters([a, b], profile, {}, all_notebooks=[a, b])
    assert params == {a: {}, b: {"n_ranks": 16}}
    assert notes == ["profile entry 'later/notebook' matches no notebook in this checkout; skipped"]
    params, _ = reproduce.plan_parameters([a], profile, {}, all_notebooks=[a, b])   # --only a
    assert params == {a: {}}
    with pytest.raises(reproduce.ParameterError, match=r"sub/b.ipynb: profile parameter 'backend' is not "
                                                       r"defined by the notebook; valid: n_ranks, seed"):
        reproduce.plan_parameters([a, b], {"sub/b": {"backend": "nccl"}}, {})
    with pytest.raises(reproduce.ParameterError, match=r"sub/b.ipynb: profile n_ranks=0 is invalid"):
        reproduce.plan_parameters([a, b], {"sub/b": {"n_ranks": 0}}, {})
    params, _ = reproduce.plan_parameters([a, b], {"sub/b": {"n_ranks": 0}}, {"n_ranks": 2})
    assert params[b] == {"n_ranks": 2}                            # -p wins over the profile
    with pytest.raises(reproduce.ParameterError, match=r"profile entry '\*': no notebook defines"):
        reproduce.plan_parameters([a, b], {"*": {"backend": "nccl"}}, {})


@pytest.mark.parametrize("profile", sorted(reproduce.PROFILES))
def test_every_profile_is_valid_for_this_repository(profile):
    nbs = reproduce.find_notebooks([])
    params, notes = reproduce.plan_parameters(nbs, reproduce.PROFILES[profile], {})
    assert set(params) == set(nbs)


@pytest.mark.parametrize("override, message", [
    ("nosuchparam=3", "unknown parameter 'nosuchparam': no selected notebook defines it. Valid names: "
                      "01_imbalance/01_stragglers.ipynb: "),
    ("n_ranks=-3", "01_imbalance/01_stragglers.ipynb: -p n_ranks=-3 is invalid: must be >= 1"),
    ("distribution='prolog'", "unknown distribution 'prolog'; choose one of: pretrain"),
])
def test_this_repositorys_notebooks_reject_bad_overrides_up_front(tmp_path, capsys, override, message):
    assert reproduce.main(["--out", str(tmp_path / "runs"), "-p", override]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "runs").exists()


def test_record_writes_a_json_line_and_returns_a_row(tmp_path, monkeypatch):
    monkeypatch.delenv("CADLIB_REPORT_DIR", raising=False)
    row = metrics.record("speedup", 1.2, paper=paper.DISTCA_MAX_SPEEDUP, how="sim")
    assert list(row.columns) == metrics.METRIC_COLUMNS and row.loc[0, "unit"] == "x"
    assert row.loc[0, "paper"] == "1.35" and "abstract" in row.loc[0, "source"]
    assert not list(tmp_path.iterdir())                          # no report dir: nothing written
    monkeypatch.setenv("CADLIB_REPORT_DIR", str(tmp_path))
    monkeypatch.setenv("CADLIB_NOTEBOOK", "x/y.ipynb")
    metrics.record("idle", 0.2, paper=(0.19, 0.55), unit="", kind="simulated", note="n")
    metrics.record("idle", 0.25, paper=(0.19, 0.55))              # a rerun of the cell replaces it
    r = metrics.record("tf", 500, kind="measured")
    assert r.loc[0, "kind"].startswith("measured on ")
    rows = metrics.load_metrics(tmp_path)
    assert [(m["metric"], m["ours"], m["notebook"]) for m in rows] == [("idle", 0.25, "x/y.ipynb"),
                                                                      ("tf", 500, "x/y.ipynb")]
    assert metrics.metrics_frame(rows).loc[0, "paper"] == "0.19–0.55"
    for bad, match in [(dict(metric_id=""), "metric_id"), (dict(ours=[1]), "ours must be"),
                       (dict(kind="guessed"), "kind must start with"), (dict(paper=(2, 1)), "low <= high"),
                       (dict(ours=float("nan")), "finite"), (dict(unit=3), "unit must be a string")]:
        with pytest.raises(ValueError, match=match):
            metrics.record(**{"metric_id": "m", "ours": 1, **bad})


def test_run_writes_report_with_summary_metrics_figures_and_failures(repo):
    rec = new_code_cell("from cadlib.analysis.report import metrics\nmetrics.record('doubled', result, paper=6, how='n * 2')")
    fig = new_code_cell(FIGURE)
    fig.metadata["tags"] = ["figure"]
    untagged = new_code_cell(FIGURE.replace("tiny bars", "not in the report"))
    tiny_notebook(repo / "notebooks" / "a.ipynb", extra=[rec, fig, untagged])
    tiny_notebook(repo / "notebooks" / "bad.ipynb", fail=True)
    rc = reproduce.main(["--out", str(repo / "runs"), "--only", "a.ipynb", "--only", "bad", "-p", "n=4",
                         "--publish", str(repo / "results" / "reports")])
    assert rc == 1                                                # one notebook failed
    run = next((repo / "runs").iterdir())
    rows = json.loads((run / "report.json").read_text())["notebooks"]
    assert {r["notebook"]: r["status"] for r in rows} == {"a.ipynb": "ok", "bad.ipynb": "failed"}
    md = (run / "report.md").read_text()
    assert "x: doubled to 8" in md and "boom" in md and "1/2 notebooks ran cleanly" in md
    assert "| doubled | 6 | 8 |" in md                            # paper vs ours, from the cell
    page = (run / "report.html").read_text()
    assert page.count("P.newPlot('a-ipynb-fig") == 1
    assert "tiny bars" in page and "not in the report" not in page
    assert page.index("id='headline'") < page.index("id='claims'") and "P.newPlot('hero'" in page
    assert "id='cadlib-plotlyjs'" in page and 1_000_000 < len(page) < 3_000_000   # plotly.js packed in
    nb_page = (run / "a.html").read_text()
    assert nb_page.count("Plotly.newPlot(") == 2 and 'src="plotly.min.js"' in nb_page
    assert (run / "plotly.min.js").stat().st_size > 1_000_000
    published = repo / "results" / "reports"
    assert "href='../../notebooks/a.ipynb'" in (published / "report.html").read_text()
    assert metrics.load_metrics(published)[0]["ours"] == 8
    assert "href='notebooks/a.html'" in (published / "report.html").read_text()   # the executed page, linked
    pub_page = (published / "notebooks" / "a.html").read_text()
    assert pub_page.count("Plotly.newPlot(") == 2 and 'src="plotly.min.js"' in pub_page
    assert (published / "notebooks" / "plotly.min.js").stat().st_size > 1_000_000


def test_published_pages_link_each_other_and_the_repository():
    folder = reproduce.ROOT / "results" / "reports" / "notebooks"
    page = ('<a href="02_pipeline.ipynb">next</a> <a href="../04_benchmarks/01_end_to_end.ipynb#top">4.1</a> '
            '<a href="../../results/reports/report.html#claims">report</a> <a href="https://x.org/a.ipynb">web</a>'
            '<link rel="stylesheet" href="notebook.css">')
    got = reproduce._relink(page, "03_pingpong/01_overlap.ipynb", folder)
    assert 'href="notebook.css"' in got                   # the shared stylesheet lies beside the page
    assert 'href="03_pingpong__02_pipeline.html"' in got and 'href="04_benchmarks__01_end_to_end.html#top"' in got
    assert 'href="../report.html#claims"' in got and 'href="https://x.org/a.ipynb"' in got
    assert reproduce.published_name("01_imbalance/01_stragglers.ipynb") == "01_imbalance__01_stragglers.html"


def test_key_figures_fall_back_to_every_figure_when_no_cell_is_tagged():
    fig = {"data": [{"type": "bar", "y": [1]}], "layout": {}}
    cells = [new_code_cell("a"), new_code_cell("b"), new_code_cell("c")]
    for c in cells[:2]:
        c.outputs = [nbformat.v4.new_output("display_data", data={figures_html.PLOTLY_MIME: fig})]
    cells[2].outputs = [nbformat.v4.new_output("display_data", data={"image/png": "iVBORw0KGgo=",
                                                                       "text/plain": "<Figure>"})]
    nb = new_notebook(cells=cells)
    assert [next(iter(f)) for f in figures_html.key_figures(nb)] == [figures_html.PLOTLY_MIME] * 2 + ["image/png"]
    cells[1].metadata["tags"] = ["figure"]
    assert figures_html.key_figures(nb) == [{figures_html.PLOTLY_MIME: fig}]
    assert "data:image/png;base64,iVBORw0KGgo=" in figures_html.figure_html({"image/png": "iVBORw0KGgo="}, "x")
    html_nb = figures_html.with_html_figures(nb)
    assert "fig-1-0" in html_nb.cells[1].outputs[0].data["text/html"]
    assert "text/html" not in nb.cells[1].outputs[0].data      # the input is not modified


@pytest.mark.parametrize("flags, named", [(["--list-params"], "papermill, latex2mathml"),
                                          (["--no-html"], "papermill")])
def test_missing_packages_are_named_in_one_line_before_any_import(flags, named):
    """papermill and latex2mathml made unimportable: one line names them (latex2mathml only when the
    HTML export runs) with the install command, exit 2, before cadlib's modules are imported."""
    code = ("import runpy, sys\nsys.modules['papermill'] = sys.modules['latex2mathml'] = None\n"
            f"sys.argv = ['reproduce.py', *{flags!r}]\n"
            f"runpy.run_path({str(ROOT / 'scripts' / 'reproduce.py')!r}, run_name='__main__')\n"
            "print('not stopped; cadlib.analysis imported:', 'cadlib.analysis' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    assert done.stderr.splitlines() == [f"reproduce.py: missing {named}; install with `make venv` in {ROOT}, "
                                        f"or `{sys.executable} -m pip install -e '{ROOT}[notebooks]'`"]
    assert reproduce.missing_dependencies() == []                 # this Python has everything


def test_gpu1_profile_puts_every_one_gpu_notebook_on_one_gpu():
    nbs = reproduce.find_notebooks([])
    params, notes = reproduce.plan_parameters(nbs, reproduce.PROFILES["gpu1"], {})
    by = {str(nb.relative_to(reproduce.ROOT / "notebooks")): p for nb, p in params.items()}
    servers, e2e = by["02_cad/02_attention_servers.ipynb"], by["04_benchmarks/01_end_to_end.ipynb"]
    assert servers["nproc"] == 1 and servers["dtype"] == "bf16" and servers["model_name"] == "llama3-8b"
    assert e2e["nproc"] == 1 and e2e["methods"].split(",") == ["colocated", "cad-pingpong"]
    assert e2e["steps"] == 1 and e2e["model"] == "llama3-8b" and e2e["timeout_s"] <= 600
    assert by["04_benchmarks/04_at_scale.ipynb"] == {"live_replay": True, "live_batches": 1}
    kernels = by["04_benchmarks/02_kernels_masks.ipynb"]
    assert kernels["live_kernels"] is True and 10 <= kernels["live_budget_s"] <= 180
    assert by["04_benchmarks/05_whatif.ipynb"] == {"gpu_table": "auto"}
    for two_gpus in ("03_pingpong/01_overlap.ipynb", "04_benchmarks/03_context_parallel.ipynb"):
        assert by[two_gpus] == {}                 # they say in one line that they need 2 GPUs
    assert all(p.get("nproc", 1) <= 1 for p in by.values())            # nothing asks for a second GPU
    # the stated limits: each notebook's timeout_s, and 4.2's live run (its budget, then 120 s to end)
    budget = sum(p.get("timeout_s", 0) for p in by.values()) + kernels["live_budget_s"] + 120
    assert budget <= 20 * 60 and not notes


@pytest.mark.parametrize("override, message", [
    ("gpu_masks='causal,diagonal'", "'diagonal' is not one of: full, causal"),
    ("gpu_backends='fa4,cutlass'", "'cutlass' is not one of: sdpa_math"),
    ("gpu_seqlens=[8192, 100]", "must be >= 256"),
    ("live_budget_s=5", "must be >= 10"),
    ("gpu_table='/nonexistent/calibration.json'", "/nonexistent/calibration.json: no such file"),
])
def test_the_one_gpu_parameters_are_checked_up_front(tmp_path, capsys, override, message):
    assert reproduce.main(["--out", str(tmp_path / "runs"), "--profile", "gpu1", "-p", override]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "runs").exists()


def test_gpu_table_accepts_the_committed_calibration_and_auto():
    nbs = reproduce.find_notebooks(["05_whatif"])
    for value in ("auto", str(reproduce.ROOT / "results" / "calibration_h200.json")):
        assert reproduce.plan_parameters(nbs, {}, {"gpu_table": value})[0][nbs[0]] == {"gpu_table": value}


def test_every_recorded_number_is_labelled_with_the_machine_that_produced_it(tmp_path, monkeypatch):
    """A row carries the device that ran its cell; a committed measurement keeps the GPU its kind names;
    the report's metric table shows the column."""
    from cadlib.analysis.report import writer
    from cadlib.infra.results import device_name
    monkeypatch.setenv("CADLIB_REPORT_DIR", str(tmp_path))
    monkeypatch.setenv("CADLIB_NOTEBOOK", "x/y.ipynb")
    here = device_name()
    assert metrics.record("sim", 1.5).loc[0, "device"] == here
    assert metrics.record("live", 2.0, kind="measured").loc[0, "device"] == here
    metrics.record("committed", 3.0, kind="measured on 2x NVIDIA H200 (committed results/bench_e2e.json)")
    rows = metrics.load_metrics(tmp_path)
    assert all(r["device"] == here for r in rows)
    frame = metrics.metrics_frame(rows).set_index("metric")
    assert frame.loc["committed", "device"] == "2x NVIDIA H200" and frame.loc["sim", "device"] == here
    assert metrics.produced_on({"kind": "simulated"}) == "—"          # a row from before rows had it
    assert metrics.produced_on({"kind": "measured on 1x NVIDIA H200, FA4"}) == "1x NVIDIA H200"
    md, _ = writer.write_report(tmp_path, [], {"device": here}, "cpu", rows, [])
    text = md.read_text()
    assert "| metric | paper | ours | unit | kind | device |" in text and f"| {here} |" in text
    assert "| 2x NVIDIA H200 |" in text

"""The workbook as its readers use it: JupyterLab in chromium (tests/browser_check.py).

Run by ``make test-browser`` (which installs chromium and playwright and sets CADLIB_BROWSER_TEST=1);
skipped in a plain ``pytest`` run, which must stay fast and needs no browser.
"""
import os
import pathlib
import re
import time

import nbformat
import pytest
from browser_check import alive, check_figures, check_report, run_in_lab
from nbformat.v4 import new_code_cell, new_notebook

from cadlib import whatif
from cadlib.core import paper
from cadlib.infra import proctree

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(os.environ.get("CADLIB_BROWSER_TEST") != "1",
                                reason="browser test: run `make test-browser` (sets CADLIB_BROWSER_TEST=1)")

SHOTS = ROOT / "runs" / "browser"
STAMP = time.strftime("%Y%m%d-%H%M%S")


def assert_nothing_left(pids):
    assert pids, "the server's process tree was never seen"
    left = alive(pids)
    assert not left, f"processes left behind: {left}"
    assert not alive(proctree._descendants(os.getpid())), "a child of the test is still running"


def test_stragglers_notebook_runs_in_jupyterlab_with_figures_and_live_widgets():
    pids = set()
    shot = SHOTS / f"{STAMP}-01_stragglers.png"
    result = run_in_lab(ROOT / "notebooks" / "01_imbalance" / "01_stragglers.ipynb", shot,
                                      widgets=True, pids_seen=pids)
    assert result["figures"] >= 1
    titles = result["widget_title"]
    assert len(set(titles[1:])) == len(titles) - 1, titles          # every change drew a new figure
    assert shot.stat().st_size > 10_000
    assert len(pids) >= 2                                           # the server and its kernel
    assert_nothing_left(pids)


def test_an_error_in_a_cell_fails_the_check_and_leaves_no_process(tmp_path):
    cells = [new_code_cell("x = 1"), new_code_cell("1 / 0"), new_code_cell("y = 2")]
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = tmp_path / "broken" / "broken.ipynb"
    path.parent.mkdir()
    nbformat.write(nb, path)
    pids = set()
    with pytest.raises(AssertionError, match="error output in the notebook.*ZeroDivisionError"):
        run_in_lab(path, SHOTS / f"{STAMP}-broken.png", pids_seen=pids)
    assert len(pids) >= 2
    assert_nothing_left(pids)


def test_committed_report_opens_with_its_answer_one_row_per_claim_and_draws_every_figure():
    page = ROOT / "results" / "reports" / "report.html"
    got = check_report(page, SHOTS / f"{STAMP}-report.png")
    assert 4 <= got["headline_rows"] <= 9
    assert got["claims"] == list(paper.CLAIMS), "one row per claim, in the registry's order"
    assert got["figures"] >= 8


def test_a_published_notebook_reads_with_its_outputs_figures_and_maths():
    """The executed copy `make report` publishes beside the report (linked from the README's notebook
    table): every figure drawn from the one shared plotly.min.js, the maths as MathML, no error output."""
    page = ROOT / "results" / "reports" / "notebooks" / "03_pingpong__02_pipeline.html"
    text = page.read_text()
    assert (page.parent / "plotly.min.js").exists() and 'src="plotly.min.js"' in text
    assert "<math" in text and "Traceback" not in text
    assert not re.search(r"<script[^>]*src=\"[^\"]*mathjax", text, re.I), "maths must not need MathJax's CDN"
    assert "notebooks/03_pingpong__02_pipeline.html" in (ROOT / "results" / "reports" / "report.html").read_text()
    assert check_figures(page, SHOTS / f"{STAMP}-published-pipeline.png") >= 3   # 1F1B, and the run's two


def test_whatif_page_draws_every_figure(tmp_path):
    """``python -m cadlib.whatif --html`` writes one self-contained page; each plotly figure in it is drawn."""
    page = tmp_path / "whatif.html"
    argv = ["--lengths", str(ROOT / "data" / "lengths" / "prolong512k_sample.txt"), "--gpus", "8",
            "--gpus-per-node", "2", "--tp", "2", "--context", "524288", "--tokens-per-group", "32768",
            "--steps", "1", "--quiet", "--html", str(page)]
    assert whatif.main(argv) == 0
    assert check_figures(page, SHOTS / f"{STAMP}-whatif.png") == 5   # steps, ranks, memory, sweep, lengths

"""One answer per claim in the prose: every number the README, docs/fidelity.md and the notebooks'
markdown quote behind a marker ``<!-- key -->`` must be what ``cadlib.analysis.report.answers`` computes
from the committed results for that key, so no page quotes a stale or second figure."""
import json
import pathlib

import pytest

from cadlib.analysis.report import answers

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _pages():
    yield "README.md", (ROOT / "README.md").read_text()
    yield "docs/fidelity.md", (ROOT / "docs" / "fidelity.md").read_text()
    for p in sorted((ROOT / "notebooks").rglob("*.ipynb")):
        if ".ipynb_checkpoints" in p.parts:
            continue
        cells = json.loads(p.read_text())["cells"]
        text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
        yield str(p.relative_to(ROOT)), text


@pytest.mark.parametrize("name, page", list(_pages()), ids=[name for name, _ in _pages()])
def test_every_marked_number_is_the_value_it_names(name, page):
    bad = answers.check_markers(page)
    assert not bad, f"{name}:\n" + "\n".join(bad)


def test_the_readme_marks_its_numbers():
    keys = {k for k, _ in answers.markers((ROOT / "README.md").read_text())}
    assert {"distca.comm_hidden@2xh200", "distca.speedup_3d_pretrain@replay_range",
            "distca.speedup_3d_prolong@replay_range"} <= keys


def test_a_stale_number_is_caught():
    key = "distca.idle_dp8@replay"
    right = answers.text(key)
    assert answers.check_markers(f"idles <!-- {key} -->{right}.") == []
    assert answers.check_markers(f"idles <!-- {key} -->47% at DP=8") == [
        f"{key}: the page says '47%', the results say {right!r}"]
    assert "unknown key" in answers.check_markers("<!-- no.such -->3%")[0]
    with pytest.raises(ValueError, match="no number 'x'"):
        answers.text("x")


def test_fix_rewrites_stale_numbers_in_markdown_and_notebooks(tmp_path):
    key = "replay.raw_err"
    right = answers.text(key)
    md = tmp_path / "page.md"
    md.write_text(f"the replay is <!-- {key} -->9.9-9.9% short.")
    nb = tmp_path / "nb.ipynb"
    nb.write_text(json.dumps({"cells": [{"cell_type": "markdown", "metadata": {}, "id": "a",
                                         "source": [f"raw <!-- {key} -->1.0%\n", "next line"]}],
                              "metadata": {}, "nbformat": 4, "nbformat_minor": 5}, indent=1))
    assert answers.main([str(md), str(nb)]) == 1                       # a check finds both stale
    assert answers.main(["--fix", str(md), str(nb)]) == 0
    assert md.read_text() == f"the replay is <!-- {key} -->{right} short."
    assert json.loads(nb.read_text())["cells"][0]["source"] == [f"raw <!-- {key} -->{right}\n", "next line"]
    assert answers.main([str(md), str(nb)]) == 0
    with pytest.raises(ValueError, match="unknown key 'nope'"):
        answers.refresh_markers("<!-- nope -->1%")


def test_fix_rewrites_the_number_and_never_the_key_that_holds_its_digits():
    """A stale count whose digits also appear in its key (``3`` in ``..._3d_...``) changes after the
    marker only: a fix once rewrote ``speedup_3d_pretrain`` to ``speedup_2d_pretrain``."""
    key = "distca.speedup_3d_pretrain@protocol_inside"
    right = answers.text(key)
    stale = next(n for n in ("3", "2", "9") if n != right)
    page, changes = answers.refresh_markers(f"lands: <!-- {key} -->{stale} of 9 settings")
    assert page == f"lands: <!-- {key} -->{right} of 9 settings" and changes == [f"{key}: {stale} -> {right}"]


@pytest.mark.parametrize("name, page", list(_pages()), ids=[name for name, _ in _pages()])
def test_no_marker_opens_a_line(name, page):
    """A line that opens with ``<!--`` starts an HTML block in CommonMark (GitHub, JupyterLab, nbconvert):
    the rest of that paragraph would render as raw text (``**bold**`` with its asterisks). A marker
    follows other text on its line."""
    bad = [ln for ln in page.splitlines() if ln.lstrip().startswith("<!--") and answers.MARKER.match(ln.lstrip())]
    assert not bad, f"{name}: markers opening a line:\n" + "\n".join(bad)

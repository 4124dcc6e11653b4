"""scripts/reproduce.py: parameter handling and a real papermill run of a tiny notebook."""
import importlib.util
import json
import pathlib

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("reproduce", ROOT / "scripts" / "reproduce.py")
reproduce = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reproduce)


def tiny_notebook(path, fail=False):
    params = new_code_cell("n = 3\nlabel = 'x'")
    params.metadata["tags"] = ["parameters"]
    body = new_code_cell("assert n > 0, 'n must be positive'\nresult = n * 2")
    summary = new_code_cell("print(f'{label}: doubled to {result}')")
    summary.metadata["tags"] = ["summary"]
    cells = [params, body, summary] + ([new_code_cell("raise RuntimeError('boom')")] if fail else [])
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def test_overrides_apply_only_to_notebooks_that_define_them(tmp_path, monkeypatch):
    monkeypatch.setattr(reproduce, "ROOT", tmp_path)
    nb = tiny_notebook(tmp_path / "a.ipynb")
    assert reproduce.notebook_parameters(nb) == {"n", "label"}
    over = reproduce.parse_overrides(["n=5", "label=hello", "other=1"])
    assert over == {"n": 5, "label": "hello", "other": 1}
    assert reproduce.params_for(nb, {"*": {"n": 7, "zzz": 1}}, {"label": "y"}) == {"n": 7, "label": "y"}
    with pytest.raises(SystemExit, match="name=value"):
        reproduce.parse_overrides(["oops"])


def test_run_writes_report_with_summary_and_failures(tmp_path, monkeypatch):
    (tmp_path / "notebooks").mkdir()
    tiny_notebook(tmp_path / "notebooks" / "ok.ipynb")
    tiny_notebook(tmp_path / "notebooks" / "bad.ipynb", fail=True)
    monkeypatch.setattr(reproduce, "ROOT", tmp_path)
    rc = reproduce.main(["--out", str(tmp_path / "runs"), "-p", "n=4", "--no-html"])
    assert rc == 1                                            # one notebook failed
    run = next((tmp_path / "runs").iterdir())
    report = json.loads((run / "report.json").read_text())
    status = {r["notebook"]: r["status"] for r in report["notebooks"]}
    assert status == {"bad.ipynb": "failed", "ok.ipynb": "ok"}
    md = (run / "report.md").read_text()
    assert "x: doubled to 8" in md and "boom" in md and "1/2 notebooks ran cleanly" in md
    assert (run / "report.html").exists()

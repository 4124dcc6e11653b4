"""The repository's entry points agree with each other: pyproject is the source of truth."""
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")


def pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_extras_have_the_agreed_packages():
    extras = pyproject()["project"]["optional-dependencies"]
    names = {k: {re.split(r"[<>=\[ ;]", r)[0].lower() for r in v} for k, v in extras.items()}
    assert {"jupyterlab", "ipywidgets", "plotly", "papermill", "pandas", "tqdm"} <= names["notebooks"]
    assert {"pytest", "nbval", "hypothesis", "ruff"} <= names["dev"]
    assert any(n.startswith("flash-attn") for n in names["gpu"])


def test_environment_yml_does_not_drift_from_pyproject():
    yml = (ROOT / "environment.yml").read_text()
    assert re.search(r"^\s*-\s*python=3\.12\s*$", yml, re.M), "environment.yml must pin python 3.12"
    pip_lines = re.findall(r"^\s+-\s+(-e .*)$", yml, re.M)
    assert pip_lines == ["-e .[notebooks,dev]"], pip_lines
    extras = set(pyproject()["project"]["optional-dependencies"])
    for extra in re.search(r"\[(.*)\]", pip_lines[0]).group(1).split(","):
        assert extra in extras, f"environment.yml installs extra {extra!r} that pyproject lacks"
    # every other conda package must be one pyproject does not manage (python, pip only)
    deps = yml.split("dependencies:", 1)[1]
    conda_pkgs = re.findall(r"^  - ([A-Za-z0-9_.\-]+)", deps, re.M)
    assert set(p.split("=")[0] for p in conda_pkgs) <= {"python", "pip"}, conda_pkgs


def test_ci_calls_make_test_and_makefile_has_both_commands():
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    mk = (ROOT / "Makefile").read_text()
    assert re.search(r"^run:", mk, re.M) and re.search(r"^test:", mk, re.M)
    assert "scripts/reproduce.py" in mk


def test_paper_figures_are_defined_once():
    """No module restates a paper figure: they live in cadlib/paper.py only."""
    for path in (ROOT / "cadlib").rglob("*.py"):
        if path.name == "paper.py":
            continue
        assert "1.35" not in path.read_text(), f"{path} restates a paper figure; import cadlib.core.paper"


def test_the_package_docstrings_example_runs():
    import doctest

    import cadlib
    result = doctest.testmod(cadlib)
    assert result.attempted >= 5 and result.failed == 0, result

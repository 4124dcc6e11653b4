"""The README's ten-line example prints what the README says it prints."""

import contextlib
import io
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_example_prints_what_it_says():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Ten lines you can check") :]
    code, printed = re.findall(r"```(?:python)?\n(.*?)```", section, re.S)[:2]
    assert len(code.strip().splitlines()) <= 10
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    assert out.getvalue().strip() == printed.strip()


def test_readme_links_point_at_files():
    text = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#]+)\)", text):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), target

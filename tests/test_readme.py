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


def test_readme_whatif_example_prints_what_it_says(capsys):
    """The README's what-if command (without its --json and --html files, with --no-sweep: the README's
    block is the table, the verdict and the band, which the sweep does not change) prints the block."""
    from cadlib import whatif

    text = (ROOT / "README.md").read_text()
    section = text[text.index("**Does CAD pay off on your data and cluster?**"):]
    cmd, printed = re.findall(r"```(?:bash)?\n(.*?)```", section, re.S)[:2]
    argv = cmd.replace("\\\n", " ").split()
    assert argv[:3] == ["python", "-m", "cadlib.whatif"]
    argv = argv[3:]
    for flag in ("--json", "--html"):
        i = argv.index(flag)
        del argv[i:i + 2]
    argv = [str(ROOT / a) if a.startswith("data/") else a for a in argv]
    assert whatif.main(argv + ["--no-sweep", "--no-fit", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert printed.strip() in out, out

"""The docs are checked, not only read: every ``cadlib.…`` dotted name in ``docs/*.md``, the READMEs,
the notebooks' markdown and cadlib's docstrings and comments resolves to a real module or attribute,
and the package map of ``docs/design.md`` names every module of the package."""
import importlib
import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOTTED = re.compile(r"(?<![\w.])cadlib(?:\.[A-Za-z_]\w*)+")


def _texts():
    for p in sorted([*ROOT.glob("docs/*.md"), *ROOT.glob("*.md"), *ROOT.glob("results/*.md"),
                     *ROOT.glob("notebooks/**/*.md"), *ROOT.glob("scripts/**/*.md")]):
        yield p.relative_to(ROOT), p.read_text()
    for p in sorted(ROOT.glob("notebooks/**/*.ipynb")):
        cells = json.loads(p.read_text())["cells"]
        yield p.relative_to(ROOT), "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    for p in sorted(ROOT.glob("cadlib/**/*.py")):
        yield p.relative_to(ROOT), p.read_text()


def resolves(name: str) -> bool:
    """``name`` is a module, or a module's attribute path (``cadlib.core.plan.Plan.validate``)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            if hasattr(obj, attr):
                obj = getattr(obj, attr)
            elif attr in getattr(obj, "__dataclass_fields__", {}) or attr in getattr(obj, "_fields", ()):
                obj = None                         # a dataclass or named-tuple field without a default
            else:
                return False
        return True
    return False


def test_every_dotted_cadlib_name_resolves():
    bad = sorted({f"{where}: {name}" for where, text in _texts() for name in DOTTED.findall(text)
                  if not resolves(name.rstrip("."))})
    assert not bad, "dotted names that name nothing:\n" + "\n".join(bad)


def test_the_package_map_names_every_module():
    text = (ROOT / "docs" / "design.md").read_text()
    section = text[text.index("## The package map"):text.index("## Conventions")]
    missing = []
    for p in sorted((ROOT / "cadlib").rglob("*.py")):
        if p.name == "__init__.py":
            continue
        if f"`{p.stem}`" not in section:
            missing.append(str(p.relative_to(ROOT)))
    assert not missing, "modules the package map of docs/design.md does not name:\n" + "\n".join(missing)


ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|exc):`~?([A-Za-z_][\w.]*)`")


def _in_module(module, name: str) -> bool:
    obj = module
    for attr in name.split("."):
        if hasattr(obj, attr):
            obj = getattr(obj, attr)
        elif attr in getattr(obj, "__dataclass_fields__", {}) or attr in getattr(obj, "_fields", ()):
            obj = None
        else:
            return False
    return True


def test_every_docstring_cross_reference_resolves():
    """``:func:`name``` and its kin in cadlib's docstrings: a dotted ``cadlib.…`` name, or a name
    (``Class.method`` too) of the module that writes it, or of cadlib below it (``core.plan.Plan``)."""
    bad = []
    for p in sorted((ROOT / "cadlib").rglob("*.py")):
        module = importlib.import_module(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"))
        for name in set(ROLE.findall(p.read_text())):
            if name.startswith("cadlib.") and resolves(name):
                continue
            if _in_module(module, name) or resolves("cadlib." + name):
                continue
            classes = [c for c in vars(module).values() if isinstance(c, type) and c.__module__ == module.__name__]
            if any(_in_module(c, name) for c in classes):      # a method named in its class's docstring
                continue
            bad.append(f"{p.relative_to(ROOT)}: {name}")
    assert not bad, "cross-references that name nothing:\n" + "\n".join(sorted(bad))

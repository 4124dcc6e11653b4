"""The package's structure (``make test`` also runs ``lint-imports`` on the layer contracts of
pyproject.toml): no import cycle among cadlib modules counting every import statement, none made
inside a function, and ``python -m cadlib.train`` runs without pandas."""
import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "cadlib"


def _module(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, modules: set[str]):
    """``(imported cadlib module, inside a function)`` for every import statement of ``path``."""
    me = _module(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    inner = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules and "." in t:
                t = t.rsplit(".", 1)[0]
            if t in modules and t != me:
                yield t, id(node) in inner


def _graph():
    files = {_module(p): p for p in PKG.rglob("*.py")}
    return files, {m: list(_imports(p, set(files))) for m, p in files.items()}


def test_no_cadlib_module_imports_another_inside_a_function():
    _, graph = _graph()
    inner = sorted(f"{m} -> {t}" for m, edges in graph.items() for t, fn in edges if fn)
    assert not inner, "imports of cadlib modules inside functions (a cycle or a layer hidden):\n" + "\n".join(inner)


def test_no_import_cycle_among_cadlib_modules():
    _, graph = _graph()
    edges = {m: {t for t, _ in e} for m, e in graph.items()}
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

    def visit(v):                                  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    assert not comps, f"import cycles: {comps}"


def test_training_runs_without_pandas(tmp_path):
    """A fake ``pandas`` that raises on import stands first on the path: ``cadlib.train`` must not need it."""
    (tmp_path / "pandas").mkdir()
    (tmp_path / "pandas" / "__init__.py").write_text("raise ImportError('pandas is not installed')\n")
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "cadlib.train", "--steps", "1", "--warmup", "0",
                          "--tokens-per-rank", "64", "--methods", "colocated,cad-pingpong"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


HOST = ("cadlib.core", "cadlib.data", "cadlib.scheduling", "cadlib.dispatch", "cadlib.analysis")
"""The layers that run without torch (with ``cadlib.whatif``, and ``cadlib.infra`` but for ``groups``)."""


def test_the_host_layers_and_the_whatif_run_without_torch(tmp_path):
    """A fake ``torch`` that raises on import stands first on the path: every module of the host layers,
    the analysis, ``cadlib.infra`` (but ``groups``, which makes process groups) and the what-if import,
    ``import cadlib`` works (its torch-backed names load when first used), and ``python -m cadlib.whatif
    --help`` prints its usage."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('torch is not installed')\n")
    files, _ = _graph()
    mods = sorted(m for m in files if m.startswith(HOST) or m.startswith("cadlib.infra") and m != "cadlib.infra.groups")
    mods += ["cadlib", "cadlib.whatif"]
    code = ("import importlib, sys\n"
            f"for m in {mods!r}:\n"
            "    importlib.import_module(m)\n"
            "assert 'torch' not in sys.modules or sys.modules['torch'] is None\n"
            "import cadlib\n"
            "try:\n"
            "    cadlib.cad_attention\n"
            "except ImportError as e:\n"
            "    print('lazy:', e)\n")
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "lazy: torch is not installed" in out.stdout
    out = subprocess.run([sys.executable, "-m", "cadlib.whatif", "--help"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "usage:" in out.stdout and "--lengths" in out.stdout, out.stderr[-3000:]

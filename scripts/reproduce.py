#!/usr/bin/env python
"""Rerun every notebook with papermill as a parameterised reproduction, then write a report.

    python scripts/reproduce.py                      # CPU/gloo defaults (what `make run` does)
    python scripts/reproduce.py --only 02_cad        # a subset (substring of the notebook path)
    python scripts/reproduce.py -p n_ranks=16        # override a parameter in every notebook that has it
    python scripts/reproduce.py --profile h200x2     # a named parameter profile (see PROFILES)
    python scripts/reproduce.py --list-params        # every notebook's parameters, defaults and rules
    python scripts/reproduce.py --publish results/reports   # also copy the report and the executed
                                                            # notebooks' HTML there (`make report`)

Every override and profile entry is checked against the notebooks' ``parameters`` cells before
anything runs: a name no selected notebook defines, or a value of the wrong type or outside its rule,
stops the run with a message naming the notebook, the parameter and what is valid (exit status 2).
Before that, a package the reproduction needs and this Python lacks (:data:`NEEDS`, and
:data:`NEEDS_HTML` without ``--no-html``) is named in one line with the command that installs it
(exit status 2).

Executed notebooks land in runs/<timestamp>-<profile>/ with their HTML (every plotly figure drawn;
plotly.js loaded from plotly.min.js beside them; maths as MathML), report.md, a self-contained
report.html and report.json. ``--publish DIR`` writes the report into DIR too, and the executed
notebooks' HTML into DIR/notebooks/ (one shared plotly.min.js; links between notebooks rewritten to
their published pages), so that the workbook reads with its outputs without running it. The report
opens with its answer: a headline block and the table of every
claim of the papers, one row each (``cadlib.analysis.report.claims``: a claim this profile did not run says
so; end-to-end ones fall back to the committed results); then each notebook's summary and key figures, the
evidence appendix (``cadlib.analysis.report.evidence``) and every metric the cells recorded through
``cadlib.analysis.report.metrics.record``. Exit status 1 when any notebook failed.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import io
import json
import os
import pathlib
import re
import shutil
import sys
import time
import tokenize

ROOT = pathlib.Path(__file__).resolve().parents[1]
NEEDS = {"cadlib": "cadlib", "numpy": "numpy", "torch": "torch", "pandas": "pandas", "plotly": "plotly",
         "papermill": "papermill", "nbformat": "nbformat", "ipykernel": "ipykernel", "IPython": "ipython",
         "tqdm": "tqdm", "ipywidgets": "ipywidgets"}
"""What the reproduction imports, by module, with its pip name: cadlib and the notebooks extra of
pyproject.toml (papermill runs the notebooks on the ``python3`` kernel of ipykernel)."""
NEEDS_HTML = {"nbconvert": "nbconvert", "latex2mathml": "latex2mathml"}
"""What the HTML export adds (skipped with ``--no-html``): nbconvert writes the pages (jupyterlab brings
it), latex2mathml the maths; plotly.js is copied from the plotly package, so no network is needed."""


def missing_dependencies(html: bool = True) -> list[str]:
    """The pip names of what this Python lacks among :data:`NEEDS` (and :data:`NEEDS_HTML`)."""
    need = {**NEEDS, **(NEEDS_HTML if html else {})}
    return [pip for module, pip in need.items() if importlib.util.find_spec(module) is None]


def check_dependencies(argv: list[str]) -> None:
    """Exit 2 with one line naming what is missing and how to install it; run before anything is
    imported, so that a missing package is not a traceback from deep inside an import."""
    missing = missing_dependencies(html="--no-html" not in argv)
    if missing:
        print(f"reproduce.py: missing {', '.join(missing)}; install with `make venv` in {ROOT}, or "
              f"`{sys.executable} -m pip install -e '{ROOT}[notebooks]'`", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    check_dependencies(sys.argv[1:])

from cadlib.analysis.figures import static as figures_html  # noqa: E402 (after the check above)
from cadlib.analysis.report import claims, evidence, metrics, writer  # noqa: E402
from cadlib.infra.results import atomic_write_text, environment_info, new_run_dir  # noqa: E402

# Parameter profiles: per-notebook overrides on top of each notebook's own defaults (the defaults are the
# CPU profile). Keys are substrings of notebook paths under notebooks/ ("*": every notebook that defines
# the name). An entry whose key matches no notebook in this checkout is skipped with a note, so a profile
# may name notebooks that do not exist yet; an entry naming a parameter its notebook lacks is an error.
_E2E = {"model": "llama3-8b", "layers": 4, "dist": "pretrain", "max_doc_len": 0, "min_shard": 512,
        "steps": 10, "mlp_recompute": True}
_OVERLAP = {"model_name": "llama3-8b", "layers": 4, "max_doc_len": 0, "min_shard": 512, "mlp_recompute": True}
_SERVERS = {"dtype": "bf16", "model_name": "llama3-8b", "tokens_per_rank": 8192,
            "distribution": "pretrain,prolong"}
PROFILES: dict[str, dict[str, dict]] = {
    "cpu": {},
    "h200": {"04_benchmarks/04_at_scale": {"live_replay": True}},
    # one GPU (issue 36), FA4 or torch's flash kernel, designed for < 20 minutes in all (each budget is the
    # notebook's timeout_s where it has one): 2.2 the servers' composability on the GPU (llama3-8b heads,
    # bf16, 8K tokens, ~2 min); 4.1 one training step per method at DP=1, colocated and CAD with ping-pong
    # (same loss), 64K tokens, with its timeline (~3 min, cut at 600 s); 4.2 a subset of the kernel x mask
    # table live beside the committed one (4 masks x 8K, 32K x 5 kernels, no new cell after 120 s, cut at
    # 240 s); 4.4 one setting replayed live (~5 min); 4.5 prices with this GPU's committed calibration
    # (results/calibration_<gpu>.json) when there is one. 3.1 and 4.3 need two GPUs: they say so in one
    # line and show the committed results; the other notebooks run their CPU defaults.
    "gpu1": {
        "02_cad/02_attention_servers": {"nproc": 1, "timeout_s": 300, **_SERVERS},
        "04_benchmarks/01_end_to_end": {"nproc": 1, "tokens_per_rank": 65536, "timeout_s": 600, **_E2E,
                                        "steps": 1, "methods": "colocated,cad-pingpong"},
        "04_benchmarks/02_kernels_masks": {"live_kernels": True, "live_budget_s": 120},
        "04_benchmarks/04_at_scale": {"live_replay": True, "live_batches": 1},
        "04_benchmarks/05_whatif": {"gpu_table": "auto"},
    },
    "h200x2": {
        "02_cad/02_attention_servers": {"nproc": 2, **_SERVERS},
        "03_pingpong/01_overlap": {"nproc": 2, "tokens_per_rank": 65536, **_OVERLAP},
        # a 3-batch live run: the 10-batch comparisons are scripts/bench/bench_e2e.py's committed files, which
        # the notebook reads and the claims table uses (running them again here would double the GPU time)
        "04_benchmarks/01_end_to_end": {"nproc": 2, "tokens_per_rank": 65536, "timeout_s": 1800, **_E2E,
                                        "steps": 3},
        "04_benchmarks/03_context_parallel": {"nproc": 2},
    },
    "h200x8": {
        "02_cad/02_attention_servers": {"nproc": 8, **_SERVERS},
        "03_pingpong/01_overlap": {"nproc": 8, "tokens_per_rank": 131072, **_OVERLAP},
        "04_benchmarks/01_end_to_end": {"nproc": 8, "tokens_per_rank": 131072, "timeout_s": 3600, **_E2E},
        "04_benchmarks/03_context_parallel": {"nproc": 8},
    },
}

# Checks per parameter name, on top of the type of the notebook's default (an int default takes ints
# only, a list default takes lists, ...). A notebook may replace an entry for itself with a literal dict
# ``PARAMETER_RULES = {"name": {...}}`` in its parameters cell. A notebook's own default is always valid
# (e.g. "auto"). Keys of a rule:
#   min, max        bounds (for lists: of every item)        nonempty   a list must have an item
#   choices         a list, or "module:attribute" naming one  also       extra accepted values ("auto")
#   check           "module:function" called with the value; a ValueError means invalid (its message
#                   says what is valid)                       split      a string is a list joined by it
RULES: dict[str, dict] = {
    "n_ranks": {"min": 1},
    "nproc": {"min": 0},
    "tokens_per_rank": {"min": 1},
    "seed": {"min": 0},
    "tolerance": {"min": 0},
    "min_shard": {"min": 1},
    "timeout_s": {"min": 1},
    "dp_sizes": {"min": 1, "nonempty": True},
    "context_lengths": {"min": 1, "nonempty": True},
    "tolerances": {"min": 0, "nonempty": True},
    "distribution": {"check": "cadlib.data.workload:sample_kwargs", "split": ","},
    "model_name": {"check": "cadlib.core.cost:as_model"},
    "dtype": {"choices": "cadlib.core.precision:DTYPES"},
    "cases": {"choices": "cadlib.verify:CASES", "split": ","},
    "toy_ranks": {"min": 1},
    "toy_tokens_per_rank": {"min": 1},
    "toy_docs": {"min": 1, "nonempty": True},
    "toy_doc": {"min": 2},
    "toy_tokens": {"min": 1},
    "toy_tolerance": {"min": 0},
    "toy_attention": {"min": 0, "nonempty": True},
    "ideal_layers": {"min": 1},
    "ideal_linear": {"min": 1e-9},
    "ideal_attention": {"min": 1e-9},
    "ideal_comm": {"min": 1e-9},
    "paper_dp_sizes": {"min": 1, "nonempty": True},
    "paper_seeds": {"min": 1},
    "paper_cap_factor": {"min": 1},
    "divergence_cap_factor": {"min": 1},
    "pp_stages": {"min": 1},
    "n_microbatches": {"min": 1},
    "microbatch_tokens": {"min": 8},
    "sim_microbatches": {"min": 2},
    "run_stages": {"min": 1},
    "run_microbatches": {"min": 1},
    "run_tokens_per_rank": {"min": 32},
    "small_ranks": {"min": 2},
    "compare_seeds": {"min": 1},
    "picture_docs": {"min": 1},
    "sparse_total": {"min": 1024},
    "sparse_corner": {"min": 1},
    "sparse_pixels": {"min": 1},
    "sparse_check_len": {"min": 64},
    "ring_positions": {"min": 1},
    "ring_window": {"min": 1},
    "balance_world": {"choices": [8, 16]},              # the cases results/cp_balance.json holds
    "balance_tokens": {"choices": [8192, 32768]},
    "live_budget_s": {"min": 10},                       # 4.2's live kernel x mask subset
    "gpu_masks": {"choices": "cadlib.data.masks:ALL_TYPES", "split": ","},
    "gpu_seqlens": {"min": 256, "nonempty": True},
    "gpu_backends": {"choices": ["sdpa_math", "sdpa_efficient", "sdpa_flash", "sdpa_cudnn", "torch_flash",
                                 "fa4", "flash_attn", "flex"], "split": ","},   # bench_kernels.py's GPU ones
    "gpu_table": {"check": "cadlib.analysis.whatif.gpu_table:load", "also": ["auto"]},   # 4.5: a calibration
}
RULE_KEYS = {"min", "max", "nonempty", "choices", "also", "check", "split"}


class ParameterError(ValueError):
    """An override or profile entry that no notebook accepts; raised before anything runs."""


def find_notebooks(only: list[str]) -> list[pathlib.Path]:
    nbs = sorted(p for p in (ROOT / "notebooks").rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
    if only:
        nbs = [p for p in nbs if any(o in str(p.relative_to(ROOT)) for o in only)]
    return nbs


def rel(path: pathlib.Path) -> str:
    """A notebook's name in messages and reports: its path under notebooks/."""
    for base in (ROOT / "notebooks", ROOT):
        if path.is_relative_to(base):
            return str(path.relative_to(base))
    return str(path)


# ---------------------------------------------------------------------------------------------------
# The parameters cell
# ---------------------------------------------------------------------------------------------------

def parameters_cell(path: pathlib.Path) -> tuple[dict, dict, dict]:
    """``(defaults, help, rules)`` of the notebook's cell tagged ``parameters``: each assigned name's
    default (``None`` when not a literal), its trailing comment, and its ``PARAMETER_RULES`` entries.

    Read with ``ast`` rather than papermill's ``inspect_notebook``, which drops any name whose trailing
    comment contains ``=`` or a quote."""
    import nbformat
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code" and "parameters" in cell.get("metadata", {}).get("tags", []):
            src = cell.source
            comments = {tok.start[0]: tok.string.lstrip("#").strip()
                        for tok in tokenize.generate_tokens(io.StringIO(src).readline)
                        if tok.type == tokenize.COMMENT}
            defaults, helps, rules = {}, {}, {}
            for node in ast.parse(src).body:
                if not isinstance(node, ast.Assign):
                    continue
                try:
                    value = ast.literal_eval(node.value)
                except ValueError:
                    value = None
                for t in node.targets:
                    if isinstance(t, ast.Name) and t.id == "PARAMETER_RULES":
                        rules = _check_rules(value, path)
                    elif isinstance(t, ast.Name):
                        defaults[t.id] = value
                        helps[t.id] = comments.get(node.lineno, "")
            return defaults, helps, rules
    return {}, {}, {}


def _check_rules(rules, path) -> dict:
    if not isinstance(rules, dict) or not all(isinstance(v, dict) for v in rules.values()):
        raise ParameterError(f"{rel(path)}: PARAMETER_RULES must be a literal dict of dicts, got {rules!r}")
    for name, rule in rules.items():
        if set(rule) - RULE_KEYS:
            raise ParameterError(f"{rel(path)}: PARAMETER_RULES[{name!r}] has unknown keys "
                                 f"{sorted(set(rule) - RULE_KEYS)}; valid: {sorted(RULE_KEYS)}")
    return rules


def notebook_parameters(path: pathlib.Path) -> set[str]:
    """Names assigned in the notebook's cell tagged ``parameters``."""
    return set(parameters_cell(path)[0])


def _resolve(ref: str):
    module, _, attr = ref.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _type_problem(value, default) -> str | None:
    """What is wrong with the type of ``value`` for a parameter whose default is ``default``."""
    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    def is_num(v):
        return is_int(v) or isinstance(v, float)

    if default is None:
        return None
    if isinstance(default, bool):
        return None if isinstance(value, bool) else "must be True or False"
    if is_int(default):
        return None if is_int(value) else "must be an integer"
    if isinstance(default, float):
        return None if is_num(value) else "must be a number"
    if isinstance(default, str):
        return None if isinstance(value, str) else "must be a string"
    if isinstance(default, (list, tuple)):
        if not isinstance(value, (list, tuple)):
            return "must be a list"
        if default and all(is_int(v) for v in default) and not all(is_int(v) for v in value):
            return "must be a list of integers"
        if default and all(is_num(v) for v in default) and not all(is_num(v) for v in value):
            return "must be a list of numbers"
    return None


def check_value(name: str, value, default, rule: dict) -> str | None:
    """None when ``value`` is valid for parameter ``name``; otherwise what is valid."""
    problem = _type_problem(value, default)
    if problem:
        return f"{problem} (default {default!r})"
    if value == default:
        return None                           # the notebook's own default is always valid
    if isinstance(value, str) and rule.get("split"):
        items = [v.strip() for v in value.split(rule["split"])]
    else:
        items = list(value) if isinstance(value, (list, tuple)) else [value]
    if rule.get("nonempty") and not items:
        return "must not be empty"
    for v in items:
        if v in rule.get("also", ()):
            continue
        if "min" in rule and isinstance(v, (int, float)) and v < rule["min"]:
            return f"must be >= {rule['min']}" + (" (every item)" if len(items) > 1 else "")
        if "max" in rule and isinstance(v, (int, float)) and v > rule["max"]:
            return f"must be <= {rule['max']}" + (" (every item)" if len(items) > 1 else "")
        if "choices" in rule:
            choices = [*_resolve(rule["choices"])] if isinstance(rule["choices"], str) else rule["choices"]
            choices = [*choices, *rule.get("also", ())]
            if v not in choices:
                sep = f" (joined by {rule['split']!r})" if rule.get("split") else ""
                return f"{v!r} is not one of: {', '.join(map(str, choices))}{sep}"
        if "check" in rule:
            try:
                _resolve(rule["check"])(v)
            except ValueError as e:
                also = f" (or {', '.join(map(repr, rule['also']))})" if rule.get("also") else ""
                return f"{e}{also}"
    return None


# ---------------------------------------------------------------------------------------------------
# Overrides and profiles, checked up front
# ---------------------------------------------------------------------------------------------------

def parse_overrides(items: list[str]) -> dict:
    out = {}
    for item in items:
        if "=" not in item:
            raise ParameterError(f"bad -p {item!r}: use name=value (value is a Python literal or a string)")
        k, v = item.split("=", 1)
        try:
            out[k.strip()] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            out[k.strip()] = v
    return out


def _valid_names(cells: dict[pathlib.Path, tuple]) -> str:
    return "; ".join(f"{rel(p)}: {', '.join(sorted(c[0])) or '(none)'}" for p, c in cells.items())


def plan_parameters(notebooks: list[pathlib.Path], profile: dict, overrides: dict,
                    all_notebooks: list[pathlib.Path] | None = None) -> tuple[dict, list[str]]:
    """``({notebook: parameters}, notes)`` for a run, every value checked; a ParameterError listing
    every problem (notebook, parameter, what is valid) when anything is wrong."""
    all_notebooks = all_notebooks if all_notebooks is not None else notebooks
    cells = {p: parameters_cell(p) for p in sorted(set(notebooks) | set(all_notebooks))}
    selected = {p: cells[p] for p in notebooks}
    errors, notes = [], []
    params: dict[pathlib.Path, dict] = {p: {} for p in notebooks}

    origins: dict[tuple[pathlib.Path, str], str] = {}

    def apply(path, name, value, origin):      # later entries win: profile "*", profile, then -p
        params[path][name] = value
        origins[path, name] = origin

    for key, values in profile.items():
        if key == "*":
            for name, value in values.items():
                if not any(name in c[0] for c in cells.values()):
                    errors.append(f"profile entry '*': no notebook defines parameter {name!r}")
                for p in notebooks:
                    if name in cells[p][0]:
                        apply(p, name, value, "profile")
            continue
        matching = [p for p in all_notebooks if key in rel(p)]
        if not matching:
            if values:
                notes.append(f"profile entry {key!r} matches no notebook in this checkout; skipped")
            continue
        for p in matching:
            if p not in params:
                continue                      # not selected by --only
            for name, value in values.items():
                if name not in cells[p][0]:
                    errors.append(f"{rel(p)}: profile parameter {name!r} is not defined by the notebook; "
                                  f"valid: {', '.join(sorted(cells[p][0]))}")
                else:
                    apply(p, name, value, "profile")
    for name, value in overrides.items():
        takers = [p for p in notebooks if name in cells[p][0]]
        if not takers:
            errors.append(f"unknown parameter {name!r}: no selected notebook defines it. "
                          f"Valid names: {_valid_names(selected)}")
        for p in takers:
            apply(p, name, value, "-p")
    for path, values in params.items():
        defaults, _, nb_rules = cells[path]
        for name, value in values.items():
            why = check_value(name, value, defaults[name], nb_rules.get(name, RULES.get(name, {})))
            if why:
                errors.append(f"{rel(path)}: {origins[path, name]} {name}={value!r} is invalid: {why}")
    if errors:
        raise ParameterError("invalid parameters, nothing was run:\n  " + "\n  ".join(errors))
    return params, notes


def params_for(path: pathlib.Path, profile: dict, overrides: dict) -> dict:
    """The checked parameters of one notebook (see :func:`plan_parameters`)."""
    return plan_parameters([path], profile, overrides)[0][path]


def list_parameters(notebooks: list[pathlib.Path]) -> str:
    lines = []
    for p in notebooks:
        defaults, helps, nb_rules = parameters_cell(p)
        lines.append(rel(p))
        for name, default in defaults.items():
            rule = nb_rules.get(name, RULES.get(name))
            extra = "  ".join(s for s in (f"# {helps[name]}" if helps[name] else "",
                                           f"rule {rule}" if rule else "") if s)
            lines.append(f"  {name} = {default!r}  {extra}".rstrip())
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------

def run_notebook(nb: pathlib.Path, out: pathlib.Path, params: dict, run_dir: pathlib.Path,
                 timeout: int) -> dict:
    import papermill as pm
    row = {"notebook": rel(nb), "parameters": params, "executed": str(out), "error": "", "links": {}}
    env = {"CADLIB_REPORT_DIR": str(run_dir), "CADLIB_NOTEBOOK": rel(nb)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)         # the kernel inherits these: cadlib.analysis.report.metrics.record writes
    t0 = time.perf_counter()
    try:
        pm.execute_notebook(str(nb), str(out), parameters=params, cwd=str(nb.parent),
                            kernel_name="python3", progress_bar=False, execution_timeout=timeout)
        row["status"] = "ok"
    except Exception as e:  # keep going: the report lists every notebook
        row["status"] = "failed"
        row["error"] = f"{type(e).__name__}: {e}".replace(f"{ROOT}{os.sep}", "")[-4000:]   # repo-relative
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    row["seconds"] = time.perf_counter() - t0
    if not out.exists():
        row["executed"] = None
    return row


PUBLISHED = "notebooks"
"""The folder under ``--publish`` that holds the executed notebooks' HTML and the one plotly.min.js."""
_HREF = re.compile(r'href="([^"#:]+)(#[^"]*)?"')


NOTEBOOK_CSS = "notebook.css"
"""The executed notebooks' one stylesheet (nbconvert's theme), beside their pages."""


def published_name(notebook: str) -> str:
    """The published HTML of a notebook (its path under notebooks/): ``03_pingpong__02_pipeline.html``."""
    return notebook.replace("/", "__").removesuffix(".ipynb") + ".html"


def _relink(page: str, notebook: str, folder: pathlib.Path) -> str:
    """A published page's relative links, written for where it now lies: another notebook's link goes
    to that notebook's published HTML, any other file's to the file in the repository."""
    src = (ROOT / "notebooks" / notebook).parent

    def fix(m):
        if m.group(1) == NOTEBOOK_CSS:              # the shared stylesheet, published beside the page
            return m.group(0)
        target = (src / m.group(1)).resolve()
        if not target.is_relative_to(ROOT):
            return m.group(0)
        if target.suffix == ".ipynb" and target.is_relative_to(ROOT / "notebooks"):
            href = published_name(str(target.relative_to(ROOT / "notebooks")))
        else:
            href = os.path.relpath(target, folder)
        return f'href="{href}{m.group(2) or ""}"'
    return _HREF.sub(fix, page)


def publish_notebooks(dest: pathlib.Path, rows: list[dict], run_dir: pathlib.Path) -> dict[str, str]:
    """Copy each executed notebook's HTML (outputs and figures drawn, maths as MathML) into
    ``dest/notebooks/`` with one shared plotly.min.js, its links rewritten (:func:`_relink`); returns
    ``{notebook: href from dest}``. Pages of an earlier publication that this run did not make are
    removed only when this run covered every notebook."""
    folder = dest / PUBLISHED
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for r in rows:
        html_name = r.get("links", {}).get("html")
        if not html_name or not (run_dir / html_name).exists():
            continue
        name = published_name(r["notebook"])
        page = _relink((run_dir / html_name).read_text(), r["notebook"], folder)
        atomic_write_text(folder / name, page)
        out[r["notebook"]] = f"{PUBLISHED}/{name}"
    if out:
        figures_html.write_plotlyjs(folder)
        if (run_dir / NOTEBOOK_CSS).exists():
            shutil.copyfile(run_dir / NOTEBOOK_CSS, folder / NOTEBOOK_CSS)
        if len(rows) == len(find_notebooks([])):
            for stale in set(folder.glob("*.html")) - {folder / pathlib.Path(h).name for h in out.values()}:
                stale.unlink()
    return out


def publish(dest: pathlib.Path, rows: list[dict], meta: dict, profile: str, run_dir: pathlib.Path,
            notes: list[str]) -> None:
    """The report again in ``dest`` (e.g. results/reports/), linking the repository's notebooks and
    their executed HTML (:func:`publish_notebooks`)."""
    dest.mkdir(parents=True, exist_ok=True)
    pages = publish_notebooks(dest, rows, run_dir)
    pub_rows = [dict(r, links={"notebook": os.path.relpath(ROOT / "notebooks" / r["notebook"], dest),
                               **({"html": pages[r["notebook"]]} if r["notebook"] in pages else {})})
                for r in rows]
    recorded = metrics.load_metrics(run_dir)
    writer.write_report(dest, pub_rows, meta, profile, recorded, notes,
                        claims=claims.claims_table(recorded, profile), evidence=evidence.sections())
    metrics_file = run_dir / metrics.METRICS_FILE
    if metrics_file.exists():
        shutil.copyfile(metrics_file, dest / metrics.METRICS_FILE)
    elif (dest / metrics.METRICS_FILE).exists():
        (dest / metrics.METRICS_FILE).unlink()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="cpu", choices=sorted(PROFILES))
    ap.add_argument("--only", action="append", default=[], help="substring of notebook paths to run")
    ap.add_argument("-p", "--param", action="append", default=[], help="name=value override")
    ap.add_argument("--out", default=str(ROOT / "runs"), help="parent folder of the run folder")
    ap.add_argument("--publish", default=None, help="also write the report into this folder")
    ap.add_argument("--no-html", action="store_true", help="skip the per-notebook HTML export")
    ap.add_argument("--timeout", type=int, default=1800, help="per-cell timeout in seconds")
    ap.add_argument("--list-params", action="store_true", help="print every notebook's parameters and exit")
    args = ap.parse_args(argv)

    notebooks = find_notebooks(args.only)
    if not notebooks:
        print(f"no notebooks matched {args.only}; available: {[rel(p) for p in find_notebooks([])]}",
              file=sys.stderr)
        return 2
    try:
        if args.list_params:
            print(list_parameters(notebooks))
            return 0
        params, notes = plan_parameters(notebooks, PROFILES[args.profile], parse_overrides(args.param),
                                        all_notebooks=find_notebooks([]))
    except ParameterError as e:
        print(f"reproduce.py: {e}", file=sys.stderr)
        return 2
    for n in notes:
        print(f"[reproduce] note: {n}")
    run_dir = new_run_dir(args.out, args.profile)
    meta = environment_info()
    print(f"[reproduce] {len(notebooks)} notebooks -> {run_dir}")
    rows = []
    for i, nb in enumerate(notebooks, 1):
        out = run_dir / rel(nb).replace("/", "__")
        print(f"[reproduce] ({i}/{len(notebooks)}) {rel(nb)} {params[nb] or ''}", flush=True)
        row = run_notebook(nb, out, params[nb], run_dir, args.timeout)
        if row["executed"]:
            row["links"]["ipynb"] = out.name
            if not args.no_html:
                try:
                    figures_html.write_plotlyjs(run_dir)
                    figures_html.notebook_html(out, out.with_suffix(".html"), plotlyjs_src="plotly.min.js",
                                               css_href=NOTEBOOK_CSS)
                    row["links"]["html"] = out.with_suffix(".html").name
                except Exception as e:  # the report must not fail because a viewer could not be made
                    print(f"  (html export of {out.name} failed: {type(e).__name__}: {e})")
        print(f"[reproduce]     {row['status']} in {row['seconds']:.1f}s", flush=True)
        rows.append(row)
    recorded = metrics.load_metrics(run_dir)            # the report ends with every claim, run here or not
    writer.write_report(run_dir, rows, meta, args.profile, recorded, notes,
                        claims=claims.claims_table(recorded, args.profile), evidence=evidence.sections())
    atomic_write_text(run_dir / "report.json", json.dumps({"meta": meta, "profile": args.profile,
                                                           "notebooks": rows}, indent=2) + "\n")
    print(f"[reproduce] report: {run_dir / 'report.html'} and report.md")
    if args.publish:
        publish(pathlib.Path(args.publish).resolve(), rows, meta, args.profile, run_dir, notes)
        print(f"[reproduce] published to {args.publish}")
    failed = [r["notebook"] for r in rows if r["status"] != "ok"]
    if failed:
        print(f"[reproduce] FAILED: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

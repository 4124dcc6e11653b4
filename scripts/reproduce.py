#!/usr/bin/env python
"""Rerun every notebook with papermill as a parameterised reproduction, then write a report.

    python scripts/reproduce.py                      # CPU/gloo defaults (what `make run` does)
    python scripts/reproduce.py --only 02_cad        # a subset (substring of the notebook path)
    python scripts/reproduce.py -p world_size=8      # override a parameter in every notebook that has it
    python scripts/reproduce.py --profile gpu        # a named parameter profile (see PROFILES)

Executed notebooks land in runs/<timestamp>/ next to report.md and report.html. Cells tagged
``summary`` in a notebook hold the claims it checks; their printed output goes into the report.
Exit status is non-zero when any notebook failed (the report still lists every notebook).
"""
from __future__ import annotations

import argparse
import ast
import html
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cadlib.results import atomic_write_text, environment_info, new_run_dir  # noqa: E402

# Parameter profiles: per-notebook overrides on top of each notebook's own defaults (which are the CPU
# profile). Keys are substrings of notebook paths; "*" applies to all notebooks that define the name.
PROFILES: dict[str, dict[str, dict]] = {
    "cpu": {},
    "gpu": {"*": {"backend": "nccl"}},
}


def find_notebooks(only: list[str]) -> list[pathlib.Path]:
    nbs = sorted(p for p in (ROOT / "notebooks").rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
    if only:
        nbs = [p for p in nbs if any(o in str(p.relative_to(ROOT)) for o in only)]
    return nbs


def notebook_parameters(path: pathlib.Path) -> set[str]:
    """Names assigned in the notebook's cell tagged ``parameters``."""
    import nbformat
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            tree = ast.parse(cell.source)
            return {t.id for node in tree.body if isinstance(node, ast.Assign)
                    for t in node.targets if isinstance(t, ast.Name)}
    return set()


def parse_overrides(items: list[str]) -> dict:
    out = {}
    for item in items:
        if "=" not in item:
            raise SystemExit(f"bad -p {item!r}: use name=value (value is a Python literal or a string)")
        k, v = item.split("=", 1)
        try:
            out[k.strip()] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            out[k.strip()] = v
    return out


def params_for(path: pathlib.Path, profile: dict, overrides: dict) -> dict:
    names = notebook_parameters(path)
    rel = str(path.relative_to(ROOT))
    params = {}
    for key, vals in profile.items():
        if key == "*" or key in rel:
            params.update({k: v for k, v in vals.items() if k in names})
    params.update({k: v for k, v in overrides.items() if k in names})
    return params


def summary_text(path: pathlib.Path) -> str:
    import nbformat
    nb = nbformat.read(path, as_version=4)
    chunks = []
    for cell in nb.cells:
        if cell.cell_type == "code" and "summary" in cell.get("metadata", {}).get("tags", []):
            for out in cell.get("outputs", []):
                if out.get("output_type") == "stream":
                    chunks.append(out.get("text", ""))
                elif "text/plain" in out.get("data", {}):
                    chunks.append(out["data"]["text/plain"])
    return "".join(chunks).strip()


def export_html(src: pathlib.Path, dest: pathlib.Path) -> pathlib.Path | None:
    try:
        from nbconvert import HTMLExporter
        body, _ = HTMLExporter().from_filename(str(src))
        atomic_write_text(dest, body)
        return dest
    except Exception as e:  # the report must not fail because a viewer could not be made
        print(f"  (html export of {src.name} failed: {e})")
        return None


def write_report(run_dir: pathlib.Path, rows: list[dict], meta: dict, profile: str) -> None:
    ok = sum(r["status"] == "ok" for r in rows)
    md = [f"# cadlib reproduction — {meta['date']}", "",
          f"Profile `{profile}` on {meta['device']}; torch {meta['torch']}, commit `{meta['commit']}`.", "",
          f"**{ok}/{len(rows)} notebooks ran cleanly.**", "",
          "| notebook | status | seconds | parameters |", "|---|---|---|---|"]
    for r in rows:
        params = json.dumps(r["parameters"])
        md.append(f"| `{r['notebook']}` | {r['status']} | {r['seconds']:.1f} | `{params}` |")
    for r in rows:
        md += ["", f"## {r['notebook']}", ""]
        if r["status"] != "ok":
            md += ["```", r["error"], "```"]
        md += ["```", r["summary"] or "(no summary cell)", "```"]
    atomic_write_text(run_dir / "report.md", "\n".join(md) + "\n")

    h = ["<!doctype html><meta charset='utf-8'><title>cadlib reproduction</title>",
         "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}td,th{padding:.2em .6em}"
         "pre{background:#f4f4f4;padding:.6em;overflow-x:auto}.failed{color:#b00}</style>",
         f"<h1>cadlib reproduction — {html.escape(meta['date'])}</h1>",
         f"<p>Profile <code>{profile}</code> on {html.escape(meta['device'])}; torch "
         f"{html.escape(str(meta['torch']))}, commit <code>{html.escape(meta['commit'])}</code>.</p>",
         f"<p><b>{ok}/{len(rows)} notebooks ran cleanly.</b></p>",
         "<table border=1 cellspacing=0><tr><th>notebook</th><th>status</th><th>s</th><th>open</th></tr>"]
    for r in rows:
        link = f"<a href='{html.escape(r['html'])}'>html</a> · " if r.get("html") else ""
        link += f"<a href='{html.escape(r['ipynb'])}'>ipynb</a>"
        h.append(f"<tr><td>{html.escape(r['notebook'])}</td><td class='{r['status']}'>{r['status']}</td>"
                 f"<td>{r['seconds']:.1f}</td><td>{link}</td></tr>")
    h.append("</table>")
    for r in rows:
        h.append(f"<h2>{html.escape(r['notebook'])}</h2>")
        if r["status"] != "ok":
            h.append(f"<pre class='failed'>{html.escape(r['error'])}</pre>")
        h.append(f"<pre>{html.escape(r['summary'] or '(no summary cell)')}</pre>")
    atomic_write_text(run_dir / "report.html", "\n".join(h) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="cpu", choices=sorted(PROFILES))
    ap.add_argument("--only", action="append", default=[], help="substring of notebook paths to run")
    ap.add_argument("-p", "--param", action="append", default=[], help="name=value override")
    ap.add_argument("--out", default=str(ROOT / "runs"), help="parent folder of the run folder")
    ap.add_argument("--no-html", action="store_true", help="skip the per-notebook HTML export")
    ap.add_argument("--timeout", type=int, default=1800, help="per-cell timeout in seconds")
    args = ap.parse_args(argv)

    import papermill as pm

    notebooks = find_notebooks(args.only)
    if not notebooks:
        raise SystemExit(f"no notebooks matched {args.only}; available: "
                         f"{[str(p.relative_to(ROOT)) for p in find_notebooks([])]}")
    overrides = parse_overrides(args.param)
    run_dir = new_run_dir(args.out, args.profile)
    meta = environment_info()
    print(f"[reproduce] {len(notebooks)} notebooks -> {run_dir}")
    rows = []
    for i, nb in enumerate(notebooks, 1):
        rel = nb.relative_to(ROOT / "notebooks")
        out = run_dir / str(rel).replace("/", "__")
        params = params_for(nb, PROFILES[args.profile], overrides)
        print(f"[reproduce] ({i}/{len(notebooks)}) {rel} {params or ''}", flush=True)
        t0 = time.perf_counter()
        row = {"notebook": str(rel), "parameters": params, "ipynb": out.name, "error": ""}
        try:
            pm.execute_notebook(str(nb), str(out), parameters=params, cwd=str(nb.parent),
                                kernel_name="python3", progress_bar=True, execution_timeout=args.timeout)
            row["status"] = "ok"
        except Exception as e:  # keep going: the report lists every notebook
            row["status"] = "failed"
            row["error"] = f"{type(e).__name__}: {e}"[-4000:]
        row["seconds"] = time.perf_counter() - t0
        row["summary"] = summary_text(out) if out.exists() else ""
        if not args.no_html and out.exists():
            h = export_html(out, out.with_suffix(".html"))
            row["html"] = h.name if h else None
        print(f"[reproduce]     {row['status']} in {row['seconds']:.1f}s", flush=True)
        rows.append(row)
    write_report(run_dir, rows, meta, args.profile)
    atomic_write_text(run_dir / "report.json", json.dumps({"meta": meta, "notebooks": rows}, indent=2))
    print(f"[reproduce] report: {run_dir / 'report.md'} and report.html")
    failed = [r["notebook"] for r in rows if r["status"] != "ok"]
    if failed:
        print(f"[reproduce] FAILED: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

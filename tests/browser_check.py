#!/usr/bin/env python
"""Open a notebook in JupyterLab in a real browser (chromium through playwright), run all its cells from
the Run menu, and check what a reader sees: no error output, plotly figures drawn, and the ipywidgets
controls redrawing their figure when one changes. Also a static report page: its headline block and
claims table at the top, every figure drawn.

    python tests/browser_check.py notebooks/01_imbalance/01_stragglers.ipynb --widgets
    python tests/browser_check.py --report results/reports/report.html
    python tests/browser_check.py --report out.html   # e.g. the page of python -m cadlib.whatif --html

JupyterLab runs on a free localhost port with a random token, from this Python, on a copy of the
notebook's folder in a temporary directory (the repository's notebooks are never saved to), with its
own settings, workspace and runtime folders. Whatever happens, the server, its kernels and the
browser are stopped: the server's whole process tree is terminated in a ``finally``. A screenshot is
saved under runs/browser/. Uses the system's ``chromium`` (no browser download).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from cadlib.infra import proctree

ROOT = pathlib.Path(__file__).resolve().parents[1]

LAB_SETTINGS = {   # JupyterLab user settings for the run: every cell in the DOM, no autosave, no popups
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                         "checkForUpdates": False},
}

# JavaScript run in the page (JupyterLab started with expose_app_in_browser, so window.jupyterapp exists).
JS_NOTEBOOK = "window.jupyterapp && window.jupyterapp.shell.currentWidget"
JS_KERNEL_IDLE = f"""() => {{ const nb = {JS_NOTEBOOK};
  const k = nb && nb.sessionContext && nb.sessionContext.session && nb.sessionContext.session.kernel;
  return !!(k && k.status === 'idle' && nb.content && nb.content.widgets.length); }}"""
JS_STATE = f"""() => {{ const nb = {JS_NOTEBOOK};
  const k = nb.sessionContext.session.kernel; const cells = nb.content.widgets;
  const code = cells.filter(c => c.model.type === 'code');
  const errors = [];
  code.forEach((c, i) => {{ for (let j = 0; j < c.model.outputs.length; j++) {{
      const o = c.model.outputs.get(j).toJSON();
      if (o.output_type === 'error') errors.push(`cell ${{i}}: ${{o.ename}}: ${{o.evalue}}`); }} }});
  return {{status: k ? k.status : 'none', executed: code.filter(c => c.model.executionCount !== null).length,
          code: code.length, errors}}; }}"""


def chromium_path() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        raise RuntimeError("no chromium on PATH; install it (Debian: apt-get install -y chromium)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LabServer:
    """JupyterLab on ``root`` (a context manager); :meth:`pids` is the server's process tree."""

    def __init__(self, root: pathlib.Path, state: pathlib.Path, log: pathlib.Path, timeout: float = 90):
        self.root, self.state, self.log_path, self.timeout = root, state, log, timeout
        self.port, self.token = free_port(), secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.seen: set[int] = set()

    def __enter__(self) -> "LabServer":
        for rel, values in LAB_SETTINGS.items():
            path = self.state / "settings" / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(self.state / "settings"),
                   JUPYTERLAB_WORKSPACES_DIR=str(self.state / "workspaces"),
                   JUPYTER_RUNTIME_DIR=str(self.state / "runtime"), PYTHONPATH=os.pathsep.join(
                       p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
               f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
               "--LabApp.expose_app_in_browser=True", "--ServerApp.terminals_enabled=False", "--allow-root"]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=self.root,
                                     start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_ready(self) -> None:
        end = time.monotonic() + self.timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {self.proc.returncode}; log: {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/api/status?token={self.token}", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"jupyter lab did not answer within {self.timeout:.0f} s; log: {self.log_path}")

    def pids(self) -> set[int]:
        """The server and every process it started (kernels run in sessions of their own)."""
        if self.proc is not None and self.proc.poll() is None:
            self.seen |= {self.proc.pid, *proctree._descendants(self.proc.pid)}
        return set(self.seen)

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.pids()
            proctree.terminate_tree(self.proc.pid, grace=5.0)
            self.proc.wait(timeout=10)
        self.log.close()


def alive(pids) -> list[int]:
    """The pids of ``pids`` that still run (zombies count as gone)."""
    return [p for p in pids if proctree._identity(p) is not None]


@contextlib.contextmanager
def browser_page(viewport=(1400, 1000)):
    from playwright.sync_api import sync_playwright
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": viewport[0], "height": viewport[1]})
            yield page
        finally:
            browser.close()


def _wait(page, fn: str, timeout_s: float, what: str, arg=None):
    try:
        return page.wait_for_function(fn, arg=arg, timeout=timeout_s * 1000, polling=250)
    except Exception as e:
        raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}") from e


@contextlib.contextmanager
def _sigterm_unwinds():
    """While inside, SIGTERM (a CI timeout) raises SystemExit so that the ``finally`` blocks stop the
    server and the browser instead of orphaning them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise SystemExit(f"terminated by signal {signum}")
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_in_lab(notebook: pathlib.Path, screenshot: pathlib.Path, *, widgets: bool = False,
               timeout_s: float = 90, pids_seen: set | None = None) -> dict:
    """Open ``notebook`` in JupyterLab, Run > Run All Cells, and assert what the page shows.

    Returns ``{"cells": n, "figures": n, "widget_title": (before, after)}``. Raises AssertionError
    naming the failing check; the server, its kernels and the browser are stopped in every case.
    ``pids_seen`` (a set) receives the server's process tree, for callers that check nothing is left."""
    notebook = pathlib.Path(notebook).resolve()
    screenshot.parent.mkdir(parents=True, exist_ok=True)
    with _sigterm_unwinds(), tempfile.TemporaryDirectory(prefix="cadlib-lab-") as tmp:
        tmp = pathlib.Path(tmp)
        root = tmp / "root"
        shutil.copytree(notebook.parent, root / notebook.parent.name,
                        ignore=shutil.ignore_patterns(".ipynb_checkpoints", "*.html"))
        rel = f"{notebook.parent.name}/{notebook.name}"
        server = LabServer(root, tmp / "state", screenshot.with_suffix(".lab.log"))
        try:
            with server, browser_page() as page:
                page.goto(f"{server.url}/lab/tree/{rel}?token={server.token}")
                _wait(page, JS_KERNEL_IDLE, timeout_s, "the notebook to open with an idle kernel")
                if pids_seen is not None:
                    pids_seen |= server.pids()
                page.get_by_role("menuitem", name="Run", exact=True).click()
                page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
                _wait(page, f"""() => {{ const s = ({JS_STATE})();
                        return s.status === 'idle' && (s.executed === s.code || s.errors.length > 0); }}""",
                      timeout_s, "every cell to run")
                time.sleep(0.5)                  # outputs of the last cell reach the page
                state = page.evaluate(JS_STATE)
                if pids_seen is not None:
                    pids_seen |= server.pids()
                try:
                    assert not state["errors"], f"error output in the notebook: {state['errors']}"
                    assert state["executed"] == state["code"], f"only {state['executed']}/{state['code']} ran"
                    figs = ".jp-Notebook .jp-OutputArea .js-plotly-plot"
                    _wait(page, f"() => document.querySelectorAll('{figs} svg.main-svg').length > 0",
                          30, "a plotly figure drawn in the notebook")
                    result = {"cells": state["code"],
                              "figures": page.locator(f"{figs}").count()}
                    if widgets:
                        result["widget_title"] = _check_widgets(page)
                finally:
                    with contextlib.suppress(Exception):   # never mask the failing check
                        page.screenshot(path=str(screenshot))
        finally:
            if pids_seen is not None:
                pids_seen |= server.seen
    return result


def _check_widgets(page, changes: int = 2) -> list[str | None]:
    """Controls rendered; each change of the first dropdown (re)draws the figure in their box, so its
    title changes (before the first change the box may show no figure). Returns the titles seen."""
    box = page.locator(".jp-Notebook .widget-vbox").filter(has=page.locator(".widget-dropdown select")).first
    try:
        box.wait_for(state="visible", timeout=30_000)
    except Exception as e:
        raise AssertionError("no ipywidgets controls rendered (a box with a dropdown)") from e
    box.scroll_into_view_if_needed()
    titles = box.locator(".js-plotly-plot .gtitle")
    seen = [titles.first.text_content() if titles.count() else None]
    select = box.locator(".widget-dropdown select").first
    values = select.locator("option").evaluate_all("os => os.map(o => o.value)")
    for _ in range(changes):
        others = [v for v in values if v != select.input_value()]
        assert others, "the dropdown offers no other value"
        select.select_option(others[-1])
        _wait(page, """([sel, before]) => { const f = document.querySelector(sel);
                       const t = f && f.querySelector('.gtitle');
                       return !!(f && f.querySelector('svg.main-svg') && t && t.textContent !== before); }""",
              60, f"the widgets' figure to redraw after the dropdown changed to {others[-1]!r}",
              arg=[".jp-Notebook .widget-vbox .js-plotly-plot", seen[-1]])
        seen.append(titles.first.text_content())
    box.scroll_into_view_if_needed()
    return seen


def _drawn(page, page_path) -> int:
    """Wait until every plotly figure of the open page is drawn; returns how many there are."""
    n = page.locator(".plotly-graph-div").count()
    assert n > 0, f"{page_path} has no plotly figure"
    _wait(page, "(n) => document.querySelectorAll('.plotly-graph-div svg.main-svg').length >= n", 60,
          f"all {n} figures of {page_path} to be drawn", arg=n)
    return n


def check_figures(page_path: pathlib.Path, screenshot: pathlib.Path | None = None) -> int:
    """Open a static page and wait until every plotly figure in it is drawn; returns how many."""
    with browser_page() as page:
        page.goto(pathlib.Path(page_path).resolve().as_uri())
        n = _drawn(page, page_path)
        if screenshot:
            page.screenshot(path=str(screenshot), full_page=False)
    return n


def check_report(page_path: pathlib.Path, screenshot: pathlib.Path | None = None) -> dict:
    """Open a static report page and check what a reader meets first: the headline block (a table of
    rows and the hero figure), the claims table, and every plotly figure drawn. Returns ``{"figures",
    "headline_rows", "claim_rows", "claims"}`` (the claim ids of the table's rows, in order)."""
    with browser_page() as page:
        page.goto(pathlib.Path(page_path).resolve().as_uri())
        n = _drawn(page, page_path)
        headline = page.locator("#headline table.headline tr").count() - 1
        assert headline >= 4, f"the headline block has {headline} rows"
        assert page.locator("#headline #hero svg.main-svg").count() >= 1, "the headline's figure is not drawn"
        top = page.evaluate("() => [document.getElementById('headline').getBoundingClientRect().top, "
                            "document.getElementById('claims').getBoundingClientRect().top]")
        assert top[0] < top[1] < 4000, f"the answer is not at the top of the page: {top}"
        claims = page.locator("table.claims tr.claim").evaluate_all("rs => rs.map(r => r.dataset.claim)")
        if screenshot:
            page.screenshot(path=str(screenshot), full_page=False)
    return {"figures": n, "headline_rows": headline, "claim_rows": len(claims), "claims": claims}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebook", nargs="?", help="notebook to run in JupyterLab")
    ap.add_argument("--widgets", action="store_true", help="also check the ipywidgets controls redraw")
    ap.add_argument("--report", help="a static report page whose figures must all be drawn")
    ap.add_argument("--out", default=str(ROOT / "runs" / "browser"), help="folder for screenshots")
    args = ap.parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = pathlib.Path(args.out)
    if args.notebook:
        shot = out / f"{stamp}-{pathlib.Path(args.notebook).stem}.png"
        print(run_in_lab(pathlib.Path(args.notebook), shot, widgets=args.widgets), "screenshot:", shot)
    if args.report:
        out.mkdir(parents=True, exist_ok=True)
        print(check_report(pathlib.Path(args.report), out / f"{stamp}-report.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

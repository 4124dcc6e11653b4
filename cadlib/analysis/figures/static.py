"""Figures that reach the reader of static HTML: plotly figures of executed notebooks rendered as
``text/html`` beside their JSON (:func:`with_html_figures`), plotly.js loaded once per page (inlined,
packed, or from a local file) so pages work offline, and a notebook's key figures and summary text for
:mod:`cadlib.analysis.report.writer`.
"""
from __future__ import annotations

import copy
import html
import os
import pathlib
import re
from typing import Any, Iterable

from ...infra.results import atomic_write_text

PLOTLY_MIME = "application/vnd.plotly.v1+json"
FIGURE_TAGS = ("figure", "summary")



def plotly_div(fig: dict, div_id: str) -> str:
    """A ``<div>`` + ``<script>`` drawing ``fig`` (a plotly figure dict); needs plotly.js on the page."""
    import plotly.io as pio
    return pio.to_html(fig, include_plotlyjs=False, full_html=False, validate=False, div_id=div_id,
                       default_height="450px")


def plotlyjs_tag(src: str | None = None) -> str:
    """plotly.js for a page: inlined (``src=None``) or from a local file next to it. ``define`` is
    hidden while it loads, so a page that also loads require.js still gets the global ``Plotly``."""
    hide, restore = ("<script>window.__cadlibDefine = window.define; window.define = undefined;</script>",
                     "<script>window.define = window.__cadlibDefine;</script>")
    if src is not None:
        return f"{hide}<script src=\"{html.escape(src)}\"></script>{restore}"
    from plotly.offline import get_plotlyjs
    return f"{hide}<script type=\"text/javascript\">{get_plotlyjs()}</script>{restore}"


def plotlyjs_packed_tag() -> str:
    """plotly.js inside the page gzipped and base64-encoded (0.4x its size), unpacked by the browser
    (``DecompressionStream``: Chromium 80+, Firefox 113+, Safari 16.4+) into ``window.cadlibPlotly``,
    a promise of ``Plotly`` that figures from :func:`plotly_div_deferred` wait on."""
    import base64
    import gzip

    from plotly.offline import get_plotlyjs
    packed = base64.b64encode(gzip.compress(get_plotlyjs().encode(), 9, mtime=0)).decode()
    return ("<script id='cadlib-plotlyjs' type='application/octet-stream'>" + packed + "</script>\n"
            "<script>window.cadlibPlotly = (async () => {\n"
            "  if (!window.DecompressionStream) {\n"
            "    document.body.insertAdjacentHTML('afterbegin', '<p><b>This browser cannot unpack the "
            "figures (no DecompressionStream); open the page in a current browser.</b></p>');\n"
            "    throw new Error('no DecompressionStream'); }\n"
            "  const b = atob(document.getElementById('cadlib-plotlyjs').textContent.trim());\n"
            "  const u = Uint8Array.from(b, c => c.charCodeAt(0));\n"
            "  const gz = new Blob([u]).stream().pipeThrough(new DecompressionStream('gzip'));\n"
            "  const s = document.createElement('script'); s.text = await new Response(gz).text();\n"
            "  document.head.appendChild(s);\n"
            "  return window.Plotly; })();</script>")


def plotly_div_deferred(fig: dict, div_id: str) -> str:
    """A ``<div>`` drawing ``fig`` once ``window.cadlibPlotly`` (:func:`plotlyjs_packed_tag`) resolves."""
    import plotly.io as pio
    layout = fig.get("layout", {}) or {}
    style = (f"height:{layout['height']}px;" if layout.get("height") else "height:450px;") + \
        (f"width:{layout['width']}px" if layout.get("width") else "width:100%")
    spec = pio.to_json(fig, validate=False).replace("</", "<\\/")
    return (f"<div id='{div_id}' class='plotly-graph-div' style='{style}'></div>"
            f"<script>window.cadlibPlotly.then(P => {{ const f = {spec};\n"
            f"P.newPlot('{div_id}', f.data, f.layout || {{}}, {{responsive: true}}); }});</script>")


def write_plotlyjs(folder: str | os.PathLike, name: str = "plotly.min.js") -> pathlib.Path:
    """Write plotly.js into ``folder`` once (for pages that load it with ``plotlyjs_tag(name)``)."""
    from plotly.offline import get_plotlyjs

    path = pathlib.Path(folder) / name
    if not path.exists():
        atomic_write_text(path, get_plotlyjs())
    return path


def _outputs(nb) -> Iterable[tuple[int, dict, Any]]:
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            for out in cell.get("outputs", []):
                yield i, cell, out


def with_html_figures(nb, prefix: str = "fig"):
    """A copy of notebook ``nb`` where each plotly output also carries ``text/html`` (a div drawing it).
    Div ids are ``{prefix}-{cell}-{output}``, stable from run to run."""
    nb = copy.deepcopy(nb)
    for i, cell in enumerate(nb.cells):
        for j, out in enumerate(cell.get("outputs", []) if cell.cell_type == "code" else []):
            data = out.get("data", {})
            if PLOTLY_MIME in data and "text/html" not in data:
                data["text/html"] = plotly_div(data[PLOTLY_MIME], f"{prefix}-{i}-{j}")
    return nb


IMAGE_MIMES = ("image/png", "image/jpeg", "image/svg+xml")


def captioned_figures(nb, tags: Iterable[str] = FIGURE_TAGS) -> list[tuple[dict, str]]:
    """The figures of cells tagged with any of ``tags`` (every figure when no such cell has one), each
    as ``({mime: data}, caption)``: a plotly figure dict under :data:`PLOTLY_MIME`, or an image (png, jpeg,
    svg); the caption is the cell's ``caption`` metadata, else the figure's title."""
    tags = set(tags)
    figs = []
    for _, cell, out in _outputs(nb):
        data = out.get("data", {})
        mime = next((m for m in (PLOTLY_MIME, *IMAGE_MIMES) if m in data), None)
        if mime:
            title = ((data[mime].get("layout") or {}).get("title") or {}) if mime == PLOTLY_MIME else {}
            title = title.get("text", "") if isinstance(title, dict) else str(title)
            caption = cell.get("metadata", {}).get("caption") or re.sub(r"<[^>]+>", " ", title).strip()
            figs.append((set(cell.get("metadata", {}).get("tags", [])), {mime: data[mime]}, caption))
    tagged = [(f, c) for t, f, c in figs if t & tags]
    return tagged if tagged else [(f, c) for _, f, c in figs]


def key_figures(nb, tags: Iterable[str] = FIGURE_TAGS) -> list[dict]:
    """The figures of :func:`captioned_figures`, without their captions."""
    return [f for f, _ in captioned_figures(nb, tags)]


def figure_html(fig: dict, div_id: str) -> str:
    """HTML for one entry of :func:`key_figures` (plotly figures wait for :func:`plotlyjs_packed_tag`)."""
    mime, data = next(iter(fig.items()))
    if mime == PLOTLY_MIME:
        return plotly_div_deferred(data, div_id)
    if mime == "image/svg+xml":
        return data if isinstance(data, str) else "".join(data)
    data = data if isinstance(data, str) else "".join(data)
    return f"<img id='{div_id}' alt='figure' src='data:{mime};base64,{data.strip()}'>"


def summary_text(nb, tag: str = "summary") -> str:
    """The printed output of the cells tagged ``summary``."""
    chunks = []
    for _, cell, out in _outputs(nb):
        if tag in cell.get("metadata", {}).get("tags", []):
            if out.get("output_type") == "stream":
                chunks.append(out.get("text", ""))
            elif "text/plain" in out.get("data", {}):
                chunks.append(out["data"]["text/plain"])
    return "".join(chunks).strip()


_CODE = re.compile(r"(```.*?```|`[^`\n]*`)", re.S)
_DISPLAY = re.compile(r"\$\$(.+?)\$\$", re.S)
_INLINE = re.compile(r"(?<![\\$])\$(?![\s$])([^$\n]+?)(?<![\s\\])\$")


def render_math(markdown: str) -> str:
    """``markdown`` with its TeX (``$...$`` inline, ``$$...$$`` displayed; not inside code) replaced by
    MathML, which browsers draw without a script or a network: exported pages show their maths offline."""
    from latex2mathml.converter import convert

    def math(text: str, display: str) -> str:
        return convert(text.strip(), display=display).replace("\n", "")

    parts = _CODE.split(markdown)
    for i in range(0, len(parts), 2):
        p = _DISPLAY.sub(lambda m: "\n\n" + math(m.group(1), "block") + "\n\n", parts[i])
        parts[i] = _INLINE.sub(lambda m: math(m.group(1), "inline"), p)
    return "".join(parts)


def notebook_html(ipynb: str | os.PathLike, dest: str | os.PathLike, plotlyjs_src: str | None = None,
                  css_href: str | None = None):
    """Export an executed notebook to HTML with every plotly figure drawn (plotly.js inlined, or loaded
    from ``plotlyjs_src`` relative to the page) and its maths pre-rendered as MathML (:func:`render_math`;
    no MathJax from the network). With ``css_href``, the page's own stylesheet (nbconvert's theme, some
    7,000 lines, the same for every notebook) goes to that file beside ``dest`` and the page links it."""
    import nbformat
    from nbconvert import HTMLExporter

    nb = with_html_figures(nbformat.read(str(ipynb), as_version=4))
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = render_math(cell.source)
    body, _ = HTMLExporter().from_notebook_node(nb)
    body = re.sub(r"<script[^>]*src=\"[^\"]*mathjax[^\"]*\"[^>]*>\s*</script>", "", body, flags=re.I)
    body = re.sub(r"(<head[^>]*>)", lambda m: m.group(1) + plotlyjs_tag(plotlyjs_src), body, count=1)
    if css_href is not None:
        body = shared_stylesheet(body, pathlib.Path(dest).parent / css_href, css_href)
    return atomic_write_text(dest, body)


_HEAD_STYLE = re.compile(r"<style[^>]*>(.*?)</style>", re.S | re.I)


def shared_stylesheet(page: str, css_path: str | os.PathLike, css_href: str) -> str:
    """``page`` with the ``<style>`` blocks of its ``<head>`` written to ``css_path`` (their text, in
    order) and replaced by one ``<link>`` to ``css_href``; the body's own styles stay."""
    head_end = page.lower().find("</head>")
    if head_end < 0:
        return page
    head, rest = page[:head_end], page[head_end:]
    css = "\n".join(m.group(1) for m in _HEAD_STYLE.finditer(head))
    if not css:
        return page
    atomic_write_text(css_path, css)
    head = _HEAD_STYLE.sub("", head)
    return head + f'<link rel="stylesheet" href="{css_href}">\n' + rest

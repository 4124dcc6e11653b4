"""Every number the prose quotes, computed once from the committed results.

:func:`numbers` computes, from the scale replay under ``results/replay/`` and the end-to-end runs
``results/bench_e2e_*.json``, each figure that the README and the notebooks' markdown quote, keyed by
the claim it answers and its evidence (``distca.idle_dp8@replay``) or by what it measures
(``replay.raw_err``), with that evidence in words (how it was obtained, at which scale). The prose marks
a quoted number with its key in an HTML comment, invisible when rendered::

    the replay idles <!-- distca.idle_dp8@replay -->46.3% of the GPU time at DP=8

and :func:`check_markers` (``tests/test_answers.py``, over the README and every notebook) fails when
the number after a marker is not :func:`text` of its key, so no page quotes a stale figure. The
verdicts these numbers carry are :mod:`cadlib.analysis.report.verdicts`'.
"""
from __future__ import annotations

import functools
import json
import pathlib
import re
from typing import NamedTuple

from . import claims, fidelity, scale

# ---------------------------------------------------------------------------------------------------
# The numbers the prose quotes
# ---------------------------------------------------------------------------------------------------

class Number(NamedTuple):
    """A figure the prose quotes: ``value`` (a number, or ``(low, high)``), ``text`` exactly as written,
    and its ``evidence`` (how it was obtained, at which scale)."""

    value: float | tuple[float, float]
    text: str
    evidence: str


def _span(lo: float, hi: float, fmt: str, unit: str) -> str:
    a, b = format(lo, fmt), format(hi, fmt)
    return f"{a}{unit}" if a == b else f"{a}-{b}{unit}"


def _speedup_range(g, evidence: str) -> Number:
    """A range of speedups (``1.02-1.23x``) over the settings of ``g``."""
    return Number((float(g.min()), float(g.max())), _span(g.min(), g.max(), ".2f", "x"), evidence)


REPLAY = "replayed on 1x H200 from the paper's 64-256-GPU settings"
REPLAY_PAPER = REPLAY + " under the paper's protocol (FA2, Llama-8B)"
E2E = "measured on 2x H200"


@functools.lru_cache(maxsize=4)
def numbers(results_dir=None) -> dict[str, Number]:
    """Every quoted figure by key, from the committed results (``results_dir``: the repository's
    ``results/`` by default; the replay's files under its ``replay/``)."""
    replay_dir = None if results_dir is None else pathlib.Path(results_dir) / "replay"
    out: dict[str, Number] = {}
    idl = scale.idle(replay_dir).set_index("dp")
    for dp in (4, 8):
        v = float(idl.loc[dp, "varlen"])
        out[f"distca.idle_dp{dp}@replay"] = Number(v, f"{v:.1f}%",
                                                   f"{REPLAY} (variable-length chunking, DP={dp})")
    sp = scale.speedups(scale.PROTOCOL_TAG, results_dir=replay_dir)
    for d in ("pretrain", "prolong"):
        g = sp[sp.dist == d].speedup_over_wlb
        out[f"distca.speedup_3d_{d}@replay"] = Number(float(g.mean()), f"{g.mean():.2f}x",
                                                      f"{REPLAY_PAPER}, mean")
        out[f"distca.speedup_3d_{d}@replay_range"] = _speedup_range(g, REPLAY_PAPER)
    old = scale.speedups(results_dir=replay_dir)
    for d in ("pretrain", "prolong"):
        g = old[old.dist == d].speedup_over_wlb
        out[f"distca.speedup_3d_{d}@replay_ours_range"] = _speedup_range(
            g, f"{REPLAY}, under our earlier protocol (FA4; docs/fidelity.md's variants)")
    for tag, kernel in (("_paper", "FA2, the paper's kernel"), ("_paper_fa4", "FA4")):
        pr = fidelity.paper_speedups(tag, replay_dir)
        key = "protocol" if tag == "_paper" else "protocol_fa4"
        for d in ("pretrain", "prolong"):
            g = pr[pr.dist == d]
            if tag != scale.PROTOCOL_TAG:       # the protocol's own range is @replay_range above
                out[f"distca.speedup_3d_{d}@{key}_range"] = _speedup_range(
                    g.speedup_over_wlb,
                    f"{REPLAY} under the paper's protocol ({kernel}, {int(g.batches.min())} batches)")
            out[f"distca.speedup_3d_{d}@{key}_inside"] = Number(
                float(g.inside.sum()), str(int(g.inside.sum())),
                f"settings of {len(g)} inside the paper's range, {REPLAY} under the paper's protocol "
                f"({kernel})")
    p4 = scale.speedups_4d_paper(results_dir=replay_dir)
    for d in ("pretrain", "prolong"):
        g = p4[p4.dist == d].speedup_over_wlb
        out[f"distca.speedup_4d_8b_{d}@replay_range"] = _speedup_range(
            g, f"{REPLAY_PAPER} (4D, each method at its best configuration that fits in memory)")
    for view in ("any", "budget"):
        s4 = scale.speedups_4d(view, replay_dir)
        for d in ("pretrain", "prolong"):
            g = s4[s4.dist == d].speedup_over_wlb
            out[f"distca.speedup_4d_8b_{d}@replay_{view}"] = _speedup_range(g, f"{REPLAY} (4D, {view})")
    ab = scale.pingpong_ablation(results_dir=replay_dir)
    exposed = float((1 / ab.signal_only_over_pingpong.mean() - 1) * 100)
    out["distca.comm_hidden@replay"] = Number(exposed, f"{exposed:.1f}%", REPLAY)
    e2e = [r for r in claims.e2e_ours(results_dir) if not r["control"] and "_2gpu_" in r["setting"]]
    hidden = [r["ours"] for r in e2e if r["claim"] == "distca.comm_hidden"]
    if hidden:
        out["distca.comm_hidden@2xh200"] = Number((min(hidden), max(hidden)),
                                                  _span(min(hidden), max(hidden), ".1f", "%"), E2E)
    v = scale.validation(replay_dir)
    v = v[~v.setting.str.startswith("uniform")]
    raw, fixed = v.err_of_mean.abs(), v.on_gpu_err_of_mean.abs()
    out["replay.raw_err"] = Number((float(raw.min()), float(raw.max())),
                                   _span(100 * raw.min(), 100 * raw.max(), ".1f", "%"),
                                   "the DP=2 replay against the 2x H200 runs: |error| of the mean step")
    out["replay.scaled_err"] = Number((float(fixed.min()), float(fixed.max())),
                                      _span(100 * fixed.min(), 100 * fixed.max(), ".1f", "%"),
                                      "the same, timings scaled to the runs' GPU (device_ratio)")
    dr = v.device_ratio - 1
    out["replay.device_ratio"] = Number((float(dr.min()), float(dr.max())),
                                        _span(100 * dr.min(), 100 * dr.max(), ".1f", "%"),
                                        "the 2x H200 machine's LM head over the timing GPU's, minus 1")
    diff = float((v.speedup_replayed - v.speedup_measured).abs().max() * 100)
    out["replay.speedup_diff"] = Number(diff, f"{diff:.1f}", "points: replayed against measured speedups")
    return out


def text(key: str, results_dir=None) -> str:
    """The quoted text of ``key`` (see :func:`numbers`); ValueError naming the keys."""
    got = numbers(results_dir)
    if key not in got:
        raise ValueError(f"no number {key!r}; choose one of: {', '.join(got)}")
    return got[key].text


MARKER = re.compile(r"<!--\s*([A-Za-z0-9_.@-]+)\s*-->([^\s<]*)")
"""A quoted number's marker: ``<!-- key -->`` right before the number (no space between)."""


def markers(page: str) -> list[tuple[str, str]]:
    """``(key, quoted)`` of every marker in ``page``; ``quoted`` loses a trailing ``.,;:)``."""
    return [(k, q.rstrip(".,;:)")) for k, q in MARKER.findall(page)]


def check_markers(page: str, results_dir=None) -> list[str]:
    """What is wrong with the markers of ``page``: an unknown key, or a number that is not the key's
    :func:`text` (one line each; empty when all agree)."""
    got = numbers(results_dir)
    bad = []
    for key, quoted in markers(page):
        if key not in got:
            bad.append(f"unknown key {key!r} (quoted {quoted!r})")
        elif quoted != got[key].text:
            bad.append(f"{key}: the page says {quoted!r}, the results say {got[key].text!r}")
    return bad


def refresh_markers(page: str, results_dir=None) -> tuple[str, list[str]]:
    """``page`` with every marked number replaced by its key's :func:`text`, and one line per change
    (``key: old -> new``). An unknown key raises ValueError naming it. What the prose around a number
    says about it (above or below the paper, say) is not checked: read the changes."""
    got = numbers(results_dir)
    changes = []

    def swap(m: re.Match) -> str:
        key, quoted = m.group(1), m.group(2)
        if key not in got:
            raise ValueError(f"unknown key {key!r} (quoted {quoted!r}); choose one of: {', '.join(got)}")
        bare = quoted.rstrip(".,;:)")
        if bare == got[key].text:
            return m.group(0)
        changes.append(f"{key}: {bare} -> {got[key].text}")
        head = m.group(0)[:m.start(2) - m.start(0)]     # the marker itself: never rewritten
        return head + got[key].text + quoted[len(bare):]
    return MARKER.sub(swap, page), changes


def main(argv=None) -> int:
    """``python -m cadlib.analysis.report.answers [--fix] FILE...``: check (or rewrite) the marked numbers
    of the README and notebooks after the results change; exit 1 when a check finds a stale number."""
    import argparse
    ap = argparse.ArgumentParser(description=main.__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--fix", action="store_true", help="rewrite stale numbers in place")
    a = ap.parse_args(argv)
    stale = 0
    for f in a.files:
        path = pathlib.Path(f)
        if path.suffix == ".ipynb":                 # the markdown cells' text, not the file's JSON
            nb = json.loads(path.read_text())
            changes = []
            for cell in nb["cells"]:
                if cell["cell_type"] == "markdown":
                    src = "".join(cell["source"])
                    new, ch = refresh_markers(src)
                    if ch:
                        cell["source"] = new.splitlines(keepends=True)
                        changes += ch
            write = lambda: path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")  # noqa: E731
        else:
            new, changes = refresh_markers(path.read_text())
            write = lambda: path.write_text(new)  # noqa: E731
        for c in changes:
            print(f"{f}: {c}")
        stale += len(changes)
        if a.fix and changes:
            write()
    return 0 if a.fix or not stale else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""The plumbing of notebook 4.4 (at scale) and 4.5 (what if), so that their cells stay a few lines.

4.4: :func:`toy_phases` and :func:`toy_steps`, two ranks whose per-phase times a reader adds up by hand
into a step, then composed by :func:`cadlib.analysis.model.compose.compose` (the replay's composition).

4.5: :func:`unit_table`, the what-if's table for a hand-sized batch in unit costs (a token's linear work
1, a causal pair 1, ping-pong hiding CAD's all-to-all): per method the step ``max_r busy_r``, tokens
per unit of time, the idle share ``1 - mean_r busy_r / step`` and the speedups, the columns
:func:`cadlib.analysis.whatif.page.table_rows` prints; :func:`hand_check` recomputes the what-if's own
table from its per-step numbers; :func:`whatif_argv` writes the notebook's parameters as the CLI's flags.
"""
from __future__ import annotations

import pathlib
import subprocess
import sys
import tempfile

import numpy as np
import pandas as pd

from ...core import cost
from ...infra.results import REPO_ROOT
from ..model.compose import Phases, compose
from ..report import scale as replayed


# ---------------------------------------------------------------------------------------------------
# 4.4: a step from per-phase times
# ---------------------------------------------------------------------------------------------------

def toy_phases(method: str, attention=(4.0, 1.0), linear: float = 1.0, comm: float = 0.5, head: float = 1.0,
               allreduce: float = 1.0, bwd: float = 2.0) -> Phases:
    """One layer of two (or more) ranks in unit times: linear layers ``linear`` before and after core
    attention, ``attention`` per rank, the backward ``bwd`` times each forward phase, the LM head and the
    gradient all-reduce. ``colocated``: each rank its own attention, no collective. ``cad``: attention
    spread evenly (the mean on every rank), an all-to-all of ``comm`` before and after it, forward and
    backward. ``cad-pingpong``: the same as two nano-batches of half of everything."""
    a = np.asarray(attention, dtype=np.float64)
    r = np.ones_like(a)
    if method == "colocated":
        att, c, halves = a, 0.0, 1
    elif method in ("cad", "cad-pingpong"):
        att, c, halves = np.full_like(a, a.mean()), comm, 2 if method == "cad-pingpong" else 1
    else:
        raise ValueError(f"toy_phases: unknown method {method!r}; choose one of: colocated, cad, "
                         "cad-pingpong")

    def per(x):
        x = np.broadcast_to(np.asarray(x, dtype=np.float64), a.shape) / halves
        return np.stack([x, x]) if halves == 2 else x

    return Phases(pre=per(linear * r), post=per(linear * r), pre_bwd=per(bwd * linear * r),
                  post_bwd=per(bwd * linear * r), attn=per(att), attn_bwd=per(bwd * att),
                  comm_in=per(c * r), comm_out=per(c * r), comm_in_bwd=per(c * r), comm_out_bwd=per(c * r),
                  head=head * r, allreduce=allreduce)


def toy_steps(attention=(4.0, 1.0), comm: float = 0.5, **kw) -> pd.DataFrame:
    """:func:`toy_phases` of colocated, CAD and CAD with ping-pong composed over one layer: per method the
    step, each rank's busy time, the idle share of the GPU time and the speedup over colocated."""
    rows = []
    for m in ("colocated", "cad", "cad-pingpong"):
        c = compose(m, toy_phases(m, attention, comm=comm, **kw), 1)
        rows.append({"method": m, "step": c.step, **{f"busy rank {i}": b for i, b in enumerate(c.busy)},
                     "idle": c.idle_fraction})
    df = pd.DataFrame(rows).set_index("method")
    df["x colocated"] = df.step["colocated"] / df.step
    return df


def views_4d(results_dir=None) -> pd.DataFrame:
    """The 4D replay's speedups (:func:`cadlib.analysis.report.scale.speedups_4d`) in both views, with a
    ``view`` column: every configuration allowed, and within the token budget."""
    views = {"every configuration": "any", "within the token budget": "budget"}
    return pd.concat([replayed.speedups_4d(v, results_dir).assign(view=k) for k, v in views.items()],
                     ignore_index=True)


def by_pp_4d(results_dir=None) -> pd.DataFrame:
    """CAD over WLB-ideal with both at the same PP degree (1, 2, 4, 8), the mean over the 4D settings."""
    return pd.DataFrame([{"pp": pp, "dist": d, "speedup_over_wlb": g.speedup_over_wlb.mean()}
                         for pp in (1, 2, 4, 8)
                         for d, g in replayed.speedups_4d(f"pp={pp}", results_dir).groupby("dist")])


def live_replay(setting: str, batches: int, suite: str = "3d") -> pd.DataFrame:
    """Time and compose one replay setting again (``scripts/bench/bench_replay.py time`` then ``compose``
    into a temporary folder; a GPU) and return its summary rows."""
    script = str(REPO_ROOT / "scripts" / "bench" / "bench_replay.py")
    with tempfile.TemporaryDirectory() as tmp:
        for cmd in ("time", "compose"):
            subprocess.run([sys.executable, script, cmd, "--suite", suite, "--only", setting, "--batches",
                            str(batches), "--cache", f"{tmp}/times.json", "--out", tmp, "--tag", "_live"],
                           check=True)
        return replayed.summary("_live", pathlib.Path(tmp))


# ---------------------------------------------------------------------------------------------------
# 4.5: the what-if's table by hand
# ---------------------------------------------------------------------------------------------------

def _pairs(n: int) -> int:
    return cost.causal_pairs(0, n)


def capped_longest_first(docs, ranks: int, cap: int) -> list[list[int]]:
    """WLB-ideal's packing as DistCA runs it, in unit costs: whole documents, longest first, each to the
    least-loaded rank (load = tokens + pairs) that still has room under ``cap`` tokens (ties: lowest
    rank). ValueError when a document fits nowhere."""
    bins: list[list[int]] = [[] for _ in range(ranks)]
    load, tok = np.zeros(ranks), np.zeros(ranks, dtype=np.int64)
    for n in sorted(docs, reverse=True):
        ok = [r for r in range(ranks) if tok[r] + n <= cap]
        if not ok:
            raise ValueError(f"capped_longest_first: a {n}-token document fits no rank under cap={cap}")
        r = min(ok, key=lambda i: (load[i], i))
        bins[r].append(n)
        load[r] += n + _pairs(n)
        tok[r] += n
    return bins


def unit_table(ranks_docs: list[list[int]], cap: int | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The what-if's comparison for a batch already packed in order (``ranks_docs``: the documents of
    each rank, as sequential packing leaves them) in unit costs: ``(per_rank, table)``. Colocated keeps
    that packing; WLB-ideal repacks by :func:`capped_longest_first` under ``cap`` (default: the most
    tokens a rank holds); CAD keeps the tokens and gives every rank the mean attention (ping-pong hides
    the all-to-all). ``table``: per method step, tokens per unit, idle, x colocated, x WLB-ideal."""
    docs = [n for r in ranks_docs for n in r]
    tokens = np.array([sum(r) for r in ranks_docs])
    cap = int(tokens.max()) if cap is None else cap
    wlb = capped_longest_first(docs, len(ranks_docs), cap)
    pairs = {"colocated": [sum(map(_pairs, r)) for r in ranks_docs],
             "wlb": [sum(map(_pairs, r)) for r in wlb]}
    pairs["cad-pingpong"] = [sum(pairs["colocated"]) / len(ranks_docs)] * len(ranks_docs)
    toks = {"colocated": tokens, "wlb": np.array([sum(r) for r in wlb]), "cad-pingpong": tokens}
    per_rank = pd.concat({m: pd.DataFrame({"tokens": toks[m], "pairs": pairs[m],
                                           "busy": toks[m] + np.asarray(pairs[m])})
                          for m in toks}, axis=1)
    per_rank.index.name = "rank"
    per_rank[("wlb", "documents")] = [" ".join(map(str, r)) for r in wlb]
    rows = {}
    for m in toks:
        busy = per_rank[(m, "busy")].to_numpy(dtype=np.float64)
        step = busy.max()
        rows[m] = {"step": step, "tokens per unit": tokens.sum() / step, "idle": 1 - busy.mean() / step}
    t = pd.DataFrame(rows).T
    t["x colocated"] = t.step["colocated"] / t.step
    t["x WLB-ideal"] = t.step["wlb"] / t.step
    return per_rank, t


def hand_check(res: dict) -> pd.DataFrame:
    """The what-if's table (:func:`cadlib.analysis.whatif.planner.plan`) recomputed by hand from its own
    numbers: tokens/s = DP x micro-batches x tokens per group / step; the raw speedup of each sampled step
    = the baseline's step / CAD's. One row per check with both sides and whether they agree."""
    i = res["inputs"]
    tokens = i["cluster"]["dp"] * i["training"]["micro_batches"] * i["training"]["tokens_per_group"]
    rows = []
    for key, r in res["methods"].items():
        rows.append({"check": f"{key}: tokens/s = {tokens:,} / step", "table": r["tokens_per_s"],
                     "by hand": tokens / r["step_s"]})
    cad = res["methods"]["cad-pingpong"]
    for base in ("colocated", "wlb"):
        b = res["methods"][base]
        rows.append({"check": f"CAD over {base}, step 0 = {base}'s step / CAD's",
                     "table": cad[f"speedups_over_{base}"][0],
                     "by hand": b["steps_s"][0] / cad["steps_s"][0]})
    df = pd.DataFrame(rows)
    df["agree"] = np.isclose(df["table"], df["by hand"], rtol=1e-9)
    return df


def whatif_argv(*, lengths_path: str = "", column: str = "", distribution: str = "", clip: bool = False,
                model_name: str, gpus: int, gpus_per_node: int, tp: int, pp: int, micro_batches: int,
                context: int, tokens_per_group: int, intra_node_gbps: float = 0.0,
                inter_node_gbps: float = 0.0, steps: int, seed: int = 0, shipped: str = "") -> list[str]:
    """A notebook's what-if parameters as ``python -m cadlib.whatif``'s flags (``distribution`` in place of
    a lengths file; ``lengths_path`` empty: ``shipped``; bandwidths of 0: the defaults)."""
    src = ["--dist", distribution] if distribution else ["--lengths", str(lengths_path or shipped)]
    argv = src + (["--column", column] if column else []) + (["--clip"] if clip else []) + [
        "--model", model_name, "--gpus", str(gpus), "--gpus-per-node", str(gpus_per_node), "--tp", str(tp),
        "--pp", str(pp), "--micro-batches", str(micro_batches), "--context", str(context),
        "--tokens-per-group", str(tokens_per_group), "--steps", str(steps), "--seed", str(seed)]
    argv += ["--intra-node-gbps", str(intra_node_gbps)] if intra_node_gbps else []
    argv += ["--inter-node-gbps", str(inter_node_gbps)] if inter_node_gbps else []
    return argv


def whatif_widgets(values: dict, run, models=("tiny", "llama3-8b", "llama-34b"),
                   contexts=(32768, 65536, 131072, 262144, 524288, 1048576)):
    """The what-if's inputs as ipywidgets (``values``: the notebook's parameters by name) and a **plan**
    button that prints ``run(**{name: value})`` (a callable answering with text, or raising ValueError
    with the CLI's one line) into an output area below. Returns ``(box, press)``; ``press()`` plans the
    current values, as the button does."""
    import ipywidgets as widgets

    v = values
    controls = {
        "lengths_path": widgets.Text(value=v["lengths_path"], placeholder="the shipped ProLong sample",
                                     description="lengths file"),
        "column": widgets.Text(value=v["column"], description="column"),
        "distribution": widgets.Text(value=v["distribution"], placeholder="or: prolong, pretrain, ...",
                                     description="distribution"),
        "clip": widgets.Checkbox(value=v["clip"], description="clip to context"),
        "model_name": widgets.Dropdown(options=list(models), value=v["model_name"], description="model"),
        "gpus": widgets.IntText(value=v["gpus"], description="GPUs"),
        "gpus_per_node": widgets.IntText(value=v["gpus_per_node"], description="GPUs/node"),
        "tp": widgets.IntText(value=v["tp"], description="TP"),
        "pp": widgets.IntText(value=v["pp"], description="PP"),
        "context": widgets.Dropdown(options=sorted({*contexts, v["context"]}), value=v["context"],
                                    description="context"),
        "tokens_per_group": widgets.IntText(value=v["tokens_per_group"], description="tokens/group"),
        "inter_node_gbps": widgets.FloatText(value=v["inter_node_gbps"], description="inter-node GB/s"),
    }
    button, out = widgets.Button(description="plan", button_style="primary"), widgets.Output()

    def press(_=None):
        with out:
            out.clear_output(wait=True)
            try:
                print(run(**{k: w.value for k, w in controls.items()}))
            except ValueError as e:
                print(e)

    button.on_click(press)
    ws = list(controls.values())
    box = widgets.VBox([widgets.HBox(ws[:4]), widgets.HBox(ws[4:8]), widgets.HBox(ws[8:]), button, out])
    return box, press

"""The plumbing of the lessons (the notebooks), so that their cells stay a few lines: hand-sized
examples a reader can check with a pencil, the tables that show them, and the small studies the
notebooks grow them into. Nothing here computes what a module of its own owns: the layouts, plans,
dispatches, simulations and masks come from the layers below.

* chapter 1 (stragglers): :func:`unit_step` (a step in unit costs), :func:`paper_idle_table`,
  :func:`straggler_view` and :func:`explorer` (the interactive view);
* chapter 2 (CAD) has its own module, :mod:`cadlib.analysis.lessons.cad`;
* chapter 3 (ping-pong): :func:`nano_halves`; pipeline parallelism has its own module,
  :mod:`cadlib.analysis.lessons.pipeline`; chapter 4 (end to end): :func:`toy_runs`; (kernels x masks)
  :func:`block_picture` and :func:`sparse_areas`;
* every chapter: :func:`check_params`, the parameter checks a notebook runs first.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np
import pandas as pd

from ...core import cost
from ...core.layout import Layout
from ...data import packing, sparse, workload
from ...scheduling import nanosplit
from ..figures import plots
from ..model import sim


def check_params(**rules) -> None:
    """Raise ValueError naming the first parameter that breaks its rule: ``name=(value, ok, what)``,
    where ``ok`` is a bool or a callable of the value and ``what`` says what is valid."""
    for name, (value, ok, what) in rules.items():
        good = ok(value) if callable(ok) else ok
        if not good:
            raise ValueError(f"{name} must be {what}, got {value!r}")


# ---------------------------------------------------------------------------------------------------
# Chapter 1: stragglers
# ---------------------------------------------------------------------------------------------------


def unit_step(layout: Layout, linear: float = 1.0, pair: float = 1.0) -> pd.DataFrame:
    """One data-parallel step in unit costs: per rank its ``tokens``, causal ``pairs``, ``busy =
    linear * tokens + pair * pairs`` and ``wait`` for the slowest rank at the gradient all-reduce.
    ``attrs``: ``step`` (the slowest rank's busy time) and ``idle_fraction``
    (``sum wait / (ranks x step)``)."""
    costs = packing.rank_costs(layout, None)
    pairs = np.array(
        [sum(cost.causal_pairs(c.start, c.end) for c in r) for r in layout.ranks], dtype=np.int64
    )
    tokens = np.asarray(costs["tokens"], dtype=np.int64)
    busy = linear * tokens + pair * pairs
    step = float(busy.max())
    df = pd.DataFrame(
        {"tokens": tokens, "pairs": pairs, "busy": busy, "wait": step - busy},
        index=pd.RangeIndex(layout.n_ranks, name="rank"),
    )
    df.attrs.update(step=step, idle_fraction=float(df["wait"].sum() / (layout.n_ranks * step)))
    return df


def paper_idle_table(frame: pd.DataFrame, paper: Mapping[int, float]) -> pd.DataFrame:
    """The paper's idle figure beside ours, per DP size, from :func:`cadlib.analysis.model.idle.straggler_idle`
    run with both packings: the paper's share, the median over sampled batches of variable-length
    chunking and its 25-75% range, its tokens max/mean, and the median of fixed-length packing."""
    var, fixed = frame[frame.packing == "varlen"], frame[frame.packing == "sequential"]
    q = var.groupby("dp").idle_fraction.quantile([0.25, 0.5, 0.75]).unstack()
    dps = sorted(q.index)
    return pd.DataFrame(
        {
            "paper": [paper[d] / 100 if d in paper else np.nan for d in dps],
            "variable-length (median)": q[0.5].to_numpy(),
            "variable-length, 25%-75%": [f"{a:.0%}-{b:.0%}" for a, b in zip(q[0.25], q[0.75])],
            "tokens max/mean": var.groupby("dp").tokens_max_over_mean.median().to_numpy(),
            "fixed-length (median)": fixed.groupby("dp").idle_fraction.median().to_numpy(),
        },
        index=pd.Index(dps, name="DP"),
    )


def straggler_view(distribution: str, context: int, dp: int, model, seed: int = 0, tolerance: float = 0.1):
    """One sampled batch of ``dp`` ranks x ``context`` tokens: per-rank linear and attention seconds under
    plain DP and under CAD (the simulator's H200 rates), titled with both step times."""
    docs = workload.sample_docs(
        total_tokens=dp * context, seed=seed, max_doc_len=context, **workload.sample_kwargs(distribution)
    )
    lay = packing.pack(docs, dp, context)
    dp_t, cad_t = sim.simulate("dp", lay, model), sim.simulate("cad", lay, model, tolerance=tolerance)
    return plots.rank_loads(
        {
            "linear s": dp_t.breakdown["linear"],
            "attention s (DP)": dp_t.breakdown["attention"],
            "attention s (CAD)": cad_t.breakdown["attention"],
        },
        f"{distribution}, {context:,} tokens/rank, DP={dp}: DP step {dp_t.step:.1f}s, "
        f"CAD step {cad_t.step:.1f}s",
        yaxis="seconds per step",
    )


def explorer(view: Callable, controls: Mapping[str, tuple]):
    """ipywidgets controls that redraw ``view(**values)`` (a function returning a figure) below them.
    ``controls``: ``name -> (options or (min, max), value)``: a list or tuple of options gives a dropdown,
    a ``range`` a slider. Returns the box to display."""
    import ipywidgets as widgets
    from IPython.display import display

    ws = {}
    for name, (options, value) in controls.items():
        if isinstance(options, range):
            ws[name] = widgets.IntSlider(
                min=options.start, max=options.stop - 1, value=value, description=name
            )
        else:
            ws[name] = widgets.Dropdown(options=list(options), value=value, description=name)
    out = widgets.Output()

    def redraw(_=None):
        with out:
            out.clear_output(wait=True)
            view(**{k: w.value for k, w in ws.items()}).show()

    for w in ws.values():
        w.observe(redraw, names="value")
    box = widgets.VBox([widgets.HBox(list(ws.values())), out])
    display(box)
    return box


# ---------------------------------------------------------------------------------------------------
# Chapter 3: ping-pong's nano-batches
# ---------------------------------------------------------------------------------------------------


def nano_halves(layout: Layout, min_piece: int = 512) -> pd.DataFrame:
    """Tokens of nano-batch A and B per rank, with whole documents and with documents that may be cut
    between the halves (``split_nano_batches``), and ``|A - B|``."""
    rows = []
    for cut in (False, True):
        a, b = nanosplit.split_nano_batches(layout, "tokens", split_docs=cut, min_piece=min_piece)
        for r in range(layout.n_ranks):
            rows.append(
                {
                    "nano-batches": "cut documents" if cut else "whole documents",
                    "rank": f"rank {r}",
                    "A tokens": len(a.rows[r]),
                    "B tokens": len(b.rows[r]),
                }
            )
    df = pd.DataFrame(rows)
    df["|A - B|"] = (df["A tokens"] - df["B tokens"]).abs()
    return df


# ---------------------------------------------------------------------------------------------------
# Chapter 4: end to end
# ---------------------------------------------------------------------------------------------------


def toy_runs(steps: Mapping[str, float], colocated_attention: Sequence[float]) -> list[dict]:
    """Rank results in the shape ``cadlib.train`` returns them, for a hand-sized end-to-end example: one
    batch, each method's step (the same on every rank: they meet at the all-reduce) and colocated's
    attention time per rank, for :func:`cadlib.analysis.runs.e2e.summarise`."""
    nan = float("nan")
    return [
        {
            "rank": r,
            "records": [
                {
                    "method": m,
                    "batch": 0,
                    "rank": r,
                    "step_ms": float(s),
                    "layers_ms": float(s),
                    "fwd_bwd_ms": float(s),
                    "peak_mem_gib": nan,
                    "attention_ms": float(attn) if m == "colocated" else nan,
                    "comm_ms": 0.0,
                    "comm_exposed_ms": 0.0,
                    "allreduce_ms": 0.0,
                    "loss": 0.0,
                }
                for m, s in steps.items()
            ],
        }
        for r, attn in enumerate(colocated_attention)
    ]


# ---------------------------------------------------------------------------------------------------
# Chapter 4: kernels x masks (block-sparse masks)
# ---------------------------------------------------------------------------------------------------


def block_picture(m: sparse.BlockSparseMask, head: int = 0, pixels: int = 256, span: int | None = None) -> np.ndarray:
    """Head ``head`` of ``m`` over its first ``span`` tokens (default all) as a ``pixels x pixels``
    boolean picture: pixel ``(a, b)`` is whether query token ``t_a`` sees key token ``t_b``, at
    ``t = (a + 1/2) span / pixels`` (exact at those tokens; every block of at least ``span / pixels``
    tokens shows). For masks too large to draw token by token."""
    span = m.total if span is None else int(span)
    if pixels < 1 or not 0 <= head < m.heads or not 1 <= span <= m.total:
        raise ValueError(f"pixels must be >= 1, head in 0..{m.heads - 1} and span in 1..{m.total}; got "
                         f"pixels={pixels}, head={head}, span={span}")
    n = min(pixels, span)
    rb, cb = m.bounds(head)
    t = ((np.arange(n) + 0.5) * span / n).astype(np.int64)
    return m.blocks[head][np.searchsorted(rb, t, side="right") - 1][:, np.searchsorted(cb, t, side="right") - 1]


def sparse_areas(total: int, sparsities: Sequence[float], blocks: Mapping[str, Sequence[int]], heads: int = 8,
                 seed: int = sparse.DEFAULT_SEED) -> pd.DataFrame:
    """The attended fraction ``area / (heads T^2)`` of the block-sparse masks (``blocks[family]``: block
    sizes of :data:`cadlib.data.sparse.UNIFORM`, average sizes of :data:`cadlib.data.sparse.VARIABLE`) at
    each sparsity (the kept fraction of column blocks), beside ``k / N``, the kept fraction of blocks: one
    row per (family, block, sparsity), with the heads' smallest and largest fraction."""
    rows = []
    for family, sizes in blocks.items():
        for b in sizes:
            for s in sparsities:
                m = sparse.make_sparse_mask(family, total, b, s, heads=heads, seed=seed)
                per = m.head_areas() / float(total) ** 2
                rows.append({"family": family, "block": int(b), "sparsity": float(s), "blocks N": m.blocks.shape[2],
                             "kept k": m.params["k"], "k / N": m.params["k"] / m.blocks.shape[2],
                             "area / T^2": m.sparsity(), "head min": per.min(), "head max": per.max()})
    return pd.DataFrame(rows)

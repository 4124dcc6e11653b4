"""One palette for every notebook and the report: a method keeps its colour in every figure.

``COLOURS[method]`` takes a method's name (:data:`cadlib.core.methods.METHODS`: ``colocated``, ``wlb``,
``cad``, ``cad-pingpong``, ...) or its label (``WLB-ideal``, ``CAD (ping-pong)``), the simulator's
parallelisms (``dp``, ``pp``, ``cp``) and the references figures draw beside measurements (``paper``,
``simulator``); :func:`colour` does the same and says which names exist when given another one.
Colourblind-safe hues (Okabe-Ito); CAD is blue in every shade, the baselines are warm or grey.

* ``colocated`` (and plain data parallelism ``dp``): grey; ``wlb`` / ``WLB-ideal``: vermilion;
  ``varlen`` (variable-length chunking): orange;
* ``cad``: sky blue; ``cad-pingpong`` / ``CAD (ping-pong)``: blue; ``signal-only``: purple;
* ``cp-ring`` / ``CP ring (zigzag)`` (the what-if's CP over the packed sequence): the ring's colour below;
* ``paper``: green (a band: :data:`BAND_OPACITY`); ``simulator``: black, dashed (:data:`SIMULATOR_DASH`);
* the CP mechanisms of notebook 4.3 (``allgather``, ``ring``, ``ulysses``, ``usp``, ``loongtrain``; ``cad``
  is CAD's colour).
"""
from __future__ import annotations

GREY, VERMILION, ORANGE, SKY, BLUE, PURPLE, GREEN, BLACK, YELLOW = (
    "#7F7F7F", "#D55E00", "#E69F00", "#56B4E9", "#0072B2", "#CC79A7", "#009E73", "#000000", "#F0E442")

COLOURS: dict[str, str] = {
    "colocated": GREY, "dp": GREY,
    "wlb": VERMILION, "WLB-ideal": VERMILION,
    "varlen": ORANGE, "variable-length chunking": ORANGE, "pp": ORANGE, "cp": ORANGE,
    "cad": SKY, "CAD": SKY,
    "cad-pingpong": BLUE, "CAD (ping-pong)": BLUE,
    "signal-only": PURPLE,
    "cp-ring": "#1B9E77", "CP ring (zigzag)": "#1B9E77",
    "paper": GREEN,
    "simulator": BLACK,
    # the CP mechanisms of cadlib.cp (4.3): CAD keeps its colour, the others hues no method uses
    "allgather": "#A6761D", "ring": "#1B9E77", "ulysses": "#E7298A", "usp": "#7570B3",
    "loongtrain": "#BCBD22",
}
"""The colour of each method (by name and by label) and of the paper's and the simulator's lines."""
BAND_OPACITY = 0.18
"""A band (the paper's range, the simulator's error band) is a filled rectangle this opaque."""
SIMULATOR_DASH = "dash"
"""The simulator's lines are dashed, in :data:`COLOURS` ``["simulator"]`` or the method's colour."""

PIPELINE_COLOURS: dict[str, str] = {
    "forward": BLUE, "backward": GREEN, "forward (long document)": SKY, "backward (long document)": "#7FD1B9",
    "dummy forward": "#CFD8DC", "dummy backward": "#B0BEC5",
    "attention": ORANGE, "attention served while idle": YELLOW,
}
"""The slots of a pipeline step (1F1B and lock-step ticks) and the attention calls beside them."""


def colour(method: str) -> str:
    """The colour of ``method`` (a name or a label of :data:`COLOURS`); ValueError naming the valid ones."""
    if method not in COLOURS:
        raise ValueError(f"no colour for {method!r}; choose one of: {', '.join(COLOURS)}")
    return COLOURS[method]


def colour_map(methods) -> dict[str, str]:
    """``{method: colour}`` for the ``methods`` of a figure (plotly's ``color_discrete_map``)."""
    return {m: colour(m) for m in methods}

"""Figures: one palette (``palette``: ``COLOURS[method]``, re-exported here), the plotly charts the
notebooks and the report share (``plots``), and plotly figures and maths rendered into static, offline
HTML pages (``static``)."""
from .palette import BAND_OPACITY, COLOURS, PIPELINE_COLOURS, SIMULATOR_DASH, colour, colour_map

__all__ = ["BAND_OPACITY", "COLOURS", "PIPELINE_COLOURS", "SIMULATOR_DASH", "colour", "colour_map"]

"""Figures: one palette and the plotly charts the notebooks and the report share (``plots``), and
plotly figures and maths rendered into static, offline HTML pages (``static``)."""

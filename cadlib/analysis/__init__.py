"""What the measurements and models say, in rooms that import one way (pandas, plotly; no torch).

``figures`` and ``model`` at the bottom; ``replay`` and ``runs`` above ``model``; ``whatif`` and ``report``
above those; ``lessons`` (the notebooks' plumbing) on top. ``pyproject.toml``'s import-linter contracts hold it.
"""

"""The tests mirror the package (tests/core, tests/data, ..., one folder per layer); what several
modules share is in ``helpers.py`` and ``golden_plans.py`` here, found through this folder on the path."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

"""The tests mirror the package (tests/core, tests/data, ..., one folder per layer); what several
modules share is in ``helpers.py`` and ``golden_plans.py`` here, found through this folder on the path.

Without CUDA, Triton's kernels (``cadlib.runtime.fused``) run in Triton's interpreter on CPU tensors:
``TRITON_INTERPRET=1`` must be set before triton is first imported, so it is set here, before any test
module imports cadlib (it changes nothing where triton is not installed)."""
import os
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

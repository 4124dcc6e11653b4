"""Defaults of an end-to-end run, in one place: ``python -m cadlib.train``, ``scripts/bench/bench_e2e.py``,
the plan recipes (:mod:`cadlib.scheduling.recipes`) and the labels of committed result files
(:func:`cadlib.analysis.runs.e2e.setting_label`) all read them here."""
from __future__ import annotations

DEFAULT_TOLERANCE = 0.02
"""The scheduler's tolerance in end-to-end runs. Over NVLink a tight plan costs little: the few more
bytes it moves are cheap, and it leaves less of the straggler than 0.05 does (``results/README.md``
compares the two)."""

DEFAULT_COMM_CTAS = {"nvlink": 8, "inter-node-like": 4}
"""NCCL thread blocks for CAD's all-to-alls in end-to-end runs, per link (``python -m cadlib.train
--comm-ctas``; None: NCCL's own choice): enough to move what ping-pong hides, leaving the kernels
beside them more SMs (``scripts/probes/probe_comm_overlap.py`` measures the rates)."""

DEFAULT_NANO_SPLIT = "docs"
"""How ``cad-pingpong`` forms its two nano-batches: documents may be cut between them
(:mod:`cadlib.scheduling.nanosplit`), so a rank whose tokens are one long document still has two
halves to overlap. ``"whole"`` keeps documents whole; result files that do not record the choice ran
with ``"whole"``."""

DEFAULT_SENT_LAST = False
"""Whether CAD's tokens are laid out sent-last (``--sent-last``, :mod:`cadlib.scheduling.sentlast`);
a result file whose run differs is named and labelled so."""

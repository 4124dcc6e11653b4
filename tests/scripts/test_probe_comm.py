"""scripts/probes/probe_comm_overlap.py's CTA recommendation (made-up GPU numbers: the rule is what is
tested)."""
import importlib.util
from pathlib import Path

PATH = Path(__file__).resolve().parents[2] / "scripts" / "probes" / "probe_comm_overlap.py"
spec = importlib.util.spec_from_file_location("probe_comm_overlap", PATH)
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)


def row(ctas, a2a, attn, gemm):
    return {"ctas": ctas, "a2a_ms": a2a, "attn_slowdown": attn, "gemm_slowdown": gemm}


def test_recommends_the_limit_that_costs_the_compute_least():
    rows = [row("nccl default", 1.5, 1.10, 1.04), row(1, 12.0, 1.01, 1.00), row(2, 6.0, 1.01, 1.01),
            row(4, 3.0, 1.03, 1.02)]
    # penalties: default 0.15, 2 -> 0.06, 4 -> 0.09; 1 is over the 8 ms floor
    assert probe.recommend(rows) == 2


def test_keeps_nccls_choice_when_a_limit_makes_the_all_to_all_too_slow():
    rows = [row("nccl default", 20.0, 1.02, 1.01), row(2, 60.0, 1.00, 1.00), row(8, 26.0, 1.01, 1.00)]
    assert probe.recommend(rows) == 0               # 2 and 8 take more than 1.25 x 20 ms

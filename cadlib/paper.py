"""Figures quoted from the papers, each defined once with its source. Notebooks print them beside
what we measure; nothing else in the code may restate these numbers."""
from __future__ import annotations

from typing import NamedTuple


class PaperFigure(NamedTuple):
    value: float
    unit: str
    what: str
    source: str

    def __str__(self) -> str:
        return f"{self.value:g}{self.unit} — {self.what} [{self.source}]"


DISTCA = "DistCA: core attention disaggregation for long-context LLM training"
LONGCA_BENCH = "LongCA-bench: a long-context attention benchmark"

DISTCA_MAX_SPEEDUP = PaperFigure(
    1.35, "x", "end-to-end training throughput of CAD over the best baseline, 512 H200s, 512K context",
    DISTCA + ", abstract")
DISTCA_MAX_GPUS = PaperFigure(512, " GPUs", "largest evaluated scale (H200)", DISTCA + ", evaluation")
DISTCA_MAX_CONTEXT = PaperFigure(512 * 1024, " tokens", "longest evaluated context", DISTCA + ", evaluation")
LONGCA_MASK_TYPES = PaperFigure(12, "", "attention mask types with exact mask-area FLOPs", LONGCA_BENCH)


def compare(fig: PaperFigure, measured: float, label: str = "measured here") -> str:
    """One line that puts a paper figure beside ours, e.g. for a notebook cell's output."""
    return f"paper: {fig.value:g}{fig.unit} ({fig.what}; {fig.source})  |  {label}: {measured:.3g}{fig.unit}"

DISTCA_BLOG = ("CAD: Disaggregating Core Attention for Efficient Long-context Language Model Training, "
               "the authors' blog post (hao-ai-lab.github.io/blogs/distca)")
DISTCA_IDLE_DP4 = PaperFigure(
    19, "%", "share of GPU time idle waiting for the slowest data-parallel rank, 8B model, 512K context, "
    "DP=4, variable-length chunking", DISTCA + ", motivation")
DISTCA_IDLE_DP8 = PaperFigure(
    55, "%", "share of GPU time idle waiting for the slowest data-parallel rank, 8B model, 512K context, "
    "DP=8, variable-length chunking", DISTCA + ", motivation")
DISTCA_IDLE_DP2 = PaperFigure(
    2, "%", "share of GPU time idle from data-parallel stragglers at DP=2 (read as '~2%'; the same curve "
    "reaches 55% at DP=8)", DISTCA_BLOG + ", Figure 5a")

DISTCA_NO_PINGPONG_SLOWDOWN_MIN = PaperFigure(
    10, "%", "step time added when CAD runs without ping-pong (one nano-batch, communication exposed), "
    "lower end", DISTCA + ", ablation of ping-pong")
DISTCA_NO_PINGPONG_SLOWDOWN_MAX = PaperFigure(
    17, "%", "step time added when CAD runs without ping-pong (one nano-batch, communication exposed), "
    "upper end", DISTCA + ", ablation of ping-pong")
DISTCA_PINGPONG_EXPOSED_COMM = PaperFigure(
    0, "%", "step time of CAD with ping-pong above the signal-only control (every all-to-all cut to one "
    "element per peer): with ping-pong the two are equal", DISTCA + ", ablation of ping-pong")
DISTCA_PINGPONG_OVERLAP = PaperFigure(
    100, "%", "share of CAD's communication that ping-pong hides behind compute (\"completely overlap "
    "communication with compute\")", DISTCA + ", abstract")

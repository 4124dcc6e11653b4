"""Figures quoted from the papers, each defined once with its source, and the registry of the papers'
headline claims (:data:`CLAIMS`). Notebooks print them beside
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
    1.35, "x", "end-to-end training throughput of CAD over WLB-ideal, at most: the top of Llama-8B 4D on "
    "ProLong at 64-256 H200s (section 6.2, Figure 10); the abstract's \"up to 512 H200 GPUs and 512K "
    "context\" are the evaluation's extremes, not this run's", DISTCA + ", abstract and section 6.2")
DISTCA_MAX_GPUS = PaperFigure(512, " GPUs", "largest evaluated scale (H200)", DISTCA + ", evaluation")
DISTCA_MAX_CONTEXT = PaperFigure(512 * 1024, " tokens", "longest evaluated context", DISTCA + ", evaluation")
LONGCA_MASK_TYPES = PaperFigure(12, "", "attention mask types with exact mask-area FLOPs", LONGCA_BENCH)


def compare(fig: PaperFigure, measured: float, label: str = "measured here") -> str:
    """One line that puts a paper figure beside ours, e.g. for a notebook cell's output."""
    return f"paper: {fig.value:g}{fig.unit} ({fig.what}; {fig.source})  |  {label}: {measured:.3g}{fig.unit}"

DISTCA_BLOG = ("CAD: Disaggregating Core Attention for Efficient Long-context Language Model Training, "
               "the authors' blog post (hao-ai-lab.github.io/blogs/distca)")
DISTCA_FIG4B_IDLE = {1: 1.7, 2: 1.9, 4: 19.2, 8: 55.4}
"""Figure 4b, idle time over iteration time (%) of variable-length chunking by DP degree, 8B model,
512K-token data chunks, TP=8 (the bars' labels; the text: "the idle fraction rises to 19% at DP=4 and
55% at DP=8"; the values at DP 1 and 2 are our chart reading of which bar is which)."""
DISTCA_IDLE_DP2, DISTCA_IDLE_DP4, DISTCA_IDLE_DP8 = (
    PaperFigure(DISTCA_FIG4B_IDLE[dp], "%", "share of GPU time idle waiting for the slowest data-parallel "
                f"rank, 8B model, 512K-token chunks, DP={dp}, variable-length chunking",
                DISTCA + ", Figure 4b") for dp in (2, 4, 8))

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

# ---------------------------------------------------------------------------------------------------
# The evaluation's configurations and the motivation's figures, read in the paper's text (arXiv 2510.18121)
# ---------------------------------------------------------------------------------------------------

DISTCA_TP = 8
"""Tensor parallelism of every DistCA run: "we fix TP=8 in our experiments" (section 6.1), one node."""
DISTCA_GPUS_PER_NODE = 8
"""DGX H200 nodes, "8x 140GB H200 GPUs" each (section 6.1)."""
DISTCA_GPU_MEMORY_GB = 140
"""Memory of one of those H200 GPUs, GB: "8x 140GB H200 GPUs" (section 6.1)."""
DISTCA_TABLE3_8B = ((131072, (8, 16, 32), (64, 128, 256)),
                    (262144, (4, 8, 16), (64, 128, 256)),
                    (524288, (2, 4, 8), (64, 128, 256)))
"""Table 3, 3D training configurations of Llama-8B: (MaxDocLen, batch sizes, GPUs), the i-th batch size
with the i-th GPU count."""
DISTCA_TABLE4_8B = ((131072, (32, 64, 128), (64, 128, 256)),
                    (262144, (16, 32, 32), (64, 128, 256)),
                    (524288, (8, 8, 16), (64, 128, 256)))
"""Table 4, 4D (with PP) training configurations of Llama-8B, as Table 3."""
DISTCA_ZCONFIG = {"batch_size": (0.5, 1, 2, 4, 8, 16, 32, 64), "n_micro": (1, 2, 4, 8, 16, 32, 64),
                  "pp": (1, 2, 4, 8), "wlb_cp": (1, 2, 4, 8, 16, 32, 64)}
"""The grid DistCA's 4D sweeps enumerate (``benchmarks/_250923_test_pp_34b/zconfig_gen.py:32-97`` at
9bcf02a): ``batch_size`` sequences per ping (and per pong) of a micro-batch and ``n_micro``
micro-batches with ``batch_size x n_micro`` half Table 4's batch; ``pp`` with one micro-batch without
PP and at least ``2 pp`` with it; DistCA's attention servers on every node of a stage and no
``batch_size`` 0.5; WLB-LLM's ``wlb_cp`` with ``pp x cp`` at most the nodes and ``nodes // cp`` at most
the ``2 x batch_size`` sequences of a micro-batch. Its 8B generator (``_250920_test_pp/zconfig_gen.py``)
is the same with ``batch_size`` to 8, ``n_micro`` to 16 and PP to 32; it cannot form Table 4's 8B
batches, so the 34B grid is the one that does."""
DISTCA_4D_BUFFER_GIB = 4.0
"""DistCA's all-to-all buffer per GPU in its 8B 4D runs, GiB (``EXPERIMENT_NVSHMEM_BUFFER_SIZE_GB=4``,
``benchmarks/_250920_test_pp/salloc_srun.test_pp_basic.missing-v4.sh:25`` at 9bcf02a)."""
DISTCA_4D_TOLERANCE_FACTORS = (0.05, 0.1, 0.15, 0.2, 0.22, 0.25, 0.28, 0.3, 0.35, 0.4, 0.45, 0.5, 0.6, 0.7,
                               0.8, 0.9, 1.0)
"""The tolerances DistCA's 4D driver tries per tick, in order, from ``MIN_TOLERANCE_FACTOR`` (0.05) until
the tick's plans fit the buffer; none fitting raises (the run fails) rather than growing the buffer
(``distca/utils/test_util.py:619-795`` at 2afd219)."""
DISTCA_TABLE3_34B = ((131072, (4, 8, 16), (64, 128, 256)),
                     (262144, (2, 4, 8), (64, 128, 256)),
                     (524288, (2, 4, 8), (64, 128, 256)))
"""Table 3's Llama-34B rows, as ``DISTCA_TABLE3_8B``."""
DISTCA_TABLE4_34B = ((131072, (32, 64, 128), (128, 256, 512)),
                     (262144, (16, 32, 32), (128, 256, 512)),
                     (393216, (8, 8, 16), (128, 256, 512)))
"""Table 4's Llama-34B rows, as ``DISTCA_TABLE4_8B`` (its longest MaxDocLen is 384K)."""
DISTCA_CODE = "DistCA's released code (github.com/hao-ai-lab/DistCA)"
DISTCA_CORPUS_DOCS = {"pretrain": 99_519, "prolong": 77_932}
"""Documents in DistCA's two length files (``distca/simulator/data/dist_wlbllm.json``,
``dist_prolong.json``), whose percentiles are the tables of :mod:`cadlib.data.workload`; our corpora
draw as many from those tables."""
DISTCA_SAMPLER = {"filter_threshold": 65_536, "filter_ratio": 0.5, "upsample": 4, "draw": 10_000,
                  "change_long_doc_ratio": 0.3, "elongate_unit": 65_536, "multiple_of": 16}
"""How DistCA's end-to-end driver samples documents (``tests/test_e2e_combined.salloc.sh``'s defaults
and ``distca/simulator/optimizers/samples.py``): documents of at least ``filter_threshold`` tokens
(raw lengths) are long and repeated ``upsample`` times, the first ``filter_ratio`` of the short ones kept;
Pretrain draws ``draw`` documents from that pool without replacement and multiplies every length by the
elongation factor; ProLong sets each long document to ``elongate_unit`` x elongation tokens with
probability ``change_long_doc_ratio`` (``benchmarks/example-4d-parallel/run4d.sh``'s ``"prolong 0.3"``),
puts the long ones first and does not shuffle. The elongation factor is MaxDocLen / ``elongate_unit``
(``run4d.sh``: ``ELONGATE_FACTOR=$((NUM_TOKENS / 65536))``). Sequences of MaxDocLen
tokens are filled in order, every document rounded up to a multiple of ``multiple_of`` and cut where a
sequence ends (``batch_documents``); a step draws two batches of sequences, ping the first, pong the
second (``test_e2e_combined.py``)."""
DISTCA_WLB_BREAKPOINT = {"llama3-8b": 64_000, "llama-34b": 131_072}
"""WLB-LLM's ``ATTN_LINEAR_BREAKPOINT`` per model, tokens: the document length at which its packer's
workload ``(l / Bk)^2 + l / Bk`` counts attention as much as the linear layers. DistCA's run scripts
set it in their ``model_config`` (``deepseek-ai/DeepSeek-R1-Distill-Llama-8B 64000 32``,
``codellama/CodeLlama-34b-hf 131072 48``, e.g.
``benchmarks/_250918_large_scale_v11_dpcp/salloc_srun.sweep-bigbatch-pretrain-8b.sh`` at 9bcf02a) and
``distca/planner/wlb_planner.py:16-20`` reads it from the environment."""
DISTCA_WLB_BREAKPOINT_DEFAULT = 131_072
"""``ATTN_LINEAR_BREAKPOINT`` when the environment sets none (``distca/planner/wlb_planner.py:16``,
``128 * K``): the value for a model of ours DistCA did not run."""
DISTCA_WLB_EMPTY_PAD = 128
"""Tokens of the dummy document WLB-LLM's packer gives a replica it left empty
(``distca/planner/wlb_planner.py:109-113``)."""
DISTCA_FIG3_ALLGATHER = {2: 2.7, 4: 6.0, 8: 13.5, 16: 26.5, 32: 39.7}
"""Figure 3a, per-document CP all-gather latency share of the step (%) by number of nodes, Llama-8B,
every document 32K tokens: read off the chart (the text: "from merely 3% on 2 nodes to nearly 40% on
32 nodes")."""
DISTCA_FIG3_KV_MEMORY = {2: 3.0, 16: 30.0}
"""Figure 3b, the all-gathered KV's share of a GPU's memory (%): "from 3% at 2 nodes to almost 30% at 16
nodes" (the text)."""
DISTCA_IB_GBPS = 50.0
"""InfiniBand bandwidth per GPU, GB/s: "We assume the InfiniBand bandwidth is 50GB/s" (Appendix A)."""
IB_GBPS_LOW = 40.0
"""A lower inter-node bandwidth per GPU, GB/s, for the sensitivity of the scale replay (ours, not the
paper's)."""
DISTCA_TOLERANCE_FACTORS = (0.0, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08, 0.09,
                            0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
"""The tolerances DistCA's 3D driver tries, in order, until a step's ping and pong plans fit its
communication buffer (``tests/test_e2e_combined.py:1080``, DistCA commit 2afd219; the same at the
paper's runs, 9858059)."""
DISTCA_MIN_TOLERANCE = 0.05
"""The smallest tolerance it tries (``MIN_TOLERANCE_FACTOR``, default 0.05,
``test_e2e_combined.py:1072-1077``; some of the paper's runs set 0.1 or 0.2 and its table takes the
best)."""
DISTCA_BUFFER_GIB = 2.0
"""Its all-to-all buffer per GPU in the 3D runs, GiB (``EXPERIMENT_NVSHMEM_BUFFER_SIZE_GB=2`` in every 3D
run script of the paper, 9bcf02a ``benchmarks/_250918_large_scale_v11_dpcp/*.sh``)."""
DISTCA_BUFFER_GROW_GIB = 0.5
"""When no tolerance fits, the 3D driver runs the last plan tried (tolerance 1.0) and grows the buffer
to ``ceil(need in GiB) + 0.5`` GiB (``test_e2e_combined.py:1247-1259``)."""


# ---------------------------------------------------------------------------------------------------
# The claims registry: every headline claim of the two papers, once
# ---------------------------------------------------------------------------------------------------

class Claim(NamedTuple):
    """One claim a paper makes, as the reproduction checks it.

    ``paper`` is the published figure: a number, a ``(low, high)`` range (``None`` for an open end,
    e.g. ``(None, 1.15)`` for "at most 1.15x"), or ``None`` where the claim is qualitative (``text``
    then says what is claimed). ``verified`` says where the figure was read, or that it could not be
    read from a source available here (then it is the figure as quoted to us, unverified).
    ``notebook`` is where a cell computes ours; ``kind`` how ours is obtained (``simulated``,
    ``computed``, ``measured``); ``gap``, where set, why this workbook does not produce ours."""
    id: str
    claim: str
    paper: float | tuple | None
    unit: str
    source: str
    setting: str
    verified: str
    notebook: str
    kind: str
    text: str = ""
    gap: str = ""

    @property
    def low(self):
        return self.paper[0] if isinstance(self.paper, tuple) else self.paper

    @property
    def high(self):
        return self.paper[1] if isinstance(self.paper, tuple) else self.paper

    def paper_str(self) -> str:
        """The paper's figure as text: ``19%``, ``1.07–1.2x``, ``≤ 1.15x``, or the qualitative claim."""
        if self.paper is None:
            return self.text or "qualitative"
        if not isinstance(self.paper, tuple):
            return f"{self.paper:g}{self.unit}"
        lo, hi = self.paper
        if lo is None:
            return f"≤ {hi:g}{self.unit}"
        if hi is None:
            return f"≥ {lo:g}{self.unit}"
        return f"{lo:g}–{hi:g}{self.unit}"


DISTCA_ARXIV = "DistCA, arXiv 2510.18121"
LONGCA_REPO = "LongCA-bench (github.com/NJUDeepEngine/LongCA-bench)"
_ABSTRACT = "read in the arXiv abstract (2510.18121v1)"
_TEXT = "checked against the paper's text (arXiv 2510.18121)"
_E2E = "04_benchmarks/01_end_to_end.ipynb"
_SCALE = "04_benchmarks/04_at_scale.ipynb"
_REPLAYED = "replayed"
"""Ours: every rank's compute replayed on 1x H200, the network modelled (cadlib.analysis.replay.settings)."""
_GAP_34B = "a 34B model at long context needs more GPUs than the measured 2 (and 4D parallelism)"

CLAIMS_LIST: tuple[Claim, ...] = (
    Claim("distca.idle_dp4", "Variable-length chunking still leaves GPUs idle waiting for the slowest "
          "data-parallel rank at DP=4.", DISTCA_FIG4B_IDLE[4], "%", DISTCA_ARXIV + ", Figure 4b",
          "Llama-3 8B, 512K-token data chunks, TP=8, DP=4 (average idle over average iteration time)",
          _TEXT + ": \"the idle fraction rises to 19% at DP=4\" (bar label 19.2%)", _SCALE, _REPLAYED),
    Claim("distca.idle_dp8", "... and at DP=8 more than half of the GPU time is idle.",
          DISTCA_FIG4B_IDLE[8], "%", DISTCA_ARXIV + ", Figure 4b",
          "Llama-3 8B, 512K-token data chunks, TP=8, DP=8",
          _TEXT + ": \"and 55% at DP=8\" (bar label 55.4%)", _SCALE, _REPLAYED),
    Claim("distca.speedup_max", "CAD's end-to-end training throughput over WLB-ideal, at most.",
          (None, DISTCA_MAX_SPEEDUP.value), "x", DISTCA_ARXIV + ", abstract; section 6.2, Figure 10",
          "the top of Llama-8B 4D on ProLong, 64-256 GPUs, MaxDocLen 128K-512K, against WLB-ideal (the "
          "abstract's 512 GPUs exist only in the 34B runs, whose top is 1.25x; 512K only in the 8B ones)",
          _ABSTRACT + "; the only evaluation sentence with 1.35 is section 6.2's 8B 4D ProLong range; "
          "which of its points is 1.35 is a chart reading", "01_imbalance/01_stragglers.ipynb", "simulated"),
    Claim("distca.speedup_3d_pretrain", "CAD over WLB-ideal with 3D parallelism, Pretrain documents.",
          (1.07, 1.20), "x", DISTCA_ARXIV + ", section 6.2, Figure 9",
          "Llama-8B and Llama-34B pooled (Figure 9's two rows; the top, 1.20, fits only the 8B panel's "
          "axis, the bottom is not attributable without the chart), 3D parallelism = DP x CP x TP without "
          "pipeline parallelism, TP=8, 64-256 GPUs, MaxDocLen 128K-512K (Table 3), Pretrain; ours: 8B only",
          _TEXT + ": \"1.07-1.20x speedup in Pretrain\" (one sentence for the whole Figure 9)", _SCALE,
          _REPLAYED),
    Claim("distca.speedup_3d_prolong", "CAD over WLB-ideal with 3D parallelism, ProLong documents.",
          (1.05, 1.12), "x", DISTCA_ARXIV + ", section 6.2, Figure 9",
          "Llama-8B and Llama-34B pooled (Figure 9's two rows; 1.12 fits only the 8B panel's axis), 3D "
          "parallelism (DP x CP x TP, no PP), TP=8, 64-256 GPUs, ProLong; ours: 8B only",
          _TEXT + ": \"1.05-1.12x speedup in Prolong dataset\"", _SCALE, _REPLAYED),
    Claim("distca.speedup_4d_8b_pretrain", "CAD over WLB-ideal with 4D parallelism (with PP), 8B, Pretrain.",
          (1.15, 1.30), "x", DISTCA_ARXIV + ", section 6.2, Figure 10",
          "Llama-3 8B, 4D parallelism (DP x PP x CP x TP), 64-256 GPUs, MaxDocLen 128K-512K (Table 4), Pretrain",
          _TEXT + ": \"1.15x-1.30x speedup on the Pretrain dataset\"", _SCALE, _REPLAYED),
    Claim("distca.speedup_4d_8b_prolong", "CAD over WLB-ideal with 4D parallelism, 8B, ProLong.",
          (1.10, 1.35), "x", DISTCA_ARXIV + ", section 6.2, Figure 10",
          "Llama-3 8B, 4D parallelism, 64-256 GPUs (Table 4), ProLong",
          _TEXT + ": \"1.10x-1.35x speedup on the ProLong dataset\"", _SCALE, _REPLAYED),
    Claim("distca.speedup_4d_34b_pretrain", "CAD over WLB-ideal with 4D parallelism, 34B, Pretrain: up to.",
          (None, 1.15), "x", DISTCA_ARXIV + ", section 6.2, Figure 10",
          "34B model, 4D parallelism, 128-512 GPUs, MaxDocLen 128K / 256K / 384K (Table 4), Pretrain",
          _TEXT + ": \"positive speedup across most configurations ... up to 1.15x speedup on Pretrain\"; "
          "some 34B configurations are below 1.0x (Figure 10), and the 34B runs go to 384K, not 512K",
          _SCALE, "measured", gap=_GAP_34B),
    Claim("distca.speedup_4d_34b_prolong", "CAD over WLB-ideal with 4D parallelism, 34B, ProLong: up to.",
          (None, 1.25), "x", DISTCA_ARXIV + ", section 6.2, Figure 10",
          "34B model, 4D parallelism, 128-512 GPUs, up to 384K, ProLong",
          _TEXT + ": \"1.25x speedup on ProLong\"", _SCALE, "measured", gap=_GAP_34B),
    Claim("distca.cp_allgather_2nodes", "Per-document CP: the all-gather share of the step on 2 nodes.",
          3, "%", DISTCA_ARXIV + ", Figure 3a", "Llama-8B, every document 32K, per-document CP over 2 nodes",
          _TEXT + ": \"the all-gather latency share rises from merely 3% on 2 nodes\" (chart: 2.7%)",
          _SCALE, _REPLAYED),
    Claim("distca.cp_allgather_32nodes", "... grows to about 40% of the step on 32 nodes.",
          40, "%", DISTCA_ARXIV + ", Figure 3a", "Llama-8B, every document 32K, per-document CP over 32 nodes",
          _TEXT + ": \"to nearly 40% on 32 nodes\" (chart: 39.7%)", _SCALE, _REPLAYED),
    Claim("distca.cp_kv_memory_2nodes", "Per-document CP: the all-gathered K,V's share of a GPU's memory on "
          "2 nodes.", DISTCA_FIG3_KV_MEMORY[2], "%", DISTCA_ARXIV + ", Figure 3b",
          "Llama-8B, per-document CP over 2 nodes",
          _TEXT + ": \"the KV memory fraction grows from 3% at 2 nodes\"", "04_benchmarks/03_context_parallel.ipynb",
          "computed"),
    Claim("distca.cp_kv_memory_16nodes", "... grows to almost 30% on 16 nodes.", DISTCA_FIG3_KV_MEMORY[16],
          "%", DISTCA_ARXIV + ", Figure 3b", "Llama-8B, per-document CP over 16 nodes",
          _TEXT + ": \"to almost 30% at 16 nodes\"", "04_benchmarks/03_context_parallel.ipynb", "computed"),
    Claim("distca.memory_divergence", "Variable-length chunking makes activation memory diverge across "
          "ranks (max/mean) to balance compute.", (1.08, 1.17), "x", DISTCA_ARXIV + ", Figure 4a",
          "512K maximum length, TP=8, DP 2-8", _TEXT + ": \"achieving compute balance requires 1.08 - "
          "1.17x more activation memory on some ranks\" (the authors' blog says 1.2x)",
          "01_imbalance/01_stragglers.ipynb", "simulated"),
    Claim("distca.composability", "A flash kernel keeps near-peak throughput on fused query shards of at "
          "least 128 tokens.", None, "x unsplit TF/s", DISTCA_ARXIV + ", section 3.3, Figure 5",
          "FA2, 32K-token chunks of document shards", _TEXT + ": \"a high throughput as long as each "
          "document shard has more than 128 tokens\"", "02_cad/02_attention_servers.ipynb",
          "measured", text="near peak for shards >= 128 tokens"),
    Claim("distca.tolerance_comm_cut", "Raising the scheduler's tolerance from 0 to 0.15 cuts the memory of "
          "the communication buffers by 20-25% with the step time almost unchanged.", (20, 25), "%",
          DISTCA_ARXIV + ", section 6.3, Figure 12", "8B and 34B on 8 and 16 nodes, Pretrain, tolerance 0 -> 0.15",
          _TEXT + ": \"tuning tolerance factor from 0 to 0.15 decreases the memory requirement by 20-25% "
          "while leaving average duration staying almost the same\" (the buffer memory, not the bytes "
          "moved)", "02_cad/01_scheduling.ipynb", "computed"),
    Claim("distca.pingpong_gain", "Without ping-pong (one stream) the step takes longer by this much.",
          (DISTCA_NO_PINGPONG_SLOWDOWN_MIN.value, DISTCA_NO_PINGPONG_SLOWDOWN_MAX.value), "%",
          DISTCA_ARXIV + ", section 6.3, Figure 11", "8B and 34B on 8 and 16 nodes, Pretrain",
          _TEXT + ": \"eliminating the 10-17% higher latency that would otherwise incur by Single Stream\"",
          _SCALE, _REPLAYED),
    Claim("distca.comm_hidden", "With ping-pong CAD's step equals the signal-only control (communication "
          "hidden), except 8B on 8 nodes.", (None, 2), "%", DISTCA_ARXIV + ", section 6.3, Figure 11",
          "8B and 34B on 8 and 16 nodes, Pretrain; the control sets every all-to-all's sizes to 1 byte per "
          "peer; \"nearly the same\" has no number in the paper: the 2% is our reading",
          _TEXT + ": \"DistCA achieves nearly the same latency as Signal ... The only exception is the 8B "
          "model on 8 nodes\"", _SCALE, _REPLAYED),
    Claim("distca.scheduler_bytes", "The communication-aware scheduler balances to within the tolerance "
          "while moving fewer bytes than bytes-blind balancing.", None, "x baseline bytes",
          DISTCA_ARXIV + ", scheduler",
          "any batch; ours against two baselines, one setting each: equal-FLOPs water-filling "
          "(vs_equal_flops) and DistCA's released planner (vs_distca_planner: distca/planner/planner.py of "
          "github.com/hao-ai-lab/DistCA at commit 2afd219, re-implemented as cadlib.scheduling.distca)",
          _ABSTRACT + " (the abstract names the greedy scheduler; the byte claim is qualitative)",
          "02_cad/01_scheduling.ipynb", "computed",
          text="balanced within ε, fewer bytes than equal-FLOPs and than DistCA's planner"),
    Claim("longca.flop_accounting", "Attention FLOPs are 4 x mask area x heads x head dim forward and 2.5x "
          "that backward, from the exact mask area, for all 12 mask types.", LONGCA_MASK_TYPES.value,
          " masks",
          LONGCA_REPO + ", longca_bench/attn/baselines/utils.py calculate_attn_flops",
          "the 12 mask types of the kernel benchmark", "read in the repository's code (commit 22683e3)",
          "04_benchmarks/02_kernels_masks.ipynb", "computed"),
    Claim("longca.sliding_window_count", "The benchmark counts its two-sided sliding_window mask with the "
          "area of the causal band (window (w, 0)) while the kernel computes the two-sided band (w, w): "
          "counted / computed area.", None, "x computed area",
          LONGCA_REPO + ", longca_bench/attn/run_benchmark.py "
          "(MaskIterator built with window_size=(window_size, 0) for every mask)",
          "w = 1024, 1K-48K tokens", "read in the repository's code (commit 22683e3)",
          "04_benchmarks/02_kernels_masks.ipynb", "computed",
          text="its code counts the causal band"),
    Claim("longca.published_figures", "Kernel and CP throughput comparisons with published figures.",
          None, "", LONGCA_REPO + ", README", "kernels on Hopper GPUs; CP on multi-GPU",
          "the repository's README gives no figures (its instructions are marked TODO); the companion "
          "blog shows charts whose values could not be read here: comparisons are on our own harness only",
          "04_benchmarks/02_kernels_masks.ipynb", "measured", text="no figures published in text"),
)

# ---------------------------------------------------------------------------------------------------
# LongCA-bench's findings that the sparse-kernel study and the CP tables check (issue 34)
# ---------------------------------------------------------------------------------------------------

LONGCA_ARXIV = "LongCA-bench, arXiv 2510.17896"
LONGCA_SPARSITIES = (0.1, 0.9)
"""Sparsity ratios (the kept fraction of key blocks) of the benchmark's block-sparse masks, lowest and
highest (its scripts: ``run_block_sparse_benchmark.py``, ``run_var_block_sparse_benchmark.py``)."""
LONGCA_UNIFORM_BLOCKS = (64, 128)
"""Block sizes of its uniform block-sparse masks (``block_sizes`` in ``run_block_sparse_benchmark.py``)."""
LONGCA_VARIABLE_MIN_BLOCK = 128
"""Smallest block of its variable block-sparse masks (``min_q_block_size = min_kv_block_size = 128``)."""
LONGCA_DRAWS = 30
"""Independent draws of each document-type mask, reported as median with 20/80% quantiles."""
_LONGCA_QUOTED = ("as stated in issue 34 from the paper; the paper's text (arXiv 2510.17896) could not be read "
                  "from a source available here")
_GAP_MULTI_GPU = "not at this scale: needs several GPUs, only one is lent"

CLAIMS_LIST = CLAIMS_LIST + (
    Claim("longca.sparse_bwd_bottleneck", "In block-sparse attention the backward pass is the bottleneck of "
          "every kernel: its TF/s stay well below the forward's.", None, "x fwd TF/s", LONGCA_ARXIV +
          ", sparse kernels", "uniform (blocks 64, 128) and variable (average 128-1024) block-sparse masks, "
          "sparsity 0.1-0.9, 16K-128K tokens, GQA and MHA (scripts/bench/bench_sparse.py: bwd / fwd TF/s per cell)",
          _LONGCA_QUOTED, "04_benchmarks/02_kernels_masks.ipynb", "measured",
          text="backward the universal bottleneck of sparse kernels"),
    Claim("longca.hybrid_cp_best", "Hybrid context parallelism (head parallelism with a ring: USP, LoongTrain) "
          "is the best mechanism overall.", None, "", LONGCA_ARXIV + ", context parallelism",
          "the five CP mechanisms on full, causal and document masks (scripts/bench/bench_cp.py, fastest fwd+bwd per "
          "case)", _LONGCA_QUOTED, "04_benchmarks/03_context_parallel.ipynb", "measured",
          text="USP/LoongTrain best overall", gap=_GAP_MULTI_GPU + " (the CP timings; on 2 GPUs USP is Ulysses "
          "and LoongTrain the ring, so a hybrid needs 4 or more)"),
    Claim("longca.ring_fluctuates_docs", "Ring P2P's throughput fluctuates on document masks (it depends on "
          "how the documents fall on the zigzag), unlike on the full and causal masks.", None, "",
          LONGCA_ARXIV + ", context parallelism", "ring on causal_document and full_document over "
          f"{LONGCA_DRAWS} draws (scripts/bench/bench_cp.py --draws {LONGCA_DRAWS}: the q20-q80 spread); its "
          "dispatch's max/mean area across the draws (results/cp_balance.json) is the computed cause",
          _LONGCA_QUOTED, "04_benchmarks/03_context_parallel.ipynb", "measured",
          text="ring P2P fluctuates on document masks", gap=_GAP_MULTI_GPU + f" (the ring's timings over "
          f"{LONGCA_DRAWS} draws of the document masks)"),
    Claim("longca.heads_first", "Partition heads first: head parallelism balances any mask (every rank computes "
          "the whole sequence for its heads), so a hybrid should use as much of it as the heads allow before "
          "cutting the sequence.", None, "x max/mean area", LONGCA_ARXIV + ", context parallelism",
          "max/mean attention area per rank of Ulysses against ring and all-gather on the document masks, "
          "8 and 16 ranks (results/cp_balance.json: Ulysses 1.0)", _LONGCA_QUOTED,
          "04_benchmarks/03_context_parallel.ipynb", "computed", text="partition heads first"),
)

CLAIMS: dict[str, Claim] = {c.id: c for c in CLAIMS_LIST}
"""The registry, by id. ``cadlib.analysis.report.claims`` turns ours into a verdict against each."""
if len(CLAIMS) != len(CLAIMS_LIST):
    raise RuntimeError("duplicate claim ids in cadlib.core.paper.CLAIMS_LIST")


def claim(claim_id: str) -> Claim:
    """The registry entry ``claim_id``; unknown ids raise ValueError listing the valid ones."""
    if claim_id not in CLAIMS:
        raise ValueError(f"unknown claim {claim_id!r}; choose one of: {', '.join(CLAIMS)}")
    return CLAIMS[claim_id]

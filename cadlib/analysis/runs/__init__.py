"""What our own runs say: end-to-end summaries (``e2e``), a step's timelines (``timelines``), the attention
server benchmarks (``server_bench``), the cost model checked against measured steps (``cost_check``) and
the memory model against measured peaks (``memory_check``)."""

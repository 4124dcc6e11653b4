#!/usr/bin/env bash
# The attention server's tables on 1x H200 with FA4 (about 5-6 minutes; every command has its own timeout):
#   1. composability, the server path with shards merged vs one KV copy per shard (and the kernel
#      alone on copies, as the committed files), fa4, 16K and 64K documents, shards 128..2048;
#   2. the same with every other shard on the server (non-contiguous: cannot merge);
#   3. the kernel latency table for cadlib.core.measured.MeasuredCost (fa4 and torch_flash, bf16,
#      32q/8kv heads, d=128);
#   4. the FA4 overlapping-KV probe (does the varlen backward sum dK/dV of shared KV rows?).
# Writes 6 files under $OUT. Run from the repository root; set CADLIB_COMMIT to the commit sent.
# DRY=1 runs the same commands at CPU smoke sizes (sdpa_ref, tiny heads): a typo check, no numbers.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD CADLIB_COMMIT=${CADLIB_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
PY=${PYTHON:-python}
LOG="$OUT/server_tables.log"
if [ "${DRY:-0}" = 1 ]; then
  COMP="scripts/bench/bench_attention_server.py --part composability --smoke --warmup 1 --iters 1"
  D16=256 D64=1024 SH=16,32,64,128 SH2=32,128 PROF="--device cpu --quick" PROBE="--device cpu"
else
  COMP="scripts/bench/bench_attention_server.py --part composability --backends fa4 --warmup 2 --iters 5"
  D16=16384 D64=65536 SH=128,512,1024,2048 SH2=512,2048 PROF="--backends fa4,torch_flash" PROBE=""
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >>"$LOG" 2>&1
fi
timeout 90  $PY $COMP --doc-lens $D16 --shards $SH --kv-share merged,copy,kernel \
    --out "$OUT/composability_16k.json" 2>&1 | tee -a "$LOG"
timeout 150 $PY $COMP --doc-lens $D64 --shards $SH --kv-share merged,copy,kernel \
    --out "$OUT/composability_64k.json" 2>&1 | tee -a "$LOG"
timeout 60  $PY $COMP --doc-lens $D16,$D64 --shards $SH2 --kv-share merged,copy --patterns alternate \
    --out "$OUT/composability_alternate.json" 2>&1 | tee -a "$LOG"
timeout 140 $PY scripts/bench/profile_kernels.py $PROF --time-budget-s 100 \
    --out "$OUT/kernel_profile_h200.json" 2>&1 | tee -a "$LOG"
timeout 40  $PY scripts/probes/probe_kv_overlap.py $PROBE --out "$OUT/kv_overlap_probe.json" 2>&1 | tee -a "$LOG"
ls -la "$OUT" | tee -a "$LOG"

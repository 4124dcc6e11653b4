#!/usr/bin/env bash
# The linear layers on 1x H200 (torch with its own triton; FA4 not needed), about 5 minutes, every stage
# under its own timeout:
#   gputests  the fused kernels (tests/runtime/test_fused.py, tests/bench/test_shard.py) compiled on CUDA
#             against their plain references, bf16 and fp32, offsets past 2^31 elements (~1-2 min with
#             Triton's first compiles)
#   bench     scripts/bench/bench_linear.py: pre, post, head, norm, optimizer; reference and fused blocks
#             beside their GEMMs alone; 128K first, then 64K, 256K, 32K, 16K tokens; TP 1 and 8 (one
#             shard, sequence parallel). Continues $OUT/bench_linear_h200.json (or the committed
#             results/bench_linear_h200.json) with --merge, so running the script again fills what the
#             budget (BENCH_BUDGET, s) left out.
#   time      scripts/bench/bench_replay.py time --linear fused-sp --linear-only: the replay's linear grid
#             and head of llama3-8b's TP=8 shard (the 3D and 4D settings' shard) with the fused blocks and
#             sequence parallelism's norms on tokens / 8, into a copy of the committed cache
#             ($OUT/replay_times.json, new keys linear@fused-sp/tp8|... beside the committed ones)
#   e2e       (not by default, ~3 min) scripts/bench/bench_e2e.py on this GPU: llama3-8b, 4 layers, 128K
#             tokens, uniform documents, colocated and CAD ping-pong, --recompute auto (the committed
#             bench_e2e_1x_uniform_128k_nvlink.json ran the reference blocks with --mlp-recompute)
# Writes under $OUT with $OUT/linear_1gpu.log. STAGES= picks stages. DRY=1: the same commands at CPU smoke
# sizes (a typo check, no numbers). Run from the repository root; set CADLIB_COMMIT to the commit sent.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
STAGES=${STAGES:-"gputests bench time"}
export CADLIB_COMMIT=${CADLIB_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)} PYTHONUNBUFFERED=1
mkdir -p /tmp/sc
printf 'import site\nsite.addsitedir("/tmp/site")\n' > /tmp/sc/sitecustomize.py    # FA4's install target, if used
export PYTHONPATH=/tmp/sc:$PWD
PY=${PYTHON:-python3}
LOG="$OUT/linear_1gpu.log"
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$LOG"; }
if [ "${DRY:-0}" = 1 ]; then
  BENCH="--smoke"; TIME="--smoke --linear-only"; E2E="--smoke"
else
  BENCH=""; TIME="--suite 3d --linear fused-sp --linear-only --backend fa4"
  E2E="--nproc 1 --dists uniform --tokens 131072 --methods colocated,cad-pingpong --steps 4 --warmup 1 --recompute auto"
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >>"$LOG" 2>&1
  $PY -c "import torch, cadlib.runtime.fused as f; print('torch', torch.__version__, 'triton', \
f.triton.__version__ if f.HAVE_TRITON else None)" 2>&1 | tee -a "$LOG"
fi
for st in $STAGES; do
  stamp "stage $st"
  case $st in
    gputests)
      timeout 180 $PY -m pytest -q -p no:cacheprovider tests/runtime/test_fused.py tests/bench/test_shard.py \
        2>&1 | tail -8 | tee -a "$LOG" ;;
    bench)
      [ -f results/bench_linear_h200.json ] && [ ! -f "$OUT/bench_linear_h200.json" ] \
        && cp results/bench_linear_h200.json "$OUT/bench_linear_h200.json"
      B=${BENCH_BUDGET:-120}
      timeout $(( B + 90 )) $PY scripts/bench/bench_linear.py $BENCH --time-budget-s "$B" --merge \
        --out "$OUT/bench_linear_h200.json" 2>&1 | tail -80 | tee -a "$LOG" ;;
    time)
      [ -f "$OUT/replay_times.json" ] || cp results/replay/times_h200.json "$OUT/replay_times.json"
      timeout 240 $PY scripts/bench/bench_replay.py time $TIME --cache "$OUT/replay_times.json" \
        --budget-s 180 2>&1 | tail -8 | tee -a "$LOG" ;;
    e2e)
      timeout 400 $PY scripts/bench/bench_e2e.py $E2E --quiet --tag _fused --out "$OUT" 2>&1 | tail -6 \
        | tee -a "$LOG" ;;
    *) echo "unknown stage $st" | tee -a "$LOG" ;;
  esac
done
stamp done

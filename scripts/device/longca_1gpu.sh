#!/usr/bin/env bash
# LongCA-bench's one-GPU tables on 1x H200 (FA4 as flash_attn.cute, installed beforehand; torch 2.11),
# about 7-8 minutes, every stage under its own timeout:
#   sparse   scripts/bench/bench_sparse.py: flex and fa4, uniform blocks 64 and 128, sparsity 0.5 then 0.1 then
#            0.9, 16K-128K, GQA 64:8 and MHA 64:64, fwd and bwd, each (kernel, block, heads) checked
#            against the dense reference at 2K; then the variable blocks (flex). Continues a committed
#            results/bench_sparse_h200.json if there is one (--merge: measured cells are not re-run), so
#            running the script again fills what a budget left '-'.
#   mha      scripts/bench/bench_kernels.py, the MHA rows (64:64) of fa4 and flex on every mask, 4K-32K
#   draws    scripts/bench/bench_kernels.py --draws 30 on the document masks, fa4, GQA 64:8, 16K and 32K
#            (median and 20/80% quantiles across draws)
# Writes $OUT/bench_sparse_h200.json, $OUT/bench_kernels_mha.json, $OUT/bench_kernels_draws.json and
# $OUT/longca_1gpu.log. STAGES= picks stages (also: gputests, the GPU kernel tests, ~1-2 min); SPARSE_BUDGET
# (s) the sparse stage's budget. DRY=1: the same commands at CPU smoke sizes (a typo check, no numbers).
# Run from the repository root; set CADLIB_COMMIT to the commit sent.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
STAGES=${STAGES:-"sparse mha draws"}
export CADLIB_COMMIT=${CADLIB_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)} PYTHONUNBUFFERED=1
mkdir -p /tmp/sc
printf 'import site\nsite.addsitedir("/tmp/site")\n' > /tmp/sc/sitecustomize.py    # FA4's install target, if used
export PYTHONPATH=/tmp/sc:$PWD
PY=${PYTHON:-python3}
LOG="$OUT/longca_1gpu.log"
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$LOG"; }
if [ "${DRY:-0}" = 1 ]; then
  SPARSE="--smoke"; MHA="--smoke --backends sdpa_math,flex_eager --heads 4:4"; DRAWS="--smoke --backends sdpa_ref --draws 3"
  SEQ_MHA=256; SEQ_DRAWS=256; MASKS_DRAWS=causal_document
else
  SPARSE="--kernels flex,fa4 --families uniform_block_sparse,variable_block_sparse --blocks 64,128 --avg-blocks 128,1024 --sparsities 0.5,0.1,0.9 --seqlens 16384,32768,65536,131072 --heads 64:8,64:64"
  MHA="--backends fa4,flex --heads 64:64 --slow-ms 800"; DRAWS="--backends fa4 --heads 64:8 --draws 30 --draw-reps 2"
  SEQ_MHA=4096,16384,32768; SEQ_DRAWS=16384,32768
  MASKS_DRAWS=full_document,causal_document,share_question,causal_blockwise,prefix_lm_document,block_causal_document
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >>"$LOG" 2>&1
  $PY -c "import cadlib.runtime.kernels as k; print('backends', k.available_backends('cuda'))" 2>&1 | tee -a "$LOG"
fi
for st in $STAGES; do
  stamp "stage $st"
  case $st in
    gputests)
      timeout 180 $PY -m pytest -q -p no:cacheprovider tests/runtime/test_sparse_kernels.py 2>&1 | tail -5 | tee -a "$LOG" ;;
    sparse)
      [ -f results/bench_sparse_h200.json ] && [ ! -f "$OUT/bench_sparse_h200.json" ] \
        && cp results/bench_sparse_h200.json "$OUT/bench_sparse_h200.json"
      B=${SPARSE_BUDGET:-250}
      timeout $(( B + 90 )) $PY scripts/bench/bench_sparse.py $SPARSE --time-budget-s "$B" --merge \
        --out "$OUT/bench_sparse_h200.json" 2>&1 | grep -v "^ *$" | tail -60 | tee -a "$LOG" ;;
    mha)
      timeout 120 $PY scripts/bench/bench_kernels.py $MHA --seqlens $SEQ_MHA --time-budget-s 60 \
        --out "$OUT/bench_kernels_mha.json" 2>&1 | tail -40 | tee -a "$LOG" ;;
    draws)
      timeout 120 $PY scripts/bench/bench_kernels.py $DRAWS --masks $MASKS_DRAWS --seqlens $SEQ_DRAWS --time-budget-s 60 \
        --out "$OUT/bench_kernels_draws.json" 2>&1 | tail -20 | tee -a "$LOG" ;;
    *) echo "unknown stage $st" | tee -a "$LOG" ;;
  esac
done
stamp done

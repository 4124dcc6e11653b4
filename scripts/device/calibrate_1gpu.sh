#!/usr/bin/env bash
# cadlib.calibrate on 1x H200 (issue 33), then its check against the committed grids; about 3 minutes
# (the calibration stops timing at --budget-s 500 and is killed at 560 s; the check takes seconds):
#   calibrate  python -m cadlib.calibrate: llama3-8b's kernel latency grid (FA4 when importable, else
#              torch_flash; BACKEND= overrides) and the TP=8 shard's linear grid (reference and fused-sp)
#              and optimizer step -> $OUT/calibration_h200.json (the all-to-all is skipped on one GPU)
#   check      scripts/analyses/check_calibration.py: every entry beside results/kernel_profile_h200.json
#              and results/replay/times_h200.json, the fraction within 5% -> $OUT/calibration_check.json
# FA4 is used when importable (install it first, as scripts/device/replay_1gpu.sh's fa4 stage does, into
# /tmp/site). Writes $OUT/calibrate_1gpu.log. DRY=1: the same commands at CPU smoke sizes (a typo check).
# Run from the repository root; set CADLIB_COMMIT to the commit sent.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export CADLIB_COMMIT=${CADLIB_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)} PYTHONUNBUFFERED=1
mkdir -p /tmp/sc
printf 'import site\nsite.addsitedir("/tmp/site")\n' > /tmp/sc/sitecustomize.py    # FA4's install target, if used
export PYTHONPATH=/tmp/sc:$PWD
PY=${PYTHON:-python3}
LOG="$OUT/calibrate_1gpu.log"
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$LOG"; }
if [ "${DRY:-0}" = 1 ]; then
  CAL="--smoke"
else
  CAL="--model llama3-8b --tp 8 --backend ${BACKEND:-auto} --budget-s 500"
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >>"$LOG" 2>&1
fi
stamp "calibrate $CAL"
timeout 560 $PY -m cadlib.calibrate $CAL --quiet --out "$OUT/calibration_h200.json" 2>&1 | tail -20 | tee -a "$LOG"
stamp "check"
timeout 60 $PY scripts/analyses/check_calibration.py "$OUT/calibration_h200.json" \
  --out "$OUT/calibration_check.json" 2>&1 | tail -20 | tee -a "$LOG"
stamp done

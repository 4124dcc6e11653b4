#!/usr/bin/env bash
# One H200 with FlashAttention-4: the GPU checks of the package and the scale replay's timings.
# Stages (STAGES, in order; each under its own timeout):
#   fa4       install FA4 from the two wheel folders (.fa4a/ copied to /tmp/fa4 by an earlier call,
#             .fa4b/ carried by this one) into /tmp/site
#   gputests  the kernel tests on CUDA (every backend the machine has)
#   replay2   scripts/bench_server_replay.py on the committed pretrain 64K and prolong 128K batches
#   kernels   the FA4 column of the kernel x mask table, merged into a copy of results/bench_kernels.json
#   time      scripts/bench_replay.py time (REPLAY_SUITE, REPLAY_BUDGET seconds) into $OUT/replay_times.json,
#             continuing the committed cache
# Writes under $OUT; set CADLIB_COMMIT to the commit sent. Run from the repository root.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
STAGES=${STAGES:-"fa4 gputests replay2 kernels time"}
export CADLIB_COMMIT=${CADLIB_COMMIT:-unknown} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
mkdir -p /tmp/sc
printf 'import site\nsite.addsitedir("/tmp/site")\n' > /tmp/sc/sitecustomize.py
export PYTHONPATH=/tmp/sc:$PWD
LOG="$OUT/replay_1gpu.log"
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$LOG"; }
for st in $STAGES; do
  stamp "stage $st"
  case $st in
    fa4)
      cat /tmp/fa4/part_aa .fa4b/part_ab > /tmp/fa4/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl \
        && rm -f /tmp/fa4/part_aa && cp .fa4b/*.whl /tmp/fa4/ \
        && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/fa4/*.whl 2>&1 | tail -2
      python3 -c "import cadlib.runtime.kernels as k; print('backends', k.available_backends('cuda'))" 2>&1 | tee -a "$LOG" ;;
    gputests)
      timeout 150 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_kernels.py 2>&1 | tail -5 | tee -a "$LOG" ;;
    replay2)
      for s in "pretrain 65536 64k" "prolong 131072 128k"; do
        set -- $s
        timeout 120 python3 scripts/bench_server_replay.py --dist $1 --tokens $2 \
          --methods colocated,cad,cad-pingpong --out "$OUT/server_replay_2x_$1_$3.json" 2>&1 | tail -4 | tee -a "$LOG"
      done ;;
    kernels)
      cp results/bench_kernels.json "$OUT/bench_kernels.json"
      timeout 150 python3 scripts/bench_kernels.py --backends fa4 --out "$OUT/bench_kernels.json" --merge \
        --time-budget-s 120 2>&1 | tail -6 | tee -a "$LOG" ;;
    time)
      [ -f "$OUT/replay_times.json" ] || cp results/replay/times_h200.json "$OUT/replay_times.json" 2>/dev/null || true
      timeout $(( ${REPLAY_BUDGET:-400} + 60 )) python3 scripts/bench_replay.py time --suite "${REPLAY_SUITE:-validation,3d}" \
        --cache "$OUT/replay_times.json" --budget-s "${REPLAY_BUDGET:-400}" 2>&1 | tail -25 | tee -a "$LOG" ;;
    *) echo "unknown stage $st" | tee -a "$LOG" ;;
  esac
done
stamp done

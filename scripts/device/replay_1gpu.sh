#!/usr/bin/env bash
# One H200 with FlashAttention-4: the GPU checks of the package and the scale replay's timings.
# Stages (STAGES, in order; each under its own timeout):
#   fa4       install FA4 into /tmp/site: the DSL wheel's parts (part_aa, part_ab, ...) in /tmp/fa4,
#             copied there by earlier calls (or part_ab carried in .fa4b/), the other wheels in any
#             carried .fa4*/ folder
#   e2e1x     scripts/bench/bench_e2e.py on this one GPU (DP=1; uniform and pretrain, 64K and 128K tokens,
#             colocated and CAD ping-pong) into /tmp/e2e1x and $OUT: the replay's check on the very
#             machine that times it
#   time1x    scripts/bench/bench_replay.py time on those runs (validation suite, '_1x_') into a fresh
#             $OUT/times_1x.json
#   time4d    scripts/bench/bench_replay.py time --suite 4d: the pipeline-replay server calls of SHAPES (default
#             the sample, results/replay/shapes_4d_sample.json; or a `shapes4d --all` listing) into
#             $OUT/times_4d.json
#   retime    the cached attention calls whose times look like a kernel compile
#             (cadlib.analysis.replay.times.compile_suspects), timed again with a warm-up: the committed
#             cache (validation and 3D, FA4 and torch_flash; the 4D sample) into $OUT/replay_times.json,
#             and results/replay/times_h200_4d_full.json (the listings in .shapes4d/) into
#             $OUT/times_4d_full.json
#   gputests  the kernel tests on CUDA (every backend the machine has)
#   replay2   scripts/bench/bench_server_replay.py on the committed pretrain 64K and prolong 128K batches
#   kernels   the FA4 column of the kernel x mask table, merged into a copy of results/bench_kernels.json
#   time      scripts/bench/bench_replay.py time (REPLAY_SUITE, REPLAY_BUDGET seconds) into $OUT/replay_times.json,
#             continuing the committed cache (REPLAY_ARGS: more of its options, e.g. "--backend torch_flash
#             --warmup 0 --batches 15")
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
      [ -f /tmp/fa4/part_ab ] || cp .fa4b/part_ab /tmp/fa4/
      cat /tmp/fa4/part_a? > /tmp/fa4/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl \
        && rm -f /tmp/fa4/part_a? && { cp .fa4*/*.whl /tmp/fa4/ 2>/dev/null; true; } \
        && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/fa4/*.whl 2>&1 | tail -2
      python3 -c "import cadlib.runtime.kernels as k; print('backends', k.available_backends('cuda'))" 2>&1 | tee -a "$LOG" ;;
    gputests)
      timeout 150 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_kernels.py 2>&1 | tail -5 | tee -a "$LOG" ;;
    replay2)
      for s in "pretrain 65536 64k" "prolong 131072 128k"; do
        set -- $s
        timeout 120 python3 scripts/bench/bench_server_replay.py --dist $1 --tokens $2 \
          --methods colocated,cad,cad-pingpong --out "$OUT/server_replay_2x_$1_$3.json" 2>&1 | tail -4 | tee -a "$LOG"
      done ;;
    kernels)
      cp results/bench_kernels.json "$OUT/bench_kernels.json"
      timeout 150 python3 scripts/bench/bench_kernels.py --backends fa4 --out "$OUT/bench_kernels.json" --merge \
        --time-budget-s 120 2>&1 | tail -6 | tee -a "$LOG" ;;
    time)
      [ -f "$OUT/replay_times.json" ] || cp results/replay/times_h200.json "$OUT/replay_times.json" 2>/dev/null || true
      timeout $(( ${REPLAY_BUDGET:-400} + 60 )) python3 scripts/bench/bench_replay.py time --suite "${REPLAY_SUITE:-validation,3d}" \
        --cache "$OUT/replay_times.json" --budget-s "${REPLAY_BUDGET:-400}" ${REPLAY_ARGS:-} 2>&1 | tail -25 | tee -a "$LOG" ;;
    e2e1x)
      timeout ${E2E_TIMEOUT:-480} python3 scripts/bench/bench_e2e.py --nproc 1 --dists uniform,pretrain --tokens 65536,131072 \
        --methods colocated,cad-pingpong --steps 4 --warmup 1 --quiet --out /tmp/e2e1x 2>&1 | tail -6 | tee -a "$LOG"
      cp /tmp/e2e1x/*.json "$OUT/" ;;
    time1x)
      cp /tmp/e2e1x/bench_e2e_1x_*.json results/
      timeout 200 python3 scripts/bench/bench_replay.py time --suite validation --only _1x_ --cache "$OUT/times_1x.json" \
        --budget-s 150 2>&1 | tail -8 | tee -a "$LOG" ;;
    time4d)
      timeout $(( ${REPLAY_BUDGET:-150} + 60 )) python3 scripts/bench/bench_replay.py time --suite 4d --cache "$OUT/times_4d.json" \
        --shapes "${SHAPES:-results/replay/shapes_4d_sample.json}" --budget-s "${REPLAY_BUDGET:-150}" 2>&1 | tail -8 | tee -a "$LOG" ;;
    retime)
      cp results/replay/times_h200.json "$OUT/replay_times.json"
      for be in fa4 torch_flash; do
        timeout 200 python3 scripts/bench/bench_replay.py time --suite validation,3d --retime --backend $be \
          --cache "$OUT/replay_times.json" --budget-s 150 2>&1 | grep -v " 0 new calls" | tail -12 | tee -a "$LOG"
      done
      timeout 100 python3 scripts/bench/bench_replay.py time --suite 4d --retime --cache "$OUT/replay_times.json" \
        --budget-s 60 2>&1 | tail -3 | tee -a "$LOG"
      cp results/replay/times_h200_4d_full.json "$OUT/times_4d_full.json"
      for f in .shapes4d/*.json; do
        timeout 100 python3 scripts/bench/bench_replay.py time --suite 4d --retime --shapes "$f" \
          --cache "$OUT/times_4d_full.json" --budget-s 60 2>&1 | tail -3 | tee -a "$LOG"
      done ;;
    *) echo "unknown stage $st" | tee -a "$LOG" ;;
  esac
done
stamp done

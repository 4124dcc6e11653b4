#!/usr/bin/env bash
# The one-GPU profile of scripts/reproduce.py (issue 36) on one H200: torch's own flash kernel first, then
# FlashAttention-4, each run's report copied to $OUT. Run from the repository root:
#
#   OUT=/tmp/out bash scripts/device/gpu1_profile.sh                        # both runs (~11-12 min each)
#   STAGES=nofa4 ONLY="02_kernels 05_whatif" PARAMS="live_budget_s=60" OUT=/tmp/out bash scripts/device/gpu1_profile.sh
#
# Stages (STAGES, in order; each under its own timeout):
#   wheels   the Jupyter stack (papermill, ipykernel, nbconvert's needs, plotly, ...) from a carried .whl/
#            into /tmp/site_nb (the device README: wheels travel, pip has no index there); skipped when
#            this Python already has papermill
#   nofa4    reproduce.py --profile gpu1 without FA4 on the path (torch_flash, SDPA, FlexAttention)
#            -> $OUT/nofa4/ (report.md, report.html, report.json, metrics.jsonl, the executed notebooks)
#   fa4      FA4 into /tmp/site as scripts/device/replay_1gpu.sh does (the DSL wheel's parts part_aa,
#            part_ab in /tmp/fa4, copied there by earlier calls, or carried in .fa4b/; the other wheels in
#            any carried .fa4*/), then the profile again with it -> $OUT/fa4/
# ONLY: notebook substrings (one --only each); PARAMS: name=value overrides (one -p each).
# Set CADLIB_COMMIT to the commit sent.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
STAGES=${STAGES:-"wheels nofa4 fa4"}
export CADLIB_COMMIT=${CADLIB_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
PY=${PYTHON:-python3}
LOG="$OUT/gpu1_profile.log"
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$LOG"; }
NB_SITE=/tmp/site_nb
[ -d "$NB_SITE/share/jupyter" ] || mkdir -p "$NB_SITE/share/jupyter"
export JUPYTER_PATH=$NB_SITE/share/jupyter${JUPYTER_PATH:+:$JUPYTER_PATH}   # nbconvert's templates there
SEL=""; for o in ${ONLY:-}; do SEL="$SEL --only $o"; done
for p in ${PARAMS:-}; do SEL="$SEL -p $p"; done
profile() {   # name pythonpath
  stamp "profile gpu1 ($1) start"
  PYTHONPATH=$2 $PY -c "import torch, cadlib.runtime.kernels as k; from cadlib.infra.results import device_name
print('$1:', device_name(), 'attention backends', k.available_backends('cuda' if torch.cuda.is_available() else 'cpu'))" 2>&1 | tee -a "$LOG"
  PYTHONPATH=$2 timeout -k 10 ${PROFILE_TIMEOUT:-1150} $PY scripts/reproduce.py --profile gpu1 $SEL --out /tmp/runs_$1 \
    --publish "$OUT/$1" > "$OUT/reproduce_$1.log" 2>&1
  stamp "profile gpu1 ($1) rc=$? ($(grep -c ' ok in ' "$OUT/reproduce_$1.log") notebooks ok)"
  grep -E '^\[reproduce\] +(ok|failed) in|FAILED' "$OUT/reproduce_$1.log" | tee -a "$LOG"
  cp "$(ls -d /tmp/runs_$1/*-gpu1 2>/dev/null | tail -1)"/{*.ipynb,report.json} "$OUT/$1/" 2>/dev/null
}
for st in $STAGES; do
  stamp "stage $st"
  case $st in
    wheels)
      if $PY -c "import papermill, ipykernel, nbconvert, latex2mathml" 2>/dev/null; then stamp "jupyter stack present"
      elif ls .whl/*.whl >/dev/null 2>&1; then
        timeout 180 $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$NB_SITE" \
          .whl/*.whl 2>&1 | tail -3 | tee -a "$LOG"
      else stamp "no .whl/ carried and papermill missing: reproduce.py will name what is missing"; fi ;;
    nofa4)
      profile nofa4 "$NB_SITE:$PWD" ;;
    fa4)
      mkdir -p /tmp/fa4 /tmp/site /tmp/sc
      [ -f /tmp/fa4/part_ab ] || cp .fa4b/part_ab /tmp/fa4/ 2>/dev/null
      if ls /tmp/fa4/part_a? >/dev/null 2>&1; then
        cat /tmp/fa4/part_a? > /tmp/fa4/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl \
          && rm -f /tmp/fa4/part_a?
      fi
      cp .fa4*/*.whl /tmp/fa4/ 2>/dev/null
      timeout 180 $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/fa4/*.whl 2>&1 | tail -2 | tee -a "$LOG"
      printf 'import site\nsite.addsitedir("/tmp/site")\n' > /tmp/sc/sitecustomize.py
      profile fa4 "/tmp/sc:$NB_SITE:$PWD" ;;
    *) stamp "unknown stage $st" ;;
  esac
done
stamp done

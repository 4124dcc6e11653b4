#!/usr/bin/env bash
# Every 2-GPU measurement of results/, in one go, in priority order (how the committed 2x H200 files
# were made). Run from a repository root, ideally a snapshot that nothing edits while it runs:
#
#   OUT=/tmp/res bash scripts/device/suite_2gpu.sh                  # every stage
#   STAGES="cpcheck report" OUT=/tmp/res bash scripts/device/suite_2gpu.sh
#   SMOKE=1 OUT=/tmp/res bash scripts/device/suite_2gpu.sh          # CPU/gloo, tiny sizes: a typo check
#
# Stages: e2e (bench_e2e, NVLink, pretrain/prolong/uniform x 64K/128K tokens per GPU, ~16 min on
# 2x H200), cp (bench_cp, ~2.5 min), cpcheck (bf16 CP check, ~20 s), report (reproduce.py --profile
# h200x2, ~4.5 min; needs papermill, ipykernel, nbconvert, plotly), uniform128 (the last e2e setting),
# kernels (bench_kernels on one GPU each: SDPA flash/cuDNN/torch FA2, and FlexAttention, ~2 min);
# tolerance (pretrain at 64K and 128K with the scheduler's tolerance 0.02 instead of 0.05, ~6 min;
# not in the default list); e2e64 (the three 64K NVLink settings only, ~7 min); internode (pretrain
# 64K over the inter-node-like link, ~2.5 min); server (the attention server on its own: kernel
# composability, merged KV vs the kernel, 16K and 64K documents, on GPU 0 beside the overhead
# benchmark on GPU 1, then the overhead benchmark on both GPUs, ~3 min); e2e128 (the three 128K NVLink
# settings only, ~11 min); tol64 / tol128 (one
# half of tolerance each); comp (the composability benchmark with its bracketed reference on GPU 0 beside
# FlexAttention's cells that the kernels stage's time budget left out, on GPU 1, ~3 min); e2e:DIST:TOKENS
# (one NVLink setting, e.g. e2e:prolong:131072); verify (cadlib.verify, bf16, 2 GPUs, ~1 min); probe
# (scripts/probes/probe_comm_overlap.py on both links, ~2 min); sdpaeff (SDPA's memory-efficient backend on the
# cells the kernels stage's budget left out, one half per GPU, ~3.5 min); replay (scripts/bench/bench_server_replay.py,
# the three settings of results/server_replay_2x_*.json over both GPUs, ~2 min). E2E_ARGS adds flags to every
# e2e run (e.g. "--sent-last") and E2E_TAG its file-name tag (bench_e2e adds _sentlast itself); VERIFY_ARGS
# adds flags to the verify stage; after the probe
# stage, each e2e run also takes the CTA limit it recommended for its link ($OUT/e2e_args_<link>).
# Each stage has its own timeout, copies what it wrote to $OUT and logs a line to $OUT/stages.log;
# $OUT/ALLDONE marks the end. Stages run in the order STAGES names them. Benchmarks write into this tree's results/, so the report stage (which
# reads the committed results) sees the new end-to-end files.
set -u
OUT=${OUT:-out}; SMOKE=${SMOKE:-0}
STAGES=${STAGES:-"e2e cp cpcheck report uniform128 kernels"}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export CADLIB_COMMIT=${CADLIB_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
PY=${PYTHON:-python3}
# packages installed with `pip install --target DIR` keep their data files (nbconvert's HTML templates)
# under DIR/share/jupyter, which Jupyter does not search unless told: add every such DIR on PYTHONPATH
for d in ${PYTHONPATH//:/ }; do
  [ -d "$d/share/jupyter" ] && export JUPYTER_PATH=${JUPYTER_PATH:+$JUPYTER_PATH:}$d/share/jupyter
done
stage() { echo "$(date +%T) $*" | tee -a "$OUT/stages.log"; }
E2E_ARGS=${E2E_ARGS:-}; E2E_TAG=${E2E_TAG:-}   # extra bench_e2e flags for every e2e run, and its --tag
e2e() {  # dist tokens limit_s
  local name="bench_e2e_2x_$1_$(( $2 / 1024 ))k_nvlink$E2E_TAG.json" args
  if [ "$SMOKE" = 1 ]; then args="--smoke --dists $1"; name="bench_e2e_smoke_2x_pretrain_0k_nvlink$E2E_TAG.json"
  else args="--nproc 2 --tokens $2 --dists $1 --link nvlink --timeout $(( $3 - 20 ))"; fi
  args="$args $E2E_ARGS $(cat "$OUT/e2e_args_nvlink" 2>/dev/null) --tag=$E2E_TAG"   # the probe's CTA limit
  [[ $E2E_ARGS == *--sent-last* ]] && name=${name%.json}_sentlast.json  # (bench_e2e names it so)
  stage "e2e $1 $2 start"
  timeout -k 15 "$3" $PY scripts/bench/bench_e2e.py $args --quiet --out results >> "$OUT/e2e.log" 2>&1
  local rc=$?; cp "results/$name" "$OUT/" 2>/dev/null; stage "e2e $1 $2 rc=$rc"
}
st_e2e() {
  e2e pretrain 65536 240; e2e prolong 65536 240; e2e pretrain 131072 330; e2e prolong 131072 330
  e2e uniform 65536 240
}
st_e2e64() { e2e pretrain 65536 240; e2e uniform 65536 240; e2e prolong 65536 240; }
st_e2e128() { e2e pretrain 131072 330; e2e prolong 131072 330; e2e uniform 131072 330; }
st_internode() {    # NCCL through host memory: about 25 ms per GiB, like an inter-node link
  stage "e2e pretrain 65536 inter-node-like start"
  if [ "$SMOKE" = 1 ]; then args="--smoke"; else args="--nproc 2 --tokens 65536 --dists pretrain --timeout 250"; fi
  args="$args $E2E_ARGS $(cat "$OUT/e2e_args_inter-node-like" 2>/dev/null)"
  timeout -k 15 270 $PY scripts/bench/bench_e2e.py $args --tag=$E2E_TAG --link inter-node-like --quiet --out results \
    >> "$OUT/e2e.log" 2>&1
  stage "e2e pretrain 65536 inter-node-like rc=$?"; cp results/bench_e2e_*inter-node-like$E2E_TAG*.json "$OUT/" 2>/dev/null
}
st_probe() {  # NCCL's all-to-all beside attention and GEMMs, per CTA limit, on both links (~1 min each)
  local args="" sfx
  [ "$SMOKE" = 1 ] && args="--smoke"
  for link in nvlink inter-node-like; do
    stage "probe $link start"; sfx=$link
    env $([ $link = inter-node-like ] && echo NCCL_P2P_DISABLE=1) timeout -k 10 150 torchrun --standalone \
      --nproc-per-node 2 scripts/probes/probe_comm_overlap.py $args --out "$OUT/comm_overlap_probe_2xh200_$sfx.json" \
      --recommend-out "$OUT/e2e_args_$sfx" > "$OUT/probe_$sfx.log" 2>&1
    stage "probe $link rc=$? ($(grep -h 'recommended' "$OUT/probe_$sfx.log" | cut -c1-80))"
  done
}
st_sdpaeff() {  # SDPA's memory-efficient backend on the 10 masks x 32K-48K its time budget left out (~3.5 min)
  stage "sdpa_efficient start"
  local half masks=(share_question,causal_blockwise,prefix_lm_causal,prefix_lm_document,sliding_window_causal
                    sliding_window,global_sliding_window,block_causal_document,full_document_long,causal_document_long)
  for half in 0 1; do
    if [ "$SMOKE" = 1 ]; then KB="--smoke"; else
      KB="--backends sdpa_efficient --seqlens 32768,40960,49152 --masks ${masks[$half]} --slow-ms 100000 --warmup 1 --reps 3"; fi
    CUDA_VISIBLE_DEVICES=$half timeout -k 10 400 $PY scripts/bench/bench_kernels.py $KB \
      --out "$OUT/bench_kernels_sdpa_eff$half.json" > "$OUT/kernels_sdpa_eff$half.log" 2>&1 &
  done
  wait; stage "sdpa_efficient done (combine: python scripts/bench/bench_kernels.py --combine results/bench_kernels.json $OUT/bench_kernels_sdpa_eff*.json --out results/bench_kernels.json)"
}
st_cp() {
  stage "bench_cp start"
  if [ "$SMOKE" = 1 ]; then CP="--smoke"; CPOUT=results/bench_cp_smoke.json
  else CP="--time-budget-s 160"; CPOUT=results/bench_cp.json; fi
  timeout -k 10 230 torchrun --standalone --nproc-per-node 2 scripts/bench/bench_cp.py $CP --out $CPOUT > "$OUT/cp.log" 2>&1
  stage "bench_cp rc=$?"; cp $CPOUT "$OUT/" 2>/dev/null
}
st_cpcheck() {
  stage "cp.check start"
  if [ "$SMOKE" = 1 ]; then CK="--dtype fp32 --tokens 61 --pg-backend gloo"; else CK="--dtype bf16 --tokens 8192 --heads 16,8,128"; fi
  timeout -k 10 200 torchrun --standalone --nproc-per-node 2 -m cadlib.cp.check --suite layout,protocol $CK \
    --out results/cp_check_2gpu_bf16.json > "$OUT/cpcheck.log" 2>&1
  stage "cp.check rc=$?"; cp results/cp_check_2gpu_bf16.json "$OUT/" 2>/dev/null
}
st_verify() {   # CAD attention vs an fp32 per-document reference, bf16 over NCCL (results/verify_cad_2xh200_bf16.txt)
  stage "verify start"
  local args="--dtype bf16 --model llama3-8b --tokens-per-rank 8192 --case random,one-token,empty-rank,spanning --dist pretrain,prolong"
  [ "$SMOKE" = 1 ] && args="--dtype fp32 --tokens-per-rank 64 --case random --dist pretrain"
  args="$args ${VERIFY_ARGS:-}"                          # e.g. --sent-last
  local vt=""; [[ ${VERIFY_ARGS:-} == *--sent-last* ]] && vt=_sentlast
  { echo "# torchrun --standalone --nproc-per-node 2 -m cadlib.verify $args"
    echo "# 2 GPUs, commit $CADLIB_COMMIT, $(date -u +%F)"
    timeout -k 10 200 torchrun --standalone --nproc-per-node 2 -m cadlib.verify $args 2>&1 | grep -v "Warning\|exe_args"
  } > "$OUT/verify_cad_2xh200_bf16$vt.txt"
  stage "verify rc=${PIPESTATUS[0]} ($(grep -c ' ok' "$OUT/verify_cad_2xh200_bf16$vt.txt") ok lines)"
}
st_report() {
  if [ "$SMOKE" = 1 ]; then PROF=cpu; else PROF=h200x2; fi
  stage "reproduce $PROF start"
  timeout -k 10 520 $PY scripts/reproduce.py --profile $PROF --publish results/reports/$PROF > "$OUT/reproduce.log" 2>&1
  stage "reproduce rc=$?"
  tar czf "$OUT/report_$PROF.tgz" results/reports/$PROF $(ls -dt runs/*-$PROF 2>/dev/null | head -1) 2>/dev/null
}
st_uniform128() { e2e uniform 131072 330; }
st_replay() {   # each rank's attention-server work of the e2e plans, replayed on one GPU (~1 min a setting)
  stage "replay start"
  local a="--backend fa4"; [ "$SMOKE" = 1 ] && a="--smoke"
  CUDA_VISIBLE_DEVICES=0 timeout -k 10 200 $PY scripts/bench/bench_server_replay.py --dist pretrain --tokens 65536 $a \
    --out "$OUT/server_replay_2x_pretrain_64k.json" > "$OUT/replay0.log" 2>&1 &
  { CUDA_VISIBLE_DEVICES=1 timeout -k 10 200 $PY scripts/bench/bench_server_replay.py --dist prolong --tokens 131072 $a \
      --out "$OUT/server_replay_2x_prolong_128k.json"
    CUDA_VISIBLE_DEVICES=1 timeout -k 10 200 $PY scripts/bench/bench_server_replay.py --dist pretrain --tokens 131072 $a \
      --out "$OUT/server_replay_2x_pretrain_128k.json"; } > "$OUT/replay1.log" 2>&1 &
  wait; stage "replay done"
}
tolerance() {  # tokens...: a tighter tolerance on 2 GPUs: the residual imbalance vs the bytes it moves
  for t in "$@"; do
    stage "e2e pretrain $t eps 0.02 start"
    if [ "$SMOKE" = 1 ]; then args="--smoke"; else args="--nproc 2 --tokens $t --dists pretrain --timeout 310"; fi
    timeout -k 15 330 $PY scripts/bench/bench_e2e.py $args --tolerance 0.02 --tag _eps0.02 --quiet --out results >> "$OUT/e2e.log" 2>&1
    stage "e2e pretrain $t eps 0.02 rc=$?"; cp results/bench_e2e_*_eps0.02.json "$OUT/" 2>/dev/null
  done
}
st_tolerance() { tolerance 65536 131072; }
st_tol64() { tolerance 65536; }
st_tol128() { tolerance 131072; }
st_kernels() {
  stage "kernels start"
  if [ "$SMOKE" = 1 ]; then KB="--smoke"; KF="--smoke"; else
    KB="--backends sdpa_flash,sdpa_cudnn,torch_flash --time-budget-s 110"
    KF="--backends flex --seqlens 4096,16384,32768 --time-budget-s 110 --masks full,causal_document,full_document,share_question,causal_blockwise,prefix_lm_causal,prefix_lm_document,sliding_window,sliding_window_causal,global_sliding_window,block_causal_document"
  fi
  CUDA_VISIBLE_DEVICES=0 timeout -k 10 170 $PY scripts/bench/bench_kernels.py $KB --out "$OUT/bench_kernels_sdpa.json" > "$OUT/kernels_sdpa.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 timeout -k 10 170 $PY scripts/bench/bench_kernels.py $KF --out "$OUT/bench_kernels_flex.json" > "$OUT/kernels_flex.log" 2>&1 &
  wait; stage "kernels done (combine with: python scripts/bench/bench_kernels.py --combine results/bench_kernels.json $OUT/bench_kernels_*.json --out results/bench_kernels.json)"
}
composability() {  # limit_s name: the composability benchmark, merged KV vs the kernel alone, on GPU 0
  local sv="--backends fa4 --warmup 2 --iters 5 --doc-lens 16384,65536 --shards 128,512,1024,2048"
  [ "$SMOKE" = 1 ] && sv="--smoke --doc-lens 256 --shards 16,64"
  CUDA_VISIBLE_DEVICES=0 timeout -k 10 "$1" $PY scripts/bench/bench_attention_server.py --part composability $sv \
    --kv-share merged,kernel --out "$OUT/bench_attention_server_composability_1gpu_$2.json" > "$OUT/server_comp.log" 2>&1
}
st_comp() {  # the composability reference bracketed (GPU 0) beside FlexAttention's untimed cells (GPU 1)
  stage "comp start"
  if [ "$SMOKE" = 1 ]; then KF="--smoke"; else
    KF="--backends flex --seqlens 1024,2048,8192,24576,40960,49152 --time-budget-s 150 --masks block_causal_document,causal_document_long,full_document_long,global_sliding_window,prefix_lm_document,sliding_window,sliding_window_causal"
  fi
  composability 170 bracketed &
  CUDA_VISIBLE_DEVICES=1 timeout -k 10 200 $PY scripts/bench/bench_kernels.py $KF --out "$OUT/bench_kernels_flex.json" > "$OUT/kernels_flex.log" 2>&1 &
  wait; stage "comp done"
}
st_server() {
  stage "server start"
  if [ "$SMOKE" = 1 ]; then OV="--smoke"; else OV=""; fi; NP=2
  composability 150 merged &
  CUDA_VISIBLE_DEVICES=1 timeout -k 10 150 $PY scripts/bench/bench_attention_server.py --part overhead $OV \
    --out "$OUT/bench_attention_server_overhead_1gpu.json" > "$OUT/server_ovh1.log" 2>&1 &
  wait; stage "server 1-GPU parts done"
  timeout -k 10 150 torchrun --standalone --nproc-per-node $NP scripts/bench/bench_attention_server.py --part overhead $OV \
    --out "$OUT/bench_attention_server_overhead_2gpu.json" > "$OUT/server_ovh2.log" 2>&1
  stage "server overhead 2 GPUs rc=$?"
}
for s in $STAGES; do
  if [[ $s == e2e:*:* ]]; then IFS=: read -r _ dist tok <<< "$s"; e2e "$dist" "$tok" $(( tok > 65536 ? 330 : 240 ))
  elif declare -F "st_$s" > /dev/null; then "st_$s"; else stage "unknown stage $s (skipped)"; fi
done
touch "$OUT/ALLDONE"

#!/usr/bin/env bash
# Issue 17, same-GPU predictions: the runs that check `gpulens predict --batch-size` and
# `--gpus 2` against measurements on the same machine, in one device call.
#   PARTS="batch gpus" OUT=$OUT bash benchmarks/predict_ladder.sh     # a 2-GPU machine (~8 min)
#   PARTS="batch" bash benchmarks/predict_ladder.sh                   # one GPU (~5 min)
# batch: five workloads (bf16, synthetic data on the GPU) at the two batch sizes of
#        predict_session.sh (the sources, each with a 5-step profiler window) and at half the
#        smaller and twice the larger one (the targets, never used to build the model).
#        BATCH_CASES="vit_b_16:32,64" overrides the list (workload:size,size,...).
#        REPEATS=3 runs the whole list three times over, interleaved (round 1 of every size,
#        then round 2, ...; each run a separate process), so that the host's drift over minutes
#        falls on every configuration alike; ROUNDS="3 4" names the rounds instead (a second
#        call on the same warm machine goes on where the first stopped). predict_same_gpu.py's
#        "repeats" row is then the spread between runs of one configuration, and its
#        "*_averaged" rows score the median prediction against the median measurement.
# gpus:  the same workloads on 1 GPU and as 2-GPU DDP (same per-GPU batch): the all-reduce model
#        predicts the second from the first, uncalibrated (no pair of its own in the store).
#        REPEATS/ROUNDS interleave rounds here too (a 1-GPU and a 2-GPU run per case a round).
#        GPU_COUNTS="2 4" adds 4-GPU DDP runs after each 2-GPU one (a 4-GPU machine).
# Then python benchmarks/predict_same_gpu.py predict-ladder-*.tar.xz scores them.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 GPULENS_HOME=${GPULENS_HOME:-/tmp/gpulens-ladder}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-benchmarks/results}
PARTS=${PARTS:-batch}
mkdir -p "$OUT" "$GPULENS_HOME"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_')
ngpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
day=$(date +%F)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader
# runs stop starting after BUDGET_S seconds, so that the bundle is always written inside a
# device call's limit
start_s=$(date +%s)
one() {  # workload batch gpus profiler-steps
  local w=$1 b=$2 g=$3 p=$4 name="ladder-$1-b$2-g$3${REP:+-r$REP}"
  if (( $(date +%s) - start_s > ${BUDGET_S:-420} )); then echo "$name skipped: budget" >&2; return; fi
  local extra=(); [ "$p" -gt 0 ] && extra=(--torch-profiler "$p")
  [ "$g" -gt 1 ] && extra+=(--gpus "$g")
  CUDA_VISIBLE_DEVICES=${VISIBLE:-0} timeout 150 python3 -m gpulens.cli run "$w" --batch-size "$b" \
    --precision bf16 --duration "${DURATION_S:-10}" "${extra[@]}" --no-store --name "$name" \
    --json > "$GPULENS_HOME/$name.json" 2> "$GPULENS_HOME/$name.log" \
    || echo "$name failed: $(tail -1 "$GPULENS_HOME/$name.log")" >&2
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], \
    round(d['throughput_samples_per_s'] or 0, 1), 'samples/s')" "$GPULENS_HOME/$name.json" "$name" \
    2>/dev/null
}
rounds=${ROUNDS:-$(seq 1 "${REPEATS:-1}")}  # a lone round's runs carry no -r suffix
for part in $PARTS; do
  echo "=== $part ($(date +%T))" >&2
  case $part in
    batch)
      for r in $rounds; do
        REP=$([ "$rounds" != 1 ] && echo "$r")
        for w_sizes in ${BATCH_CASES:-resnet18:64,128,256,512 resnet50:32,64,128,256 \
                       vgg16:16,32,64,128 vit_b_16:16,32,64,128 gpt2:2,4,8,16}; do
          w=${w_sizes%%:*}
          IFS=, read -r -a sizes <<< "${w_sizes##*:}"
          for b in "${sizes[@]}"; do one "$w" "$b" 1 5; done
        done
      done ;;
    gpus)
      if [ "$ngpu" -lt 2 ]; then echo "gpus: needs 2 GPUs, this machine has $ngpu" >&2; continue; fi
      for r in $rounds; do
        REP=$([ "$rounds" != 1 ] && echo "$r")
        for case in ${GPUS_CASES:-resnet18:256 resnet50:128 vgg16:64 vit_b_16:64 gpt2:8}; do
          w=${case%%:*} b=${case##*:}
          one "$w" "$b" 1 0
          for g in ${GPU_COUNTS:-2}; do  # GPU_COUNTS="2 4" on a 4-GPU machine
            (( g <= ngpu )) || { echo "gpus: $g GPUs asked, this machine has $ngpu" >&2; continue; }
            VISIBLE=$(seq -s, 0 $((g - 1))) one "$w" "$b" "$g" 0
          done
        done
      done ;;
    *) echo "unknown part '$part': use batch or gpus" >&2 ;;
  esac
done
# traces slimmed to what predict reads (the tarball is committed); the host side of each
# trace (step wall time, CUDA runtime calls) summarised first
python3 benchmarks/trace_host_summary.py "$GPULENS_HOME/runs" > "$GPULENS_HOME/runs/host_summary.json"
tar czf "$GPULENS_HOME/full.tgz" -C "$GPULENS_HOME" runs
python3 benchmarks/slim_records.py "$GPULENS_HOME/full.tgz" "$OUT/predict-ladder-$commit-$gpu-x$ngpu-$day.tar.xz"
python3 benchmarks/predict_same_gpu.py "$OUT/predict-ladder-$commit-$gpu-x$ngpu-$day.tar.xz" \
  --out "$OUT/predict_same_gpu-$commit-$gpu-x$ngpu-$day.json" || true

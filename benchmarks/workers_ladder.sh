#!/usr/bin/env bash
# Issue 17, same-GPU predictions across loader workers: each job with its JPEG loader at
# several worker counts (`gpulens run JOB --data DIR --workers W --prep-timing`), bundled for
# predict_same_gpu.py, which predicts every run from every other of its job with
# `gpulens predict RUN --workers W` (the predictor itself, not a rule beside it).
#   OUT=$OUT bash benchmarks/workers_ladder.sh             # one GPU, ~8 min
#   WORKERS_CASES="resnet50:1,2,4,8" DURATION_S=20 REPEATS=2 SCORE=0 ...
# REPEATS=N runs the whole list N times over (round 1 of every count, then round 2, ...), so the
# host's drift falls on every count alike; ROUNDS="3" names the rounds instead, to carry on in a
# second call on the same warm machine (GPULENS_HOME keeps the first call's runs, and the
# bundle holds them all). A run whose JSON is already in GPULENS_HOME is not run again, so the
# same command in a later call carries on where the last one stopped. Each run's record holds
# the loader probe of --prep-timing (benchmarks/probe_variants.py makes a copy without it, to
# score the probe's share).
# LABEL=cpus8 adds a word to the file names, to tell apart two ladders of one machine and day
# (e.g. one run under `taskset -c 0-7`, to try the workers decline on fewer CPUs).
# GPUS="1 2" runs every worker count on 1 GPU and as 2-GPU DDP (W workers a rank; named -g2-),
# interleaved: predict_same_gpu.py scores each 1-GPU run's `predict --gpus 2` on the pair.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 GPULENS_HOME=${GPULENS_HOME:-/tmp/gpulens-workers}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT" "$GPULENS_HOME"
command -v nvidia-smi > /dev/null || { echo "$0: runs on a GPU machine (no nvidia-smi here)" >&2; exit 2; }
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_')
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
day=$(date +%F)
stem="$commit-$gpu${LABEL:+-$LABEL}-$day"
images=${IMAGES_DIR:-/tmp/workers-ladder-images}
[ -d "$images" ] || python3 -m gpulens.cli data make images --out "$images" --n "${IMAGES:-10000}" \
  --json > /dev/null || { echo "could not make the images" >&2; exit 1; }
start_s=$(date +%s)
for case in ${WORKERS_CASES:-resnet50:1,2,4,8 mobilenet_v3_small:1,2,4,8}; do
  job=${case%%:*}
  IFS=, read -r -a counts <<< "${case##*:}"
  for r in ${ROUNDS:-$(seq 1 "${REPEATS:-1}")}; do
    for w in "${counts[@]}"; do
      for g in ${GPUS:-1}; do
        name="workers-$job-w$w$([ "$g" = 1 ] || echo "-g$g")-r$r"
        # a run already recorded in GPULENS_HOME (an earlier call on this warm machine) is kept
        if [ -s "$GPULENS_HOME/$name.json" ]; then echo "$name kept: recorded earlier" >&2; continue; fi
        if (( $(date +%s) - start_s > ${BUDGET_S:-420} )); then echo "$name skipped: budget" >&2; continue; fi
        timeout 150 python3 -m gpulens.cli run "$job" --data "$images" --workers "$w" --prep-timing \
          --precision bf16 --duration "${DURATION_S:-15}" --gpus "$g" --no-store --name "$name" --json \
          > "$GPULENS_HOME/$name.json" 2> "$GPULENS_HOME/$name.log" \
          || echo "$name failed: $(tail -1 "$GPULENS_HOME/$name.log")" >&2
        python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], \
          round(d['throughput_samples_per_s'] or 0, 1), 'samples/s, +-', d.get('throughput_ci95_pct'), '%'); \
          p=json.load(open(d['record_dir']+'/run.json')).get('loader_scaling') or {}; \
          print('  probe', dict(zip(p.get('processes',[]), [round(x) for x in p.get('samples_per_s_per_process',[])])))" \
          "$GPULENS_HOME/$name.json" "$name" 2>/dev/null
      done
    done
  done
done
tar czf "$GPULENS_HOME/full.tgz" -C "$GPULENS_HOME" runs
python3 benchmarks/slim_records.py "$GPULENS_HOME/full.tgz" "$OUT/workers-ladder-$stem.tar.xz" \
  --drop-loader-bound-prep-rows  # the per-sample rows are most of the bytes; see slim_records.py
[ "${SCORE:-1}" = 0 ] && exit 0  # SCORE=0: score the bundle elsewhere (a call's seconds)
python3 benchmarks/predict_same_gpu.py "$OUT/workers-ladder-$stem.tar.xz" \
  --out "$OUT/predict_same_gpu-workers-$stem.json" || true

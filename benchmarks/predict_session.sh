#!/usr/bin/env bash
# Issue 17: the runs cross-GPU validation needs, on whatever GPU this runs on. Run it once on an
# H100 and once on an H200 (one device call each, about 6 minutes), then on any machine:
#   python benchmarks/predict_validation.py predict-records-*H100*.tar.xz predict-records-*H200*.tar.xz
# Five workloads x two batch sizes, bf16, synthetic data on the GPU (the GPU's own speed; loader
# speed is the host's), each with a 5-step profiler window for the per-kernel roofline.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 GPULENS_HOME=${GPULENS_HOME:-/tmp/gpulens-predict}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT" "$GPULENS_HOME"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_')
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
day=$(date +%F)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader
for case in resnet18:128 resnet18:256 resnet50:64 resnet50:128 vgg16:32 vgg16:64 \
            vit_b_16:32 vit_b_16:64 gpt2:4 gpt2:8; do
  w=${case%%:*} b=${case##*:}
  timeout 120 python3 -m gpulens.cli run "$w" --batch-size "$b" --precision bf16 \
    --duration "${DURATION_S:-12}" --torch-profiler 5 --no-store --name "predict-$w-b$b" --json \
    > "$GPULENS_HOME/$w-b$b.json" 2> "$GPULENS_HOME/$w-b$b.log" \
    || echo "$w b$b failed: $(tail -1 "$GPULENS_HOME/$w-b$b.log")" >&2
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], \
    round(d['throughput_samples_per_s'] or 0, 1), 'samples/s')" "$GPULENS_HOME/$w-b$b.json" "$w b$b" \
    2>/dev/null
done
tar czf "$GPULENS_HOME/full.tgz" -C "$GPULENS_HOME" runs
python3 benchmarks/slim_records.py "$GPULENS_HOME/full.tgz" "$OUT/predict-records-$commit-$gpu-$day.tar.xz"
python3 benchmarks/predict_validation.py "$OUT/predict-records-$commit-$gpu-$day.tar.xz" || true

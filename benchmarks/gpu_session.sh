#!/usr/bin/env bash
# Issue 2 on a GPU machine, in one call: doctor, demo, the resnet50 bf16 run on generated JPEGs
# with 15 workers, and the overhead benchmark. Each step writes its JSON under $OUT.
#   bash benchmarks/gpu_session.sh            (OUT defaults to benchmarks/results/session)
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 GPULENS_HOME=${GPULENS_HOME:-/tmp/gpulens-home}
OUT=${OUT:-benchmarks/results/session}
mkdir -p "$OUT"
gl() { python3 -m gpulens.cli "$@"; }
step() { echo "=== $* ($(date +%T))" >&2; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,power.limit --format=csv
step doctor;   gl doctor --json > "$OUT/doctor.json"; gl doctor
step demo;     gl demo --no-store --json > "$OUT/demo.json"; echo "rc=$?"
step data;     gl data make images --out /tmp/img --n "${N_IMAGES:-20000}" --json > "$OUT/data_make.json"; echo "rc=$?"
step resnet50; gl run resnet50 --precision bf16 --data /tmp/img --workers 15 --steps 200 \
                  --no-store --json > "$OUT/resnet50_bf16_jpeg.json"; echo "rc=$?"
step command;  gl run --no-store --json -- python3 examples/train_tracked.py > "$OUT/command_tracked.json"; echo "rc=$?"
step records;  tar czf "$OUT/records.tgz" -C "$GPULENS_HOME" runs
step overhead; python3 benchmarks/launch_overhead.py --cases r18_b8,r50_b256 --ablations "" \
                  --pairs 5 --out "$OUT/launch_overhead.json"; echo "rc=$?"
step done

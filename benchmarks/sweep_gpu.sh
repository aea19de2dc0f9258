#!/usr/bin/env bash
# A 4-cell sweep on a GPU machine through the local executor (no network, no Ray needed):
# two workloads x two batch sizes, one cell per GPU at a time. Copies the sweep directory (cell
# state files), the JSON summary and the run records to $OUT, bundled in one tar (the device tool
# brings back at most 8 files).
#   OUT=/tmp/out bash benchmarks/sweep_gpu.sh
set -euo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-$(mktemp -d)}
export GPULENS_HOME=${GPULENS_HOME:-$(mktemp -d)}
mkdir -p "$OUT"
cp "$(dirname "$0")/sweep_spec.yaml" "$OUT/sweep_spec.yaml"
set +e
python -m gpulens.cli sweep "$OUT/sweep_spec.yaml" --out "$OUT/sweep" --json \
  > "$OUT/sweep_summary.json" 2> "$OUT/sweep_stderr.log"
rc=$?
set -e
echo "gpulens sweep exit code: $rc"
# the summary table (every cell is done or failed, so --resume runs nothing)
python -m gpulens.cli sweep "$OUT/sweep_spec.yaml" --out "$OUT/sweep" --resume --retries 0 2>/dev/null || true
python -m gpulens.cli runs list --json > "$OUT/runs_list.json" || true
tar -czf "$OUT/sweep_records.tar.gz" -C "$OUT" sweep -C "$GPULENS_HOME" runs && rm -rf "$OUT/sweep"

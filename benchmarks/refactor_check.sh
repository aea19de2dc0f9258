#!/usr/bin/env bash
# Issue 13 on one GPU: after the run-contract refactor, `gpulens stalls` and `gpulens colocate`
# are run as the committed H100 results were (same commands) and compared with them.
#   bash benchmarks/refactor_check.sh stalls|colocate      (writes JSON and a log under $OUT)
# SRC=DIR runs another checkout's src (e.g. the code before the refactor, side by side on the
# same machine) and TAG names its files.
set -uo pipefail
export PYTHONPATH=${SRC:-$PWD/src} PYTHONUNBUFFERED=1 GPULENS_HOME=${GPULENS_HOME:-/tmp/gpulens-home}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
gl() { python3 -m gpulens.cli "$@"; }
step() { echo "=== $* ($(date +%T))" >&2; }
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_')
day=$(date +%F)
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
tag=${TAG:-refactor}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,power.limit --format=csv

wrap() {  # wrap RAW OUTFILE COMMAND...: the JSON with the command and commit that made it
  python3 - "$1" "$2" "$commit" "${*:3}" <<'PY'
import json, sys
raw, out, commit, cmd = sys.argv[1:]
doc = json.load(open(raw))
json.dump({"command": "PYTHONPATH=src " + cmd, "code_commit": commit, "result": doc},
          open(out, "w"), indent=1)
PY
}

case "${1:-}" in
stalls)
  [ -d /tmp/img ] || { step data; gl data make images --out /tmp/img --n 100000 --json > /dev/null; }
  step stalls
  cmd=(python3 -m gpulens.cli stalls resnet50 --data /tmp/img --precision bf16 --no-store --json)
  timeout "${STALLS_TIMEOUT_S:-420}" "${cmd[@]}" > "$OUT/stalls.raw.json"
  echo "rc=$?"
  wrap "$OUT/stalls.raw.json" "$OUT/stalls-resnet50_bf16-paired-$tag-$gpu-$day.json" "${cmd[@]}"
  tar czf "$OUT/stalls-records-$tag.tgz" -C "$GPULENS_HOME" runs && rm -rf "$GPULENS_HOME/runs"
  ;;
colocate)
  step colocate
  cmd=(python3 -m gpulens.cli colocate resnet50:batch=64 resnet18:batch=64
       --mechanisms time-slice,streams,mps --mps-thread-pct 25,50,100 --duration 8 --warmup-s 2
       --no-store --json)
  timeout "${COLOCATE_TIMEOUT_S:-400}" "${cmd[@]}" > "$OUT/colocate.raw.json"
  echo "rc=$?"
  wrap "$OUT/colocate.raw.json" "$OUT/colocate-resnet50_resnet18-$tag-$gpu-$day.json" "${cmd[@]}"
  ;;
*) echo "usage: $0 stalls|colocate" >&2; exit 2 ;;
esac
step done

#!/usr/bin/env bash
# Issue 3 on one GPU machine: the ground-truth validation of the stall breakdown, or the whole
# resnet50 breakdown over a generated ~10 GB JPEG dataset (timed: target under 5 minutes with
# every share known to within 3 points). Writes JSON (with the command) and a log under $OUT.
#   bash benchmarks/stalls_session.sh validation
#   bash benchmarks/stalls_session.sh resnet50 [TAG [more gpulens stalls options...]]
# e.g. `resnet50 latency5ms --storage-latency-ms 5 --time-budget 150`; TAG names the files.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 GPULENS_HOME=${GPULENS_HOME:-/tmp/gpulens-home}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
gl() { python3 -m gpulens.cli "$@"; }
step() { echo "=== $* ($(date +%T))" >&2; }
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_')
day=$(date +%F)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,power.limit --format=csv
nproc

case "${1:-}" in
validation)
  step data; gl data make images --out /tmp/img_val --n 6000
  step validation
  timeout 540 python3 benchmarks/stalls_validation.py --data /tmp/img_val --workload resnet18 \
    --workers 1,2,4 --latencies-ms 2,5,10 --precision bf16 --batch-size 32 --duration 15 \
    --paired --out "$OUT/stalls_validation-resnet18-paired-$gpu-$day.json"
  echo "rc=$?"
  ;;
resnet50)
  [ -d /tmp/img ] || { step data; gl data make images --out /tmp/img --n 100000 --json > "$OUT/data_make.json"; }
  tag=${2:+-$2}
  export GPULENS_HOME=$GPULENS_HOME/stalls$tag
  step "stalls $tag"
  cmd=(python3 -m gpulens.cli stalls resnet50 --data /tmp/img --precision bf16 --no-store --json "${@:3}")
  timeout "${STALLS_TIMEOUT_S:-500}" "${cmd[@]}" > "$OUT/stalls.raw.json"
  echo "rc=$?"
  python3 - "$OUT" "$gpu" "$day" "$tag" "${cmd[*]}" <<'PY'
import json, sys
out, gpu, day, tag, cmd = sys.argv[1:]
doc = json.load(open(f"{out}/stalls.raw.json"))
doc = {"command": "PYTHONPATH=src " + cmd
       + "  # /tmp/img: gpulens data make images --out /tmp/img --n 100000 "
       "(bash benchmarks/stalls_session.sh resnet50)", "gpu": gpu, "date": day, **doc}
json.dump(doc, open(f"{out}/stalls-resnet50_bf16{tag}-{gpu}-{day}.json", "w"), indent=1)
b, ci = doc["breakdown_pct"], doc["breakdown_ci95_pp"]
for k in b:
    if b[k] is not None:
        print(f"{k:20s} {b[k]:6.1f} ± {ci[k]:.1f} pp")
print("throughput", {k: v and round(v) for k, v in doc["throughput_samples_per_s"].items()})
print("run CIs %", {k: v and round(v, 2) for k, v in doc["throughput_ci95_pct"].items()})
print("wall_s", doc["wall_s"], "max CI pp", max(v for v in ci.values() if v is not None))
print("all runs", doc["all_runs"])
paired = doc.get("fetch_paired")
if paired:
    print("paired fetch ms/sample", round(paired["fetch_ms_per_sample"], 4), "±",
          round(paired["fetch_ci95_ms"], 4))
    for r in paired["runs"]:
        print("  ", {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()})
print("read timers", doc["single_run_estimate_pct"].get("read_stall_from_timers"))
print(*doc["notes"], sep="\n")
PY
  rm -f "$OUT/stalls.raw.json"
  # the run records without the per-sample prep rows (step times and NVML series), and the
  # prep rows of the paired cold runs (what their fetch stall comes from), for analysis
  tar czf "$OUT/stalls-resnet50$tag-records.tgz" --exclude='prep_*' -C "$GPULENS_HOME" runs
  (cd "$GPULENS_HOME" && grep -l '"name": "stalls-resnet50-paired_cold"' runs/*/run.json \
    | xargs -r -n1 dirname | tar czf "$OUT/stalls-resnet50$tag-paired-prep.tgz" -T -)
  ;;
*)
  echo "usage: bash benchmarks/stalls_session.sh validation|resnet50" >&2; exit 2 ;;
esac
step done

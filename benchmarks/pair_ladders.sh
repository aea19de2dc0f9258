#!/usr/bin/env bash
# Issue 17 on a GPU pair, in order of what each answers, within one device call of CALL_S
# seconds; the same command in the next call on the warm machine carries on where it stopped
# (each step keeps what an earlier call recorded):
#   1. ddp_loader_startup.py --contexts fork,spawn: a plain DDP job whose ranks fork their
#      JPEG loader's workers against one whose ranks spawn them (gpulens before 8ab5f69),
#      beside `gpulens run --gpus 2` now: is spawning why 2-GPU JPEG runs took ~100 s to start?
#   2. pair32: resnet18, 12 workers a rank, 1 and 2 GPUs on all 32 CPUs (the rank rule's test).
#   3. pair16 and pair8: session 28's ladders again under taskset, now with forked workers.
#   COMMIT=<sha> CALL_S=590 OUT=$OUT bash benchmarks/pair_ladders.sh
# STARTUP=0 leaves out step 1; LADDERS="pair32" picks the ladders (by label) and their order.
# Each ladder's bundle (workers-ladder-<sha>-<gpu>-<label>-<day>.tar.xz) is rewritten under
# $OUT at the end of its step; scoring is left to predict_same_gpu.py on any machine.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
CALL_S=${CALL_S:-590}
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
command -v nvidia-smi > /dev/null || { echo "$0: runs on a GPU machine (no nvidia-smi here)" >&2; exit 2; }
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_')
day=$(date +%F)
state=/tmp/pair-ladders
mkdir -p "$OUT" "$state"
images=/tmp/workers-ladder-images
[ -d "$images" ] || python3 -m gpulens.cli data make images --out "$images" --n 10000 \
  --json > /dev/null || { echo "could not make the images" >&2; exit 1; }
{ nproc; nvidia-smi --query-gpu=name,memory.total --format=csv; nvidia-smi topo -m; } \
  > "$OUT/host-$commit-$gpu-$day.txt" 2>&1
startup="ddp_loader_startup-$commit-$gpu-$day"
if [ "${STARTUP:-1}" != 0 ] && [ ! -e "$state/startup.done" ]; then
  # ~3-4 min expected (the spawn variant is the slow one); a hang costs at most 5 of them
  timeout 300 python3 benchmarks/ddp_loader_startup.py --data "$images" --workers 8 --gpus 2 \
    --contexts fork,spawn --orders group_first --out "$OUT/$startup.json" \
    > "$state/startup.log" 2>&1 && touch "$state/startup.done"
  cp "$state/startup.log" "$OUT/$startup.log"
  tail -8 "$state/startup.log"
fi
# a ladder starts a run only while one more (up to its 150 s timeout) and the bundle still fit
for ladder in "pair32 0-31 resnet18:12" "pair16 0-15 resnet18:8" "pair8 0-7 resnet18:8"; do
  read -r label cpus case <<< "$ladder"
  [[ " ${LADDERS:-pair32 pair16 pair8} " == *" $label "* ]] || continue
  budget_s=$((CALL_S - SECONDS - 190))
  (( budget_s > 0 )) || { echo "$label: no time left in this call" >&2; break; }
  (( $(nproc) > ${cpus#*-} )) || { echo "$label: needs CPUs $cpus" >&2; continue; }
  echo "== $label (CPUs $cpus, $case), budget ${budget_s}s"
  COMMIT=$commit taskset -c "$cpus" env WORKERS_CASES="$case" GPUS="1 2" ROUNDS="1 2 3" \
    BUDGET_S=$budget_s DURATION_S=15 SCORE=0 LABEL=$label GPULENS_HOME=/tmp/gp-$label OUT="$OUT" \
    bash benchmarks/workers_ladder.sh
done

#!/usr/bin/env bash
# Issue 15: the README's own stall command on default settings (5-minute budget, ±3-point target)
# with WORKERS loader workers over 20k generated JPEGs, then optionally the tracker-vs-injection
# agreement (AGREEMENT_PAIRS=N). One device call per worker setting:
#   WORKERS=8 AGREEMENT_PAIRS=4 bash benchmarks/stalls_defaults.sh
# The JPEGs go to .gl/img (ignored by git; a warm device machine keeps them for the next call).
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 GPULENS_HOME=${GPULENS_HOME:-/tmp/gpulens-home}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
gl() { python3 -m gpulens.cli "$@"; }
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_')
day=$(date +%F)
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
workers=${WORKERS:-15}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader
if [ ! -f .gl/img/.done ]; then
  t0=$(date +%s)
  gl data make images --out .gl/img --n "${N_IMAGES:-20000}" --force --json > /dev/null && touch .gl/img/.done
  echo "20k JPEGs made in $(( $(date +%s) - t0 )) s" >&2
fi
cmd=(python3 -m gpulens.cli stalls resnet50 --data .gl/img --workers "$workers" --precision bf16 --json)
t0=$(date +%s.%N)
timeout "${STALLS_TIMEOUT_S:-420}" "${cmd[@]}" > "$OUT/stalls.raw.json" 2> "$OUT/stalls-w$workers.log"
rc=$?
wall=$(python3 -c "import time; print(round(time.time() - $t0, 1))")
python3 - "$OUT/stalls.raw.json" "$OUT/stalls-defaults-resnet50_bf16-w$workers-$commit-$gpu-$day.json" \
  "$commit" "$wall" "$rc" "${cmd[*]}" <<'PY'
import json, sys
raw, out, commit, wall, rc, cmd = sys.argv[1:]
try:
    doc = json.load(open(raw))
except ValueError:
    doc = None
json.dump({"command": "PYTHONPATH=src " + cmd.replace("python3 -m gpulens.cli", "gpulens"),
           "code_commit": commit, "wall_s": float(wall), "exit_code": int(rc), "result": doc},
          open(out, "w"), indent=1)
if doc:
    print(f"stalls w={cmd.split('--workers ')[1].split()[0]}: wall {wall} s, exit {rc}, "
          f"tool wall {doc.get('wall_s')}")
    ci = doc.get("breakdown_ci95_pp") or {}
    for k, v in (doc.get("breakdown_pct") or {}).items():
        if v is not None:
            print(f"  {k:<12} {v:6.2f} +- {ci.get(k) or 0:.2f}")
    print(f"  runs: { {k: v for k, v in (doc.get('runs') or {}).items() if v} }")
    for n in doc.get("notes") or []:
        print(f"  note: {n[:400]}")
PY
rm -f "$OUT/stalls.raw.json"
tail -3 "$OUT/stalls-w$workers.log"
if [ "${AGREEMENT_PAIRS:-0}" -gt 0 ]; then
  timeout "${AGREEMENT_TIMEOUT_S:-200}" python3 benchmarks/unmodified_check.py agreement \
    --pairs "$AGREEMENT_PAIRS" --agreement-cases ${AGREEMENT_CASES:-gpu_bound files_w4} --out "$OUT/agreement-$commit-$gpu-$day.json" 2> "$OUT/agreement.log" | tail -6
fi

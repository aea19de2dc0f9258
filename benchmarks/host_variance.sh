#!/usr/bin/env bash
# Issue 17: why two processes of one host-paced configuration differ (up to 14.5% for 25 s
# runs in session 19), and whether gpulens has a part in it. Interleaved rounds of four
# variants of each case, every one a fresh process:
#   gpulens         `gpulens run` as the ladders run it (its host probe included)
#   gpulens_pinned  the same under `taskset -c $PIN_CPUS` (every round on the same cores)
#   plain           benchmarks/plain_ddp.py on 1 GPU (a plain PyTorch loop, probe of its own)
#   plain_pinned    the same under taskset
# If the pinned variants agree across rounds and the unpinned ones do not, the spread comes
# from where the scheduler puts the process, not from gpulens or the run's length.
# One GPU, ~8 min:  COMMIT=<hash> OUT=$OUT bash benchmarks/host_variance.sh
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 GPULENS_HOME=${GPULENS_HOME:-/tmp/gpulens-variance}
OUT=${OUT:-$(mktemp -d)}
PIN_CPUS=${PIN_CPUS:-2,3}
mkdir -p "$OUT" "$GPULENS_HOME"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_')
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
day=$(date +%F)
lines="$GPULENS_HOME/plain.jsonl"
: > "$lines"
lscpu > "$GPULENS_HOME/lscpu.txt" 2>&1
start_s=$(date +%s)
one() {  # variant workload batch round
  local v=$1 w=$2 b=$3 r=$4 name="var-$1-$2-b$3-r$4" pin=()
  if (( $(date +%s) - start_s > ${BUDGET_S:-450} )); then echo "$name skipped: budget" >&2; return; fi
  [[ $v == *_pinned ]] && pin=(taskset -c "$PIN_CPUS")
  if [[ $v == gpulens* ]]; then
    timeout 120 "${pin[@]}" python3 -m gpulens.cli run "$w" --batch-size "$b" --precision bf16 \
      --duration "${DURATION_S:-8}" --no-store --name "$name" --json \
      > "$GPULENS_HOME/$name.json" 2> "$GPULENS_HOME/$name.log" \
      || echo "$name failed: $(tail -1 "$GPULENS_HOME/$name.log")" >&2
  else
    timeout 120 "${pin[@]}" python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
      benchmarks/plain_ddp.py --model "$w" --batch-size "$b" --steps "${PLAIN_STEPS:-250}" \
      --probe-steps 20 2> "$GPULENS_HOME/$name.log" | tail -1 \
      | python3 -c "import json,sys; d=json.loads(sys.stdin.read()); d['name']=sys.argv[1]; \
        print(json.dumps(d))" "$name" >> "$lines" \
      || echo "$name failed: $(tail -1 "$GPULENS_HOME/$name.log")" >&2
  fi
}
for r in $(seq 1 "${ROUNDS:-4}"); do
  for case in ${VARIANCE_CASES:-vit_b_16:32 resnet50:64}; do
    for v in gpulens gpulens_pinned plain plain_pinned; do one "$v" "${case%%:*}" "${case##*:}" "$r"; done
  done
done
python3 - "$GPULENS_HOME" "$OUT/host_variance-$commit-$gpu-$day.json" <<'PY'
import glob, json, statistics, sys
from pathlib import Path
home, out = Path(sys.argv[1]), Path(sys.argv[2])
rows = []
for f in glob.glob(str(home / "runs" / "*" / "run.json")):
    m = json.loads(Path(f).read_text())
    s = m["summary"]
    rows.append({"name": m.get("name"), "samples_per_s": s.get("throughput_samples_per_s"),
                 "host_issue_s": s.get("host_issue_s_per_step")})
for line in (home / "plain.jsonl").read_text().splitlines():
    d = json.loads(line)
    rows.append({"name": d["name"], "samples_per_s": d["throughput_samples_per_s"],
                 "host_issue_s": d["host_issue_s"]})
for r in rows:  # var-VARIANT-WORKLOAD-bBATCH-rROUND
    _, r["variant"], r["workload"], b, rnd = r["name"].split("-")
    r["batch"], r["round"] = int(b[1:]), int(rnd[1:])
groups = {}
for r in rows:
    groups.setdefault((r["workload"], r["batch"], r["variant"]), []).append(r)
table = []
print(f"{'case':14} {'variant':15} {'samples/s by round':36} {'spread%':>7} {'probe ms by round':30}")
for (w, b, v), rs in sorted(groups.items()):
    rs.sort(key=lambda r: r["round"])
    t = [r["samples_per_s"] for r in rs if r["samples_per_s"]]
    p = [r["host_issue_s"] * 1e3 for r in rs if r["host_issue_s"]]
    spread = (max(t) - min(t)) / statistics.median(t) * 100 if len(t) > 1 else None
    table.append({"workload": w, "batch": b, "variant": v, "samples_per_s": t, "probe_ms": p,
                  "spread_pct": spread})
    print(f"{w + ' b' + str(b):14} {v:15} {' '.join(f'{x:7.1f}' for x in t):36} "
          f"{spread if spread is not None else float('nan'):7.1f} {' '.join(f'{x:6.2f}' for x in p)}")
out.write_text(json.dumps({"rows": rows, "table": table,
                           "lscpu": (home / "lscpu.txt").read_text()}, indent=1))
PY
tar czf "$OUT/host_variance-logs-$commit-$gpu-$day.tgz" -C "$GPULENS_HOME" . 2>/dev/null

#!/usr/bin/env bash
# Issue 18: the spec of benchmarks/sweep_gpu.sh (two workloads x two batch sizes, 30 steps) run by
# the Ray executor on a local Ray cluster started for it, on a CPU machine (`device: cpu` is the
# only change: there is no GPU). Needs `pip install 'gpulens[sweep]'`. Writes the spec, the JSON
# summary, `gpulens runs list --json` and a results JSON (with this command and the machine) to
# $OUT; the cell state files and records go into one tar.
#   OUT=/tmp/out bash benchmarks/sweep_ray_cpu.sh
set -euo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$(mktemp -d)}
export GPULENS_HOME=${GPULENS_HOME:-$(mktemp -d)}
mkdir -p "$OUT"
# the GPU sweep's spec, on the CPU: the only change
sed 's/^options: {steps: 30}$/options: {steps: 30, device: cpu}/' "$(dirname "$0")/sweep_spec.yaml" \
  > "$OUT/sweep_spec.yaml"
grep -q "device: cpu" "$OUT/sweep_spec.yaml" || { echo "sweep_spec.yaml changed: edit the sed above" >&2; exit 2; }
t0=$(date +%s)
set +e
python -m gpulens.cli sweep "$OUT/sweep_spec.yaml" --executor ray --out "$OUT/sweep" --json \
  > "$OUT/sweep_summary.json" 2> "$OUT/sweep_stderr.log"
rc=$?
set -e
wall=$(( $(date +%s) - t0 ))
echo "gpulens sweep --executor ray: exit $rc after $wall s"
python -m gpulens.cli sweep "$OUT/sweep_spec.yaml" --out "$OUT/sweep" --resume --retries 0 2>/dev/null || true
python -m gpulens.cli runs list --json > "$OUT/runs_list.json" || true
python - "$OUT" "$rc" "$wall" <<'PY'
import json, os, platform, sys
from pathlib import Path

out, rc, wall = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
import ray

summary = json.loads((out / "sweep_summary.json").read_text() or "{}")
doc = {
    "command": "OUT=... bash benchmarks/sweep_ray_cpu.sh",
    "spec": (out / "sweep_spec.yaml").read_text(),
    "exit_code": rc,
    "wall_s": wall,
    "ray_version": ray.__version__,
    "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                "platform": platform.platform()},
    "summary": summary,
    "runs_list": json.loads((out / "runs_list.json").read_text() or "[]"),
}
(out / "sweep_ray_cpu.json").write_text(json.dumps(doc, indent=2) + "\n")
PY
tar -czf "$OUT/sweep_ray_records.tar.gz" -C "$OUT" sweep -C "$GPULENS_HOME" runs && rm -rf "$OUT/sweep"
echo "results: $OUT/sweep_ray_cpu.json"

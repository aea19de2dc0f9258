#!/usr/bin/env bash
# The README's own commands on a GPU machine, typed as a new user would (README "A five-minute
# tour" and "What to run on"), in a fresh HOME: each step's exit status, wall time and last lines,
# and whether it printed a traceback or "internal error". Issue 17's commands (predict, fit,
# advise, allocate-workers) run on the tour's own runs, right after the runs they need. A plain
# reference runs beside its measured twin: examples/train_plain.py alone, then under
# `gpulens run --` (its own samples/s line in both).
#   OUT=$OUT bash benchmarks/readme_tour.sh            # one GPU (2: the data-parallel steps too),
#                                                       # stops starting steps at BUDGET_S
#   SKIP="plain_alone run_plain" ...                    # leaves out the steps named (recorded so)
# Writes $OUT/readme_tour-<commit>-<gpu>-<day>.json (the steps) and .tgz (every step's log).
# `gpulens` is a shim for `python3 -m gpulens.cli` over this checkout's src (the device image has
# gpulens's dependencies but no network to install it).
set -uo pipefail
OUT=${OUT:-benchmarks/results}
BUDGET_S=${BUDGET_S:-520}  # no step starts after this
CALL_S=${CALL_S:-585}      # and none runs past this (a device call's limit), less the bundling
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
command -v nvidia-smi > /dev/null || { echo "$0: runs on a GPU machine (no nvidia-smi here)" >&2; exit 2; }
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_')
gpu_count=$(nvidia-smi -L | wc -l)
(( gpu_count > 1 )) && gpu=$gpu-x$gpu_count
day=$(date +%F)
work=$(mktemp -d /tmp/readme-tour.XXXX)
mkdir -p "$OUT" "$work/home" "$work/bin" "$work/logs"
cat > "$work/bin/gpulens" <<EOF
#!/bin/sh
PYTHONPATH=$PWD/src exec python3 -m gpulens.cli "\$@"
EOF
chmod +x "$work/bin/gpulens"
command -v python > /dev/null || ln -s "$(command -v python3)" "$work/bin/python"  # the README says python
export HOME=$work/home PATH=$work/bin:$PATH PYTHONUNBUFFERED=1
unset GPULENS_HOME
steps=$work/steps.jsonl
: > "$steps"
# the other validated GPU, for `predict --gpu`
case $gpu in *H100*) other=H200 ;; *) other=H100 ;; esac

step() {  # step NAME TIMEOUT_S 'COMMAND' (run by bash in the tour's HOME, from the checkout)
  local name=$1 limit=$2 cmd=$3 rc t0 t1
  if [[ " ${SKIP:-} " == *" $name "* ]]; then
    echo "{\"step\": \"$name\", \"skipped\": \"SKIP\"}" >> "$steps"
    printf '%-20s skipped (SKIP)\n' "$name"
    return
  fi
  if (( SECONDS > BUDGET_S )); then
    echo "{\"step\": \"$name\", \"skipped\": \"budget\"}" >> "$steps"
    printf '%-20s skipped (budget)\n' "$name"
    return
  fi
  (( limit > CALL_S - 15 - SECONDS )) && limit=$((CALL_S - 15 - SECONDS))
  t0=$(date +%s.%N)
  timeout "$limit" bash -c "$cmd" > "$work/logs/$name.log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  python3 - "$name" "$rc" "$t0" "$t1" "$work/logs/$name.log" "$cmd" >> "$steps" <<'PY'
import json
import sys

name, rc, t0, t1, log, cmd = sys.argv[1:]
lines = open(log, errors="replace").read().splitlines()
print(json.dumps({
    "step": name, "command": cmd, "rc": int(rc), "wall_s": round(float(t1) - float(t0), 1),
    "traceback": any("Traceback (most recent call last)" in x for x in lines),
    "internal_error": any("internal error" in x.lower() for x in lines),
    "tail": lines[-15:],
}))
PY
  awk -v n="$name" -v rc="$rc" -v a="$t0" -v b="$t1" 'BEGIN {printf "%-20s rc=%-3s %7.1f s\n", n, rc, b - a}'
}
newest_run() { ls -t "$HOME/.gpulens/runs" 2>/dev/null | head -1; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader
step doctor 90 'gpulens doctor'
step demo 300 'gpulens demo'
step workloads 60 'gpulens workloads'
step run_resnet18 240 'gpulens run resnet18 --steps 50 --batch-size 64 --precision bf16'
r18=$(newest_run)
step run_resnet50_profiled 240 'gpulens run resnet50 --precision bf16 --batch-size 128 --torch-profiler 5'
r50p=$(newest_run)
step predict_gpu 120 "gpulens predict $r50p --gpu $other"
step predict_gpu_json 120 "gpulens predict $r50p --gpu $other --json"
step predict_gpus_2 120 "gpulens predict $r50p --gpu $other --gpus 2"
step predict_batch 120 "gpulens predict $r50p --batch-size 256"
step predict_r18_gpu 120 "gpulens predict $r18 --gpu $other"
step advise_workload 120 'gpulens advise resnet50 --epochs 90 --dataset-size 1281167 --deadline 24 --spot'
step advise_run 120 "gpulens advise $r18 --epochs 90 --dataset-size 1281167 --deadline 24 --json"
step fit 120 'gpulens fit'
step make_images 300 'gpulens data make images --out ~/data/img --n 20000'
step run_resnet50_jpeg 300 'gpulens run resnet50 --precision bf16 --data ~/data/img --workers 15'
r50=$(newest_run)
step predict_workers 120 "gpulens predict $r50 --workers 8"
step plain_alone 240 'python3 examples/train_plain.py -b 32 --model resnet18'
step run_plain 240 'gpulens run --duration 60 -- python examples/train_plain.py -b 32 --model resnet18'
step run_plain_stopped 120 'gpulens run --duration 10 -- python examples/train_plain.py -b 32 --model resnet18 --steps 100000'
step run_tracked 300 'gpulens run -- python examples/train_tracked.py'
step allocate_workers 180 'gpulens allocate-workers resnet50 resnet18 --cpus 16'
step report 120 'gpulens report latest'
step runs_list 60 'gpulens runs list'
# a new user's slips: each one usage line, exit 2, and no record left behind (rc 0 iff none)
step mistakes 120 'n0=$(ls ~/.gpulens/runs | wc -l)
gpulens run -- nosuchcmd; echo "rc=$?"
gpulens colocate resnet18:batch=64 resnet18:batch=64 --mechanisms mig; echo "rc=$?"
gpulens predict latest --gpu RTX9999; echo "rc=$?"
n1=$(ls ~/.gpulens/runs | wc -l); echo "records added: $((n1 - n0))"; test "$n1" -eq "$n0"'
# stopped as Slurm, Kubernetes and `kill` stop a job, a built-in run and a wrapped script, each
# started with `&` as a batch script does: exit 143, the record ended `killed` with its reason,
# and no process of the run left on a GPU (rc 0 iff all of these)
step sigterm 150 'ok=0
for cmd in "gpulens run resnet18 --duration 120 --batch-size 64 --precision bf16" \
           "gpulens run -- python examples/train_plain.py -b 32 --model resnet18 --steps 100000"; do
  $cmd & pid=$!; sleep 25; kill -TERM $pid; wait $pid; rc=$?; sleep 3
  st=$(python3 -c "import json,glob,os; d=max(glob.glob(os.path.expanduser(\"~/.gpulens/runs/*\")), key=os.path.getmtime); r=json.load(open(d+\"/run.json\")); print(r.get(\"status\"), \"|\", r.get(\"error\") or \"\")")
  left=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader | wc -l)
  echo "$cmd -> rc=$rc record: $st; GPU processes left: $left"
  test "$rc" -eq 143 && [[ "$st" == killed* ]] && test "$left" -eq 0 || ok=1
done; exit $ok'
step runs_compare 60 "gpulens runs compare latest $r18"
step colocate_streams_mps 240 'gpulens colocate resnet18:batch=64 infer:resnet50:batch=1,rate=100 --mechanisms streams,mps'
step make_tokens 240 'gpulens data make tokens --out ~/data/tok --n 50000000'
step run_gpt2 300 'gpulens run gpt2 --data ~/data/tok --until-ci 2 --json'
# the README's data-parallel commands, where the machine has 2 GPUs or more
if (( gpu_count >= 2 )); then
  step run_gpt2_2gpu_socket 180 'gpulens run gpt2 --gpus 2 --nccl-transport socket --precision bf16 --duration 20'
  step stalls_resnet50_2gpu 330 'gpulens stalls resnet50 --data ~/data/img --gpus 2 --workers 15 --precision bf16'
fi
step stalls_resnet50 330 'gpulens stalls resnet50 --data ~/data/img --workers 15 --precision bf16'
step stalls_whatif 300 'gpulens stalls tiny_cnn --data ~/data/img --workers 1 --storage-latency-ms 20'
# a budget the user sets holds for the whole command (it took 131 s for 60 before a5c9b85)
step stalls_budget_60 120 'gpulens stalls tiny_cnn --data ~/data/img --workers 1 --storage-latency-ms 20 --time-budget 60'

name=readme_tour-$commit-$gpu-$day
python3 - "$steps" "$OUT/$name.json" "$commit" "$gpu" <<'PY'
import json
import sys

steps_file, out, commit, gpu = sys.argv[1:]
steps = [json.loads(x) for x in open(steps_file)]
json.dump({"commit": commit, "gpu": gpu, "command": "OUT=$OUT bash benchmarks/readme_tour.sh",
           "steps": steps}, open(out, "w"), indent=1)
ran = [s for s in steps if "rc" in s]
bad = [s["step"] for s in ran if s["rc"] != 0 or s["traceback"] or s["internal_error"]]
print(f"\n{len(ran)} of {len(steps)} steps ran; not clean: {', '.join(bad) or 'none'}")
PY
tar czf "$OUT/$name.tgz" -C "$work" logs steps.jsonl

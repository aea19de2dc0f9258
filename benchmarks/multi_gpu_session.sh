#!/usr/bin/env bash
# Issues 3 and 5 on a 2-GPU machine, in two calls that each fit a 10-minute limit:
#   bash benchmarks/multi_gpu_session.sh stalls   # topology, data, 2-GPU stall breakdowns
#   bash benchmarks/multi_gpu_session.sh ladder   # scaling-ladder dry run, stall validation
# SRC overrides the source tree (default ./src); each step writes its JSON under $OUT.
set -uo pipefail
export PYTHONPATH=${SRC:-$PWD/src} PYTHONUNBUFFERED=1 GPULENS_HOME=${GPULENS_HOME:-/tmp/gpulens-home}
# NVLink multicast stays off on shared hosts (the machine's own rule); keep it off here too.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-benchmarks/results/session}
mkdir -p "$OUT"
gl() { python3 -m gpulens.cli "$@"; }
step() { echo "=== $* ($(date +%T))" >&2; }
part=${1:-stalls}

if [ "$part" = stalls ]; then
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv
  nvidia-smi topo -m | tee "$OUT/topo.txt"
  nproc
  step data
  [ -d /tmp/img ] || gl data make images --out /tmp/img --n "${N_IMAGES:-40000}" --json > "$OUT/data_images.json"
  [ -d /tmp/tok ] || gl data make tokens --out /tmp/tok --n 40000000 --json > "$OUT/data_tokens.json"
  step stalls resnet50
  gl stalls resnet50 --data /tmp/img --gpus 2 --workers 15 --precision bf16 \
     --max-duration "${MAX_DURATION:-25}" --no-store --json > "$OUT/stalls_resnet50.json"; echo "rc=$?"
  step stalls gpt2
  gl stalls gpt2 --data /tmp/tok --gpus 2 --workers 4 --precision bf16 \
     --max-duration "${MAX_DURATION:-25}" --no-store --json > "$OUT/stalls_gpt2.json"; echo "rc=$?"
  python3 - "$OUT" <<'EOF'
import json, sys
for name in ("resnet50", "gpt2"):
    try:
        d = json.load(open(f"{sys.argv[1]}/stalls_{name}.json"))
    except Exception as exc:
        print(name, "no result:", exc); continue
    b, ci, t = d["breakdown_pct"], d["breakdown_ci95_pp"], d["throughput_samples_per_s"]
    print(name, " ".join(f"{k}={'-' if v is None else f'{v:.1f}±{ci[k]:.1f}'}" for k, v in b.items()))
    print("   samples/s", {k: None if v is None else round(v) for k, v in t.items()})
    for n in d["notes"]:
        print("   note:", n)
EOF
fi

if [ "$part" = ladder ]; then
  step ladder
  python3 benchmarks/scaling_ladder.py --gpus 1,2,4,8 --duration "${LADDER_DURATION:-10}" \
     --out "$OUT/scaling_ladder.json"; echo "rc=$?"
  step validation
  [ -d /tmp/img ] || gl data make images --out /tmp/img --n 20000 --json > /dev/null
  CUDA_VISIBLE_DEVICES=0 python3 benchmarks/stalls_validation.py --data /tmp/img \
     --workload resnet18 --workers 1,2,4 --latencies-ms 2,5,10 --steps 60 \
     --out "$OUT/stalls_validation.json"; echo "rc=$?"
fi
step done

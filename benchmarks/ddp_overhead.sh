#!/usr/bin/env bash
# Issue 17: where a 2-GPU DDP step's time beyond the 1-GPU step comes from. Each case runs the
# plain loop of plain_ddp.py on 1 GPU and as 2-GPU DDP (same per-GPU batch): throughput, the
# host's issue time per step on an idle GPU (--probe-steps) and, from 5 profiled steps on rank
# 0, the compute and NCCL kernels' time per step and the GPU's busy span. Traces of the
# vit_b_16 case are kept. A 2-GPU machine, ~4 min:
#   OUT=$OUT bash benchmarks/ddp_overhead.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-$(mktemp -d)}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_')
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
day=$(date +%F)
lines="$OUT/ddp_overhead-$commit-$gpu-$day.jsonl"
: > "$lines"
for case in ${DDP_CASES:-resnet50:128 vit_b_16:64 resnet18:256 vgg16:64}; do
  m=${case%%:*} b=${case##*:}
  for n in 1 2; do
    timeout 120 python3 -m torch.distributed.run --standalone --nproc-per-node "$n" \
      benchmarks/plain_ddp.py --model "$m" --batch-size "$b" --steps "${STEPS:-100}" \
      --probe-steps 10 --profile-steps 5 --trace-dir "/tmp/ddp-traces/$m-b$b" \
      2> "/tmp/ddp-$m-$n.log" | tail -1 >> "$lines" \
      || echo "$m b$b x$n failed: $(tail -2 "/tmp/ddp-$m-$n.log")" >&2
  done
done
tar czf "$OUT/ddp_overhead-traces-$commit-$gpu-$day.tgz" -C /tmp/ddp-traces vit_b_16-b64 2>/dev/null
python3 - "$lines" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip().startswith("{")]
by = {(r["model"], r["world_size"]): r for r in rows}
print(f"{'model':10} {'b':>4} {'n':>2} {'step ms':>8} {'issue ms':>8} {'compute':>8} {'nccl':>7} {'busy':>7} {'window':>7}")
for (m, n), r in sorted(by.items()):
    g = r.get("gpu") or {}
    f = lambda k: f"{(g.get(k) or 0) * 1e3:7.2f}"
    print(f"{m:10} {r['batch_size']:>4} {n:>2} {r['step_s'] * 1e3:8.2f} {(r['host_issue_s'] or 0) * 1e3:8.2f} "
          f"{f('compute_kernel_s_per_step'):>8} {f('nccl_kernel_s_per_step')} {f('gpu_busy_span_s_per_step')} {f('window_s_per_step')}")
PY

#!/usr/bin/env bash
# Issue 18 on a machine with 2 GPUs: two "nodes" on one host, one GPU each, over NCCL, the
# README's own commands (by hand, then under torchrun), against one node with --gpus 2 and a
# plain torchrun DDP loop on the same 2 GPUs. Writes $OUT/multinode-<gpu>-<date>.tgz and a table.
#   OUT=/tmp/out bash benchmarks/multinode_gpu.sh
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-$(mktemp -d)}
W=$OUT/multinode && mkdir -p "$W"
STEPS=${STEPS:-150}
RUN=(resnet50 --precision bf16 --batch-size 128 --steps "$STEPS" --json)
gl() { python3 -m gpulens.cli "$@"; }
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee "$W/gpus.txt"
nvidia-smi topo -m > "$W/topo.txt" 2>&1
ngpu=$(nvidia-smi -L | wc -l)
[ "$ngpu" -ge 2 ] || { echo "needs 2 GPUs, found $ngpu" >&2; exit 2; }

echo "=== one node, --gpus 2 ($(date +%T))" >&2
GPULENS_HOME=$W/home-single gl run "${RUN[@]}" --gpus 2 > "$W/single.json" 2> "$W/single.log"
echo "single: exit $?" >&2

echo "=== two nodes by hand, one shared GPULENS_HOME ($(date +%T))" >&2
port=29611
for r in 0 1; do
  CUDA_VISIBLE_DEVICES=$r GPULENS_HOME=$W/home-shared gl run "${RUN[@]}" --gpus 1 --nnodes 2 \
    --node-rank $r --master-addr 127.0.0.1 --master-port $port > "$W/hand-node$r.json" \
    2> "$W/hand-node$r.log" &
done
wait; echo "by hand: exits in logs" >&2
GPULENS_HOME=$W/home-shared gl runs show latest --json > "$W/hand-joined.json" 2>&1

echo "=== two nodes, separate homes, then gpulens runs join ($(date +%T))" >&2
port=29612
for r in 0 1; do
  CUDA_VISIBLE_DEVICES=$r GPULENS_HOME=$W/home-n$r gl run "${RUN[@]}" --gpus 1 --nnodes 2 \
    --node-rank $r --master-addr 127.0.0.1 --master-port $port > "$W/sep-node$r.json" \
    2> "$W/sep-node$r.log" &
done
wait
shards=$(ls -d "$W"/home-n0/runs/*.node0 "$W"/home-n1/runs/*.node1 2>/dev/null)
# shellcheck disable=SC2086
GPULENS_HOME=$W/home-joined gl runs join $shards --json > "$W/joined.json" 2> "$W/joined.log"
echo "join: exit $?" >&2

echo "=== torchrun, one gpulens per node ($(date +%T))" >&2
for r in 0 1; do
  CUDA_VISIBLE_DEVICES=$r GPULENS_HOME=$W/home-torchrun timeout 300 python3 -m torch.distributed.run \
    --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29613 \
    -m gpulens.cli run "${RUN[@]}" --gpus 1 > "$W/torchrun-node$r.json" 2> "$W/torchrun-node$r.log" &
done
wait
GPULENS_HOME=$W/home-torchrun gl runs show latest --json > "$W/torchrun-joined.json" 2>&1

echo "=== plain torchrun DDP, 2 GPUs ($(date +%T))" >&2
timeout 300 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/plain_ddp.py \
  --model resnet50 --batch-size 128 --steps "$STEPS" > "$W/plain.json" 2> "$W/plain.log"

python3 - "$W" <<'PY' | tee "$W/table.txt"
import json, sys, glob
from pathlib import Path
w = Path(sys.argv[1])
def load(name):
    try:
        text = (w / name).read_text()
        return json.loads(text[text.index("{"):]) if "{" in text else None
    except (OSError, ValueError):
        return None
def tput(doc):
    return None if not doc else (doc.get("summary") or doc).get("throughput_samples_per_s")
rows = [("one node --gpus 2", load("single.json")),
        ("2 nodes by hand, shared home, joined", load("hand-joined.json")),
        ("2 nodes, separate homes, joined", load("joined.json")),
        ("torchrun 2 nodes, joined", load("torchrun-joined.json")),
        ("plain torchrun DDP", load("plain.json"))]
print(f"{'how':36} {'samples/s':>10}  ranks  stragglers  joined")
for name, doc in rows:
    if doc is None:
        print(f"{name:36} {'-':>10}  (no JSON: see the log)"); continue
    s = doc.get("summary") or doc  # `runs show --json` nests the figures in its summary
    ranks = s.get("ranks")
    strag = s.get("stragglers")
    join = (doc.get("join") or {}).get("joined")
    n = len(ranks) if isinstance(ranks, (list, dict)) else ranks
    print(f"{name:36} {tput(doc) or 0:10.1f}  {n!s:5}  {strag!s:10}  {join}")
PY
tar czf "$OUT/multinode-$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_')x$ngpu-$(date +%F).tgz" -C "$OUT" multinode && rm -rf "$W"

#!/usr/bin/env bash
# A --gpus 2 run beside plain DDP (benchmarks/plain_ddp.py), interleaved, then a rank slowed on
# purpose (GPULENS_TEST_SLOW_RANK) to see it named, and predict from the 2-GPU run.
#   OUT=$OUT bash benchmarks/ranks_gpu.sh      (a machine of 2 GPUs or more)
export PYTHONPATH=$PWD/src GPULENS_HOME=/tmp/gh PYTHONUNBUFFERED=1
g() { python3 -m gpulens.cli "$@"; }
for i in 1 2; do
  torchrun --nproc-per-node 2 benchmarks/plain_ddp.py --model resnet50 --batch-size 128 --steps 300 2>/dev/null | tail -1 | sed "s/^/plain $i: /"
  g run resnet50 --gpus 2 --batch-size 128 --precision bf16 --steps 300 --json > $OUT/r50_2gpu_$i.json 2> $OUT/r50_2gpu_$i.err; echo "gpulens $i rc=$?"
  python3 -c "import json,sys; d=json.load(open('$OUT/r50_2gpu_$i.json')); s=d.get('summary',d); print('gpulens $i:', {k: s.get(k) for k in ('throughput_samples_per_s','world_size','ranks_reported','slowest_rank','stragglers','measured_steps')})"
done
g predict latest --gpu H100 > $OUT/predict_2gpu.txt 2>&1; echo "predict rc=$?"; tail -5 $OUT/predict_2gpu.txt
GPULENS_TEST_SLOW_RANK=1:0.05 g run resnet18 --gpus 2 --batch-size 64 --precision bf16 --steps 100 > $OUT/slow_rank.txt 2>&1; echo "slow rc=$?"; grep -i -A2 "ranks" $OUT/slow_rank.txt | head -5
g runs show latest > /dev/null 2>&1; echo "show rc=$?"

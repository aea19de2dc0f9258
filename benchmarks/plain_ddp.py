"""A plain PyTorch DDP training loop, the reference for gpulens's multi-GPU runs: the
torchvision model, channels_last, bf16 autocast, SGD with momentum, synthetic data on the
device. Under torchrun; rank 0 prints one JSON line with the throughput over all ranks.

    torchrun --nproc-per-node 2 benchmarks/plain_ddp.py --model resnet50 --batch-size 128
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torchvision


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--warmup", type=int, default=20)
    args = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local)
    model = getattr(torchvision.models, args.model)().to(device, memory_format=torch.channels_last)
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local])
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(args.batch_size, 3, 224, 224, device=device).to(
        memory_format=torch.channels_last
    )
    y = torch.randint(0, 1000, (args.batch_size,), device=device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    elapsed_max = torch.tensor(elapsed, device=device)
    dist.all_reduce(elapsed_max, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        total = args.steps * args.batch_size * dist.get_world_size() / elapsed_max.item()
        print(json.dumps({"throughput_samples_per_s": total, "world_size": dist.get_world_size(),
                          "steps": args.steps, "elapsed_s": elapsed_max.item()}))  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

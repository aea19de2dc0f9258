"""A plain PyTorch DDP training loop, the reference for gpulens's multi-GPU runs: the
torchvision model, channels_last, bf16 autocast, SGD with momentum, synthetic data on the
device. Under torchrun; rank 0 prints one JSON line with the throughput over all ranks.

    torchrun --nproc-per-node 2 benchmarks/plain_ddp.py --model resnet50 --batch-size 128

Where DDP's cost beyond the all-reduce comes from (issue 17): ``--probe-steps N`` times the
host's issue of N steps on an idle GPU after the measured window (as gpulens's probe does), and
``--profile-steps N --trace-dir D`` then profiles N steps on rank 0 and reports, per step, the
compute kernels' time, the NCCL kernels' time, and the GPU's busy span. With
``--nproc-per-node 1`` the same loop runs without DDP, the 1-GPU reference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
    ap.add_argument("--probe-steps", type=int, default=0)
    ap.add_argument("--profile-steps", type=int, default=0)
    ap.add_argument("--trace-dir", default=None)
    args = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local)
    model = getattr(torchvision.models, args.model)().to(device, memory_format=torch.channels_last)
    if dist.get_world_size() > 1:
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
    issue_s = []
    for _ in range(args.probe_steps):  # every rank, so that DDP's collectives match
        torch.cuda.synchronize()
        t_issue = time.perf_counter()
        step()
        issue_s.append(time.perf_counter() - t_issue)
    torch.cuda.synchronize()
    gpu = _profile(step, args.profile_steps, args.trace_dir) if args.profile_steps else None
    if dist.get_rank() == 0:
        total = args.steps * args.batch_size * dist.get_world_size() / elapsed_max.item()
        print(json.dumps({"model": args.model, "batch_size": args.batch_size,
                          "throughput_samples_per_s": total, "world_size": dist.get_world_size(),
                          "steps": args.steps, "elapsed_s": elapsed_max.item(),
                          "step_s": elapsed_max.item() / args.steps,
                          "host_issue_s": statistics.median(issue_s) if issue_s else None,
                          "gpu": gpu}))  # fmt: skip
    dist.destroy_process_group()


def _profile(step, steps: int, trace_dir: str | None) -> dict | None:
    """Profile ``steps`` steps on every rank (DDP's collectives need all of them); rank 0
    returns the per-step GPU figures and writes its trace under ``trace_dir``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    if dist.get_rank() != 0:
        return None
    path = os.path.join(trace_dir or "/tmp", f"ddp-w{dist.get_world_size()}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels)
    nccl_us = sum(float(e["dur"]) for e in kernels if "nccl" in e["name"].lower())
    all_us = sum(float(e["dur"]) for e in kernels)
    busy_us, cur_start, cur_end = 0.0, None, None
    for start, end in spans:  # the union of kernel spans: time the GPU ran anything
        if cur_end is None or start > cur_end:
            busy_us += (cur_end - cur_start) if cur_end is not None else 0.0
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy_us += (cur_end - cur_start) if cur_end is not None else 0.0
    return {
        "profiled_steps": steps,
        "compute_kernel_s_per_step": (all_us - nccl_us) * 1e-6 / steps,
        "nccl_kernel_s_per_step": nccl_us * 1e-6 / steps,
        "gpu_busy_span_s_per_step": busy_us * 1e-6 / steps,
        "window_s_per_step": (spans[-1][1] - spans[0][0]) * 1e-6 / steps if spans else None,
    }


if __name__ == "__main__":
    main()

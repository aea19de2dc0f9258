"""A plain PyTorch training script with gpulens tracking added in two lines (marked ###).

python examples/train_tracked.py                 # makes its own gpulens run
gpulens run -- python examples/train_tracked.py  # steps go into gpulens's run
gpulens stalls --data DIR -- python examples/train_tracked.py --data DIR  # stall breakdown
torchrun --nproc_per_node 2 examples/train_tracked.py              # data parallel: one run,
gpulens run -- torchrun --nproc_per_node 2 examples/train_tracked.py  # steps per rank
gpulens run -- python examples/train_tracked.py --no-track  # no ### lines: steps injected

With --data DIR the script reads the files under DIR (any files: each sample is a file's first
bytes, as a vector), so `gpulens stalls` can time it with the files in the page cache and cold.
Under torchrun (WORLD_SIZE > 1) it trains with DistributedDataParallel (NCCL on GPUs, gloo on
CPU); gpulens times each rank and combines them.
"""

import argparse
import contextlib
import os
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

import gpulens

parser = argparse.ArgumentParser()
parser.add_argument("--data", help="a folder of files to read (default: random tensors)")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--workers", type=int, default=0)
parser.add_argument("--batch-size", type=int, default=128)
parser.add_argument("--width", type=int, default=256, help="hidden units per layer")
parser.add_argument(
    "--depth", type=int, default=1, help="hidden layers (--depth 4 --width 4096: GPU-bound steps)"
)
parser.add_argument(
    "--no-track", action="store_true", help="leave the ### lines out: a plain script, for "
    "comparing the tracker API with `gpulens run`'s injection on the same loop"
)  # fmt: skip
args = parser.parse_args()


class Files(Dataset):
    """Each sample: the first 64 bytes of one file as floats, and a label from its folder."""

    def __init__(self, root):
        self.paths = sorted(p for p in Path(root).rglob("*") if p.is_file())

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        raw = self.paths[i].read_bytes()[:64].ljust(64, b"\0")
        x = torch.frombuffer(bytearray(raw), dtype=torch.uint8).float() / 255.0
        return x, sum(self.paths[i].parent.name.encode()) % 10


distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
cuda = torch.cuda.is_available()
device = "cuda" if cuda else "cpu"
if distributed:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
if args.data:
    data = Files(args.data)
else:
    data = TensorDataset(torch.randn(4096, 64), torch.randint(0, 10, (4096,)))
sampler = DistributedSampler(data) if distributed else None
loader = DataLoader(
    data,
    batch_size=args.batch_size,
    shuffle=sampler is None,
    sampler=sampler,
    num_workers=args.workers,
)
layers = [torch.nn.Linear(64, args.width), torch.nn.ReLU()]
for _ in range(args.depth - 1):
    layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
model = torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 10))
model = model.to(device)
if distributed:
    model = DistributedDataParallel(model, device_ids=[device] if cuda else None)
opt = torch.optim.SGD(model.parameters(), lr=0.1)

tracking = contextlib.nullcontext() if args.no_track else gpulens.track(name="tracked-example")
total_loss, n_steps = 0.0, 0
with tracking as tracker:  ###
    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        # device=: batches arrive on the device (under `gpulens stalls`, its ingestion-free run
        # repeats the first few batches already there instead of loading more)
        batches = loader if tracker is None else tracker.data(loader, device=device)  ###
        for x, y in batches:
            x, y = x.to(device), y.to(device)  # a no-op where data() moved them
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            total_loss += loss.item()  # as most scripts do (it waits for the step's GPU work)
            n_steps += 1
            if tracker is not None:
                tracker.step()  # optional: marks the end of the step explicitly
if distributed:
    dist.destroy_process_group()
if int(os.environ.get("RANK", "0")) == 0:
    print(f"final loss {loss.item():.3f}, mean {total_loss / max(1, n_steps):.3f}")

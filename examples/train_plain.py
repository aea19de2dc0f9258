"""A plain PyTorch training script with no gpulens in it (for `gpulens run -- python ...`).

resnet50 (or --model) on random uint8 images served by a DataLoader with worker processes,
channels_last, bf16 autocast on a GPU, SGD. It times itself and prints one JSON line at the end:
{"samples_per_s": ..., "steps": ..., "final_loss": ...} over the steps after --warmup.

    python examples/train_plain.py --steps 150 --batch-size 256
    gpulens run -- python examples/train_plain.py --steps 150 --batch-size 256
"""

import argparse
import json
import time

import torch
import torchvision
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="resnet50")
parser.add_argument("-b", "--batch-size", type=int, default=256)
parser.add_argument("--steps", type=int, default=150, help="measured steps (then it stops)")
parser.add_argument("--warmup", type=int, default=30)
parser.add_argument("--workers", type=int, default=8)
parser.add_argument("--size", type=int, default=224)
args = parser.parse_args()


class RandomImages(Dataset):
    """A fixed pool of random images (uint8, as decoded JPEGs are), served by index."""

    def __init__(self, n, size):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=g)
        self.y = torch.randint(0, 1000, (n,), generator=g)

    def __len__(self):
        return 1 << 30  # endless: the script stops by its step count

    def __getitem__(self, i):
        return self.x[i % len(self.x)], self.y[i % len(self.y)]


cuda = torch.cuda.is_available()
device = torch.device("cuda" if cuda else "cpu")
torch.manual_seed(0)
model = getattr(torchvision.models, args.model)().to(device, memory_format=torch.channels_last)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
loader = DataLoader(RandomImages(512, args.size), batch_size=args.batch_size,
                    num_workers=args.workers, pin_memory=cuda, shuffle=False)  # fmt: skip
mean = torch.tensor([0.485, 0.456, 0.406], device=device).view(1, 3, 1, 1) * 255
t0 = None
for step, (x, y) in enumerate(loader):
    if step == args.warmup:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
    if step == args.warmup + args.steps:
        break
    x = x.to(device, non_blocking=True).float().sub_(mean).div_(58.0)
    x = x.contiguous(memory_format=torch.channels_last)
    y = y.to(device, non_blocking=True)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
if cuda:
    torch.cuda.synchronize()
elapsed = time.perf_counter() - t0
print(json.dumps({"samples_per_s": args.steps * args.batch_size / elapsed, "steps": args.steps,
                  "final_loss": round(loss.item(), 4)}), flush=True)  # fmt: skip

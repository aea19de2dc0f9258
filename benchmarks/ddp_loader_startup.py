"""Why a 2-GPU run with a JPEG loader takes ~100 s to start (session 28): a plain PyTorch DDP
job's start-up, phase by phase, beside `gpulens run`'s, on the same host and data.

    python benchmarks/ddp_loader_startup.py --data /tmp/workers-ladder-images --workers 8 \
        [--gpus 2] [--contexts fork,forkserver,spawn] [--orders group_first,loader_first] [--out F]

On one H200 pair (ef78583) `gpulens run resnet18 --data ... --workers 8 --gpus 2` spent
92-118 s before its first measured step, against 13-16 s on 1 GPU and 10-13 s for 2-GPU runs on
synthetic data; the host's memory grew ~85 MB/s meanwhile, one CPU busy per rank, the GPUs
idle. The likely cause (session 29): its ranks, started by spawn, spawned their workers too
(gpulens forks them since 8ab5f69); `--contexts fork,spawn` compares the two in a plain job.
Another suspect was forking the workers from a process that has set up NCCL (fork copies its
mappings). Each variant here is a plain script (no gpulens code in the ranks):
`group_first` joins the process group and wraps the model in DDP before the loader forks its
workers (what most DDP scripts and gpulens do); `loader_first` starts the workers first; the
context is the DataLoader's `multiprocessing_context`. Each rank times: the process group,
model + DDP, the loader's iterator (the workers' start), the first batch, 5 steps. Without CUDA
it runs on the CPU with gloo (a smoke test; the times say nothing about the GPU case).

`--stacks-every-s N` (default 15) has every process (the plain ranks, and gpulens's CLI and
ranks through a `sitecustomize` on PYTHONPATH) dump all its threads' Python stacks every N s
(faulthandler): where a rank sits during a slow start. The records of that start showed two
cores busy (one thread a rank) for ~95 s with all 16 cores busy for ~0.2 s in pairs every ~10 s,
disk reads and the page cache flat: CPU work in the ranks, not I/O.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Put first on PYTHONPATH, it dumps the stacks of each Python process started under it (a
# thread holding the GIL: faulthandler's dump_traceback_later, which reads frames without it,
# crashed `gpulens run` on its first dump), then runs the sitecustomize the process would have
# run without it.
STACKS_SITECUSTOMIZE = """\
import importlib.machinery
import importlib.util
import os
import sys


def _startup_stacks(folder, every_s):
    import threading
    import time
    import traceback

    with open("/proc/self/cmdline", "rb") as cmd:
        argv = cmd.read().replace(b"\\0", b" ").decode(errors="replace")[:300]
    t0 = time.monotonic()

    def dump():
        with open(os.path.join(folder, f"stacks-{os.getpid()}.txt"), "w", buffering=1) as out:
            out.write(f"# pid {os.getpid()}: {argv}\\n")
            while True:
                time.sleep(every_s)
                out.write(f"--- {time.monotonic() - t0:.1f} s after start\\n")
                for tid, frame in sys._current_frames().items():
                    if tid != threading.get_ident():
                        out.write(f"thread {tid}:\\n" + "".join(traceback.format_stack(frame)))

    threading.Thread(target=dump, daemon=True, name="startup-stacks").start()


if os.environ.get("STARTUP_STACKS_DIR"):
    _startup_stacks(os.environ["STARTUP_STACKS_DIR"], float(os.environ["STARTUP_STACKS_EVERY_S"]))
_here = os.path.dirname(os.path.abspath(__file__))
_others = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _others)
if _spec is not None and _spec.loader is not None:
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
"""
MAX_DUMP_CHARS = 40000  # per process, the first dumps: the start-up is what matters


def _dump_stacks(path: Path, every_s: float):
    """Every ``every_s`` the stacks of this process's other threads go to ``path`` until the
    returned event is set."""
    import threading
    import traceback

    stop, t0 = threading.Event(), time.monotonic()

    def dump() -> None:
        with open(path, "w", buffering=1) as out:
            while not stop.wait(every_s):
                out.write(f"--- {time.monotonic() - t0:.1f} s after start\n")
                for tid, frame in sys._current_frames().items():
                    if tid != threading.get_ident():
                        out.write(f"thread {tid}:\n" + "".join(traceback.format_stack(frame)))

    threading.Thread(target=dump, daemon=True, name="startup-stacks").start()
    return stop


def _read_stacks(folder: Path) -> dict[str, str]:
    return {
        p.name: p.read_text(errors="replace")[:MAX_DUMP_CHARS] for p in sorted(folder.iterdir())
    }


def _loader(data: str, workers: int, batch: int, context: str, rank: int, world: int, cuda: bool):
    import torchvision.transforms as T
    from torch.utils.data import DataLoader, DistributedSampler
    from torchvision.datasets import ImageFolder

    dataset = ImageFolder(
        data,
        T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor()]),
    )
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, seed=0)
    return DataLoader(
        dataset,
        batch_size=batch,
        sampler=sampler,
        num_workers=workers,
        pin_memory=cuda,
        drop_last=True,
        prefetch_factor=2,
        persistent_workers=False,
        multiprocessing_context=context if workers > 0 else None,
    )


def _rank(local_rank: int, world: int, args: dict, port: int, queue, launched: float) -> None:
    import torchvision

    stop_stacks = None
    if args.get("stacks_every_s"):
        name = f"stacks-{args['context']}-{args['order']}-rank{local_rank}.txt"
        stop_stacks = _dump_stacks(Path(args["stacks_dir"]) / name, args["stacks_every_s"])
    t0 = time.perf_counter()
    marks: dict[str, float] = {"spawn_s": time.time() - launched}  # the rank's start and imports
    cuda = torch.cuda.is_available() and args["gpus"] > 0
    device = torch.device(f"cuda:{local_rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))

    def join():
        kwargs = {"device_id": device} if cuda else {}
        dist.init_process_group(
            "nccl" if cuda else "gloo", rank=local_rank, world_size=world, **kwargs
        )
        model = torchvision.models.resnet18().to(device, memory_format=torch.channels_last)
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[local_rank] if cuda else None
        )
        dist.barrier()
        marks["group_and_ddp_s"] = time.perf_counter() - t0
        return ddp

    def start_loader():
        loader = _loader(
            args["data"],
            args["workers"],
            args["batch"],
            args["context"],
            local_rank,
            world,
            cuda,
        )
        before = time.perf_counter()
        it = iter(loader)
        marks["loader_iter_s"] = time.perf_counter() - before
        return it

    if args["order"] == "loader_first":
        batches = start_loader()
        model = join()
    else:
        model = join()
        batches = start_loader()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    before = time.perf_counter()
    x, y = next(batches)
    marks["first_batch_s"] = time.perf_counter() - before
    marks["to_first_batch_s"] = time.perf_counter() - t0
    marks["launch_to_first_batch_s"] = time.time() - launched
    if stop_stacks is not None:  # the start-up is dumped; the steps run undisturbed
        stop_stacks.set()
    for step in range(args["steps"]):
        if step:
            x, y = next(batches)
        x = x.to(device, non_blocking=True, memory_format=torch.channels_last)
        y = y.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    if cuda:
        torch.cuda.synchronize(device)
    marks["to_last_step_s"] = time.perf_counter() - t0
    queue.put((local_rank, marks))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plain(args: argparse.Namespace, context: str, order: str) -> dict:
    world = args.gpus if torch.cuda.is_available() and args.gpus > 0 else 2
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    options = {
        "data": args.data,
        "workers": args.workers,
        "batch": args.batch_size,
        "context": context,
        "order": order,
        "steps": args.steps,
        "gpus": args.gpus,
        "stacks_every_s": args.stacks_every_s,
    }
    with tempfile.TemporaryDirectory() as stacks_dir:
        options["stacks_dir"] = stacks_dir
        start = time.perf_counter()
        mp.start_processes(
            _rank,
            args=(world, options, _free_port(), queue, time.time()),
            nprocs=world,
            start_method="spawn",
        )
        wall_s = time.perf_counter() - start
        stacks = _read_stacks(Path(stacks_dir))
    ranks = dict(queue.get(timeout=30) for _ in range(world))
    return {"context": context, "order": order, "wall_s": wall_s, "ranks": ranks,
            "stacks": stacks}  # fmt: skip


def gpulens_run(args: argparse.Namespace) -> dict:
    """`gpulens run` on the same data: its record's time from start to the measured window."""
    from datetime import datetime

    with tempfile.TemporaryDirectory() as home, tempfile.TemporaryDirectory() as stacks_dir:
        env = {**os.environ, "GPULENS_HOME": home}
        if args.stacks_every_s:
            site = Path(stacks_dir) / "site"
            site.mkdir()
            (site / "sitecustomize.py").write_text(STACKS_SITECUSTOMIZE)
            (Path(stacks_dir) / "dumps").mkdir()
            env.update(
                PYTHONPATH=os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")])),
                STARTUP_STACKS_DIR=str(Path(stacks_dir) / "dumps"),
                STARTUP_STACKS_EVERY_S=str(args.stacks_every_s),
            )
        cmd = [sys.executable, "-m", "gpulens.cli", "run", "resnet18", "--data", args.data,
               "--workers", str(args.workers), "--gpus", str(args.gpus),
               "--batch-size", str(args.batch_size), "--steps", str(args.steps),
               "--no-store", "--json"]  # fmt: skip
        # bf16 as the plain ranks (autocast on CUDA only): on a CPU without bf16 units two
        # ranks took 25 s a step at batch 8
        cmd += ["--precision", "bf16"] if torch.cuda.is_available() else ["--device", "cpu"]
        start = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        wall_s = time.perf_counter() - start
        stacks = _read_stacks(Path(stacks_dir) / "dumps") if args.stacks_every_s else {}
        if done.returncode:
            return {"error": done.stderr.strip().splitlines()[-1:], "wall_s": wall_s,
                    "stacks": stacks}  # fmt: skip
        record = json.loads(done.stdout)["record_dir"]
        meta = json.loads((Path(record) / "run.json").read_text())
        created = datetime.fromisoformat(meta["created_at"].replace("Z", "+00:00")).timestamp()
        import pandas as pd

        steps = pd.read_parquet(Path(record) / "series" / "steps.parquet")
        s = meta["summary"]
        return {
            "wall_s": wall_s,
            # the end of its first (warm-up) step: comparable with the plain ranks' first step
            "to_first_step_end_s": float(steps["time_unix_s"].min()) - created,
            "to_measured_window_s": s["measured_start_unix_s"] - created,
            "warmup_steps": s["warmup_steps"],
            "stacks": stacks,
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="an image folder (gpulens data make images)")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--contexts", default="fork,forkserver")
    ap.add_argument("--orders", default="group_first,loader_first")
    ap.add_argument("--no-gpulens", action="store_true", help="skip the gpulens run")
    ap.add_argument("--out", type=Path)
    stacks_help = "dump every process's stacks this often while starting (0: off)"
    ap.add_argument("--stacks-every-s", type=float, default=15.0, help=stacks_help)
    args = ap.parse_args()
    rows = []
    for context in args.contexts.split(","):
        for order in args.orders.split(","):
            rows.append(plain(args, context, order))
            print(json.dumps(rows[-1]), flush=True)
    doc = {"args": vars(args) | {"out": str(args.out)}, "plain": rows}
    if not args.no_gpulens:
        doc["gpulens"] = gpulens_run(args)
        print(json.dumps(doc["gpulens"]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1))
    print(f"\n{'context':<11} {'order':<13} {'group+ddp':>9} {'iter':>7} {'1st batch':>9} "
          f"{'to 1st':>7} {'to end':>7} {'launch->1st':>11}  (rank 0, s)")  # fmt: skip
    for r in rows:
        m = r["ranks"][0]
        print(f"{r['context']:<11} {r['order']:<13} {m['group_and_ddp_s']:9.1f} "
              f"{m['loader_iter_s']:7.1f} {m['first_batch_s']:9.1f} {m['to_first_batch_s']:7.1f} "
              f"{m['to_last_step_s']:7.1f} {m['launch_to_first_batch_s']:11.1f}")  # fmt: skip
    if "gpulens" in doc:
        g = doc["gpulens"]
        print(f"gpulens run: to its first step's end {g.get('to_first_step_end_s')}, to its "
              f"measured window {g.get('to_measured_window_s')}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

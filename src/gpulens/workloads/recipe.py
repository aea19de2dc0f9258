"""The one training recipe: model, optimizer, mixed precision, memory format and batches.

``run``, ``stalls``, the data-parallel ranks, the loader benchmark and ``colocate``'s jobs train
the same way through these functions (ViT and language models get AdamW, the rest SGD with
momentum; fp16 gets a GradScaler; image models on a GPU run channels-last).
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpulens.data.affinity import worker_init
from gpulens.errors import UsageError
from gpulens.workloads.config import LOADER_PREFETCH, EffectiveTrainConfig
from gpulens.workloads.models import WorkloadSpec

SYNTHETIC_POOL_BATCHES = 4


def optimizer_for(spec: WorkloadSpec, model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW for transformers (language models, ViT), SGD with momentum for the rest."""
    if spec.task == "language_model" or spec.name.startswith("vit"):
        return torch.optim.AdamW(model.parameters(), lr=3e-4)
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def autocast_for(device: torch.device, precision: str):
    """The mixed-precision context of a forward pass (none for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler_for(device: torch.device, precision: str) -> torch.amp.GradScaler | None:
    """fp16 needs its loss scaled; bf16 and fp32 do not."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None


def memory_format_for(channels_last: bool) -> torch.memory_format:
    return torch.channels_last if channels_last else torch.contiguous_format


def model_for(spec: WorkloadSpec, device: torch.device, channels_last: bool) -> torch.nn.Module:
    """The workload's model on ``device``, in training mode, channels-last if asked."""
    model = spec.build().to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    model.train()
    return model


def training_step(
    spec: WorkloadSpec,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    precision: str,
) -> Callable[[Any, Any], Any]:
    """One optimizer step on a batch ``(x, y)``: forward under autocast, backward (scaled for
    fp16), step, zero the gradients. Returns the loss."""
    scaler = grad_scaler_for(device, precision)

    def step_fn(x, y):
        with autocast_for(device, precision):
            loss = spec.loss(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step_fn


def synthetic_batches(
    spec: WorkloadSpec,
    batch: int,
    device: torch.device,
    seed: int,
    memory_format: torch.memory_format = torch.contiguous_format,
):
    """A few batches already on the device, cycled: no loading, no copy (ingestion-free)."""
    g = torch.Generator().manual_seed(seed)
    pool = []
    for _ in range(SYNTHETIC_POOL_BATCHES):
        if spec.task == "language_model":
            tokens = torch.randint(
                0, spec.vocab_size, (batch, spec.input_shape[0] + 1), generator=g
            )
            pool.append((tokens[:, :-1].to(device), tokens[:, 1:].to(device)))
        else:
            x = torch.randn((batch, *spec.input_shape), generator=g)
            y = torch.randint(0, spec.num_classes, (batch,), generator=g)
            x = x.to(device)
            pool.append(
                (x.contiguous(memory_format=memory_format) if x.dim() == 4 else x, y.to(device))
            )
    return itertools.cycle(pool)


class EndlessShuffle(torch.utils.data.Sampler):
    """Shuffled indices, one permutation after another, with no end.

    A DataLoader restarts its workers' queues at every epoch end, which stalls the loop for a
    moment; in a short measurement one such stall weighs far more than in a long training, so
    gpulens measures the steady state and never ends an epoch. In a distributed run every
    process draws the same permutation and takes every ``world_size``-th index from ``rank``
    on, so the processes read disjoint files.
    """

    def __init__(self, n: int, seed: int = 0, rank: int = 0, world_size: int = 1):
        self.n = n
        self.seed = seed
        self.rank = rank
        self.world_size = world_size

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed)
        while True:
            yield from torch.randperm(self.n, generator=g)[self.rank :: self.world_size].tolist()


def oom_message(batch_size: int, device: torch.device | str) -> str:
    return (
        f"CUDA out of memory at batch size {batch_size} on {device}: lower --batch-size "
        f"(try {max(1, batch_size // 2)}) or use --precision bf16"
    )


@dataclass
class Prepared:
    """A model ready to train and the batches to feed it."""

    step_fn: Callable[[Any, Any], Any]
    batches: Iterator
    memory_format: torch.memory_format
    # The effective config with what building learnt: the optimizer, the dataset, the length
    # of a paired cold run.
    effective: EffectiveTrainConfig
    dataset: Any = None  # the loader's dataset (None for batches made on the device)


def require_one_batch(eff, n_samples: int, world_size: int = 1) -> None:
    """UsageError where ``n_samples`` make less than one batch for each of ``world_size``
    processes (a loader with drop_last would yield nothing)."""
    if n_samples < eff.batch_size * world_size:
        raise UsageError(
            f"dataset {eff.data} has {n_samples} samples, fewer than one batch of "
            f"{eff.batch_size} per process: make more data or lower --batch-size"
        )


def build_loader(
    spec: WorkloadSpec,
    eff: EffectiveTrainConfig,
    device: torch.device,
    timing_dir: Path | None = None,
    rank: int = 0,
    world_size: int = 1,
    skip_log: Path | None = None,
    local_rank: int | None = None,
) -> torch.utils.data.DataLoader:
    """The data loader a run over on-disk data uses: the workload's dataset (with any storage
    emulation), ``eff.workers`` worker processes, pinned memory on a GPU, endless shuffle.
    With ``eff.skip_bad_samples`` images that cannot be decoded are replaced, each skip
    logged to ``skip_log`` (the run record's ``skipped_samples.tsv``). ``local_rank`` (this
    host's, where ``rank`` is global over several nodes) picks the CPUs of pinned workers."""
    from gpulens.data.datasets import build_dataset, collate_with_timing
    from gpulens.data.storage import StorageEmulation

    batch = eff.batch_size
    storage = StorageEmulation(eff.storage_latency_s, eff.storage_bandwidth_bytes_per_s)
    dataset = build_dataset(
        spec,
        eff.data,
        n_synthetic=0,
        storage=storage if storage.active else None,
        timing_dir=timing_dir,
        skip_bad_samples=eff.skip_bad_samples,
        skip_log=skip_log,
    )
    require_one_batch(eff, len(dataset), world_size)
    workers = eff.workers
    sampler: torch.utils.data.Sampler = EndlessShuffle(len(dataset), eff.seed, rank, world_size)
    if eff.paired_cold_block:
        sampler = paired_sampler(dataset, eff)
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch,
        sampler=sampler,
        drop_last=True,
        num_workers=workers,
        multiprocessing_context=loader_start_method() if workers > 0 else None,
        pin_memory=device.type == "cuda",
        prefetch_factor=LOADER_PREFETCH if workers > 0 else None,
        collate_fn=collate_with_timing(timing_dir) if timing_dir else None,
        worker_init_fn=worker_init(
            eff.worker_affinity, workers, rank if local_rank is None else local_rank
        ),
    )


def loader_start_method() -> str:
    """How the loader's workers start: the platform's default (fork on Linux up to Python
    3.13), as in a plain script or a torchrun rank. A process started by spawn, as each rank of
    ``--gpus N`` is, would otherwise spawn its workers too, each re-importing torch: a loader
    unlike the one measured on one GPU. (On an H200 pair a plain DDP job's loader took 90 s to
    spawn 8 workers and 0.1 s to fork them; gpulens's 2-GPU JPEG runs went from 92-118 s to
    their measured window to 23-33 s.)"""
    return multiprocessing.get_all_start_methods()[0]


def paired_sampler(dataset, eff: EffectiveTrainConfig) -> torch.utils.data.Sampler:
    """The sampler of a paired cold run; storage emulation, if any, slows the cold half only."""
    from gpulens.data.paired import PairedColdSampler, cold_mask
    from gpulens.data.prep_timing import InstrumentedImageFolder

    if not isinstance(dataset, InstrumentedImageFolder):
        raise UsageError("paired cold reading needs an image folder dataset (one file per sample)")
    cold = cold_mask(len(dataset), eff.seed)
    dataset.emulate_only(cold)
    return PairedColdSampler(
        cold,
        eff.batch_size,
        eff.workers,
        eff.paired_cold_block,
        eff.seed,
        reuse_cold=dataset.storage is not None,
    )


def paired_facts(loader: torch.utils.data.DataLoader) -> dict[str, Any]:
    """What the analysis of a paired cold run needs to draw the same cold half again, and how
    long the run lasts; nothing for other loaders."""
    from gpulens.data.paired import PairedColdSampler

    if not isinstance(loader.sampler, PairedColdSampler):
        return {}
    return {
        "paired_cold_samples": len(loader.dataset),
        "paired_cold_max_steps": loader.sampler.max_batches(),
    }


def prepare(
    spec: WorkloadSpec,
    eff: EffectiveTrainConfig,
    device: torch.device,
    timing_dir: Path | None,
    rank: int = 0,
    world_size: int = 1,
    skip_log: Path | None = None,
    local_rank: int | None = None,
) -> Prepared:
    """Build the model, optimizer and batch source; wraps the model in DDP when a process
    group is up. ``Prepared.effective`` is ``eff`` with the optimizer and the dataset added.
    ``skip_log``: where the loader logs the bad samples it skips (see :func:`build_loader`)."""
    cuda = device.type == "cuda"
    batch = eff.batch_size
    memory_format = memory_format_for(eff.channels_last)
    model = model_for(spec, device, eff.channels_last)
    optimizer = optimizer_for(spec, model)
    if world_size > 1:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(
            model,
            device_ids=[device.index] if cuda else None,
            bucket_cap_mb=eff.ddp_bucket_mb or 25,
        )
    built: dict[str, Any] = {"optimizer": type(optimizer).__name__}
    if eff.data == "synthetic":
        batches = synthetic_batches(spec, batch, device, eff.seed + rank, memory_format)
        built["dataset"] = {"kind": "synthetic_on_device", "pool_batches": SYNTHETIC_POOL_BATCHES}
    else:
        from gpulens.data.datasets import describe_dataset

        loader = build_loader(spec, eff, device, timing_dir, rank, world_size, skip_log, local_rank)
        batches = iter(loader)
        built.update(paired_facts(loader), dataset=describe_dataset(eff.data))
    step_fn = training_step(spec, model, optimizer, device, eff.precision)
    dataset = None if eff.data == "synthetic" else loader.dataset
    return Prepared(step_fn, batches, memory_format, eff.with_built(**built), dataset)

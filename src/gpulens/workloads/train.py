"""The instrumented training loop behind ``gpulens run WORKLOAD`` and ``gpulens demo``.

The benchmark owns timing; the workload owns the model (MLPerf LoadGen's split). Requested and
effective settings are both recorded.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from gpulens.data.affinity import WORKER_AFFINITIES, worker_init
from gpulens.data.bad_samples import SKIPPED_SAMPLES_FILE, read_skipped
from gpulens.errors import RuntimeFailure, UsageError
from gpulens.probes.environment import capture_environment
from gpulens.probes.gpu_specs import peak_flops
from gpulens.probes.monitor import Monitor, ProbeSpec
from gpulens.probes.nvml.inventory import describe_gpus
from gpulens.probes.steps import STEPS_SCHEMA, StepTimer
from gpulens.probes.summary import summarize_gpu, summarize_host
from gpulens.record.writer import RunWriter
from gpulens.stats import rate_ci95, throughput_ci
from gpulens.workloads.devices import nvml_index_for, resolve_device
from gpulens.workloads.models import WorkloadSpec, get_workload

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "bf16", "fp16")
DEFAULT_STEPS = 100
# With --until-ci and no budget, stop after this long whatever the interval.
DEFAULT_UNTIL_CI_BUDGET_S = 600.0
SYNTHETIC_POOL_BATCHES = 4
NCCL_TRANSPORTS = ("default", "socket")
LOADER_PREFETCH = 2  # batches each data-loader worker prepares ahead (PyTorch's default)


@dataclass
class TrainConfig:
    """What the user asked for. ``None`` means "gpulens chooses"; the choice lands in the
    effective config."""

    workload: str
    batch_size: int | None = None
    steps: int | None = None
    duration_s: float | None = None
    warmup_steps: int | None = None
    device: str | None = None
    precision: str = "fp32"
    workers: int | None = None
    data: str = "synthetic"
    until_ci_pct: float | None = None
    sample_hz: float = 10.0
    count_flops: bool = True
    channels_last: bool | None = None
    seed: int = 0
    name: str | None = None
    # Slow-storage emulation in the dataset reader (what-if runs, validation of attributions).
    storage_latency_s: float = 0.0
    storage_bandwidth_bytes_per_s: float | None = None
    # Time read, decode, augment and collate in the loader workers (series prep_w*).
    prep_timing: bool = False
    # Data-parallel training (DDP): one process per GPU, each with ``batch_size`` samples.
    gpus: int = 1
    # NCCL transport between the GPUs: "default" (P2P/NVLink where NCCL finds it) or "socket"
    # (no P2P, no shared memory: NCCL's network transport over TCP, as between hosts).
    nccl_transport: str = "default"
    ddp_bucket_mb: float | None = None
    # Loader workers: "os" (where the scheduler puts them) or "cores" (one physical core each).
    worker_affinity: str = "os"
    # Paired cold reading (``gpulens stalls``): the loader workers alternate, every this many
    # samples, between the half of the files kept in the page cache and the other half, which
    # the caller evicted (or which storage emulation slows down); the run ends when that half
    # is used up. Needs an image folder and prep timing.
    paired_cold_block: int | None = None
    # Images that cannot be decoded: stop with an error naming the file (False), or put the
    # next readable image in their place and count them in the summary (True).
    skip_bad_samples: bool = False

    def __post_init__(self) -> None:
        if self.batch_size is not None and self.batch_size <= 0:
            raise UsageError(f"--batch-size must be a positive integer, got {self.batch_size}")
        if self.steps is not None and self.steps <= 0:
            raise UsageError(f"--steps must be a positive integer, got {self.steps}")
        if self.duration_s is not None and self.duration_s <= 0:
            raise UsageError(f"--duration must be positive seconds, got {self.duration_s}")
        if self.steps is not None and self.duration_s is not None:
            raise UsageError("give either --steps or --duration, not both")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise UsageError(f"--warmup must be zero or more steps, got {self.warmup_steps}")
        if self.precision not in PRECISIONS:
            raise UsageError(
                f"unknown precision '{self.precision}': use one of {', '.join(PRECISIONS)}"
            )
        if self.workers is not None and self.workers < 0:
            raise UsageError(f"--workers must be zero or more, got {self.workers}")
        if self.until_ci_pct is not None and not 0 < self.until_ci_pct < 100:
            raise UsageError(
                f"--until-ci must be a percentage in (0, 100), got {self.until_ci_pct}"
            )
        if self.sample_hz <= 0 or self.sample_hz > 1000:
            raise UsageError(f"--sample-hz must be in (0, 1000], got {self.sample_hz}")
        if self.gpus < 1:
            raise UsageError(f"--gpus must be 1 or more, got {self.gpus}")
        if self.nccl_transport not in NCCL_TRANSPORTS:
            raise UsageError(
                f"unknown NCCL transport '{self.nccl_transport}': use one of "
                f"{', '.join(NCCL_TRANSPORTS)}"
            )
        if self.gpus == 1 and self.nccl_transport != "default":
            raise UsageError("--nccl-transport needs --gpus 2 or more")
        if self.worker_affinity not in WORKER_AFFINITIES:
            raise UsageError(
                f"unknown worker affinity '{self.worker_affinity}': use one of "
                f"{', '.join(WORKER_AFFINITIES)}"
            )
        if self.ddp_bucket_mb is not None and self.ddp_bucket_mb <= 0:
            raise UsageError(f"--ddp-bucket-mb must be positive, got {self.ddp_bucket_mb}")
        if self.data == "synthetic" and (
            self.storage_latency_s or self.storage_bandwidth_bytes_per_s
        ):
            raise UsageError("storage emulation needs on-disk data: give --data PATH")
        if self.paired_cold_block is not None:
            if self.paired_cold_block < 1:
                raise UsageError(
                    f"paired_cold_block must be 1 or more samples, got {self.paired_cold_block}"
                )
            if self.data == "synthetic" or not self.prep_timing or self.gpus > 1:
                raise UsageError(
                    "paired cold reading needs on-disk data, prep timing and one process"
                )
        if self.data != "synthetic" and not Path(self.data).expanduser().exists():
            raise UsageError(
                f"dataset path {self.data} does not exist: make one with "
                f"`gpulens data make images --out {self.data} --n 1000` or use --data synthetic"
            )


@dataclass
class TrainResult:
    run_id: str
    record_dir: Path
    summary: dict[str, Any]


ProgressFn = Callable[[int, int | None, float, dict[str, Any]], None]


def _default_workers(data: str) -> int:
    if data == "synthetic":
        return 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(8, (cpus or 2) - 1))


def _optimizer(spec: WorkloadSpec, model: torch.nn.Module) -> torch.optim.Optimizer:
    if spec.task == "language_model" or spec.name.startswith("vit"):
        return torch.optim.AdamW(model.parameters(), lr=3e-4)
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def _synthetic_batches(
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


def _autocast(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def _peak_precision(spec: WorkloadSpec, precision: str) -> str:
    if precision != "fp32":
        return precision
    conv = spec.task == "image_classification" and not spec.name.startswith("vit")
    if (conv and torch.backends.cudnn.allow_tf32) or torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "fp32"


def resolve_config(config: TrainConfig, spec: WorkloadSpec, device: torch.device) -> dict[str, Any]:
    """The effective config: every choice left to gpulens made."""
    if device.type == "cpu" and config.precision == "fp16":
        raise UsageError("fp16 training needs a GPU: use --precision bf16 or fp32 on the CPU")
    if config.until_ci_pct is not None:
        steps, duration = (
            config.steps,
            config.duration_s or (None if config.steps else DEFAULT_UNTIL_CI_BUDGET_S),
        )
    else:
        steps = config.steps if config.steps or config.duration_s else DEFAULT_STEPS
        duration = config.duration_s
    workers = config.workers if config.workers is not None else _default_workers(config.data)
    warmup = config.warmup_steps
    if warmup is None:
        warmup = min(10, max(2, (steps or 50) // 10))
        if config.data != "synthetic":
            # The loader's queue starts full (workers x prefetch batches) and would hide a data
            # bottleneck from the first measured steps: drain it during warm-up.
            warmup = max(warmup, 2 * max(workers, 1) * LOADER_PREFETCH)
    channels_last = config.channels_last
    if channels_last is None:
        channels_last = device.type == "cuda" and spec.task == "image_classification"
    return {
        "workload": spec.name,
        "task": spec.task,
        "batch_size": config.batch_size or spec.default_batch_size,
        "steps": steps,
        "duration_s": duration,
        "warmup_steps": warmup,
        "device": str(device),
        "precision": config.precision,
        "workers": workers,
        "data": config.data,
        "until_ci_pct": config.until_ci_pct,
        "sample_hz": config.sample_hz,
        "count_flops": config.count_flops,
        "channels_last": bool(channels_last),
        "storage_latency_s": config.storage_latency_s,
        "storage_bandwidth_bytes_per_s": config.storage_bandwidth_bytes_per_s,
        "prep_timing": config.prep_timing,
        "gpus": config.gpus,
        "nccl_transport": config.nccl_transport,
        "ddp_bucket_mb": config.ddp_bucket_mb,
        "worker_affinity": config.worker_affinity,
        "paired_cold_block": config.paired_cold_block,
        "skip_bad_samples": config.skip_bad_samples,
        "seed": config.seed,
        "optimizer": None,  # filled once built
    }


def run_training(
    config: TrainConfig,
    runs_root: Path,
    progress: ProgressFn | None = None,
    kind: str = "train",
    role: str | None = None,
) -> TrainResult:
    """Train ``config.workload`` under the monitor and write a complete run record; ``role``
    is the run's part in an experiment (``stalls:cached``), stored in run.json."""
    spec = get_workload(config.workload)
    if config.gpus > 1:
        from gpulens.workloads.distributed import run_distributed

        return run_distributed(config, spec, runs_root, progress, kind, role)
    device = resolve_device(config.device)
    eff = resolve_config(config, spec, device)
    torch.manual_seed(config.seed)

    # The record exists before the slow start-up (NVML, the environment, the model), so a run
    # stopped there still leaves a record that says so.
    writer = RunWriter(
        runs_root,
        kind=kind,
        name=config.name or f"{spec.name}-{device.type}-b{eff['batch_size']}",
        requested_config=asdict(config),
        role=role,
    )
    with finishing(writer, eff["batch_size"], device):
        writer.update(environment=capture_environment(describe_gpus()))
        nvml_index = nvml_index_for(device)
        probes = [ProbeSpec("host", {"root_pid": os.getpid()})]
        if nvml_index is not None:
            probes.insert(0, ProbeSpec("gpu", {"indices": [nvml_index]}))
        else:
            writer.update(unsupported={"gpu": "the run used the CPU"})
        summary = _train(spec, eff, device, writer, probes, nvml_index, progress)
    return TrainResult(writer.run_id, writer.dir, summary)


@contextlib.contextmanager
def finishing(writer: RunWriter, batch_size: int, device: torch.device | str):
    """Close the run record on every exit path: finished, failed (an out-of-memory error
    becomes a one-line hint) or killed by Ctrl-C."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as exc:
        message = oom_message(batch_size, device)
        writer.finish("failed", error=message)
        failure = RuntimeFailure(message)
        failure.gpulens_record_dir = writer.dir
        raise failure from exc
    except BaseException as exc:
        interrupted = isinstance(exc, KeyboardInterrupt)
        writer.finish(
            "killed" if interrupted else "failed",
            error="interrupted (Ctrl-C)" if interrupted else str(exc) or type(exc).__name__,
        )
        with contextlib.suppress(AttributeError, TypeError):
            exc.gpulens_record_dir = writer.dir  # so the caller can store what was left
        raise
    writer.finish("finished")


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


def build_loader(
    spec: WorkloadSpec,
    eff: dict[str, Any],
    device: torch.device,
    timing_dir: Path | None = None,
    rank: int = 0,
    world_size: int = 1,
    skip_log: Path | None = None,
) -> torch.utils.data.DataLoader:
    """The data loader a run over on-disk data uses: the workload's dataset (with any storage
    emulation), ``eff["workers"]`` worker processes, pinned memory on a GPU, endless shuffle.
    With ``eff["skip_bad_samples"]`` images that cannot be decoded are replaced, each skip
    logged to ``skip_log`` (the run record's ``skipped_samples.tsv``)."""
    from gpulens.data.datasets import build_dataset, collate_with_timing
    from gpulens.data.storage import StorageEmulation

    batch = eff["batch_size"]
    storage = StorageEmulation(eff["storage_latency_s"], eff["storage_bandwidth_bytes_per_s"])
    dataset = build_dataset(
        spec, eff["data"], n_synthetic=0,
        storage=storage if storage.active else None, timing_dir=timing_dir,
        skip_bad_samples=bool(eff.get("skip_bad_samples")), skip_log=skip_log,
    )  # fmt: skip
    if len(dataset) < batch * world_size:
        raise UsageError(
            f"dataset {eff['data']} has {len(dataset)} samples, fewer than one batch of "
            f"{batch} per process: make more data or lower --batch-size"
        )
    workers = eff["workers"]
    sampler: torch.utils.data.Sampler = EndlessShuffle(len(dataset), eff["seed"], rank, world_size)
    if eff.get("paired_cold_block"):
        sampler = _paired_sampler(dataset, eff)
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch,
        sampler=sampler,
        drop_last=True,
        num_workers=workers,
        pin_memory=device.type == "cuda",
        prefetch_factor=LOADER_PREFETCH if workers > 0 else None,
        collate_fn=collate_with_timing(timing_dir) if timing_dir else None,
        worker_init_fn=worker_init(eff.get("worker_affinity", "os"), workers, rank),
    )


def _paired_sampler(dataset, eff: dict[str, Any]) -> torch.utils.data.Sampler:
    """The sampler of a paired cold run; storage emulation, if any, slows the cold half only."""
    from gpulens.data.paired import PairedColdSampler, cold_mask
    from gpulens.workloads.prep_timing import InstrumentedImageFolder

    if not isinstance(dataset, InstrumentedImageFolder):
        raise UsageError("paired cold reading needs an image folder dataset (one file per sample)")
    cold = cold_mask(len(dataset), eff["seed"])
    dataset.emulate_only(cold)
    sampler = PairedColdSampler(
        cold, eff["batch_size"], eff["workers"], eff["paired_cold_block"], eff["seed"],
        reuse_cold=dataset.storage is not None,
    )  # fmt: skip
    # What the analysis needs to draw the same cold half again, and how long it lasts.
    eff["paired_cold_samples"] = len(dataset)
    eff["paired_cold_max_steps"] = sampler.max_batches()
    return sampler


def prepare(
    spec: WorkloadSpec,
    eff: dict[str, Any],
    device: torch.device,
    timing_dir: Path | None,
    rank: int = 0,
    world_size: int = 1,
    skip_log: Path | None = None,
) -> Prepared:
    """Build the model, optimizer and batch source; wraps the model in DDP when a process
    group is up. Fills the effective config's ``optimizer`` and ``dataset``. ``skip_log``: where
    the loader logs the bad samples it skips (see :func:`build_loader`)."""
    cuda = device.type == "cuda"
    batch = eff["batch_size"]
    model = spec.build().to(device)
    memory_format = torch.channels_last if eff["channels_last"] else torch.contiguous_format
    if eff["channels_last"]:
        model = model.to(memory_format=memory_format)
    model.train()
    optimizer = _optimizer(spec, model)
    if world_size > 1:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(
            model,
            device_ids=[device.index] if cuda else None,
            bucket_cap_mb=eff.get("ddp_bucket_mb") or 25,
        )
    eff["optimizer"] = type(optimizer).__name__
    scaler = torch.amp.GradScaler(device.type) if eff["precision"] == "fp16" else None

    if eff["data"] == "synthetic":
        batches = _synthetic_batches(spec, batch, device, eff["seed"] + rank, memory_format)
        eff["dataset"] = {"kind": "synthetic_on_device", "pool_batches": SYNTHETIC_POOL_BATCHES}
    else:
        from gpulens.data.datasets import describe_dataset

        loader = build_loader(spec, eff, device, timing_dir, rank, world_size, skip_log)
        batches = iter(loader)
        eff["dataset"] = describe_dataset(eff["data"])

    def step_fn(x, y):
        with _autocast(device, eff["precision"]):
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

    return Prepared(step_fn, batches, memory_format)


@dataclass
class LoopResult:
    """What the measured loop saw: enough for the summary."""

    wall_measured_s: float
    t_measure0: float  # unix time of the measured window's start and end
    t_measure1: float
    stop_reason: str
    flops_per_step: float | None


class StopControl:
    """Agrees on when to stop across the processes of a distributed run: rank 0 decides and
    broadcasts its decision every ``every`` measured steps over a CPU (gloo) group, so no
    rank is left waiting in an all-reduce."""

    REASONS = ("", "steps", "duration", "until_ci", "data")

    def __init__(self, group, every: int = 10):
        self.group = group
        self.every = every

    def agree(self, reason: str | None) -> str | None:
        import torch.distributed as dist

        code = torch.tensor([self.REASONS.index(reason or "")], dtype=torch.int64)
        dist.broadcast(code, src=0, group=self.group)
        return self.REASONS[int(code.item())] or None

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group)


def measured_loop(
    prepared: Prepared,
    eff: dict[str, Any],
    device: torch.device,
    timer: StepTimer,
    progress: ProgressFn | None,
    samples_per_step: int,
    control: StopControl | None = None,
) -> LoopResult:
    """Warm up, then train until the step count, the time budget or the CI target is met."""
    cuda = device.type == "cuda"
    memory_format = prepared.memory_format
    batches, step_fn = prepared.batches, prepared.step_fn
    flops_per_step: float | None = None
    warmup, max_steps, budget_s = eff["warmup_steps"], eff["steps"], eff["duration_s"]
    t_measure0 = time.time()
    t_run0 = time.perf_counter()
    measure_start = None
    stop_reason = "steps"
    step = 0
    while True:
        timer.warmup_steps = warmup
        timer.begin_step()
        try:
            x, y = next(batches)
        except StopIteration:  # a paired cold run used up its cold files
            if measure_start is None:
                raise RuntimeFailure(
                    f"the data ran out after {step} of {warmup} warm-up steps: use more data"
                ) from None
            stop_reason = "data"
            break
        timer.batch_ready()
        if x.device != device:
            x = x.to(device, non_blocking=True, memory_format=memory_format)
            y = y.to(device, non_blocking=True)
        elif eff["channels_last"] and x.dim() == 4:
            x = x.contiguous(memory_format=memory_format)
        timer.copy_done()
        if step == 0 and eff["count_flops"] and control is None:
            flops_per_step = _count_flops(lambda x=x, y=y: step_fn(x, y))
        else:
            step_fn(x, y)
        timer.end_step(samples=samples_per_step)
        step += 1
        if step == warmup:
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            if control is not None:
                control.barrier()
            measure_start = time.perf_counter()
            t_measure0 = time.time()
        measured = step - warmup
        elapsed = time.perf_counter() - (measure_start or t_run0)
        if progress is not None:
            progress(step, (max_steps + warmup) if max_steps else None, elapsed, {})
        if measured <= 0:
            continue
        if max_steps is not None and measured >= max_steps:
            stop_reason = "steps"  # every rank counts the same steps: no need to agree
            break
        if control is not None and measured % control.every:
            continue
        wanted = None
        if budget_s is not None and elapsed >= budget_s:
            wanted = "duration"
        elif eff["until_ci_pct"] is not None and measured >= 20 and measured % 10 == 0:
            ci = throughput_ci(ci_step_times(timer.measured_rows()), samples_per_step)
            if ci is not None and ci.ci95_pct <= eff["until_ci_pct"]:
                wanted = "until_ci"
        if control is not None:
            wanted = control.agree(wanted)
        if wanted:
            stop_reason = wanted
            break
    if cuda:
        torch.cuda.synchronize(device)
    t_measure1 = time.time()
    wall_measured_s = time.perf_counter() - (measure_start or t_run0)
    return LoopResult(wall_measured_s, t_measure0, t_measure1, stop_reason, flops_per_step)


def _train(
    spec: WorkloadSpec,
    eff: dict[str, Any],
    device: torch.device,
    writer: RunWriter,
    probes: list[ProbeSpec],
    nvml_index: int | None,
    progress: ProgressFn | None,
) -> dict[str, Any]:
    timing_dir = writer.dir / "series" if eff["prep_timing"] else None
    prepared = prepare(spec, eff, device, timing_dir, skip_log=writer.dir / SKIPPED_SAMPLES_FILE)
    writer.update(effective_config=eff)
    cuda = device.type == "cuda"
    timer = StepTimer(writer.series("steps", STEPS_SCHEMA), cuda=cuda, warmup_steps=0)
    monitor = Monitor(writer, probes, hz=eff["sample_hz"])
    with monitor:
        loop = measured_loop(prepared, eff, device, timer, progress, eff["batch_size"])
        timer.finish()
    overhead = monitor.overhead()
    peak_mem = torch.cuda.max_memory_allocated(device) if cuda else None
    # The sampler's CPU share, and gpulens's own time on this training thread per step.
    costs = {**overhead.as_dict(), "tracking_us_per_step": timer.tracking_us_per_step()}
    return summarize_run(
        spec, eff, device, writer, timer.measured_rows(), costs, loop,
        [nvml_index] if nvml_index is not None else [], [peak_mem],
    )  # fmt: skip


def _count_flops(fn: Callable[[], Any]) -> float | None:
    """FLOPs of one training step (forward, backward, optimizer) by torch's flop counter."""
    try:
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            fn()
        return float(counter.get_total_flops())
    except Exception as exc:  # an op the counter does not know must not stop the run
        log.warning("could not count FLOPs: %s", exc)
        fn()
        return None


def _mean(values) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def ci_step_times(rows: list[dict[str, Any]]) -> list[float]:
    """Step times for the throughput's confidence interval: the GPU's (between consecutive
    step starts on the stream) where known, else the host's. The host runs ahead of an
    asynchronous GPU, so its first steps look fast and the step before a synchronize slow:
    edge effects that widen a short run's interval tenfold though the GPU's pace is steady."""
    gpu = [t for r in rows if (t := r.get("gpu_step_time_s")) is not None and t > 0]
    # Rows resolve in order, and the last one never has a GPU time (no next step start).
    if len(gpu) >= max(2, len(rows) - 1 - 8):
        return gpu
    return [r["step_time_s"] for r in rows if r["step_time_s"] is not None]


def summarize_run(
    spec: WorkloadSpec,
    eff: dict[str, Any],
    device: torch.device,
    writer: RunWriter,
    rows: list[dict[str, Any]],
    overhead: dict[str, Any],
    loop: LoopResult,
    nvml_indices: list[int],
    peak_mem_bytes: list[int | None],
    world_size: int = 1,
) -> dict[str, Any]:
    """The run's summary (written into run.json): throughput over all processes, phases of
    rank 0's steps, the first GPU's monitor means (all GPUs under ``gpus``), MFU per GPU."""
    batch = eff["batch_size"]
    samples_per_step = batch * world_size
    ci = throughput_ci(ci_step_times(rows), samples_per_step)
    samples = samples_per_step * len(rows)
    wall = loop.wall_measured_s
    # The point estimate comes from the bracketing synchronizes: exact for the whole window.
    tput = samples / wall if wall > 0 and rows else None
    phases = {
        "data_wait": _mean(r["data_wait_s"] for r in rows),
        "h2d": _mean(r["h2d_s"] for r in rows),
        "compute": _mean(r["compute_s"] for r in rows),
        "step": wall / len(rows) if rows else None,
    }
    gpu_summary = None
    per_gpu = []
    mfu = None
    flops_per_step = loop.flops_per_step
    if device.type == "cuda":
        gpu_df = writer.read_series("gpu")
        for i, index in enumerate(nvml_indices):
            s = summarize_gpu(gpu_df, loop.t_measure0, loop.t_measure1, index, samples // max(
                len(nvml_indices), 1)) or {}  # fmt: skip
            s["peak_mem_allocated_bytes"] = peak_mem_bytes[i] if i < len(peak_mem_bytes) else None
            per_gpu.append(s)
        gpu_summary = dict(per_gpu[0]) if per_gpu else {}
        gpu_summary["name"] = torch.cuda.get_device_name(device)
        peak = peak_flops(gpu_summary["name"], _peak_precision(spec, eff["precision"]))
        if flops_per_step and peak and phases["step"]:
            mfu = flops_per_step / phases["step"] / peak
        gpu_summary["peak_flops"] = peak
    host_summary = summarize_host(writer.read_series("host"), loop.t_measure0, loop.t_measure1)
    ci_pct = ci.ci95_pct if ci and math.isfinite(ci.ci95_pct) else None
    skipped = _skipped(eff, writer.dir / SKIPPED_SAMPLES_FILE)
    summary = {
        "workload": spec.name,
        "device": str(device) if world_size == 1 else f"{world_size}x {device.type}",
        "gpus": world_size if device.type == "cuda" else 0,
        "processes": world_size,
        "precision": eff["precision"],
        "batch_size": batch,
        "global_batch_size": samples_per_step,
        "workers": eff["workers"] if eff["data"] != "synthetic" else 0,
        "measured_steps": len(rows),
        "warmup_steps": eff["warmup_steps"],
        "stop_reason": loop.stop_reason,
        "measured_wall_s": wall,
        "measured_start_unix_s": loop.t_measure0,
        "measured_end_unix_s": loop.t_measure1,
        "throughput_samples_per_s": tput,
        "throughput_ci95_pct": ci_pct,
        "throughput_ci95_samples_per_s": rate_ci95(tput, ci_pct),
        "phases_s": phases,
        "flops_per_sample": flops_per_step / batch if flops_per_step else None,
        "mfu": mfu,
        "gpu": gpu_summary,
        "per_gpu": per_gpu if world_size > 1 else None,
        "host": host_summary,
        **skipped,
        **overhead,
    }
    writer.update(summary=summary, effective_config=eff)
    return summary


def _skipped(eff: dict[str, Any], skip_log: Path) -> dict[str, Any]:
    """The summary's count of bad samples skipped (warm-up included): None where nothing could
    be skipped (synthetic data, or skipping off: a bad sample then stops the run)."""
    if eff["data"] == "synthetic" or not eff.get("skip_bad_samples"):
        return {"skipped_samples": None, "skipped_files_total": None, "skipped_files": None}
    got = read_skipped(skip_log)
    if got["skipped_samples"]:
        first = ", ".join(got["skipped_files"])
        n, files = got["skipped_samples"], got["skipped_files_total"]
        log.warning("skipped %d bad samples (%d files, first: %s): %s", n, files, first, skip_log)
    return got

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
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from gpulens.errors import RuntimeFailure, UsageError
from gpulens.probes.environment import capture_environment
from gpulens.probes.gpu import describe_gpus
from gpulens.probes.gpu_specs import peak_flops
from gpulens.probes.monitor import Monitor, ProbeSpec
from gpulens.probes.steps import STEPS_SCHEMA, StepTimer
from gpulens.probes.summary import summarize_gpu, summarize_host
from gpulens.record.writer import RunWriter
from gpulens.stats import throughput_ci
from gpulens.workloads.devices import nvml_index_for, resolve_device
from gpulens.workloads.models import WorkloadSpec, get_workload

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "bf16", "fp16")
DEFAULT_STEPS = 100
# With --until-ci and no budget, stop after this long whatever the interval.
DEFAULT_UNTIL_CI_BUDGET_S = 600.0
SYNTHETIC_POOL_BATCHES = 4
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
        if self.data == "synthetic" and (
            self.storage_latency_s or self.storage_bandwidth_bytes_per_s
        ):
            raise UsageError("storage emulation needs on-disk data: give --data PATH")
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
    gpulens measures the steady state and never ends an epoch.
    """

    def __init__(self, n: int, seed: int = 0):
        self.n = n
        self.seed = seed

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed)
        while True:
            yield from torch.randperm(self.n, generator=g).tolist()


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


def _resolve(config: TrainConfig, spec: WorkloadSpec, device: torch.device) -> dict[str, Any]:
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
        "seed": config.seed,
        "optimizer": None,  # filled once built
    }


def run_training(
    config: TrainConfig,
    runs_root: Path,
    progress: ProgressFn | None = None,
    kind: str = "train",
) -> TrainResult:
    """Train ``config.workload`` under the monitor and write a complete run record."""
    spec = get_workload(config.workload)
    device = resolve_device(config.device)
    eff = _resolve(config, spec, device)
    torch.manual_seed(config.seed)

    gpus = describe_gpus()
    writer = RunWriter(
        runs_root,
        kind=kind,
        name=config.name or f"{spec.name}-{device.type}-b{eff['batch_size']}",
        requested_config=asdict(config),
        environment=capture_environment(gpus),
    )
    nvml_index = nvml_index_for(device)
    probes = [ProbeSpec("host", {"root_pid": os.getpid()})]
    if nvml_index is not None:
        probes.insert(0, ProbeSpec("gpu", {"indices": [nvml_index]}))
    else:
        writer.update(unsupported={"gpu": "the run used the CPU"})
    try:
        summary = _train(spec, eff, device, writer, probes, nvml_index, progress)
    except torch.cuda.OutOfMemoryError as exc:
        bs = eff["batch_size"]
        message = (
            f"CUDA out of memory at batch size {bs} on {device}: lower --batch-size "
            f"(try {max(1, bs // 2)}) or use --precision bf16"
        )
        writer.finish("failed", error=message)
        raise RuntimeFailure(message) from exc
    except KeyboardInterrupt:
        writer.finish("killed", error="interrupted (Ctrl-C)")
        raise
    except BaseException as exc:
        writer.finish("failed", error=str(exc) or type(exc).__name__)
        raise
    writer.finish("finished")
    return TrainResult(writer.run_id, writer.dir, summary)


def _train(
    spec: WorkloadSpec,
    eff: dict[str, Any],
    device: torch.device,
    writer: RunWriter,
    probes: list[ProbeSpec],
    nvml_index: int | None,
    progress: ProgressFn | None,
) -> dict[str, Any]:
    cuda = device.type == "cuda"
    batch = eff["batch_size"]
    model = spec.build().to(device)
    memory_format = torch.channels_last if eff["channels_last"] else torch.contiguous_format
    if eff["channels_last"]:
        model = model.to(memory_format=memory_format)
    model.train()
    optimizer = _optimizer(spec, model)
    eff["optimizer"] = type(optimizer).__name__
    scaler = torch.amp.GradScaler(device.type) if eff["precision"] == "fp16" else None

    if eff["data"] == "synthetic":
        batches = _synthetic_batches(spec, batch, device, eff["seed"], memory_format)
        eff["dataset"] = {"kind": "synthetic_on_device", "pool_batches": SYNTHETIC_POOL_BATCHES}
    else:
        from gpulens.workloads.datasets import (
            build_dataset,
            collate_with_timing,
            describe_dataset,
        )
        from gpulens.workloads.storage import StorageEmulation

        storage = StorageEmulation(eff["storage_latency_s"], eff["storage_bandwidth_bytes_per_s"])
        timing_dir = writer.dir / "series" if eff["prep_timing"] else None
        dataset = build_dataset(
            spec, eff["data"], n_synthetic=0,
            storage=storage if storage.active else None, timing_dir=timing_dir,
        )  # fmt: skip
        if len(dataset) < batch:
            raise UsageError(
                f"dataset {eff['data']} has {len(dataset)} samples, fewer than one batch of "
                f"{batch}: make more data or lower --batch-size"
            )
        workers = eff["workers"]
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=batch,
            sampler=EndlessShuffle(len(dataset), eff["seed"]),
            drop_last=True,
            num_workers=workers,
            pin_memory=cuda,
            prefetch_factor=LOADER_PREFETCH if workers > 0 else None,
            collate_fn=collate_with_timing(timing_dir) if timing_dir else None,
        )
        batches = iter(loader)
        eff["dataset"] = describe_dataset(eff["data"])
    writer.update(effective_config=eff)

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

    timer = StepTimer(writer.series("steps", STEPS_SCHEMA), cuda=cuda, warmup_steps=0)
    flops_per_step: float | None = None
    monitor = Monitor(writer, probes, hz=eff["sample_hz"])
    warmup, max_steps, budget_s = eff["warmup_steps"], eff["steps"], eff["duration_s"]
    t_measure0 = t_measure1 = time.time()
    t_run0 = time.perf_counter()
    measure_start = None
    ci = None
    stop_reason = "steps"
    with monitor:
        step = 0
        while True:
            timer.warmup_steps = warmup
            timer.begin_step()
            x, y = next(batches)
            timer.batch_ready()
            if x.device != device:
                x = x.to(device, non_blocking=True, memory_format=memory_format)
                y = y.to(device, non_blocking=True)
            elif eff["channels_last"] and x.dim() == 4:
                x = x.contiguous(memory_format=memory_format)
            timer.copy_done()
            if step == 0 and eff["count_flops"]:
                flops_per_step = _count_flops(lambda x=x, y=y: step_fn(x, y))
            else:
                step_fn(x, y)
            timer.end_step(samples=batch)
            step += 1
            if step == warmup:
                if cuda:
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                measure_start = time.perf_counter()
                t_measure0 = time.time()
            measured = step - warmup
            elapsed = time.perf_counter() - (measure_start or t_run0)
            if progress is not None:
                progress(step, (max_steps + warmup) if max_steps else None, elapsed, {})
            if measured <= 0:
                continue
            if max_steps is not None and measured >= max_steps:
                stop_reason = "steps"
                break
            if budget_s is not None and elapsed >= budget_s:
                stop_reason = "duration"
                break
            if eff["until_ci_pct"] is not None and measured >= 20 and measured % 10 == 0:
                times = [r["step_time_s"] for r in timer.measured_rows() if r["step_time_s"]]
                ci = throughput_ci(times, batch)
                if ci is not None and ci.ci95_pct <= eff["until_ci_pct"]:
                    stop_reason = "until_ci"
                    break
        if cuda:
            torch.cuda.synchronize(device)
        t_measure1 = time.time()
        wall_measured_s = time.perf_counter() - (measure_start or t_run0)
        timer.finish()
    overhead = monitor.overhead()
    return _summarize(
        spec, eff, device, writer, timer, overhead, flops_per_step, nvml_index,
        t_measure0, t_measure1, wall_measured_s, stop_reason,
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


def _summarize(
    spec, eff, device, writer, timer, overhead, flops_per_step, nvml_index,
    t_measure0, t_measure1, wall_measured_s, stop_reason,
) -> dict[str, Any]:  # fmt: skip
    rows = timer.measured_rows()
    batch = eff["batch_size"]
    step_times = [r["step_time_s"] for r in rows if r["step_time_s"] is not None]
    ci = throughput_ci(step_times, batch)
    samples = batch * len(rows)
    # The point estimate comes from the bracketing synchronizes: exact for the whole window.
    tput = samples / wall_measured_s if wall_measured_s > 0 and rows else None
    phases = {
        "data_wait": _mean(r["data_wait_s"] for r in rows),
        "h2d": _mean(r["h2d_s"] for r in rows),
        "compute": _mean(r["compute_s"] for r in rows),
        "step": wall_measured_s / len(rows) if rows else None,
    }
    gpu_summary = None
    mfu = None
    if device.type == "cuda":
        gpu_df = writer.read_series("gpu")
        gpu_summary = summarize_gpu(gpu_df, t_measure0, t_measure1, nvml_index or 0, samples) or {}
        gpu_summary["name"] = torch.cuda.get_device_name(device)
        gpu_summary["peak_mem_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        peak = peak_flops(gpu_summary["name"], _peak_precision(spec, eff["precision"]))
        if flops_per_step and peak and phases["step"]:
            mfu = flops_per_step / phases["step"] / peak
        gpu_summary["peak_flops"] = peak
    host_summary = summarize_host(writer.read_series("host"), t_measure0, t_measure1)
    summary = {
        "workload": spec.name,
        "device": str(device),
        "precision": eff["precision"],
        "batch_size": batch,
        "workers": eff["workers"] if eff["data"] != "synthetic" else 0,
        "measured_steps": len(rows),
        "warmup_steps": eff["warmup_steps"],
        "stop_reason": stop_reason,
        "measured_wall_s": wall_measured_s,
        "throughput_samples_per_s": tput,
        "throughput_ci95_pct": ci.ci95_pct if ci and math.isfinite(ci.ci95_pct) else None,
        "phases_s": phases,
        "flops_per_sample": flops_per_step / batch if flops_per_step else None,
        "mfu": mfu,
        "gpu": gpu_summary,
        "host": host_summary,
        **overhead.as_dict(),
    }
    writer.update(summary=summary, effective_config=eff)
    return summary

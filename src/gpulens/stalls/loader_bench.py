"""The data loader alone: how fast it delivers batches to the device with no model to feed.

This is the loader's capacity, measured end to end (read, decode, augment, collate, hand-over
between processes, pinning and the copy to the device), which the workers' own timers cannot
see in full. The stall validation uses it as the expected pace of a training run that waits on
its loader.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gpulens.errors import UsageError
from gpulens.stats import throughput_ci
from gpulens.workloads.config import LOADER_PREFETCH, TrainConfig, resolve_config
from gpulens.workloads.devices import resolve_device
from gpulens.workloads.models import get_workload
from gpulens.workloads.recipe import build_loader
from gpulens.workloads.schedule import ScheduledLoop

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoaderPace:
    """Samples per second the loader delivered, with the 95% CI half-width in percent."""

    samples_per_s: float
    ci95_pct: float
    batches: int
    workers: int
    batch_size: int
    # With prep timing: the workers' timed work per sample (read, decode, augment, collate),
    # and what else each worker spends per sample (handing batches over, fetching indices).
    busy_s_per_sample: float | None = None
    handover_s_per_sample: float | None = None

    @property
    def per_sample_s(self) -> float:
        return 1.0 / self.samples_per_s


def measure_loader(
    config: TrainConfig, duration_s: float = 10.0, timing_dir: Path | None = None
) -> LoaderPace:
    """Iterate the loader that ``run_training(config)`` would build, copying every batch to
    the device, for ``duration_s`` after a warm-up that drains the prefetch queue. With
    ``timing_dir`` the workers time their stages there, and the result splits each worker's
    time per sample into timed work and hand-over."""
    if config.data == "synthetic":
        raise UsageError("the loader pace needs on-disk data: give --data PATH")
    if duration_s <= 0:
        raise UsageError(f"the loader measurement needs a positive duration, got {duration_s}")
    spec = get_workload(config.workload)
    device = resolve_device(config.device)
    eff = resolve_config(config, spec, device)
    loader = build_loader(spec, eff, device, timing_dir)
    workers = eff.workers
    # As in a training run: the queue starts full and would flatter the first batches.
    warmup = 2 * max(workers, 1) * LOADER_PREFETCH
    batches = iter(loader)
    fetch = functools.partial(_next_to_device, batches, device)
    # A closed loop: each batch is asked for as soon as the last one is on the device.
    loop = ScheduledLoop()
    try:
        for _ in range(warmup):
            fetch()
        loop.run(fetch, time.time() + duration_s, min_steps=2)
    finally:
        del fetch, batches  # shuts the worker processes down (their timing rows are flushed)
    times_s, t_start_unix_s, t_end_unix_s = loop.step_times_s, loop.start_unix_s, loop.end_unix_s
    ci = throughput_ci(times_s, eff.batch_size)
    if ci is None:  # cannot happen: the loop times two batches at least
        raise RuntimeError("the loader delivered no batches")
    log.info("loader alone: %.1f samples/s ± %.1f%%", ci.samples_per_s, ci.ci95_pct)
    busy_s = handover_s = None
    if timing_dir is not None and workers > 0:
        from gpulens.stalls.prep_summary import summarize_prep

        busy_s = summarize_prep(
            timing_dir, ci.samples_per_s, start_unix_s=t_start_unix_s, end_unix_s=t_end_unix_s
        )["prep_s_per_sample"]
        if busy_s is not None:
            handover_s = max(0.0, workers / ci.samples_per_s - busy_s)
    return LoaderPace(
        ci.samples_per_s, ci.ci95_pct, len(times_s), workers, eff.batch_size, busy_s,
        handover_s,
    )  # fmt: skip


def _next_to_device(batches, device: torch.device) -> None:
    x, y = next(batches)
    x = x.to(device, non_blocking=True)
    y = y.to(device, non_blocking=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)

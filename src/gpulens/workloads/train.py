"""The instrumented training run behind ``gpulens run WORKLOAD`` and ``gpulens demo``.

The benchmark owns timing; the workload owns the model (MLPerf LoadGen's split). Requested and
effective settings are both recorded. The parts: :mod:`~gpulens.workloads.config` (what was
asked for and what runs), :mod:`~gpulens.workloads.recipe` (how a model trains),
:mod:`~gpulens.workloads.loop` (the measured loop) and :mod:`~gpulens.workloads.run_summary`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from gpulens.data.bad_samples import SKIPPED_SAMPLES_FILE
from gpulens.probes.monitor import ProbeSpec
from gpulens.probes.steps import StepTimer
from gpulens.record.schema import STEPS_SCHEMA
from gpulens.run import RunResult, RunSession, measured_run
from gpulens.workloads.config import EffectiveTrainConfig, TrainConfig, resolve_config
from gpulens.workloads.devices import nvml_index_for, resolve_device
from gpulens.workloads.loop import ProgressFn, measured_loop
from gpulens.workloads.models import WorkloadSpec, get_workload
from gpulens.workloads.recipe import oom_message, prepare
from gpulens.workloads.run_summary import summarize_run

log = logging.getLogger(__name__)


def run_training(
    config: TrainConfig,
    runs_root: Path,
    progress: ProgressFn | None = None,
    kind: str = "train",
    role: str | None = None,
    metrics=None,
) -> RunResult:
    """Train ``config.workload`` under the monitor and write a complete run record; ``role``
    is the run's part in an experiment (``stalls:cached``), stored in run.json; ``metrics``
    (a :class:`gpulens.web.metrics.MetricsEndpoint`) serves Prometheus metrics meanwhile."""
    spec = get_workload(config.workload)
    if config.gpus > 1 or config.nodes is not None:
        from gpulens.workloads.distributed import run_distributed

        return run_distributed(config, spec, runs_root, progress, kind, role, metrics)
    device = resolve_device(config.device)
    eff = resolve_config(config, spec, device)
    torch.manual_seed(config.seed)

    # The record exists before the slow start-up (NVML, the environment, the model), so a run
    # stopped there still leaves a record that says so.
    with measured_run(
        runs_root,
        kind=kind,
        name=config.name or f"{spec.name}-{device.type}-b{eff.batch_size}",
        requested_config=asdict(config),
        role=role,
        metrics=metrics,
    ) as run:
        run.oom_hint = oom_message(eff.batch_size, device)
        nvml_index = nvml_index_for(device)
        probes = [ProbeSpec("host", {"root_pid": os.getpid()})]
        if nvml_index is not None:
            probes.insert(0, ProbeSpec("gpu", {"indices": [nvml_index]}))
        else:
            run.mark_unsupported("gpu", "the run used the CPU")
        _train(spec, eff, device, run, probes, nvml_index, progress, config.torch_profiler_steps)
    return run.result()


def _train(
    spec: WorkloadSpec,
    eff: EffectiveTrainConfig,
    device: torch.device,
    run: RunSession,
    probes: list[ProbeSpec],
    nvml_index: int | None,
    progress: ProgressFn | None,
    profiler_steps: int = 0,
) -> dict[str, Any]:
    writer = run.writer
    timing_dir = run.dir / "series" if eff.prep_timing else None
    prepared = prepare(spec, eff, device, timing_dir, skip_log=run.dir / SKIPPED_SAMPLES_FILE)
    eff = prepared.effective
    run.set_effective(eff.as_dict())
    cuda = device.type == "cuda"
    # written by a thread of its own: the training loop never waits for the disk
    steps = writer.series("steps", STEPS_SCHEMA, background=True)
    timer = StepTimer(steps, cuda=cuda, warmup_steps=0)
    with run.monitor(probes, hz=eff.sample_hz):
        loop = measured_loop(prepared, eff, device, timer, progress, eff.batch_size)
        timer.finish()
        if profiler_steps:  # after the measured window: the profiler never slows a measured step
            from gpulens.workloads.profile import profile_steps

            writer.update(torch_profiler=profile_steps(prepared, device, profiler_steps, run.dir))
        if eff.loader_probe:  # resolved true only for a run with a loader and its workers
            writer.update(loader_scaling=_probe_loader_scaling(prepared))
    peak_mem = torch.cuda.max_memory_allocated(device) if cuda else None
    # The sampler's CPU share, and gpulens's own time on this training thread per step.
    costs = {
        **run.monitor_costs(),
        "tracking_us_per_step": timer.tracking_us_per_step(),
        "gpu_timing_every_n_steps": timer.gpu_timing_every_n_steps,
    }
    return summarize_run(
        spec,
        eff,
        device,
        writer,
        timer.measured_rows(),
        costs,
        loop,
        [nvml_index] if nvml_index is not None else [],
        [peak_mem],
    )


def _probe_loader_scaling(prepared) -> dict[str, Any] | None:
    """The loader's pace per process at several process counts (``predict --workers`` reads
    it), after the measured window and with the run's own workers stopped first: they would
    compete with the probe's processes."""
    from gpulens.data.loader_scaling import probe_loader_scaling

    # a DataLoader iterator's workers otherwise stop only when it is collected
    stop_workers = getattr(prepared.batches, "_shutdown_workers", None)
    if stop_workers is not None:
        stop_workers()
    log.info("timing the loader at several process counts (a few seconds)")
    try:
        return probe_loader_scaling(prepared.dataset)
    except Exception as exc:  # the probe must never fail a finished run
        log.warning("loader scaling probe failed: %s", exc)
        return None

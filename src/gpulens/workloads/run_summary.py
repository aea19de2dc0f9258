"""A training run's summary (written into run.json): throughput with its interval, phases,
the monitor's means, MFU against the GPU's peak."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch

from gpulens.data.bad_samples import SKIPPED_SAMPLES_FILE, read_skipped
from gpulens.probes.gpu_specs import peak_flops
from gpulens.probes.summary import summarize_gpu, summarize_host
from gpulens.record.writer import RunWriter
from gpulens.stats import rate_ci95, throughput_ci
from gpulens.workloads.config import EffectiveTrainConfig
from gpulens.workloads.loop import LoopResult, ci_step_times
from gpulens.workloads.models import WorkloadSpec

log = logging.getLogger(__name__)


def peak_precision(spec: WorkloadSpec, precision: str) -> str:
    """The precision the GPU's peak FLOPs are quoted for: TF32 where torch lets fp32 use it."""
    if precision != "fp32":
        return precision
    conv = spec.task == "image_classification" and not spec.name.startswith("vit")
    if (conv and torch.backends.cudnn.allow_tf32) or torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "fp32"


def _mean(values) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def summarize_run(
    spec: WorkloadSpec,
    eff: EffectiveTrainConfig,
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
    batch = eff.batch_size
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
            samples_per_gpu = samples // max(len(nvml_indices), 1)
            s = summarize_gpu(gpu_df, loop.t_measure0, loop.t_measure1, index, samples_per_gpu)
            s = s or {}
            s["peak_mem_allocated_bytes"] = peak_mem_bytes[i] if i < len(peak_mem_bytes) else None
            per_gpu.append(s)
        gpu_summary = dict(per_gpu[0]) if per_gpu else {}
        gpu_summary["name"] = torch.cuda.get_device_name(device)
        peak = peak_flops(gpu_summary["name"], peak_precision(spec, eff.precision))
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
        "precision": eff.precision,
        "batch_size": batch,
        "global_batch_size": samples_per_step,
        "workers": eff.workers if eff.data != "synthetic" else 0,
        "measured_steps": len(rows),
        "warmup_steps": eff.warmup_steps,
        "stop_reason": loop.stop_reason,
        "measured_wall_s": wall,
        "measured_start_unix_s": loop.t_measure0,
        "measured_end_unix_s": loop.t_measure1,
        "throughput_samples_per_s": tput,
        "throughput_ci95_pct": ci_pct,
        "throughput_ci95_samples_per_s": rate_ci95(tput, ci_pct),
        "phases_s": phases,
        "flops_per_sample": flops_per_step / batch if flops_per_step else None,
        # the host's own time to issue one step on an idle GPU (steps after the measured
        # window): the floor a smaller batch cannot go below (`predict --batch-size`)
        "host_issue_s_per_step": loop.host_issue_s,
        "mfu": mfu,
        "gpu": gpu_summary,
        "per_gpu": per_gpu if world_size > 1 else None,
        "host": host_summary,
        **skipped,
        **overhead,
    }
    writer.update(summary=summary, effective_config=eff.as_dict())
    return summary


def _skipped(eff: EffectiveTrainConfig, skip_log: Path) -> dict[str, Any]:
    """The summary's count of bad samples skipped (warm-up included): None where nothing could
    be skipped (synthetic data, or skipping off: a bad sample then stops the run)."""
    if eff.data == "synthetic" or not eff.skip_bad_samples:
        return {"skipped_samples": None, "skipped_files_total": None, "skipped_files": None}
    got = read_skipped(skip_log)
    if got["skipped_samples"]:
        first = ", ".join(got["skipped_files"])
        n, files = got["skipped_samples"], got["skipped_files_total"]
        log.warning("skipped %d bad samples (%d files, first: %s): %s", n, files, first, skip_log)
    return got

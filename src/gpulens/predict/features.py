"""What prediction reads from a run record: per-step phases, FLOPs, bytes, GPU, model size."""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpulens.errors import UsageError

log = logging.getLogger(__name__)

# Bytes per element of the precisions a run can name (the operands of its matmuls).
PRECISION_BYTES = {"fp32": 4.0, "tf32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0}


@dataclass(frozen=True)
class RunFacts:
    """One measured training run, per step and per GPU (rank 0's phases)."""

    run_id: str
    workload: str | None
    gpu_name: str
    precision: str
    batch_size: int
    gpus: int
    step_s: float
    data_wait_s: float
    h2d_s: float
    compute_s: float
    gpu_busy_s: float | None  # GPU time of a step (CUDA events), None where not measured
    flops_per_sample: float | None
    dram_bw_util_pct: float | None  # GPM, averaged over the measured window
    workers: int
    ddp_bucket_mb: float | None
    trace: Path | None
    trace_steps: int
    synthetic_data: bool = False  # batches made on the device: no loader to predict
    host_issue_s: float | None = None  # the host's issue of a step on an idle GPU (probed)
    compute_steps_s: tuple[float, ...] = ()  # each measured step's compute phase, sorted
    ranks_per_host: int = 1  # training processes on one host (their workers share it)
    gpu_util_pct: float | None = None  # NVML: the share of time some kernel ran

    def slowest_of_ratio(self, processes: int) -> float:
        """How much longer the slowest of ``processes`` independent steps takes than one
        step, on average, by this run's own step-to-step spread of compute time (1.0 where
        the steps were not kept). DDP ranks wait for each other every step."""
        x = self.compute_steps_s
        mean = sum(x) / len(x) if x else 0.0
        if processes <= 1 or len(x) < 2 or mean <= 0:
            return 1.0
        # The k-th smallest of m steps is the largest of n draws (with replacement) with
        # probability (k/m)^n - ((k-1)/m)^n.
        m, n = len(x), processes
        expected_max = sum(v * ((k / m) ** n - ((k - 1) / m) ** n) for k, v in enumerate(x, 1))
        return expected_max / mean

    @property
    def overhead_s(self) -> float:
        """Step time not in any phase (loop bookkeeping); may be slightly negative."""
        return self.step_s - self.data_wait_s - self.h2d_s - self.compute_s

    @property
    def bookkeeping_s(self) -> float:
        """Step time in no phase (loop bookkeeping), counted with compute."""
        return max(self.overhead_s, 0.0)

    @property
    def data_wait_in_step_s(self) -> float:
        """The data wait less any overlap of the phases (a slightly negative remainder), so
        that compute + bookkeeping + data wait + copy add up to the step. ``predict`` splits a
        step so, in its measured column as in its prediction: an unchanged run predicts itself."""
        return max(0.0, self.data_wait_s + min(self.overhead_s, 0.0))

    @property
    def non_data_s(self) -> float:
        """The step less its data wait and copy: what the GPU and its all-reduce decide."""
        return self.step_s - self.data_wait_s - self.h2d_s

    @property
    def gpu_time_s(self) -> float:
        """The GPU's share of the compute phase (the rest is host time that no GPU speeds up)."""
        if self.gpu_busy_s is None:
            return self.compute_s
        return min(self.gpu_busy_s, self.compute_s)

    @property
    def flops_per_step(self) -> float | None:
        return self.flops_per_sample * self.batch_size if self.flops_per_sample else None

    def bytes_per_step(self, bandwidth_bytes_per_s: float) -> float | None:
        """DRAM bytes per step from the GPM counter (its mean over the window x the step)."""
        if self.dram_bw_util_pct is None:
            return None
        return self.dram_bw_util_pct / 100.0 * bandwidth_bytes_per_s * self.step_s


def _num(value: Any) -> float | None:
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _measured_steps(record):
    """The measured (not warm-up) rows of the run's steps series, the first rank's where it
    keeps every rank's (rank 0's phases are the summary's); None where unreadable."""
    from gpulens.record.reader import first_rank_steps

    try:
        steps = first_rank_steps(record.series("steps"))
    except Exception as exc:  # a damaged series: predict from the summary alone
        log.warning("steps series of %s unreadable (%s): using the compute phase", record.dir, exc)
        return None
    if "warmup" in steps:
        steps = steps[~steps["warmup"].fillna(False).astype(bool)]
    return steps


def _gpu_busy_s(steps) -> float | None:
    if steps is None or "gpu_step_time_s" not in steps or steps.empty:
        return None
    vals = steps["gpu_step_time_s"].dropna()
    return float(vals.median()) if len(vals) else None


def _compute_steps_s(steps) -> tuple[float, ...]:
    if steps is None or "compute_s" not in steps:
        return ()
    vals = steps["compute_s"].dropna()
    return tuple(sorted(float(v) for v in vals if v > 0 and math.isfinite(v)))


def loader_workers(meta: dict) -> int:
    """A run's loader workers; older records kept them in the config only."""
    s, eff = meta.get("summary") or {}, meta.get("effective_config") or {}
    return int(s.get("workers") if s.get("workers") is not None else eff.get("workers") or 0)


def run_facts(record) -> RunFacts:
    """The facts of ``record`` (a RunRecord); UsageError naming the fix for a run that has no
    measured training steps or no GPU."""
    meta = record.meta
    rid = meta.get("run_id", str(record.dir))
    s = meta.get("summary") or {}
    eff = meta.get("effective_config") or {}
    phases = s.get("phases_s") or {}
    step = _num(phases.get("step"))
    if meta.get("kind") == "command":  # no model, batch or precision that gpulens knows
        raise UsageError(
            f"run {rid} is a command (`gpulens run -- ...`): predict needs a built-in "
            "workload's run, whose model, batch and precision it knows: measure the nearest "
            "one (`gpulens workloads`) with `gpulens run WORKLOAD --torch-profiler 5`"
        )
    if not s.get("measured_steps") or not step or step <= 0:
        raise UsageError(
            f"run {rid} has no measured training steps to predict from: "
            "give a finished `gpulens run WORKLOAD` or `gpulens stalls` run"
        )
    gpu = s.get("gpu") or {}
    name = gpu.get("name") or (meta.get("environment") or {}).get("gpu_model")
    if not name:
        raise UsageError(
            f"run {rid} ran on no GPU (device {s.get('device')}): "
            "predict from a run measured on a GPU"
        )
    prof = meta.get("torch_profiler") or {}
    trace = Path(record.dir) / prof["file"] if prof.get("file") else None
    steps = _measured_steps(record)
    return RunFacts(
        run_id=rid,
        workload=s.get("workload") or eff.get("workload"),
        gpu_name=str(name),
        precision=str(s.get("precision") or eff.get("precision") or "fp32"),
        batch_size=int(s.get("batch_size") or eff.get("batch_size") or 1),
        gpus=max(1, int(s.get("gpus") or s.get("processes") or 1)),
        step_s=step,
        data_wait_s=_num(phases.get("data_wait")) or 0.0,
        h2d_s=_num(phases.get("h2d")) or 0.0,
        compute_s=_num(phases.get("compute")) or step,
        gpu_busy_s=_gpu_busy_s(steps),
        flops_per_sample=_num(s.get("flops_per_sample")),
        dram_bw_util_pct=_num(gpu.get("dram_bw_util_pct")),
        workers=loader_workers(meta),
        ddp_bucket_mb=_num(eff.get("ddp_bucket_mb")),
        trace=trace if trace is not None and trace.is_file() else None,
        trace_steps=int(prof.get("steps") or 0),
        synthetic_data=str(eff.get("data") or "") == "synthetic",
        host_issue_s=_num(s.get("host_issue_s_per_step")),
        compute_steps_s=_compute_steps_s(steps),
        ranks_per_host=max(1, int(s.get("gpus") or s.get("processes") or 1))
        // max(1, int(s.get("nnodes") or 1)),
        gpu_util_pct=_num(gpu.get("gpu_util_pct")),
    )


def model_size(workload: str | None) -> tuple[int | None, int | None]:
    """``(parameters, layers)`` of a built-in workload (layers: convolutions and linear
    layers); ``(None, None)`` for anything else. Builds the model once on the CPU."""
    params, layers, _ = _model_counts(workload)
    return params, layers


def gradient_tensors(workload: str | None) -> int | None:
    """How many parameter tensors of a built-in workload take a gradient (DDP hooks and
    buckets each one); None for anything else."""
    return _model_counts(workload)[2]


@functools.lru_cache(maxsize=32)
def _model_counts(workload: str | None) -> tuple[int | None, int | None, int | None]:
    if not workload:
        return None, None, None
    try:
        from gpulens.workloads.models import get_workload

        spec = get_workload(workload)
    except UsageError:
        return None, None, None
    import torch

    model = spec.build()
    params = sum(p.numel() for p in model.parameters())
    layers = sum(
        isinstance(m, (torch.nn.Conv2d, torch.nn.Linear, torch.nn.MultiheadAttention))
        for m in model.modules()
    )
    tensors = sum(p.requires_grad for p in model.parameters())
    return int(params), int(layers), int(tensors)


def memory_shortfall(record, spec) -> str | None:
    """Why the run, at its batch (or a larger one), cannot fit on ``spec``'s GPU: the peak of
    memory its PyTorch allocator held exceeds the GPU's memory (read as GiB, the lenient
    reading); None where it fits or the run has no such peak. The time model knows nothing of
    memory, so a prediction (and `advise`) would otherwise price a job that cannot run."""
    gpu = (record.meta.get("summary") or {}).get("gpu") or {}
    peak = _num(gpu.get("peak_mem_allocated_bytes"))
    if peak is None or not spec.mem_gb or peak <= spec.mem_gb * 2**30:
        return None
    return (
        f"does not fit: the run's GPU held {peak / 2**30:.1f} GiB at its peak, more than the "
        f"{spec.gpu}'s {spec.mem_gb:g} GB (a smaller batch per GPU would need less)"
    )

"""The measured loop: warm up, then train until the step count, the time budget or the
throughput's confidence-interval target is met, timing every step."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gpulens.errors import RuntimeFailure
from gpulens.probes.steps import StepTimer
from gpulens.run import interrupts
from gpulens.stats import throughput_ci
from gpulens.workloads.config import EffectiveTrainConfig
from gpulens.workloads.recipe import Prepared

log = logging.getLogger(__name__)

# progress(step, total_steps or None, elapsed_s, info)
ProgressFn = Callable[[int, int | None, float, dict[str, Any]], None]
MIN_GPU_TIMED_STEPS = 10  # GPU step times enough for the throughput interval
MANY_STEPS = 200  # host step times' edge effects are negligible over this many steps
# A run that waited for its data at least this share of its steps took its pace from the loader
LOADER_PACED_SHARE = 0.05
PROGRESS_EVERY_S = 0.1  # the progress callback at most this often (and on the last step)
# After the measured window of a single-process GPU run, a few more steps each start on an
# idle GPU (after a synchronize) and time how long the host takes to issue the step: its own
# pace, which a GPU-bound step hides and a profiler window distorts (see gpulens.predict.batch).
# After, not during warm-up: early steps still carry start-up work (allocations, autotuning).
HOST_PROBE_STEPS = 5
HOST_PROBE_BUDGET_S = 1.0  # the probe stops once its steps took this long (one always runs)


@dataclass
class LoopResult:
    """What the measured loop saw: enough for the summary."""

    wall_measured_s: float
    t_measure0: float  # unix time of the measured window's start and end
    t_measure1: float
    stop_reason: str
    flops_per_step: float | None
    host_issue_s: float | None = None  # median of the probe steps; None where not probed


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
    eff: EffectiveTrainConfig,
    device: torch.device,
    timer: StepTimer,
    progress: ProgressFn | None,
    samples_per_step: int,
    control: StopControl | None = None,
    flop_counter: Callable[[Callable[[], Any]], float | None] | None = None,
) -> LoopResult:
    """Warm up, then train until the step count, the time budget or the CI target is met.
    With ``eff.count_flops`` (one process only) the first step runs under ``flop_counter``
    (default :func:`count_flops`)."""
    cuda = device.type == "cuda"
    memory_format = prepared.memory_format
    batches, step_fn = prepared.batches, prepared.step_fn
    flops_per_step: float | None = None
    warmup, max_steps, budget_s = eff.warmup_steps, eff.steps, eff.duration_s
    t_measure0 = time.time()
    t_run0 = time.perf_counter()
    measure_start = None
    stop_reason = "steps"
    step = 0
    # Synthetic batches are made in the model's memory format: no per-step reformat call.
    reformat = eff.channels_last and eff.data != "synthetic"
    last_progress_s = -PROGRESS_EVERY_S

    def on_device(x, y):
        if x.device != device:
            x = x.to(device, non_blocking=True, memory_format=memory_format)
            y = y.to(device, non_blocking=True)
        elif reformat and x.dim() == 4:
            x = x.contiguous(memory_format=memory_format)
        return x, y

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
        x, y = on_device(x, y)
        timer.copy_done()
        if step == 0 and eff.count_flops and control is None:
            flops_per_step = (flop_counter or count_flops)(lambda x=x, y=y: step_fn(x, y))
        else:
            step_fn(x, y)
        timer.end_step(samples=samples_per_step)
        interrupts.raise_if_interrupted()  # a Ctrl-C that the step's native code swallowed
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
        if progress is not None and (
            elapsed - last_progress_s >= PROGRESS_EVERY_S or step == warmup
        ):
            last_progress_s = elapsed
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
        elif eff.until_ci_pct is not None and measured >= 20 and measured % 10 == 0:
            ci = throughput_ci(ci_step_times(timer.measured_rows()), samples_per_step)
            if ci is not None and ci.ci95_pct <= eff.until_ci_pct:
                wanted = "until_ci"
        if control is not None:
            wanted = control.agree(wanted)
        if wanted:
            stop_reason = wanted
            break
    if cuda:
        torch.cuda.synchronize(device)
    t_measure1 = time.time()
    if progress is not None:
        elapsed = time.perf_counter() - (measure_start or t_run0)
        progress(step, (max_steps + warmup) if max_steps else None, elapsed, {})
    wall_measured_s = time.perf_counter() - (measure_start or t_run0)
    probed = None
    if cuda and control is None:
        probed = probe_host_issue(lambda: on_device(*next(batches)), step_fn, device)
    return LoopResult(wall_measured_s, t_measure0, t_measure1, stop_reason, flops_per_step, probed)


def probe_host_issue(
    next_batch: Callable[[], tuple[Any, Any]],
    step_fn: Callable[[Any, Any], Any],
    device: torch.device,
    steps: int = HOST_PROBE_STEPS,
    budget_s: float = HOST_PROBE_BUDGET_S,
) -> float | None:
    """Median host time to issue one step on an idle GPU, over up to ``steps`` steps run after
    the measured window; None when no batch was left."""
    issue_s: list[float] = []
    t0 = time.perf_counter()
    for _ in range(steps):
        try:
            x, y = next_batch()
        except StopIteration:
            break
        torch.cuda.synchronize(device)
        t_issue = time.perf_counter()
        step_fn(x, y)
        issue_s.append(time.perf_counter() - t_issue)
        interrupts.raise_if_interrupted()
        if time.perf_counter() - t0 >= budget_s:
            break
    torch.cuda.synchronize(device)
    return statistics.median(issue_s) if issue_s else None


def count_flops(fn: Callable[[], Any]) -> float | None:
    """FLOPs of one training step (forward, backward, optimizer) by torch's flop counter."""
    try:
        from torch.utils.flop_counter import FlopCounterMode

        # Python runs inside torch's dispatch here: a Ctrl-C raised there would be lost.
        with interrupts.held(), FlopCounterMode(display=False) as counter:
            fn()
        return float(counter.get_total_flops())
    except Exception as exc:  # an op the counter does not know must not stop the run
        log.warning("could not count FLOPs: %s", exc)
        fn()
        return None


def ci_step_times(rows: list[dict[str, Any]]) -> list[float]:
    """Step times for the throughput's confidence interval: the GPU's (between consecutive
    step starts on the stream) where known, else the host's. The host runs ahead of an
    asynchronous GPU, so its first steps look fast and the step before a synchronize slow:
    edge effects that widen a short run's interval tenfold though the GPU's pace is steady."""
    gpu = [t for r in rows if (t := r.get("gpu_step_time_s")) is not None and t > 0]
    host = [r["step_time_s"] for r in rows if r["step_time_s"] is not None]
    # Rows resolve in order, and the last one never has a GPU time (no next step start).
    if len(gpu) >= max(2, len(rows) - 1 - 8):
        return gpu
    # Short steps are timed on the GPU one in StepTimer.gpu_every: over many steps the host's
    # edge effects fade and its times cover every step; over few, the GPU's sample is better.
    # GPU times only early on mean they lag behind (read back later), not that they are sampled.
    recent = rows[-max(1, len(rows) // 4) :]
    sampled = any(r.get("gpu_step_time_s") is not None for r in recent)
    # A run paced by its loader blocks on every batch, so the host's times have no edge
    # effects, while a GPU sample every few steps falls in step with the workers' bursts: an
    # H100 resnet18 run with 8 workers gave +-292% on its 15 sampled steps, +-14% on all 90.
    # (The host may run ahead of the GPU, so the run's time is at least its GPU steps'.)
    waited_s = sum(r.get("data_wait_s") or 0.0 for r in rows)
    run_s = max(sum(host), sum(gpu) / max(len(gpu), 1) * len(host))
    loader_paced = waited_s > LOADER_PACED_SHARE * run_s
    if not sampled or loader_paced or len(host) >= MANY_STEPS or len(gpu) < MIN_GPU_TIMED_STEPS:
        return host
    return gpu

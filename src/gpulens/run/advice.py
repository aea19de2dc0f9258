"""What to look at next after a run, from its summary: a pure function over the numbers.

``advise(summary)`` returns the advice most telling first; ``report.terminal`` only renders it.
The bars are analysis, not presentation: they live here (the loader-bound one is the project's
one ``LOADER_BOUND_DATA_WAIT``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpulens.run.thresholds import LOADER_BOUND_DATA_WAIT

# Below this mean GPU utilization (percent) the GPU sits idle between steps.
LOW_GPU_UTIL_PCT = 70.0
# Below this model FLOPs utilization an fp32 run leaves the tensor cores unused.
LOW_MFU_FP32 = 0.3
# Above this 95% CI half-width (percent) the throughput is too uncertain to compare.
WIDE_CI95_PCT = 5.0

__all__ = [
    "LOW_GPU_UTIL_PCT",
    "LOW_MFU_FP32",
    "WIDE_CI95_PCT",
    "Advice",
    "advise",
]


@dataclass(frozen=True)
class Advice:
    """One piece of advice: ``key`` is stable (scripts and tests match on it), ``text`` is for
    people; ``metric``/``value``/``threshold`` say which number crossed which bar."""

    key: str
    text: str
    metric: str | None = None
    value: float | None = None
    threshold: float | None = None


def advise(summary: Mapping[str, Any]) -> list[Advice]:
    """Advice for a training run's summary (``RunResult.summary``), most telling first."""
    advice: list[Advice] = []
    phases = summary.get("phases_s") or {}
    step = phases.get("step") or 0
    wait = phases.get("data_wait") or 0
    if step and wait / step >= LOADER_BOUND_DATA_WAIT:
        share = wait / step
        advice.append(
            Advice(
                key="loader_bound",
                text=f"the loop waits for data {100 * share:.0f}% of each step: try more "
                f"--workers (this run had {summary.get('workers')}); decoding and augmenting "
                "JPEGs is CPU work",
                metric="data_wait_share",
                value=share,
                threshold=LOADER_BOUND_DATA_WAIT,
            )
        )
    gpu = summary.get("gpu") or {}
    util = gpu.get("gpu_util_pct")
    if util is not None and util < LOW_GPU_UTIL_PCT:
        if advice:  # loader-bound: the GPU idles waiting for data, not for launches
            why = "the GPU is idle while the loop waits for data (above)"
        else:  # bf16 only where the run is not already in a half precision
            more = " or --precision bf16" if summary.get("precision") == "fp32" else ""
            why = (
                f"the GPU is idle between steps; a larger --batch-size{more} gives it more "
                "work per launch"
            )
        advice.append(
            Advice(
                key="low_gpu_util",
                text=f"GPU utilization is only {util:.0f}%: {why}",
                metric="gpu_util_pct",
                value=util,
                threshold=LOW_GPU_UTIL_PCT,
            )
        )
    mfu = summary.get("mfu")
    if mfu is not None and mfu < LOW_MFU_FP32 and summary.get("precision") == "fp32":
        advice.append(
            Advice(
                key="low_mfu_fp32",
                text="MFU is low in fp32: try --precision bf16 to use the tensor cores",
                metric="mfu",
                value=mfu,
                threshold=LOW_MFU_FP32,
            )
        )
    ci = summary.get("throughput_ci95_pct")
    if ci is not None and ci > WIDE_CI95_PCT:
        advice.append(
            Advice(
                key="wide_ci",
                text=f"the throughput is uncertain (±{ci:.1f}%): run longer or use --until-ci 2",
                metric="throughput_ci95_pct",
                value=ci,
                threshold=WIDE_CI95_PCT,
            )
        )
    if summary.get("device") == "cpu":
        advice.append(
            Advice(
                key="ran_on_cpu",
                text="this ran on the CPU: `gpulens doctor` says what a GPU machine would add",
            )
        )
    return advice

"""What a collocation experiment is asked to do (``gpulens colocate``): jobs, mechanisms and
their settings, the measured window, validated when made."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpulens.errors import UsageError
from gpulens.launch.processes import (
    check_command,
)
from gpulens.workloads.jobspec import JobSpec, unique_names

log = logging.getLogger(__name__)


MECHANISMS = ("time-slice", "streams", "mps", "mig")


DEFAULT_MECHANISMS = ("time-slice", "streams", "mps", "mig")


ProgressFn = Callable[[str], None]


@dataclass
class ColocateConfig:
    """A collocation experiment. ``jobs`` are :class:`JobSpec` (see ``parse_job``)."""

    jobs: list[JobSpec]
    mechanisms: tuple[str, ...] = DEFAULT_MECHANISMS
    mps_thread_pcts: tuple[float, ...] = (25.0, 50.0, 100.0)
    mps_limit_target: str = "auto"  # all, train, or auto (train when inference is in the mix)
    mps_mem_limit: str | None = None
    stream_priorities: bool = True
    duration_s: float = 15.0
    warmup_s: float = 3.0
    device: str | None = None
    max_slowdown: float | None = None
    setup_timeout_s: float = 300.0
    command_timeout_s: float | None = None
    cpu_threads: int | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        if len(self.jobs) < 2:
            raise UsageError("give at least two jobs to run together, e.g. resnet18 resnet50")
        self.jobs = unique_names(list(self.jobs))
        for job in self.jobs:
            if job.kind == "cmd":
                check_command(list(job.command), what=f"cmd: job {job.name}")
        bad = [m for m in self.mechanisms if m not in MECHANISMS]
        if bad or not self.mechanisms:
            raise UsageError(
                f"unknown mechanism {', '.join(bad) or '(none)'}: use {', '.join(MECHANISMS)}"
            )
        self.mechanisms = tuple(dict.fromkeys(self.mechanisms))
        for pct in self.mps_thread_pcts:
            if not 0 < pct <= 100:
                raise UsageError(f"--mps-thread-pct values must be in (0, 100], got {pct:g}")
        if self.mps_limit_target not in ("auto", "all", "train"):
            raise UsageError("--mps-limit must be auto, all or train")
        if self.duration_s <= 0 or self.warmup_s < 0:
            raise UsageError("--duration must be positive and --warmup-s zero or more")
        if self.max_slowdown is not None and self.max_slowdown < 1:
            raise UsageError(
                f"--max-slowdown is a factor >= 1 (1.5 = each job keeps 2/3 of its speed), "
                f"got {self.max_slowdown:g}"
            )
        if self.mps_mem_limit:
            from gpulens.launch.mps import parse_mem_limit

            parse_mem_limit(self.mps_mem_limit)

    def as_dict(self) -> dict[str, Any]:
        return {
            "jobs": [j.to_dict() for j in self.jobs],
            "mechanisms": list(self.mechanisms),
            "mps_thread_pcts": list(self.mps_thread_pcts),
            "mps_limit_target": self.mps_limit_target,
            "mps_mem_limit": self.mps_mem_limit,
            "stream_priorities": self.stream_priorities,
            "duration_s": self.duration_s,
            "warmup_s": self.warmup_s,
            "device": self.device,
            "max_slowdown": self.max_slowdown,
        }

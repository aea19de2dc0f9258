"""The one orchestrator of a stall breakdown: it makes each run through a backend, gives it its
role (``stalls:<role>``), reads it back as stored and keeps the books (runs, throughputs, pooled
repeats, notes, what-if, recommendations) the same way for both backends:

- :class:`TrainingBackend`: a built-in workload (``run_training``), the flow in
  :mod:`gpulens.stalls.workload`;
- :class:`CommandBackend`: the user's own script (``run_command``), the flow in
  :mod:`gpulens.stalls.command`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from gpulens.errors import RuntimeFailure
from gpulens.launch.command import run_command
from gpulens.probes.environment import usable_cpus
from gpulens.run.result import RunResult, role_name
from gpulens.stalls.budget import TimeBudget
from gpulens.stalls.config import RUN_KINDS, ProgressFn, StallResult
from gpulens.stalls.model import Measured, breakdown_of, recommend, what_if
from gpulens.workloads.config import TrainConfig
from gpulens.workloads.tracking import FIRST_PASS_ENV, INGESTION_FREE_BATCHES, INGESTION_FREE_ENV

log = logging.getLogger(__name__)

StepFn = Callable[[int, int | None, float, dict[str, Any]], None]


def run_training(*args: Any, **kwargs: Any) -> RunResult:
    """:func:`gpulens.workloads.train.run_training`, imported on first use: it imports torch,
    which a command's stall breakdown never needs."""
    from gpulens.workloads.train import run_training as train

    return train(*args, **kwargs)


def warm_page_cache(files: list[Path], notes: list[str]) -> None:
    """Read the dataset into the page cache; a note when RAM cannot hold it."""
    from gpulens.data import pagecache

    pagecache.warm(files)
    resident = pagecache.resident_fraction(files)
    if resident is not None and resident < 0.95:
        notes.append(
            f"only {100 * resident:.0f}% of the dataset stayed in the page cache (RAM too small "
            "for it): the 'cached' run includes some storage reads"
        )


class Backend(Protocol):
    def run(self, role: str, **options: Any) -> RunResult:
        """Make one stored run with role ``stalls:<role>`` and return it as stored."""
        ...


class TrainingBackend:
    """Runs of a built-in workload: ``common`` training options, ``options`` per run."""

    def __init__(
        self, workload: str, common: dict[str, Any], runs_root: Path, on_step: StepFn | None
    ) -> None:
        self.workload, self.common = workload, common
        self.runs_root, self.on_step = runs_root, on_step

    def run(self, role: str, **options: Any) -> RunResult:
        cfg = TrainConfig(name=f"stalls-{self.workload}-{role}", **{**self.common, **options})
        made = run_training(
            cfg,
            self.runs_root,
            progress=self.on_step,
            kind="stalls",
            role=role_name("stalls", role),
        )
        stored = RunResult.from_record(made.record_dir)  # as stored: what any analysis reads
        join = made.summary.get("join")  # a node's shard: the joined run, or how to join
        return stored.with_summary(join=join) if join else stored


class CommandBackend:
    """Runs of the user's command, told by environment variables what to do
    (``ingestion_free``: repeat the loader's first batches; ``first_pass``: time only the
    first pass over the loader). A non-zero exit fails the breakdown; Ctrl-C ends it."""

    def __init__(
        self, argv: list[str], label: str, data_path: Path, runs_root: Path, sample_hz: float
    ) -> None:
        self.argv, self.label, self.data_path = argv, label, data_path
        self.runs_root, self.sample_hz = runs_root, sample_hz

    def run(self, role: str, ingestion_free: bool = False, first_pass: bool = False) -> RunResult:
        env = {INGESTION_FREE_ENV: "1" if ingestion_free else "0"}
        env[FIRST_PASS_ENV] = "1" if first_pass else "0"
        r = run_command(
            self.argv,
            self.runs_root,
            sample_hz=self.sample_hz,
            name=f"stalls-{self.label}-{role}",
            stdout_to_stderr=True,
            kind="stalls",
            extra_env=env,
            config={"stalls_run": role, "data": str(self.data_path)},
            role=role_name("stalls", role),
        )
        if r.status == "killed":
            raise KeyboardInterrupt
        if r.returncode != 0:
            hint = (
                f"; in this run gpulens.track().data() repeats the loader's first "
                f"{INGESTION_FREE_BATCHES} batches (GPULENS_INGESTION_FREE=1)"
                if ingestion_free
                else ""
            )
            raise RuntimeFailure(
                f"the {role} run of the command ended with exit code {r.returncode}{hint}; its "
                f"record is {r.record_dir}"
            )
        return RunResult.from_record(r.record_dir)


class StallRunner:
    """Makes the runs of one breakdown through ``backend`` and keeps ``result``'s books;
    ``budget`` (where there is one) learns what each run cost."""

    def __init__(
        self,
        backend: Backend,
        result: StallResult,
        progress: ProgressFn | None = None,
        budget: TimeBudget | None = None,
    ) -> None:
        self.backend, self.result, self.budget = backend, result, budget
        self.say: ProgressFn = progress or (lambda _msg: None)
        self.t0 = budget.started_s if budget is not None else time.perf_counter()

    def run(self, role: str, **options: Any) -> RunResult:
        """One run of ``role``; the latest run of a role is the one ``result`` shows."""
        self.say(f"{role} run")
        t_run0 = time.perf_counter()
        r = self.backend.run(role, **options)
        if self.budget is not None:
            steps = r.summary.get("measured_steps")
            self.budget.ran(time.perf_counter() - t_run0, r.measured_wall_s, steps)
        self.result.runs[role] = r.run_id
        if role in RUN_KINDS:
            self.result.throughput[role] = r.throughput_samples_per_s
            self.result.throughput_ci95_pct[role] = r.throughput_ci95_pct
        return r

    def unmeasured(self, role: str, keep_run: bool = True) -> None:
        """``role`` gave no figure (its run, if any, stays listed where ``keep_run``)."""
        if not keep_run:
            self.result.runs[role] = None
        self.result.throughput[role] = self.result.throughput_ci95_pct[role] = None

    def fill_missing(self) -> None:
        """Every run kind in the result, None where it was not run."""
        for kind in RUN_KINDS[2:]:
            self.result.runs.setdefault(kind, None)
            self.result.throughput.setdefault(kind, None)
            self.result.throughput_ci95_pct.setdefault(kind, None)

    def pool(self, repeats: dict[str, list[RunResult]], measured: dict[str, Measured | None]):
        """Every run of each role in ``all_runs``; a role run more than once shows its runs
        pooled (throughput and interval), with a note."""
        for kind, runs in repeats.items():
            self.result.all_runs[kind] = [r.run_id for r in runs]
            m = measured[kind]
            if len(runs) > 1 and m is not None and kind in RUN_KINDS:
                self.result.throughput[kind] = 1.0 / m.per_sample_s
                self.result.throughput_ci95_pct[kind] = 100.0 * m.half_width_s / m.per_sample_s
                rates = ", ".join(f"{r.throughput_samples_per_s:.0f}" for r in runs)
                spread = (
                    f"; they differ by more than their own intervals allow, so the interval "
                    f"includes the spread between runs (±{m.between_runs_pct:.1f}% SD)"
                    if m.between_runs_pct > 0
                    else ""
                )
                self.result.notes.append(
                    f"{kind}: {len(runs)} runs pooled ({rates} samples/s; all_runs){spread}"
                )

    def set_breakdown(self, measured: dict[str, Measured | None]) -> None:
        self.result.breakdown_pct, self.result.breakdown_ci95_pp = breakdown_of(measured)

    def finish(
        self,
        free: Measured,
        cached: Measured,
        cold: Measured | None,
        workers: int | None,
        mean_file_bytes: float | None,
        prep_cpu_s_per_sample: float | None,
    ) -> StallResult:
        """What-if predictions and recommendations against the current throughput (cold where
        measured), and the breakdown's wall time. ``workers`` None: the number of loader workers
        is unknown, so no what-if for workers or storage."""
        result = self.result
        current = result.throughput.get("cold") or result.throughput["cached"]
        result.what_if = what_if(
            free,
            cached,
            cold,
            workers if workers is not None else 1,
            usable_cpus(),
            mean_file_bytes,
            prep_cpu_s_per_sample,
        )
        if workers is None:
            result.what_if.pop("workers", None)
            result.what_if.pop("storage", None)
            result.notes.append(
                "what-if for data-loader workers and storage skipped: the number of loader "
                "workers is unknown (tracker.data() was not given a torch DataLoader)"
            )
        result.recommendations = recommend(
            result.breakdown_pct, result.what_if, current, workers or 0
        )
        result.wall_s = round(time.perf_counter() - self.t0, 1)
        return result

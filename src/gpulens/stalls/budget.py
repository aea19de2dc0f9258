"""The time budget of a stall breakdown (``--time-budget``): the wall time of the whole command,
from gpulens's start to its answer, the storing of the runs included. Pure (no torch).

Each run costs its measured window plus what surrounds it (building the model, starting the
loader workers, the warm-up steps, writing the record): :class:`TimeBudget` learns that
overhead from the runs made so far and gives the next run the measured seconds that let every
run still to come fit in what is left of the budget (at most ``--max-duration``). What is left
after the runs that the breakdown needs goes to repeats (:mod:`gpulens.stalls.refine`).

A run measured for less than :data:`MIN_MEASURED_S` seconds or :data:`MIN_MEASURED_STEPS`
steps gives no honest interval: where the budget cannot give every run that much, the runs get
it anyway and the breakdown says so, with the least budget that would have held; where the
budget cannot hold the runs even at a first guess of their cost, nothing runs (exit 2).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

MIN_MEASURED_S = 2.0  # a run's measured window, at the least
MIN_MEASURED_STEPS = 10  # ... and at least this many steps of it (as the slowest run so far)
# Before any run: what one costs beyond its measured window (start-up, warm-up, wind-down),
# a first guess below what tiny_cnn took on a 2-core CPU (3-8 s) and on an H200.
FIRST_GUESS_OVERHEAD_S = 3.0


@dataclass
class TimeBudget:
    """The seconds of one breakdown. ``started_s`` is on the ``time.perf_counter`` clock;
    ``finish_s`` and ``finish_per_run_s`` are kept for the work after the last run (storing
    the runs in MLflow, the report)."""

    total_s: float
    max_run_s: float
    started_s: float = field(default_factory=lambda: time.perf_counter())
    finish_s: float = 0.5
    finish_per_run_s: float = 0.0
    overhead_s: float | None = None  # the largest seen; None before the first run
    step_s: float = 0.0  # the slowest measured step so far
    runs_made: int = 0
    short: bool = False  # the honest minimum did not fit: said once

    @classmethod
    def from_unix_start(cls, total_s: float, max_run_s: float, started_unix_s: float | None,
                        **kw: float) -> TimeBudget:  # fmt: skip
        """A budget whose clock started at ``started_unix_s`` (wall clock; None: now)."""
        ago_s = 0.0 if started_unix_s is None else max(0.0, time.time() - started_unix_s)
        return cls(total_s, max_run_s, time.perf_counter() - ago_s, **kw)

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started_s

    def reserve_s(self, runs_to_come: int = 0) -> float:
        """Seconds kept for after the runs: those made and ``runs_to_come`` are stored."""
        return self.finish_s + self.finish_per_run_s * (self.runs_made + runs_to_come)

    def per_run_overhead_s(self) -> float:
        return FIRST_GUESS_OVERHEAD_S if self.overhead_s is None else self.overhead_s

    def least_measured_s(self) -> float:
        return max(MIN_MEASURED_S, MIN_MEASURED_STEPS * self.step_s)

    def least_total_s(self, runs: int) -> float:
        """The least budget for ``runs`` more runs, each measured honestly, from here."""
        per_run = self.per_run_overhead_s() + self.least_measured_s()
        return self.elapsed_s() + self.reserve_s(runs) + runs * per_run

    def measure_s(self, runs: int) -> float:
        """Measured seconds for the next of ``runs`` runs still to make: an even share of what
        is left once each has its overhead, within [least, ``max_run_s``]."""
        left_s = self.total_s - self.elapsed_s() - self.reserve_s(runs)
        share_s = left_s / max(runs, 1) - self.per_run_overhead_s()
        return round(min(self.max_run_s, max(self.least_measured_s(), share_s)), 2)

    def fits(self, runs: int) -> bool:
        return self.least_total_s(runs) <= self.total_s

    def ran(self, wall_s: float, measured_wall_s: float | None, measured_steps: int | None) -> None:
        """Learn from a run that took ``wall_s`` in all."""
        self.runs_made += 1
        if measured_wall_s is None:
            return
        overhead_s = max(0.0, wall_s - measured_wall_s)
        self.overhead_s = max(self.overhead_s or 0.0, overhead_s)
        if measured_steps:
            self.step_s = max(self.step_s, measured_wall_s / measured_steps)

    def too_small(self, runs: int) -> str:
        """One line: the budget cannot give ``runs`` more runs an honest measurement."""
        need_s = self.least_total_s(runs)
        per_run = self.per_run_overhead_s()
        return (
            f"--time-budget {self.total_s:g} s is below what this breakdown needs here: each run "
            f"takes about {per_run:.0f} s beyond its measured window and needs at least "
            f"{self.least_measured_s():.0f} s measured ({MIN_MEASURED_STEPS} steps or "
            f"{MIN_MEASURED_S:g} s), so the {runs} run{'s' * (runs != 1)} to come will take it "
            f"to about {need_s:.0f} s: give --time-budget {need_s * 1.1:.0f} or more"
        )

    def cannot_hold(self, runs: int) -> str:
        """One line, before any run: the budget cannot hold the ``runs`` runs at all."""
        need_s, store_s = self.least_total_s(runs), self.reserve_s(runs)
        return (
            f"--time-budget {self.total_s:g} s cannot hold the {runs} runs this breakdown needs: "
            f"{self.elapsed_s():.0f} s are gone to start-up, each run takes {MIN_MEASURED_S:g} s "
            f"measured and about {self.per_run_overhead_s():.0f} s more at the least (start-up "
            "and warm-up)"
            + (f", and storing them about {store_s:.0f} s" if store_s >= 1 else "")
            + f": give --time-budget {need_s * 1.5:.0f} or more (where its steps are slow, more)"
        )

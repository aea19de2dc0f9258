"""The tracker's warm-up: the first steps of a script carry its start-up (lazy initialisation,
the allocator, cuDNN's autotuning) and are left out of its throughput, not out of its record.

A script's length is known only when it ends: a fixed warm-up of :data:`WARMUP_STEPS` left a
script of 5 steps or fewer with no measured step at all (and one of 16 with 11). Where the
warm-up was not chosen by the caller, a short script keeps a shorter one
(:func:`short_run_warmup`), and its steps' rows wait (:class:`HeldWarmup`) until the warm-up is
settled, so that the record's ``warmup`` flags and the summary agree. Every step stays in the
record; the summary says how many were warm-up, and why fewer where the script was short.
"""

from __future__ import annotations

from typing import Any

WARMUP_STEPS = 5  # steps left out of a script's throughput, where it runs long enough
# A script with fewer steps than this keeps a shorter warm-up: at least 3 measured steps.
SHORT_RUN_STEPS = WARMUP_STEPS + 3


def short_run_warmup(steps_total: int, warmup_steps: int = WARMUP_STEPS) -> int:
    """The warm-up for a script that made ``steps_total`` steps: ``warmup_steps`` where that
    leaves at least 3 measured, else a third of the steps (at least the first, which carries
    the start-up; none for a single step)."""
    if steps_total >= warmup_steps + 3:
        return warmup_steps
    if steps_total <= 1:
        return 0
    return min(warmup_steps, max(1, steps_total // 3))


def warmup_note(steps_total: int, warmup: int, default: int = WARMUP_STEPS) -> str | None:
    """What the summary says of a warm-up shorter than ``default`` (None where it was not)."""
    if warmup >= default or steps_total >= default + 3:
        return None
    if warmup == 0:
        return "a single step: measured with its start-up, no warm-up left out"
    return (
        f"a short script ({steps_total} steps): its first {warmup} step{'s' * (warmup != 1)} "
        f"left out as warm-up instead of {default}, so the throughput may still include "
        "start-up work"
    )


class HeldWarmup:
    """A step series that holds a script's first rows until it has made
    :data:`SHORT_RUN_STEPS` steps (its warm-up is then the usual one) or until :meth:`settle`
    has re-flagged them at the end of a short script. The rows are the step timer's own
    dicts; a script killed in its first steps loses those rows (warm-up, never measured)."""

    def __init__(self, series: Any) -> None:
        self.series = series
        self.held: list[dict[str, Any]] = []
        self.open = False  # the warm-up is over: rows go straight through

    def append(self, row: dict[str, Any]) -> None:
        if self.open:
            self.series.append(row)
            return
        self.held.append(row)
        if len(self.held) >= SHORT_RUN_STEPS:
            self.release()

    def release(self) -> None:
        self.open = True
        held, self.held = self.held, []
        for row in held:
            self.series.append(row)

    def close(self, **kwargs: Any) -> None:
        self.release()
        self.series.close(**kwargs)

    def settle(self, timer: Any) -> None:
        """At the script's end: the warm-up of a script of this length, on the step timer's
        rows (every step so far) and for its rows to come; what was held is written."""
        warmup = short_run_warmup(len(timer.rows), timer.warmup_steps)
        timer.warmup_steps = warmup
        for row in timer.rows:
            row["warmup"] = row["step"] < warmup
        self.release()


def step_counts(steps_total: int, measured: int, adaptive: bool) -> dict[str, Any]:
    """The summary's step counts: every step, the measured ones, the warm-up ones (in the
    record, out of the throughput) and, for a short script's shorter warm-up, why."""
    warmup = steps_total - measured
    note = warmup_note(steps_total, warmup) if adaptive else None
    counts = {"measured_steps": measured, "steps_total": steps_total, "warmup_steps": warmup}
    return {**counts, "warmup_note": note} if note else counts

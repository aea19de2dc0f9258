"""Orchestrating a sweep: which cells to run (resume), retries, state files, the summary."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from gpulens.errors import UsageError
from gpulens.launch.cli_child import ChildResult
from gpulens.paths import gpulens_home
from gpulens.sweep.cells import Cell, expand, sweep_id
from gpulens.sweep.spec import SweepSpec
from gpulens.sweep.state import CellState, now, read_state, write_state

ERROR_LINES = 5
# A cell that exits with gpulens's usage-error code (a bad value in the spec) would fail the
# same way again: it is not retried.
USAGE_EXIT_CODE = UsageError.exit_code
# What --json shows of a cell's state.
CELL_FIELDS = ("cell_id", "config", "status", "attempts", "run_id", "error", "exit_code", "summary")
# Headline figures copied from a cell's --json document into its summary, when present.
HEADLINE_KEYS = (
    "throughput_samples_per_s",
    "throughput_ci95_pct",
    "normalized_aggregate_throughput",
    "status",
    "wall_s",
)


class Executor(Protocol):
    def run(
        self,
        cells: list[Cell],
        on_start: Callable[[Cell], None],
        on_done: Callable[[Cell, ChildResult], bool],
    ) -> None: ...


@dataclass(frozen=True)
class SweepConfig:
    """How to run a spec: retries after a failure, resume, and where the sweep directory is."""

    spec: SweepSpec
    retries: int = 2
    resume: bool = False
    out_dir: Path | None = None

    def __post_init__(self) -> None:
        from gpulens.errors import UsageError

        if self.retries < 0:
            raise UsageError(f"--retries must be >= 0, not {self.retries}")


@dataclass
class SweepResult:
    sweep_dir: Path
    cells: list[CellState]

    def count(self, status: str) -> int:
        return sum(c.status == status for c in self.cells)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sweep_dir": str(self.sweep_dir),
            "cells": [{k: v for k, v in asdict(c).items() if k in CELL_FIELDS} for c in self.cells],
            "done": self.count("done"),
            "failed": self.count("failed"),
            "usage_errors": sum(
                c.status == "failed" and c.exit_code == USAGE_EXIT_CODE for c in self.cells
            ),
            "remaining": len(self.cells) - self.count("done") - self.count("failed"),
        }


def sweep_dir_for(config: SweepConfig, cells: list[Cell]) -> Path:
    if config.out_dir is not None:
        return Path(config.out_dir)
    return gpulens_home() / "sweeps" / sweep_id(config.spec, cells)


def parse_outcome(result: ChildResult) -> tuple[str | None, dict[str, Any], str | None]:
    """(run_id, headline summary, error) from a finished child."""
    doc: dict[str, Any] = {}
    try:
        parsed = json.loads(result.stdout) if result.stdout.strip() else {}
        doc = parsed if isinstance(parsed, dict) else {}
    except ValueError:
        doc = {}
    run_id = doc.get("run_id")
    summary = {k: doc[k] for k in HEADLINE_KEYS if k in doc}
    if result.returncode == 0:
        return run_id, summary, None
    lines = [ln for ln in result.stderr.strip().splitlines() if ln.strip()]
    error = "\n".join(lines[-ERROR_LINES:]) or f"exited with code {result.returncode}"
    return run_id, summary, error


def run_sweep(
    config: SweepConfig,
    executor: Executor,
    on_progress: Callable[[int, int], None] | None = None,
) -> SweepResult:
    """Run every unfinished cell (all of them without ``resume``), retrying failures up to
    ``retries`` times (a usage error, never); state files record each step. Returns every
    cell's final state."""
    cells = expand(config.spec)
    sweep_dir = sweep_dir_for(config, cells)
    try:
        sweep_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        from gpulens.errors import UsageError

        raise UsageError(
            f"cannot make the sweep directory {sweep_dir} ({exc.strerror or exc}): give --out "
            "a folder you can write, or set GPULENS_HOME to one"
        ) from None
    (sweep_dir / "spec.json").write_text(
        json.dumps({"name": config.spec.name, "cells": [c.config for c in cells]}, indent=1)
    )
    states: dict[str, CellState] = {}
    todo: list[Cell] = []
    for cell in cells:
        old = read_state(sweep_dir, cell.cell_id) if config.resume else None
        if old is not None and old.status == "done":
            old.config = cell.config  # the same settings; the state file's keys are sorted
            states[cell.cell_id] = old
            continue
        # A resumed cell keeps its attempts count; a fresh one starts over.
        state = CellState(cell.cell_id, cell.config, attempts=0)
        if old is not None:
            state.attempts = old.attempts
        states[cell.cell_id] = state
        write_state(sweep_dir, state)
        todo.append(cell)
    lock = threading.Lock()
    tries: dict[str, int] = {c.cell_id: 0 for c in todo}
    finished = [len(cells) - len(todo)]

    def report() -> None:
        if on_progress is not None:
            on_progress(finished[0], len(cells))

    def on_start(cell: Cell) -> None:
        with lock:
            state = states[cell.cell_id]
            state.status, state.started_at, state.finished_at = "running", now(), None
            state.attempts += 1
            tries[cell.cell_id] += 1
            write_state(sweep_dir, state)

    def on_done(cell: Cell, result: ChildResult) -> bool:
        run_id, summary, error = parse_outcome(result)
        with lock:
            state = states[cell.cell_id]
            state.run_id, state.summary, state.error = run_id, summary, error
            state.exit_code, state.finished_at = result.returncode, now()
            again = (
                error is not None
                and result.returncode != USAGE_EXIT_CODE
                and tries[cell.cell_id] <= config.retries
            )
            state.status = "done" if error is None else ("pending" if again else "failed")
            write_state(sweep_dir, state)
            if not again:
                finished[0] += 1
                report()
            return again

    report()
    executor.run(todo, on_start, on_done)
    return SweepResult(sweep_dir, [states[c.cell_id] for c in cells])

"""One state file per cell, written atomically (write a temporary file, then rename)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

STATUSES = ("pending", "running", "done", "failed")


@dataclass
class CellState:
    """What is known about a cell: status, attempts, run id, error (last stderr lines) and
    its last attempt's exit code."""

    cell_id: str
    config: dict[str, Any]
    status: str = "pending"
    attempts: int = 0
    run_id: str | None = None
    error: str | None = None
    exit_code: int | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    started_at: float | None = None
    finished_at: float | None = None


def state_path(sweep_dir: Path, cell_id: str) -> Path:
    return Path(sweep_dir) / "cells" / f"{cell_id}.json"


def write_state(sweep_dir: Path, state: CellState) -> None:
    """Atomically replace the cell's state file: a reader never sees half a file."""
    path = state_path(sweep_dir, state.cell_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(asdict(state), indent=1, sort_keys=True, default=str))
    os.replace(tmp, path)


def read_state(sweep_dir: Path, cell_id: str) -> CellState | None:
    """The stored state, or None when there is none (or it cannot be read)."""
    try:
        doc = json.loads(state_path(sweep_dir, cell_id).read_text())
        return CellState(**doc)
    except (OSError, ValueError, TypeError):
        return None


def now() -> float:
    return time.time()

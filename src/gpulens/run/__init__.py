"""The run contract: what a run is (``RunResult``) and the one way to make one
(``measured_run``). Analyses import ``gpulens.run.result`` only (no torch, no pandas)."""

from __future__ import annotations

from typing import Any

from gpulens.run.result import RunResult, legacy_role, read_result_json, role_name
from gpulens.run.thresholds import LOADER_BOUND_DATA_WAIT

__all__ = [
    "LOADER_BOUND_DATA_WAIT",
    "RunResult",
    "RunSession",
    "legacy_role",
    "measured_run",
    "read_result_json",
    "role_name",
]


def __getattr__(name: str) -> Any:
    # The lifecycle pulls in the record writer and the monitor (pyarrow); analyses never need it.
    if name in ("measured_run", "RunSession"):
        from gpulens.run import lifecycle

        return getattr(lifecycle, name)
    raise AttributeError(f"module 'gpulens.run' has no attribute {name!r}")

"""What one run is, as every analysis sees it: the same for a run just made and a stored one.

``RunResult`` is frozen and owns its JSON (``as_dict``/``from_dict``). Its mappings are read-only
views, so no analysis can change a run's summary after it ended (a value computed later belongs
in the analysis's own result, or in the record through ``RunSession.set_summary`` while the run
is live). No torch, pandas or pyarrow here: analyses over results import on any laptop.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

RUN_FILE = "run.json"  # the same name as record.schema.RUN_FILE, without importing pyarrow

# Roles of runs inside an experiment, stored in run.json as "role" ("<experiment>:<role>").
STALLS_ROLES = (
    "ingestion_free",
    "cached",
    "cold",
    "paired_cold",
    "multi_gpu",
    "multi_gpu_socket",
)
COLOCATE_ROLES = ("experiment", "alone", "together")


def role_name(experiment: str, role: str) -> str:
    """``stalls:cached``: the experiment and the run's part in it."""
    if not experiment or not role or ":" in experiment:
        raise ValueError(f"a role needs an experiment and a role, got {experiment!r}, {role!r}")
    return f"{experiment}:{role}"


def legacy_role(meta: Mapping[str, Any]) -> str | None:
    """The role of a record written before roles were stored: stall runs carried it only in
    their name, ``stalls-<workload>-<role>`` (the longest matching role wins, so ``paired_cold``
    is not read as ``cold``)."""
    if meta.get("kind") != "stalls":
        return None
    name = str(meta.get("name") or "")
    stalls_run = (meta.get("requested_config") or {}).get("stalls_run")
    if stalls_run in STALLS_ROLES:
        return role_name("stalls", stalls_run)
    matches = [r for r in STALLS_ROLES if name.endswith(f"-{r}")]
    return role_name("stalls", max(matches, key=len)) if matches else None


def _frozen(value: Any) -> Any:
    if isinstance(value, Mapping):
        return MappingProxyType({k: _frozen(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


def _thawed(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _thawed(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thawed(v) for v in value]
    return value


@dataclass(frozen=True, kw_only=True)
class RunResult:
    """One run: identity, place, role in an experiment, outcome, and what it measured.

    ``requested_config`` is what was asked for and ``effective_config`` what actually ran (as
    MLPerf LoadGen logs both); ``summary`` holds the measured figures with units in their names.
    """

    run_id: str
    record_dir: Path
    kind: str
    role: str | None = None
    status: str = "finished"
    name: str | None = None
    requested_config: Mapping[str, Any] = field(default_factory=dict)
    effective_config: Mapping[str, Any] = field(default_factory=dict)
    summary: Mapping[str, Any] = field(default_factory=dict)
    environment: Mapping[str, Any] = field(default_factory=dict)
    error: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "record_dir", Path(self.record_dir))
        for name in ("requested_config", "effective_config", "summary", "environment"):
            object.__setattr__(self, name, _frozen(getattr(self, name) or {}))

    # --- what analyses read most; None where the run did not measure it ---------------------
    @property
    def experiment_role(self) -> str | None:
        """The part after ``experiment:`` in ``role`` (``cached`` for ``stalls:cached``)."""
        return self.role.split(":", 1)[1] if self.role and ":" in self.role else self.role

    @property
    def throughput_samples_per_s(self) -> float | None:
        return self.summary.get("throughput_samples_per_s")

    @property
    def throughput_ci95_pct(self) -> float | None:
        return self.summary.get("throughput_ci95_pct")

    @property
    def measured_wall_s(self) -> float | None:
        return self.summary.get("measured_wall_s")

    @property
    def loader_workers(self) -> int:
        """Data-loader processes that fed the run (0: synthetic data or the main process)."""
        return int(self.summary.get("workers") or 0)

    # --- JSON ------------------------------------------------------------------------------
    def as_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "record_dir": str(self.record_dir),
            "kind": self.kind,
            "role": self.role,
            "status": self.status,
            "name": self.name,
            "requested_config": _thawed(self.requested_config),
            "effective_config": _thawed(self.effective_config),
            "summary": _thawed(self.summary),
            "environment": _thawed(self.environment),
            "error": self.error,
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], record_dir: Path | str | None = None) -> RunResult:
        """From ``as_dict()`` output or a record's ``run.json`` (``record_dir`` then says where
        it lies; old records without ``role`` get the one their name implies)."""
        role = doc.get("role") if "role" in doc else legacy_role(doc)
        return cls(
            run_id=str(doc["run_id"]),
            record_dir=Path(record_dir if record_dir is not None else doc["record_dir"]),
            kind=str(doc.get("kind") or "train"),
            role=role,
            status=str(doc.get("status") or "finished"),
            name=doc.get("name"),
            requested_config=doc.get("requested_config") or {},
            effective_config=doc.get("effective_config") or {},
            summary=doc.get("summary") or {},
            environment=doc.get("environment") or {},
            error=doc.get("error"),
        )

    @classmethod
    def from_record(cls, record_dir: Path | str) -> RunResult:
        """A stored run, with the status its reader resolves (a dead owner's run is killed)."""
        from gpulens.record.reader import read_record

        return read_record(Path(record_dir)).result()

    def with_summary(self, **fields: Any) -> RunResult:
        """A copy whose summary has ``fields`` added (the record on disk is unchanged)."""
        return RunResult.from_dict(
            {**self.as_dict(), "summary": {**_thawed(self.summary), **fields}}, self.record_dir
        )


def read_result_json(record_dir: Path | str) -> RunResult:
    """A result straight from ``run.json`` without the record reader (no pandas, no status
    resolution): for tools that only need the figures."""
    path = Path(record_dir) / RUN_FILE
    return RunResult.from_dict(json.loads(path.read_text()), record_dir)

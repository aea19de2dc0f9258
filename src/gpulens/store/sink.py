"""The one interface through which an ended run record reaches a store.

A sink takes a record directory and returns the id the store gave it. Three exist: the null sink
(no store: automatic logging turned off, or nothing installed), the MLflow sink and a fan-out
over several sinks. :func:`default_sink` picks one from the environment; the background logger
(:mod:`gpulens.store.background`) and ``gpulens runs sync`` only talk to sinks. A sink raises
gpulens's own errors: :class:`~gpulens.errors.MissingExtraError` (its package is not
installed), :class:`~gpulens.store.availability.StoreUnavailableError` (the store did not
answer) or :class:`~gpulens.errors.UsageError` (the record cannot be logged yet).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

STORE_ENV = "GPULENS_STORE"
ACTIVE_RUN, ACTIVE_URI = "mlflow_active_run_id", "mlflow_active_tracking_uri"


@runtime_checkable
class RecordSink(Protocol):
    """Where ended records go."""

    name: str

    def unavailable_reason(self) -> str | None:
        """Why this sink cannot log at all (one line naming the fix), or None when it can."""

    def log_record(self, record_dir: Path) -> str:
        """Log one ended record; return the store's id for it (idempotent per record)."""


@dataclass(frozen=True)
class NullSink:
    """Logs nothing; ``reason`` says why there is no store."""

    reason: str = "no store configured"
    name: str = "none"

    def unavailable_reason(self) -> str | None:
        return self.reason

    def log_record(self, record_dir: Path) -> str:
        return ""


@dataclass(frozen=True)
class MlflowSink:
    """An MLflow tracking store (a local SQLite file by default, or a server)."""

    tracking_uri: str | None = None
    experiment: str | None = None
    name: str = "mlflow"

    def unavailable_reason(self) -> str | None:
        from gpulens.store import mlflow_sink

        if not mlflow_sink.is_available():
            return "MLflow is not installed: pip install 'gpulens[store]'"
        return None

    def log_record(self, record_dir: Path) -> str:
        from gpulens.store import mlflow_sink

        experiment = self.experiment or mlflow_sink.default_experiment()
        return mlflow_sink.log_record(Path(record_dir), self.tracking_uri, experiment)


@dataclass(frozen=True)
class FanOutSink:
    """Every record to each of ``sinks``; ids joined with ``,``. Each sink is tried even when
    one before it failed; the first failure is raised once all have been tried."""

    sinks: Sequence[RecordSink]
    name: str = "fan-out"

    def unavailable_reason(self) -> str | None:
        reasons = [r for r in (s.unavailable_reason() for s in self.sinks) if r]
        return "; ".join(reasons) if len(reasons) == len(self.sinks) else None

    def log_record(self, record_dir: Path) -> str:
        ids: list[str] = []
        first_error: BaseException | None = None
        for sink in self.sinks:
            if sink.unavailable_reason():
                continue
            try:
                ids.append(sink.log_record(record_dir))
            except Exception as exc:
                first_error = first_error or exc
        if first_error is not None:
            raise first_error
        return ",".join(i for i in ids if i)


def store_enabled() -> bool:
    """False when ``GPULENS_STORE`` turns automatic logging off."""
    return os.environ.get(STORE_ENV, "").strip().lower() not in ("0", "off", "false", "no")


def default_sink(tracking_uri: str | None = None, experiment: str | None = None) -> RecordSink:
    """The null sink when ``GPULENS_STORE`` turns the store off, else MLflow (at
    ``tracking_uri``, default ``MLFLOW_TRACKING_URI`` or the local store)."""
    if not store_enabled():
        return NullSink(f"{STORE_ENV} turns the store off")
    return MlflowSink(tracking_uri, experiment)


def active_mlflow_run() -> dict[str, str]:
    """The MLflow run active in this process (a script that called ``mlflow.start_run()``) as
    fields for the record's summary (``mlflow_active_run_id``, ``mlflow_active_tracking_uri``),
    so that the record is logged into it; empty where the script never imported MLflow."""
    mlflow = sys.modules.get("mlflow")
    if mlflow is None:
        return {}
    try:
        run = mlflow.active_run()
        if run is None:
            return {}
        return {ACTIVE_RUN: run.info.run_id, ACTIVE_URI: mlflow.get_tracking_uri()}
    except Exception:  # whatever this MLflow is, the script's run is worth more than a hint
        return {}

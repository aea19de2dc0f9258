"""Reading run records, including those whose writer died."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd
import psutil
import pyarrow as pa
import pyarrow.parquet as pq

from gpulens.record import schema


@dataclass
class RunRecord:
    """A run directory as read from disk. ``meta`` is ``run.json`` with the status resolved."""

    dir: Path
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def run_id(self) -> str:
        return self.meta["run_id"]

    @property
    def status(self) -> str:
        return self.meta["status"]

    def series_names(self) -> list[str]:
        d = self.dir / schema.SERIES_DIR
        if not d.is_dir():
            return []
        return sorted({p.stem for p in d.iterdir() if p.suffix in _SERIES_SUFFIXES})

    def series(self, name: str) -> pd.DataFrame:
        """One series as a DataFrame; an empty frame if the run never wrote it."""
        return read_series_table(self.dir / schema.SERIES_DIR / name).to_pandas()


_SERIES_SUFFIXES = (schema.PARQUET_SUFFIX, schema.STREAM_SUFFIX)


def read_series_table(base: Path) -> pa.Table:
    """``base.parquet``, or for a live or killed run every complete batch of ``base.arrows``."""
    parquet = base.with_suffix(schema.PARQUET_SUFFIX)
    if parquet.exists():
        return pq.read_table(parquet)
    stream = base.with_suffix(schema.STREAM_SUFFIX)
    if not stream.exists():
        return pa.table({})
    batches = []
    try:
        with pa.OSFile(str(stream)) as f:
            reader = pa.ipc.open_stream(f)
            arrow_schema = reader.schema
            while True:
                try:
                    batches.append(reader.read_next_batch())
                except StopIteration:
                    break
    except (pa.ArrowInvalid, OSError, EOFError):
        # A writer killed mid-batch leaves a truncated tail; everything before it is intact.
        if not batches:
            try:
                return pa.table({}) if not stream.stat().st_size else _schema_only(stream)
            except (pa.ArrowInvalid, OSError):
                return pa.table({})
        arrow_schema = batches[0].schema
    return pa.Table.from_batches(batches, schema=arrow_schema)


def _schema_only(stream: Path) -> pa.Table:
    with pa.OSFile(str(stream)) as f:
        return pa.ipc.open_stream(f).schema.empty_table()


def _owner_alive(meta: dict[str, Any]) -> bool:
    if meta.get("hostname") == socket.gethostname():
        pid = meta.get("pid")
        if not pid or not psutil.pid_exists(pid):
            return False
        try:
            created = psutil.Process(pid).create_time()
        except psutil.Error:
            return False
        # A recycled pid belongs to a process created later than the writer.
        return abs(created - float(meta.get("pid_create_time") or created)) < 1.0
    beat = meta.get("heartbeat_at")
    if not beat:
        return False
    age_s = (datetime.now(timezone.utc) - datetime.fromisoformat(beat)).total_seconds()
    return age_s < schema.HEARTBEAT_STALE_S


def read_record(run_dir: Path) -> RunRecord:
    """Read one record. A ``running`` record whose owner is gone is reported as ``killed``."""
    run_dir = Path(run_dir)
    path = run_dir / schema.RUN_FILE
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{run_dir} is not a gpulens run (no {schema.RUN_FILE})") from exc
    if meta.get("status") == schema.STATUS_RUNNING and not _owner_alive(meta):
        meta["status"] = schema.STATUS_KILLED
        meta["error"] = meta.get("error") or "the process died before the run finished"
    return RunRecord(run_dir, meta)


def list_records(runs_root: Path) -> list[RunRecord]:
    """Every readable record under ``runs_root``, oldest first."""
    runs_root = Path(runs_root)
    if not runs_root.is_dir():
        return []
    records = []
    for d in sorted(runs_root.iterdir()):
        if (d / schema.RUN_FILE).is_file():
            try:
                records.append(read_record(d))
            except (json.JSONDecodeError, OSError):
                continue
    records.sort(key=lambda r: r.meta.get("created_at") or "")
    return records

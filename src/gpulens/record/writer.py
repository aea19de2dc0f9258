"""Crash-safe writers for the run record."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psutil
import pyarrow as pa
import pyarrow.parquet as pq

from gpulens.errors import RuntimeFailure
from gpulens.paths import unwritable_home
from gpulens.record import schema
from gpulens.record.redact import redact

# What a run record captures from the user's command line and environment: secrets are
# replaced (see gpulens.record.redact) before any of it reaches the disk.
REDACTED_FIELDS = ("requested_config", "effective_config", "environment", "summary", "error")

log = logging.getLogger(__name__)


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def new_run_id() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


def atomic_write_json(path: Path, data: dict[str, Any]) -> None:
    """Write JSON so that readers see the old or the new file, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, default=_json_default, allow_nan=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, a value JSON cannot hold: no half file left behind
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):  # numpy scalars
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


class SeriesWriter:
    """Appends rows of one time series; rows reach the disk at least every ``flush_interval_s``.

    Thread-safe. Rows are dicts whose keys are the schema's fields (missing keys are null).
    ``background``: a thread of its own writes the rows, so that ``append`` (on a training
    loop's thread) never waits for the disk; otherwise the ``append`` that finds a flush due
    writes them.
    """

    def __init__(
        self,
        path: Path,
        arrow_schema: pa.Schema,
        flush_interval_s: float = 1.0,
        background: bool = False,
    ):
        self.path = Path(path).with_suffix(schema.STREAM_SUFFIX)
        self.schema = arrow_schema
        self.flush_interval_s = flush_interval_s
        self._rows: list[dict[str, Any]] = []
        self._lock = threading.Lock()  # the rows; never held while writing
        self._io_lock = threading.Lock()  # the file; taken before _lock where both are
        self._file = open(self.path, "wb")  # noqa: SIM115 - stays open for the run's lifetime
        self._writer = pa.ipc.new_stream(self._file, arrow_schema)
        # An empty batch puts the schema on disk now, so a record killed before its first flush
        # still reads back with its columns.
        self._writer.write_batch(pa.RecordBatch.from_pylist([], schema=arrow_schema))
        self._file.flush()
        self._last_flush = time.monotonic()
        self.rows_written = 0
        self._closed = False
        self._closing = threading.Event()
        self._flusher: threading.Thread | None = None
        if background:
            self._flusher = threading.Thread(
                target=self._flush_loop, name=f"gpulens-flush-{self.path.stem}", daemon=True
            )
            self._flusher.start()

    def append(self, row: dict[str, Any]) -> None:
        with self._lock:
            self._rows.append(row)
            due = (
                self._flusher is None
                and time.monotonic() - self._last_flush >= self.flush_interval_s
            )
        if due:
            self.flush()

    def flush(self) -> None:
        with self._io_lock:
            self._write_pending()

    def _write_pending(self) -> None:
        """Write the rows appended so far (hold ``_io_lock``)."""
        with self._lock:
            rows, self._rows = self._rows, []
            self._last_flush = time.monotonic()
        if not rows or self._closed:
            return
        # from_pylist: a third of the time of building columns in Python; missing keys become
        # nulls either way
        self._writer.write_batch(pa.RecordBatch.from_pylist(rows, schema=self.schema))
        self._file.flush()  # into the page cache: survives the death of this process
        self.rows_written += len(rows)

    def _flush_loop(self) -> None:
        while not self._closing.wait(max(self.flush_interval_s, 0.01)):
            try:
                self.flush()
            except Exception as exc:  # a full disk must not kill the workload; close() retries
                log.warning("could not write series %s: %s", self.path.name, exc)
                return

    def close(self, compact: bool = True) -> Path:
        """Flush, close, and (by default) compact the stream into a Parquet file."""
        self._closing.set()
        if self._flusher is not None and self._flusher is not threading.current_thread():
            self._flusher.join(timeout=30)
        with self._io_lock:
            if self._closed:
                return self.path
            self._write_pending()
            self._writer.close()
            self._file.close()
            self._closed = True
        if not compact:
            return self.path
        parquet_path = self.path.with_suffix(schema.PARQUET_SUFFIX)
        table = pa.ipc.open_stream(pa.OSFile(str(self.path))).read_all()
        tmp = parquet_path.with_name("." + parquet_path.name + ".tmp")
        pq.write_table(table, tmp)
        os.replace(tmp, parquet_path)
        self.path.unlink()
        return parquet_path


class RunWriter:
    """Owns one run directory: ``run.json`` plus its series.

    The record is valid at every moment: ``run.json`` is replaced atomically, series are flushed at
    least once a second, and a heartbeat lets readers tell a live run from a dead one.
    """

    def __init__(
        self,
        runs_root: Path,
        kind: str,
        name: str | None = None,
        requested_config: dict[str, Any] | None = None,
        environment: dict[str, Any] | None = None,
        run_id: str | None = None,
        role: str | None = None,
    ):
        self.run_id = run_id or new_run_id()
        self.dir = Path(runs_root) / self.run_id
        try:
            (self.dir / schema.SERIES_DIR).mkdir(parents=True, exist_ok=False)
        except FileExistsError:
            raise
        except OSError as exc:  # GPULENS_HOME a file, unwritable, on a missing mount...
            raise unwritable_home(Path(runs_root), exc) from None
        proc = psutil.Process()
        self.meta: dict[str, Any] = {
            "schema_version": schema.SCHEMA_VERSION,
            "run_id": self.run_id,
            "name": name or self.run_id,
            "kind": kind,
            "role": role,  # the run's part in an experiment, e.g. "stalls:cached" (or None)
            "status": schema.STATUS_RUNNING,
            "pid": proc.pid,
            "pid_create_time": proc.create_time(),
            "hostname": socket.gethostname(),
            "created_at": now_iso(),
            "ended_at": None,
            "heartbeat_at": now_iso(),
            "requested_config": redact(requested_config or {}),  # and in update()
            "effective_config": {},
            "environment": redact(environment or {}),
            "summary": {},
            "unsupported": {},
            "error": None,
        }
        self._series: dict[str, SeriesWriter] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._first_save(Path(runs_root))
        self._heartbeat = threading.Thread(target=self._beat, name="gpulens-heartbeat", daemon=True)
        self._heartbeat.start()

    # --- metadata -------------------------------------------------------------------------
    def update(self, **fields: Any) -> None:
        with self._lock:
            for key, value in fields.items():
                if key in REDACTED_FIELDS:
                    value = redact(value)
                if isinstance(value, dict) and isinstance(self.meta.get(key), dict):
                    self.meta[key].update(value)
                else:
                    self.meta[key] = value
        self.save()

    def save(self) -> None:
        with self._lock:
            self.meta["heartbeat_at"] = now_iso()
            atomic_write_json(self.dir / schema.RUN_FILE, self.meta)

    def _first_save(self, runs_root: Path) -> None:
        """The first ``run.json``, or no folder at all: a folder without one is no record, and
        ``runs list`` and ``report`` would stumble on it."""
        try:
            self.save()
        except BaseException as exc:
            shutil.rmtree(self.dir, ignore_errors=True)
            if isinstance(exc, OSError):  # a full disk, a read-only folder...
                raise unwritable_home(runs_root, exc) from None
            if isinstance(exc, (TypeError, ValueError)):  # a value JSON cannot hold (NaN...)
                raise RuntimeFailure(
                    f"could not write the run record {self.run_id}: {exc} (a value of its "
                    "config or environment; report it with the command that made it)"
                ) from None
            raise

    def _beat(self) -> None:
        while not self._stop.wait(schema.HEARTBEAT_INTERVAL_S):
            try:
                self.save()
            except OSError as exc:  # a full disk must not kill the workload
                log.warning("heartbeat failed: %s", exc)

    # --- series ---------------------------------------------------------------------------
    def series(
        self,
        name: str,
        arrow_schema: pa.Schema,
        flush_interval_s: float = 1.0,
        background: bool = False,
    ) -> SeriesWriter:
        """A new series of this run (``background``: see :class:`SeriesWriter`)."""
        writer = SeriesWriter(
            self.dir / schema.SERIES_DIR / name, arrow_schema, flush_interval_s, background
        )
        self._series[name] = writer
        return writer

    def read_series(self, name: str):
        """Everything written so far to series ``name``, as a DataFrame (flushes it first)."""
        from gpulens.record.reader import read_series_table

        if name in self._series:
            self._series[name].flush()
        return read_series_table(self.dir / schema.SERIES_DIR / name).to_pandas()

    # --- end ------------------------------------------------------------------------------
    def finish(self, status: str = schema.STATUS_FINISHED, error: str | None = None) -> None:
        if status not in schema.STATUSES:
            raise ValueError(f"unknown status {status!r}")
        self._stop.set()
        for writer in self._series.values():
            try:
                writer.close(compact=True)
            except Exception as exc:  # keep the stream; the reader still reads it
                log.warning("could not compact series %s: %s", writer.path.name, exc)
        self.update(status=status, ended_at=now_iso(), error=error)

    def is_bare(self) -> bool:
        """Whether the record is still only its ``run.json``: no series opened, and nothing
        else in its folder (a wrapped command's or a DDP rank's files, a trace...)."""
        if self._series:
            return False
        try:
            names = {p.name for p in self.dir.iterdir() if not p.name.startswith(".")}
            return names <= {schema.RUN_FILE, schema.SERIES_DIR} and not any(
                (self.dir / schema.SERIES_DIR).iterdir()
            )
        except OSError:
            return False

    def discard(self) -> bool:
        """Remove the record (a run refused before it measured anything: see
        :mod:`gpulens.run.lifecycle`). ``run.json`` goes first, so that no reader ever sees a
        part of the record; False, with the record left as it was, where it cannot go."""
        self._stop.set()
        self._heartbeat.join(timeout=2 * schema.HEARTBEAT_INTERVAL_S)
        try:
            with self._lock:
                (self.dir / schema.RUN_FILE).unlink()
        except OSError as exc:
            log.warning("could not remove the record %s: %s", self.dir, exc)
            return False
        for writer in self._series.values():
            try:
                writer.close(compact=False)
            except Exception as exc:  # the folder goes anyway
                log.debug("closing series %s: %s", writer.path.name, exc)
        try:
            shutil.rmtree(self.dir)
        except OSError as exc:  # without its run.json the folder is no record: readers skip it
            log.warning("could not remove %s: %s", self.dir, exc)
        return True

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.meta["status"] != schema.STATUS_RUNNING:
            return
        if exc_type is None:
            self.finish()
        elif issubclass(exc_type, KeyboardInterrupt):
            self.finish(schema.STATUS_KILLED, error="interrupted (Ctrl-C)")
        else:
            self.finish(schema.STATUS_FAILED, error=str(exc) or exc_type.__name__)


def write_series_frame(record_dir: Path, name: str, frame) -> Path:
    """Write a whole series at once (a DataFrame known only at the end, e.g. one row per
    request of a load run) as ``series/<name>.parquet``, atomically."""
    path = Path(record_dir) / schema.SERIES_DIR / f"{name}{schema.PARQUET_SUFFIX}"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name("." + path.name + ".tmp")
    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), tmp)
    os.replace(tmp, path)
    return path


def amend_summary(record_dir: Path, **fields: Any) -> dict[str, Any]:
    """Add figures computed from an ended run's own series to its ``run.json`` summary (e.g. the
    paired fetch stall from its prep rows), atomically; returns the new summary. Raises
    ``ValueError`` for a run that is still running (its writer owns the file)."""
    path = Path(record_dir) / schema.RUN_FILE
    meta = json.loads(path.read_text())
    if meta.get("status") == schema.STATUS_RUNNING:
        raise ValueError(f"run {meta.get('run_id')} is still running: its writer owns run.json")
    meta["summary"] = {**(meta.get("summary") or {}), **redact(fields)}
    atomic_write_json(path, meta)
    return meta["summary"]

"""Reading run records, including those whose writer died."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import pyarrow as pa
import pyarrow.parquet as pq

from gpulens.errors import DamagedRecordError
from gpulens.record import schema
from gpulens.run.result import RunResult

if TYPE_CHECKING:  # pyarrow's to_pandas imports pandas when a frame is asked for; the CLI
    import pandas as pd  # starts without it (`gpulens --help`: 0.4 s less)

# The status shown for a record whose run.json cannot be read (never written by a writer).
STATUS_DAMAGED = "damaged"


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

    def result(self) -> RunResult:
        """The run as every analysis sees it: the same type a fresh run gives."""
        return RunResult.from_dict(self.meta, self.dir)

    def series_names(self) -> list[str]:
        d = self.dir / schema.SERIES_DIR
        if not d.is_dir():
            return []
        return sorted({p.stem for p in d.iterdir() if p.suffix in _SERIES_SUFFIXES})

    def series(self, name: str) -> pd.DataFrame:
        """One series as a DataFrame; an empty frame if the run never wrote it.

        Raises ``DamagedRecordError`` naming the file if its Parquet file is damaged.
        """
        return read_series_table(self.dir / schema.SERIES_DIR / name).to_pandas()


def rank_ids(steps: pd.DataFrame) -> list[int]:
    """The ranks of a steps frame with a ``rank`` column (a data-parallel run keeps every
    rank's steps in one series), sorted; ``[]`` without one."""
    if "rank" not in steps or steps.empty:
        return []
    return sorted({int(r) for r in steps["rank"].dropna()})


def first_rank_steps(steps: pd.DataFrame) -> pd.DataFrame:
    """The lowest rank's rows where ``steps`` holds several ranks' (each step once, as the
    summary's phases count it), the frame itself otherwise."""
    ranks = rank_ids(steps)
    return steps[steps["rank"] == ranks[0]] if len(ranks) > 1 else steps


@dataclass
class DamagedRecord:
    """A run directory whose ``run.json`` cannot be read: what is wrong and what still reads."""

    dir: Path
    file: Path
    problem: str
    readable: list[str] = field(default_factory=list)

    @property
    def run_id(self) -> str:
        return self.dir.name

    @property
    def status(self) -> str:
        return STATUS_DAMAGED

    def message(self) -> str:
        still = (
            f"its series can still be read ({', '.join(self.readable)})"
            if self.readable
            else "no series can be read from it"
        )
        return (
            f"run record {self.dir} is damaged: {self.file.name} {self.problem}; {still}. "
            f"Fix: restore {self.file} from a backup, or delete the record (rm -r {self.dir})"
        )

    def error(self) -> DamagedRecordError:
        return DamagedRecordError(self.message(), path=self.file)


_SERIES_SUFFIXES = (schema.PARQUET_SUFFIX, schema.STREAM_SUFFIX)


def read_series_table(base: Path) -> pa.Table:
    """``base.parquet``, or for a live or killed run every complete batch of ``base.arrows``."""
    parquet = base.with_suffix(schema.PARQUET_SUFFIX)
    if parquet.exists():
        try:
            return pq.read_table(parquet)
        except (pa.ArrowException, OSError) as exc:
            raise damaged_series_error(parquet, exc) from exc
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


def damaged_series_error(path: Path, exc: BaseException) -> DamagedRecordError:
    """The error for a series file that cannot be read, naming the file and the fix."""
    size = path.stat().st_size if path.exists() else 0
    why = "is empty" if size == 0 else f"cannot be read ({_first_line(exc)})"
    return DamagedRecordError(
        f"series file {path} {why}: the record's run.json and other series can still be read "
        f"(gpulens runs show {path.parent.parent.name}). Fix: restore the file from a backup, "
        f"or delete it to keep the rest of the record",
        path=path,
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


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


def _owner_alive_safe(meta: dict[str, Any]) -> bool:
    """``_owner_alive``, with a hand-edited pid or heartbeat counting as a dead owner."""
    try:
        return _owner_alive(meta)
    except (TypeError, ValueError, OverflowError):
        return False


def _readable_series(run_dir: Path) -> list[str]:
    """Names of the series in ``run_dir`` that read back (for a damaged record's message)."""
    names = []
    for name in RunRecord(run_dir).series_names():
        try:
            read_series_table(run_dir / schema.SERIES_DIR / name)
        except DamagedRecordError:
            continue
        names.append(name)
    return names


def _problem(path: Path) -> tuple[dict[str, Any] | None, str]:
    """``(meta, "")`` for a readable run.json, else ``(None, what is wrong with it)``."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None, "is missing"
    except OSError as exc:
        return None, f"cannot be read ({exc.strerror or exc})"
    if not raw.strip():
        return None, "is empty" if not raw else "holds only whitespace"
    try:
        meta = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return None, "is not UTF-8 text"
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno}"
        text = raw.decode("utf-8").strip()
        if exc.pos >= len(text) or (text[:1] in "{[" and text[-1:] not in "}]"):
            msg = exc.msg.removesuffix(" at")  # "Unterminated string starting at"
            return None, f"is truncated (the JSON ends early: {msg} at {where})"
        return None, f"is not valid JSON ({exc.msg} at {where})"
    if not isinstance(meta, dict):
        return None, f"holds a JSON {type(meta).__name__}, not an object"
    for key in ("run_id", "status"):
        if not isinstance(meta.get(key), str) or not meta.get(key):
            return None, f"has no '{key}'"
    return meta, ""


def inspect_record(run_dir: Path) -> RunRecord | DamagedRecord:
    """Read one record, or describe why it cannot be read (never raises for a damaged one)."""
    run_dir = Path(run_dir)
    path = run_dir / schema.RUN_FILE
    meta, problem = _problem(path)
    if meta is None:
        return DamagedRecord(run_dir, path, problem, _readable_series(run_dir))
    return _resolve(RunRecord(run_dir, meta))


def read_record(run_dir: Path) -> RunRecord:
    """Read one record. A ``running`` record whose owner is gone is reported as ``killed``.

    Raises ``FileNotFoundError`` if ``run_dir`` holds no run.json and ``DamagedRecordError``
    (naming the file, what still reads and the fix) if run.json cannot be read.
    """
    run_dir = Path(run_dir)
    path = run_dir / schema.RUN_FILE
    if not path.exists():
        raise FileNotFoundError(f"{run_dir} is not a gpulens run (no {schema.RUN_FILE})")
    found = inspect_record(run_dir)
    if isinstance(found, DamagedRecord):
        raise found.error()
    return found


def _resolve(record: RunRecord) -> RunRecord:
    meta = record.meta
    if meta.get("status") == schema.STATUS_RUNNING and not _owner_alive_safe(meta):
        meta["status"] = schema.STATUS_KILLED
        meta["error"] = meta.get("error") or "the process died before the run finished"
    return record


def scan_records(runs_root: Path) -> tuple[list[RunRecord], list[DamagedRecord]]:
    """Every record under ``runs_root``: the readable ones oldest first, and the damaged ones
    (a run.json that is empty, truncated or not an object) by directory name."""
    runs_root = Path(runs_root)
    if not runs_root.is_dir():
        return [], []
    records: list[RunRecord] = []
    damaged: list[DamagedRecord] = []
    for d in sorted(runs_root.iterdir()):
        if (d / schema.RUN_FILE).is_file():
            found = inspect_record(d)
            (damaged if isinstance(found, DamagedRecord) else records).append(found)
    records.sort(key=_run_order(records))
    return records, damaged


def _run_order(records: list[RunRecord]):
    """Oldest first by creation; a multi-node run's shards and its joined run sort together
    (at the family's first creation), shards by node, the joined run after them: it is the
    ``latest`` of a multi-node run, not whichever shard was written last."""

    def family(r: RunRecord) -> str:
        return str((r.meta.get(schema.SHARD_KEY) or {}).get("run_id") or r.run_id)

    first: dict[str, str] = {}
    for r in records:
        created = str(r.meta.get("created_at") or "")
        first[family(r)] = min(first.get(family(r), created), created)

    def key(r: RunRecord) -> tuple:
        shard = r.meta.get(schema.SHARD_KEY) or {}
        return first[family(r)], family(r), 0 if shard else 1, shard.get("node_rank", 0)

    return key


def list_records(runs_root: Path) -> list[RunRecord]:
    """Every readable record under ``runs_root``, oldest first (damaged ones left out: see
    ``scan_records``)."""
    return scan_records(runs_root)[0]


def _series_dir(run_dir: Path) -> Path:
    d = Path(run_dir) / schema.SERIES_DIR
    return d if d.is_dir() else Path(run_dir)


def read_prep(
    run_dir: str | Path,
    start_unix_s: float | None = None,
    end_unix_s: float | None = None,
) -> pd.DataFrame:
    """The prep rows of a run (``run_dir/series/prep_*`` or ``run_dir/prep_*``), one frame;
    only those within ``[start_unix_s, end_unix_s]`` where given (the measured window)."""
    d = _series_dir(Path(run_dir))
    stems = sorted(
        {
            p.name[: -len(p.suffix)]
            for p in d.glob(f"{schema.PREP_SERIES_PREFIX}*")
            if p.suffix in (schema.STREAM_SUFFIX, schema.PARQUET_SUFFIX)
        }
    )
    tables = [read_series_table(d / s) for s in stems]
    tables = [_conform_prep(t) for t in tables if t.num_columns]
    if not tables:
        return schema.PREP_SCHEMA.empty_table().to_pandas()
    df = pa.concat_tables(tables).to_pandas()
    if start_unix_s is not None:
        df = df[df["time_unix_s"] >= start_unix_s]
    if end_unix_s is not None:
        df = df[df["time_unix_s"] <= end_unix_s]
    return df


def _conform_prep(table: pa.Table) -> pa.Table:
    """``table`` in PREP_SCHEMA; columns that older records lack are null."""
    for f in schema.PREP_SCHEMA:
        if f.name not in table.column_names:
            table = table.append_column(f, pa.nulls(table.num_rows, f.type))
    return table.select(schema.PREP_SCHEMA.names).cast(schema.PREP_SCHEMA)

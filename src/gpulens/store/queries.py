"""Queries over the local run records, returning pandas DataFrames and plain data.

Nothing here prints or imports MLflow: the records on disk are the source of truth.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import sys
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from gpulens.errors import DamagedRecordError, UsageError
from gpulens.paths import runs_dir
from gpulens.record import schema
from gpulens.record.reader import (
    DamagedRecord,
    RunRecord,
    damaged_series_error,
    list_records,
    read_record,
    read_series_table,
    scan_records,
)
from gpulens.record.writer import atomic_write_json

if TYPE_CHECKING:  # imported where a frame is built: the CLI starts without pandas
    import pandas as pd

log = logging.getLogger("gpulens.store")

# Columns of ``load_runs`` that come before the flattened summary metrics, in this order.
BASE_COLUMNS = (
    "run_id",
    "name",
    "kind",
    "status",
    "created_at",
    "ended_at",
    "duration_s",
    "workload",
    "device",
    "gpu_model",
    "gpu_count",
    "hostname",
    "error",
    "record_dir",
)
KNOWN_SERIES = ("gpu", "host", "steps")
EXPORT_FORMATS = ("dir", "csv", "parquet", "json")
# Environment facts worth a row in ``compare_runs``.
COMPARE_ENV_KEYS = (
    "gpu_model",
    "gpu_count",
    "driver_version",
    "cuda_runtime",
    "torch",
    "cpu_model",
    "cpu_count_logical",
    "ram_bytes",
    "hostname",
    "git_commit",
)
REL_DIFF_COLUMN = "rel_diff_pct"


# ----------------------------------------------------------------------------- flattening
def flatten(obj: Any, sep: str = ".", keep_none: bool = False) -> dict[str, Any]:
    """Nested dicts (and lists of dicts) as one level: ``{"a": {"b": 1}}`` -> ``{"a.b": 1}``.

    Lists of dicts are indexed (``gpus.0.power_mean_w``); lists of scalars stay list values.
    ``None`` leaves are dropped unless ``keep_none`` (a missing number is absent, not zero).
    """
    out: dict[str, Any] = {}

    def walk(value: Any, key: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{key}{sep}{k}" if key else str(k))
        elif isinstance(value, (list, tuple)) and any(isinstance(v, (dict, list)) for v in value):
            for i, v in enumerate(value):
                walk(v, f"{key}{sep}{i}" if key else str(i))
        elif isinstance(value, (list, tuple)):
            if value and key:
                out[key] = list(value)
        elif value is None:
            if keep_none and key:
                out[key] = None
        elif key:
            out[key] = value

    walk(obj, "")
    return out


def is_number(value: Any) -> bool:
    """A finite int or float that is not a bool."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )


# ----------------------------------------------------------------------------- runs
def _records(home: Path | str | None) -> list[RunRecord]:
    return list_records(runs_dir(Path(home) if home else None))


def _scan(home: Path | str | None) -> tuple[list[RunRecord], list[DamagedRecord]]:
    return scan_records(runs_dir(Path(home) if home else None))


def damaged_facts(damaged: DamagedRecord) -> dict[str, Any]:
    """The ``BASE_COLUMNS`` of a damaged record: its id (the directory name), status
    ``damaged``, and in ``error`` which file is damaged, what still reads and the fix."""
    facts: dict[str, Any] = dict.fromkeys(BASE_COLUMNS)
    facts.update(
        run_id=damaged.run_id,
        status=damaged.status,
        error=damaged.message(),
        record_dir=str(damaged.dir),
    )
    return facts


def _parse_time(value: Any) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(str(value))
    except ValueError:
        return None


def duration_s(meta: dict[str, Any]) -> float | None:
    """Seconds from creation to end; None while running or when the end is unknown (killed)."""
    start, end = _parse_time(meta.get("created_at")), _parse_time(meta.get("ended_at"))
    if start is None or end is None:
        return None
    return (end - start).total_seconds()


def _first(*values: Any) -> Any:
    for value in values:
        if value not in (None, "", [], {}):
            return value
    return None


def serving_workload(kind: str, config: dict[str, Any]) -> str | None:
    """What a serving run served or loaded: ``serve: resnet50+bert`` / ``load: resnet50``."""
    items = config.get("models") if kind == "serve" else config.get("tenants")
    names = [str(i.get("name") or i.get("model")) if isinstance(i, dict) else str(i)
             for i in items or []]  # fmt: skip
    return f"{kind}: {'+'.join(names)}" if names else None


def run_facts(record: RunRecord) -> dict[str, Any]:
    """The ``BASE_COLUMNS`` of one record, as plain JSON-safe values."""
    meta = record.meta
    summary = meta.get("summary") or {}
    eff = meta.get("effective_config") or {}
    req = meta.get("requested_config") or {}
    env = meta.get("environment") or {}
    workload = _first(summary.get("workload"), eff.get("workload"), req.get("workload"))
    if workload is None and meta.get("kind") == "command":
        workload = _first(eff.get("command"), req.get("command"))
    if workload is None and meta.get("kind") in ("serve", "load"):
        workload = serving_workload(meta.get("kind"), eff or req)
    if isinstance(workload, (list, tuple)):
        workload = " ".join(map(str, workload))
    return {
        "run_id": meta.get("run_id"),
        "name": meta.get("name"),
        "kind": meta.get("kind"),
        "status": meta.get("status"),
        "created_at": meta.get("created_at"),
        "ended_at": meta.get("ended_at"),
        "duration_s": duration_s(meta),
        "workload": workload,
        "device": _first(summary.get("device"), eff.get("device"), req.get("device")),
        "gpu_model": env.get("gpu_model"),
        "gpu_count": env.get("gpu_count"),
        "hostname": _first(env.get("hostname"), meta.get("hostname")),
        "error": meta.get("error"),
        "record_dir": str(record.dir),
    }


def summary_metrics(record: RunRecord) -> dict[str, Any]:
    """The record's summary flattened with dotted names; keys that repeat a base column dropped."""
    flat = flatten(record.meta.get("summary") or {})
    return {k: v for k, v in flat.items() if k not in BASE_COLUMNS}


def load_runs(home: Path | str | None = None) -> pd.DataFrame:
    """All runs, one row each, oldest first.

    Columns: ``BASE_COLUMNS`` (``created_at``/``ended_at`` as UTC timestamps), then every
    flattened summary metric (``throughput_samples_per_s``, ``phases_s.data_wait``, ...) in sorted
    order. A metric a run did not measure is NaN/None. A record whose run.json cannot be read
    is a row of its own at the end, with status ``damaged`` and ``error`` naming the file.
    """
    import pandas as pd

    rows, metric_keys = [], set()
    records, damaged = _scan(home)
    for record in records:
        metrics = summary_metrics(record)
        metric_keys.update(metrics)
        rows.append({**run_facts(record), **metrics})
    for bad in damaged:
        log.warning("%s", bad.message())
        rows.append(damaged_facts(bad))
    columns = list(BASE_COLUMNS) + sorted(metric_keys)
    df = pd.DataFrame(rows, columns=columns)
    for col in ("created_at", "ended_at"):
        df[col] = pd.to_datetime(df[col], utc=True, errors="coerce", format="ISO8601")
    return df


def _not_a_run_dir(key: str, as_path: Path) -> None:
    """Raises the error for a ``key`` that names a path (an existing one, or one written as a
    path) holding no run: it is no run id, and no name matched it."""
    if as_path.exists() or key.startswith(("/", "./", "../", "~")):
        what = "is a folder without a run.json" if as_path.is_dir() else "is no run directory"
        inside = _run_dirs_inside(as_path)
        if inside:  # a folder of runs (a store's runs/, an unpacked bundle): name one
            more = f" (and {len(inside) - 1} more)" if len(inside) > 1 else ""
            raise UsageError(
                f"{key} {what} but holds run directories: give one, e.g. {inside[0]}{more}"
            )
        raise UsageError(
            f"{key} {what}: give a run directory (one holding run.json) or a run id from "
            "`gpulens runs list`"
        )


def _run_dirs_inside(folder: Path) -> list[Path]:
    """The run directories directly inside ``folder`` (none when it is not a folder)."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if (p / schema.RUN_FILE).is_file())


def find_run(id_or_prefix: str | Path, home: Path | str | None = None) -> RunRecord:
    """A record by run id, unique id prefix, exact name, ``latest``, or run directory path."""
    key = str(id_or_prefix).strip()
    if not key:
        raise UsageError("give a run id (or a unique prefix, or 'latest'): see `gpulens runs list`")
    as_path = Path(key).expanduser()
    if (as_path / schema.RUN_FILE).is_file():
        return read_record(as_path)
    records, damaged = _scan(home)
    if not records and not damaged:
        _not_a_run_dir(key, as_path)
        where = runs_dir(Path(home) if home else None)
        raise UsageError(f"no runs stored in {where}: start one with `gpulens run`")
    if key == "latest":
        if not records:
            raise damaged[-1].error()
        return records[-1]
    exact = [r for r in records if r.run_id == key]
    if exact:
        return exact[0]
    exact_bad = [d for d in damaged if d.run_id == key]
    if exact_bad:
        raise exact_bad[0].error()
    matches: list[RunRecord | DamagedRecord] = [r for r in records if r.run_id.startswith(key)]
    matches += [d for d in damaged if d.run_id.startswith(key)]
    if not matches:
        matches = [r for r in records if r.meta.get("name") == key]
    if len(matches) == 1:
        found = matches[0]
        if isinstance(found, DamagedRecord):
            raise found.error()
        return found
    if not matches:
        _not_a_run_dir(key, as_path)
        raise UsageError(f"no run matches '{key}': see `gpulens runs list`")
    shown = ", ".join(r.run_id for r in matches[:5]) + (", ..." if len(matches) > 5 else "")
    raise UsageError(
        f"'{key}' matches {len(matches)} runs ({shown}): give more characters of the run id"
    )


def load_series(run_id: str, series: str = "gpu", home: Path | str | None = None) -> pd.DataFrame:
    """One series (``gpu``, ``host``, ``steps``...) of a run; empty if the run never wrote it."""
    record = find_run(run_id, home)
    available = record.series_names()
    if series not in available and series not in KNOWN_SERIES:
        raise UsageError(
            f"run {record.run_id} has no series '{series}': "
            f"choose one of {', '.join(available) or '(none recorded)'}"
        )
    df = record.series(series)
    if df.columns.empty and series in KNOWN_SERIES:  # never written: its columns all the same
        return _empty_series(series).to_pandas()
    return df


def _empty_series(series: str) -> pa.Table:
    """A known series with no rows, in its documented columns."""
    if series == "gpu":
        from gpulens.probes.nvml.probe import GPU_SAMPLE_SCHEMA as arrow_schema
    elif series == "host":
        from gpulens.probes.host import HOST_SCHEMA as arrow_schema
    else:
        arrow_schema = schema.STEPS_SCHEMA
    return arrow_schema.empty_table()


def series_info(record: RunRecord) -> list[dict[str, Any]]:
    """Name, row count, storage format and columns of each series the record holds.

    A series whose file cannot be read has ``rows`` None, no columns and ``damaged``: what is
    wrong with which file and the fix; the others are listed as usual.
    """
    info = []
    for name in record.series_names():
        base = record.dir / schema.SERIES_DIR / name
        parquet = base.with_suffix(schema.PARQUET_SUFFIX)
        try:
            if parquet.exists():
                try:
                    meta = pq.ParquetFile(parquet).metadata
                    columns = list(pq.read_schema(parquet).names)
                except (pa.ArrowException, OSError) as exc:
                    raise damaged_series_error(parquet, exc) from exc
                rows, fmt = meta.num_rows, "parquet"
            else:
                table = read_series_table(base)
                rows, fmt, columns = table.num_rows, "arrow-stream", list(table.column_names)
        except DamagedRecordError as exc:
            damaged = {"rows": None, "format": "parquet", "columns": [], "damaged": str(exc)}
            info.append({"name": name, **damaged})
            continue
        info.append({"name": name, "rows": rows, "format": fmt, "columns": columns})
    return info


# ----------------------------------------------------------------------------- compare
def _config_rows(record: RunRecord) -> dict[str, Any]:
    meta = record.meta
    config = meta.get("effective_config") or meta.get("requested_config") or {}
    return {f"config.{k}": v for k, v in flatten(config).items()}


def _env_rows(record: RunRecord) -> dict[str, Any]:
    env = record.meta.get("environment") or {}
    return {f"env.{k}": env[k] for k in COMPARE_ENV_KEYS if env.get(k) is not None}


_META_ROWS = ("name", "kind", "status", "created_at", "duration_s")


def _row_group(key: str) -> int:
    if key in _META_ROWS:
        return 0
    if key.startswith("config."):
        return 1
    if key.startswith("env."):
        return 2
    return 3


def rel_diff_pct(first: Any, other: Any) -> float | None:
    """``(other - first) / |first|`` in percent; None if either is not a number or first is 0."""
    if not (is_number(first) and is_number(other)) or first == 0:
        return None
    return (float(other) - float(first)) / abs(float(first)) * 100.0


def compare_runs(records: list[RunRecord]) -> pd.DataFrame:
    """Runs side by side: one column per run (its id), one row per field.

    Rows: ``name``/``kind``/``status``/``created_at``/``duration_s``, ``config.*`` (effective
    config), ``env.*`` (key environment facts), then the flattened summary metrics, each group in
    order of first appearance. With exactly two runs a ``rel_diff_pct`` column gives the second
    relative to the first for numeric rows.
    """
    import pandas as pd

    if not records:
        raise UsageError("give at least one run to compare: see `gpulens runs list`")
    columns: list[str] = []
    for record in records:
        col, n = record.run_id, 2
        while col in columns:
            col, n = f"{record.run_id}#{n}", n + 1
        columns.append(col)
    per_run: list[dict[str, Any]] = []
    for record in records:
        facts = run_facts(record)
        rows: dict[str, Any] = {k: facts[k] for k in _META_ROWS}
        rows.update(_config_rows(record))
        rows.update(_env_rows(record))
        rows.update(summary_metrics(record))
        per_run.append(rows)
    seen: dict[str, None] = {}
    for rows in per_run:
        seen.update(dict.fromkeys(rows))
    index = sorted(seen, key=_row_group)  # stable: first appearance within each group
    data = {col: [rows.get(k) for k in index] for col, rows in zip(columns, per_run, strict=True)}
    df = pd.DataFrame(data, index=pd.Index(index, name="field"), columns=columns, dtype=object)
    if len(records) == 2:
        df[REL_DIFF_COLUMN] = [rel_diff_pct(per_run[0].get(k), per_run[1].get(k)) for k in index]
    return df


# ----------------------------------------------------------------------------- export
def json_safe(value: Any) -> Any:
    """``value`` with NaN/inf/NA replaced by None and numpy/pandas scalars made plain."""
    pandas = sys.modules.get("pandas")  # a pandas value exists only once pandas is imported
    if pandas is not None:
        if value is pandas.NA or value is pandas.NaT:
            return None
        if isinstance(value, pandas.Timestamp):
            return value.isoformat()
    if hasattr(value, "item") and not isinstance(value, (list, tuple, dict, str)):
        value = value.item()  # numpy scalar
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _fresh_dir(dest: Path) -> None:
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UsageError(f"{dest} already exists and is not empty: choose another --out")
    dest.mkdir(parents=True, exist_ok=True)


def export_run(record: RunRecord, dest: Path | str, fmt: str = "dir") -> Path:
    """Write a run to ``dest`` and return the path written.

    - ``dir``: a copy of the record directory at ``dest``.
    - ``csv`` / ``parquet``: ``dest/run.json`` (status resolved) and one file per series, live
      Arrow streams of a killed run included.
    - ``json``: one file (``dest``, or ``dest/<run_id>.json`` if ``dest`` is a directory) holding
      ``{"run": <run.json>, "series": {name: [rows]}}``.
    """
    if fmt not in EXPORT_FORMATS:
        choices = ", ".join(EXPORT_FORMATS)
        raise UsageError(f"unknown export format '{fmt}': choose one of {choices}")
    dest = Path(dest).expanduser()
    if fmt == "dir":
        if dest.exists():
            _fresh_dir(dest)
            dest.rmdir()
        shutil.copytree(record.dir, dest)
        return dest
    if fmt == "json":
        if dest.is_dir():
            dest = dest / f"{record.run_id}.json"
        if dest.exists():
            raise UsageError(f"{dest} already exists: choose another --out")
        dest.parent.mkdir(parents=True, exist_ok=True)
        series = {
            name: json.loads(record.series(name).to_json(orient="records"))
            for name in record.series_names()
        }
        doc = {"run": json_safe(record.meta), "series": series}
        tmp = dest.with_name(f".{dest.name}.tmp")
        tmp.write_text(json.dumps(doc, default=str, allow_nan=False))
        tmp.replace(dest)
        return dest
    # Read every series first: a damaged file stops the export before anything is written.
    tables = {
        name: read_series_table(record.dir / schema.SERIES_DIR / name)
        for name in record.series_names()
    }
    _fresh_dir(dest)
    atomic_write_json(dest / schema.RUN_FILE, json_safe(record.meta))
    trace = record.dir / schema.TRACE_FILE
    if trace.exists():
        shutil.copy2(trace, dest / schema.TRACE_FILE)
    for name, table in tables.items():
        if fmt == "csv":
            table.to_pandas().to_csv(dest / f"{name}.csv", index=False)
        else:
            pq.write_table(table, dest / f"{name}.parquet")
    return dest

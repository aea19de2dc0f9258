"""What a run record becomes in MLflow, as plain data: params (the flattened effective config),
metrics (the numeric summary), tags (environment and gpulens facts) and a downsampled copy of the
time series as step metrics. No MLflow here; :mod:`gpulens.store.mlflow_sink` sends it.
"""

from __future__ import annotations

import functools
import json
import math
import posixpath
import re
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

import numpy as np
import pandas as pd

from gpulens.record.reader import RunRecord
from gpulens.store.queries import flatten, is_number, run_facts

# Conservative limits that every MLflow server version accepts.
MAX_KEY_CHARS = 250
MAX_PARAM_VALUE_CHARS = 500
MAX_TAG_VALUE_CHARS = 5000
MAX_SERIES_POINTS = 500
# Series columns copied to MLflow as step metrics.
GPU_SERIES_COLUMNS = (
    "gpu_util_pct",
    "mem_util_pct",
    "mem_used_bytes",
    "power_w",
    "temperature_c",
    "sm_clock_mhz",
    "sm_activity_pct",
    "sm_occupancy_pct",
    "tensor_activity_pct",
    "dram_bw_util_pct",
    "pcie_rx_bytes_per_s",
    "pcie_tx_bytes_per_s",
)
HOST_SERIES_COLUMNS = (
    "cpu_util_pct",
    "proc_tree_cpu_pct",
    "mem_used_bytes",
    "disk_read_bytes_per_s",
    "disk_write_bytes_per_s",
    "net_rx_bytes_per_s",
    "net_tx_bytes_per_s",
)
STEPS_SERIES_COLUMNS = ("step_time_s", "gpu_step_time_s", "data_wait_s", "h2d_s", "compute_s")
# MLflow's UI shows metrics under ``system/`` in its "System metrics" section; where gpulens
# samples the quantity MLflow's own system-metrics monitor logs, it takes MLflow's name and unit
# (megabytes: 10^6 bytes), so both read alike. The rest keep gpulens's column names.
SYSTEM_PREFIX = "system/"
MLFLOW_GPU_NAMES = {
    "gpu_util_pct": ("utilization_percentage", 1.0),
    "mem_used_bytes": ("memory_usage_megabytes", 1e-6),
    "power_w": ("power_usage_watts", 1.0),
}
MLFLOW_HOST_NAMES = {
    "cpu_util_pct": ("cpu_utilization_percentage", 1.0),
    "mem_used_bytes": ("system_memory_usage_megabytes", 1e-6),
}
_BAD_KEY_CHARS = re.compile(r"[^\w./\- ]")


def mlflow_key(key: str) -> str:
    """A key MLflow accepts: allowed characters only, no path tricks, at most 250 chars."""
    key = _BAD_KEY_CHARS.sub("_", str(key)).strip() or "_"
    if posixpath.normpath(key) != key or key.startswith(("/", ".")):
        key = key.replace("/", "_").lstrip(".") or "_"
    return key[:MAX_KEY_CHARS]


def clipped_text(value: Any, limit: int) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def record_params(record: RunRecord) -> dict[str, str]:
    """Flattened effective config (requested config if the run never got that far)."""
    meta = record.meta
    config = meta.get("effective_config") or meta.get("requested_config") or {}
    return {
        mlflow_key(k): clipped_text(v, MAX_PARAM_VALUE_CHARS)
        for k, v in flatten(config, keep_none=True).items()
    }


def record_metrics(record: RunRecord) -> dict[str, float]:
    """Flattened numeric summary; None, NaN, bools and strings are left out."""
    summary = flatten(record.meta.get("summary") or {})
    return {mlflow_key(k): float(v) for k, v in summary.items() if is_number(v)}


def record_tags(record: RunRecord) -> dict[str, str]:
    """Environment (``env.*``), unsupported metrics, non-numeric summary fields, gpulens facts."""
    meta = record.meta
    facts = run_facts(record)
    tags: dict[str, Any] = {
        f"env.{k}": v for k, v in flatten(meta.get("environment") or {}).items()
    }
    tags.update({f"unsupported.{k}": v for k, v in flatten(meta.get("unsupported") or {}).items()})
    tags.update(
        {
            f"summary.{k}": v
            for k, v in flatten(meta.get("summary") or {}).items()
            if not isinstance(v, (int, float)) or isinstance(v, bool)
        }
    )
    tags.update(
        {
            "gpulens.run_id": record.run_id,
            "gpulens.status": record.status,
            "gpulens.kind": meta.get("kind"),
            "gpulens.name": meta.get("name"),
            "gpulens.workload": facts["workload"],
            "gpulens.device": facts["device"],
            "gpulens.created_at": meta.get("created_at"),
            "gpulens.ended_at": meta.get("ended_at"),
            "gpulens.error": meta.get("error"),
            "gpulens.record_dir": str(record.dir),
            "gpulens.schema_version": meta.get("schema_version"),
        }
    )
    return {
        mlflow_key(k): clipped_text(v, MAX_TAG_VALUE_CHARS)
        for k, v in tags.items()
        if v is not None
    }


def iso_to_ms(iso: str | None) -> int | None:
    if not iso:
        return None
    try:
        return int(datetime.fromisoformat(iso).timestamp() * 1000)
    except ValueError:
        return None


def downsample(df: pd.DataFrame, max_points: int = MAX_SERIES_POINTS) -> pd.DataFrame:
    """At most ``max_points`` rows: means over consecutive equal-count bins (numeric columns)."""
    if len(df) <= max_points:
        return df
    bins = np.arange(len(df)) * max_points // len(df)
    return df.select_dtypes("number").groupby(bins).mean().reset_index(drop=True)


def system_metric_key(source: str, column: str, gpu_index: int | None = None) -> tuple[str, float]:
    """The MLflow key of a sampled column, and the factor its values take: GPU columns become
    ``system/gpu_<index>_<name>``, host columns ``system/<name>`` (MLflow's names where it logs
    the same quantity, e.g. ``system/gpu_0_utilization_percentage``; otherwise
    ``system/gpu_0_sm_activity_pct``, ``system/host_disk_read_bytes_per_s``)."""
    if source == "gpu":
        name, scale = MLFLOW_GPU_NAMES.get(column, (column, 1.0))
        return f"{SYSTEM_PREFIX}gpu_{gpu_index}_{name}", scale
    if column in MLFLOW_HOST_NAMES:
        name, scale = MLFLOW_HOST_NAMES[column]
        return f"{SYSTEM_PREFIX}{name}", scale
    return f"{SYSTEM_PREFIX}host_{column}", 1.0


def series_metrics(
    record: RunRecord,
    max_points: int = MAX_SERIES_POINTS,
    after_unix_s: float | None = None,
    until_unix_s: float | None = None,
) -> list[tuple]:
    """``(key, value, timestamp_ms, step)`` points for MLflow, at most ``max_points`` per key;
    only samples after ``after_unix_s`` and up to ``until_unix_s`` where given (live logging
    sends a running record's series in such windows).

    GPU and host samples go under ``system/`` (see :func:`system_metric_key`), so that MLflow's
    UI shows them as system metrics; their step is the elapsed time in milliseconds since the
    record's first sample. Step metrics are ``steps/<column>`` with the training step number as
    step (warm-up steps included).
    """
    names = set(record.series_names())
    frames = {n: record.series(n) for n in ("gpu", "host", "steps") if n in names}
    times = [
        df["time_unix_s"].min()
        for df in frames.values()
        if "time_unix_s" in df.columns and df["time_unix_s"].notna().any()
    ]
    t0_s = float(min(times)) if times else 0.0
    if after_unix_s is not None or until_unix_s is not None:
        low = -math.inf if after_unix_s is None else after_unix_s
        high = math.inf if until_unix_s is None else until_unix_s
        frames = {
            n: df[(df["time_unix_s"] > low) & (df["time_unix_s"] <= high)]
            for n, df in frames.items()
            if "time_unix_s" in df.columns
        }
    points: list[tuple] = []

    def add(
        df: pd.DataFrame,
        name_of: Callable[[str], tuple[str, float]],
        columns: Iterable[str],
        by_step: bool,
    ) -> None:
        present = [c for c in columns if c in df.columns and df[c].notna().any()]
        if not present or "time_unix_s" not in df.columns:
            return
        keep = ["time_unix_s", *present] + (["step"] if by_step and "step" in df.columns else [])
        small = downsample(df[keep].astype("float64"), max_points)
        for col in present:
            key, scale = name_of(col)
            part = small[["time_unix_s", col] + (["step"] if "step" in small.columns else [])]
            part = part.dropna(subset=[col, "time_unix_s"])
            for row in part.itertuples(index=False):
                t_s, value = float(row[0]), float(row[1]) * scale
                step = int(round(row[2])) if len(row) > 2 else int(round((t_s - t0_s) * 1000))
                points.append((key, value, int(t_s * 1000), step))

    gpu = frames.get("gpu")
    if gpu is not None and "gpu_index" in gpu.columns:
        for index, part in gpu.groupby("gpu_index", sort=True):
            gpu_key = functools.partial(system_metric_key, "gpu", gpu_index=int(index))
            add(part.sort_values("time_unix_s"), gpu_key, GPU_SERIES_COLUMNS, False)
    if "host" in frames:
        host_key = functools.partial(system_metric_key, "host")
        add(frames["host"].sort_values("time_unix_s"), host_key, HOST_SERIES_COLUMNS, False)

    def under(prefix: str) -> Callable[[str], tuple[str, float]]:
        return lambda col: (f"{prefix}/{col}", 1.0)

    steps = frames.get("steps")
    if steps is not None and "step" in steps.columns:
        if "rank" in steps.columns and steps["rank"].notna().any():  # one series per rank
            for rank, part in steps.groupby("rank", sort=True):
                add(part.sort_values("step"), under(f"steps/rank{int(rank)}"),
                    STEPS_SERIES_COLUMNS, True)  # fmt: skip
        else:
            add(steps.sort_values("step"), under("steps"), STEPS_SERIES_COLUMNS, True)
    return points

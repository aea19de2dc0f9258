"""Names and constants of the run record format (see README, "The run record")."""

from __future__ import annotations

SCHEMA_VERSION = 1
RUN_FILE = "run.json"
SERIES_DIR = "series"
# While a run is live a series is an Arrow IPC stream appended batch by batch (a SIGKILL loses at
# most the batch being written); when the run ends it is compacted into one Parquet file.
STREAM_SUFFIX = ".arrows"
PARQUET_SUFFIX = ".parquet"
TRACE_FILE = "trace.json"

STATUS_RUNNING = "running"
STATUS_FINISHED = "finished"
STATUS_FAILED = "failed"
STATUS_KILLED = "killed"
STATUSES = (STATUS_RUNNING, STATUS_FINISHED, STATUS_FAILED, STATUS_KILLED)

# Seconds without a heartbeat after which a "running" record from another host counts as killed.
HEARTBEAT_STALE_S = 60.0
HEARTBEAT_INTERVAL_S = 5.0

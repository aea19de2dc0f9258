"""Names and constants of the run record format (see README, "The run record")."""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 1
RUN_FILE = "run.json"
SERIES_DIR = "series"
# While a run is live a series is an Arrow IPC stream appended batch by batch (a SIGKILL loses at
# most the batch being written); when the run ends it is compacted into one Parquet file.
STREAM_SUFFIX = ".arrows"
PARQUET_SUFFIX = ".parquet"
TRACE_FILE = "trace.json"
# run.json keys of a multi-node run: a node's shard, and the run joined from them
SHARD_KEY = "shard"
JOINED_KEY = "joined"

STATUS_RUNNING = "running"
STATUS_FINISHED = "finished"
STATUS_FAILED = "failed"
STATUS_KILLED = "killed"
STATUSES = (STATUS_RUNNING, STATUS_FINISHED, STATUS_FAILED, STATUS_KILLED)

# Seconds without a heartbeat after which a "running" record from another host counts as killed.
HEARTBEAT_STALE_S = 60.0
HEARTBEAT_INTERVAL_S = 5.0

# Columns of the step series (`series/steps`): one row per training step.
STEPS_SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("time_unix_s", pa.float64()),
        ("warmup", pa.bool_()),
        ("samples", pa.int64()),
        ("data_wait_s", pa.float64()),
        ("h2d_s", pa.float64()),
        ("compute_s", pa.float64()),
        ("step_time_s", pa.float64()),
        ("gpu_step_time_s", pa.float64()),
    ]
)

# Columns of the data-preparation series (`series/prep_*`, one per process): sample rows carry
# read/decode/augment, batch rows carry collate.
PREP_SERIES_PREFIX = "prep_"
PREP_SCHEMA = pa.schema(
    [
        pa.field("time_unix_s", pa.float64()),  # when the sample or batch was ready
        pa.field("rank", pa.int32()),
        pa.field("pid", pa.int32()),
        pa.field("worker_id", pa.int32()),  # -1: the main process
        pa.field("read_s", pa.float64()),  # sample rows
        pa.field("decode_s", pa.float64()),
        pa.field("augment_s", pa.float64()),
        pa.field("nbytes", pa.int64()),
        pa.field("collate_s", pa.float64()),  # batch rows
        pa.field("batch_samples", pa.int32()),
        pa.field("cpu_s", pa.float64()),  # both: thread CPU time of the sample or the collate
        pa.field("index", pa.int64()),  # sample rows: the dataset index (image folders)
    ]
)

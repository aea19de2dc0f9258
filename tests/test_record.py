"""The run record is complete at every moment and survives the death of its writer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pyarrow as pa
import pytest

from gpulens.record.reader import list_records, read_record, read_series_table
from gpulens.record.writer import RunWriter

SCHEMA = pa.schema([("time_unix_s", pa.float64()), ("value", pa.float64())])


def test_finished_record_round_trip(tmp_path):
    with RunWriter(tmp_path, kind="train", requested_config={"batch_size": 8}) as w:
        s = w.series("gpu", SCHEMA)
        for i in range(25):
            s.append({"time_unix_s": float(i), "value": i * 2.0})
        w.update(summary={"throughput_samples_per_s": 12.5})
    rec = read_record(w.dir)
    assert rec.status == "finished"
    assert rec.meta["requested_config"] == {"batch_size": 8}
    assert rec.meta["summary"]["throughput_samples_per_s"] == 12.5
    df = rec.series("gpu")
    assert list(df["value"]) == [i * 2.0 for i in range(25)]
    # Compacted to Parquet on finish; no stream left behind.
    assert (w.dir / "series" / "gpu.parquet").exists()
    assert not (w.dir / "series" / "gpu.arrows").exists()


def test_exception_marks_failed_and_interrupt_marks_killed(tmp_path):
    with pytest.raises(RuntimeError), RunWriter(tmp_path, kind="train") as w1:
        raise RuntimeError("boom")
    assert read_record(w1.dir).status == "failed"
    assert read_record(w1.dir).meta["error"] == "boom"
    with pytest.raises(KeyboardInterrupt), RunWriter(tmp_path, kind="train") as w2:
        raise KeyboardInterrupt
    assert read_record(w2.dir).status == "killed"


def test_series_flushed_within_interval_while_running(tmp_path):
    w = RunWriter(tmp_path, kind="train")
    s = w.series("host", SCHEMA, flush_interval_s=0.05)
    s.append({"time_unix_s": 0.0, "value": 1.0})
    time.sleep(0.06)
    s.append({"time_unix_s": 1.0, "value": 2.0})  # triggers the flush of both rows
    table = read_series_table(w.dir / "series" / "host")
    assert table.num_rows == 2
    assert read_record(w.dir).status == "running"  # our own live process
    w.finish()


class _SlowDisk:
    """A series file whose flush takes ``delay_s`` (a disk stalled by writeback)."""

    def __init__(self, f, delay_s: float):
        self._f, self.delay_s = f, delay_s
        self.inside = threading.Event()

    def flush(self):
        self.inside.set()
        time.sleep(self.delay_s)
        self._f.flush()

    def close(self):
        self._f.close()


def test_a_background_series_never_makes_append_wait_for_the_disk(tmp_path):
    w = RunWriter(tmp_path, kind="train")
    s = w.series("steps", SCHEMA, flush_interval_s=0.01, background=True)
    s._file = disk = _SlowDisk(s._file, delay_s=0.5)
    s.append({"time_unix_s": 0.0, "value": 0.0})
    assert disk.inside.wait(2.0)  # the flusher thread is stuck on the disk
    t0 = time.perf_counter()
    for i in range(1, 101):
        s.append({"time_unix_s": float(i), "value": float(i)})
    assert time.perf_counter() - t0 < 0.1  # the loop went on meanwhile
    w.finish()
    assert list(read_record(w.dir).series("steps")["value"]) == [float(i) for i in range(101)]

    # the same disk without the thread: the append that finds a flush due waits for it
    w2 = RunWriter(tmp_path, kind="train")
    inline = w2.series("steps", SCHEMA, flush_interval_s=0.0)
    inline._file = _SlowDisk(inline._file, delay_s=0.3)
    t0 = time.perf_counter()
    inline.append({"time_unix_s": 0.0, "value": 0.0})
    assert time.perf_counter() - t0 >= 0.3
    w2.finish()


def test_a_background_series_reaches_the_disk_without_further_appends(tmp_path):
    w = RunWriter(tmp_path, kind="train")
    s = w.series("steps", SCHEMA, flush_interval_s=0.05, background=True)
    for i in range(3):
        s.append({"time_unix_s": float(i), "value": float(i)})
    deadline = time.monotonic() + 5.0
    while read_series_table(w.dir / "series" / "steps").num_rows < 3:
        assert time.monotonic() < deadline, "rows never reached the disk"
        time.sleep(0.02)
    # closing wakes the thread rather than waiting out a long interval, and loses nothing
    late = w.series("late", SCHEMA, flush_interval_s=60.0, background=True)
    for i in range(1000):
        late.append({"time_unix_s": float(i), "value": float(i)})
    t0 = time.perf_counter()
    w.finish()
    assert time.perf_counter() - t0 < 5.0
    assert len(read_record(w.dir).series("late")) == 1000


def test_truncated_stream_keeps_complete_batches(tmp_path):
    w = RunWriter(tmp_path, kind="train")
    s = w.series("gpu", SCHEMA, flush_interval_s=0)
    for i in range(3):
        s.append({"time_unix_s": float(i), "value": float(i)})
    path = w.dir / "series" / "gpu.arrows"
    size = path.stat().st_size
    with open(path, "r+b") as f:  # a writer killed mid-batch leaves half a batch
        f.truncate(size - 7)
    table = read_series_table(w.dir / "series" / "gpu")
    assert table.num_rows == 2


def test_dead_owner_reads_as_killed(tmp_path):
    w = RunWriter(tmp_path, kind="train")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    meta = json.loads((w.dir / "run.json").read_text())
    meta["pid"] = dead.pid
    (w.dir / "run.json").write_text(json.dumps(meta))
    w._stop.set()  # stop the heartbeat so it does not rewrite the pid
    rec = read_record(w.dir)
    assert rec.status == "killed"
    assert "died" in rec.meta["error"]
    assert [r.run_id for r in list_records(tmp_path)] == [w.run_id]


WRITER_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import pyarrow as pa
    from gpulens.record.writer import RunWriter
    schema = pa.schema([("time_unix_s", pa.float64()), ("value", pa.float64())])
    w = RunWriter(sys.argv[1], kind="train", run_id="victim")
    s = w.series("gpu", schema, flush_interval_s=0.2)
    i = 0
    while True:
        s.append({"time_unix_s": time.time(), "value": float(i)})
        i += 1
        if i == 5:
            print("ready", flush=True)
        time.sleep(0.01)
    """
)


@pytest.mark.parametrize("delay_s", [0.0, 0.35, 1.3])
def test_sigkill_at_several_points_leaves_a_readable_killed_record(tmp_path, delay_s):
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER_SCRIPT, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(delay_s)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    rec = read_record(tmp_path / "victim")
    assert rec.status == "killed"
    df = rec.series("gpu")
    # Flushed at least every 0.2 s: at most the last ~0.2 s (plus scheduling slack) is lost.
    expected_min = int(delay_s / 0.02)
    assert len(df) >= expected_min
    assert list(df["value"]) == [float(i) for i in range(len(df))]


def test_command_record_exists_before_the_slow_start_up(tmp_path, monkeypatch):
    """A run stopped while NVML starts or torch imports (the first seconds) leaves a record:
    killed, with the requested command."""
    from gpulens.launch import command
    from gpulens.probes.nvml import inventory
    from gpulens.record.reader import list_records

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt

    # measured_run starts NVML (describe_gpus) before it captures the environment
    monkeypatch.setattr(inventory, "describe_gpus", interrupted)
    with pytest.raises(KeyboardInterrupt):
        command.run_command(["true", "--epochs", "1"], tmp_path / "runs")
    (rec,) = list_records(tmp_path / "runs")
    assert rec.status == "killed"
    assert rec.meta["requested_config"]["command"] == "true --epochs 1"


@pytest.mark.parametrize(
    ("trouble", "expected"),
    [("full disk", "free space there, or set GPULENS_HOME"), ("NaN", "could not write the run")],
)
def test_a_failed_first_save_leaves_no_folder(tmp_path, monkeypatch, trouble, expected):
    """run.json could not be written at all (a full disk, a value JSON cannot hold): the record
    folder was left behind without one, half a temporary file in it, for `runs list` and
    `report` to stumble on. Now nothing is left, and the error is one line naming the fix."""
    import errno

    from gpulens.errors import GpulensError
    from gpulens.record import writer as writer_module

    config: dict = {"lr": 0.1}
    if trouble == "full disk":

        def no_space(fd):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(writer_module.os, "fsync", no_space)
    else:
        config["lr"] = float("nan")
    runs = tmp_path / "runs"
    with pytest.raises(GpulensError) as caught:
        RunWriter(runs, kind="train", requested_config=config)
    assert expected in str(caught.value) and "\n" not in str(caught.value)
    assert list(runs.iterdir()) == []  # no folder, no temporary file
    monkeypatch.undo()
    with RunWriter(runs, kind="train", requested_config={"lr": 0.1}) as w:  # the next one works
        pass
    assert [r.run_id for r in list_records(runs)] == [w.run_id]

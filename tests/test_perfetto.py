"""`gpulens export RUN --perfetto`: a run recorded on a real H100 as a trace-event document."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpulens.cli import main
from gpulens.record.reader import read_prep, read_record
from gpulens.report.perfetto import (
    GPU_COUNTERS,
    PID_STEPS,
    TORCH_PID_OFFSET,
    perfetto_trace,
    torch_events,
)

FIXTURES = Path(__file__).parent / "fixtures"
JPEG = FIXTURES / "record_h100_resnet50_jpeg"
PAIRED = FIXTURES / "prep_h100_resnet50_paired"


def _by(events, ph, **match):
    return [e for e in events if e["ph"] == ph and all(e.get(k) == v for k, v in match.items())]


def test_steps_become_slices_with_their_phases_inside():
    record = read_record(JPEG)
    steps = record.series("steps")
    trace = perfetto_trace(record)
    events = trace["traceEvents"]
    slices = _by(events, "X", pid=PID_STEPS)
    step_slices = [e for e in slices if e["cat"] in ("step", "warmup")]
    assert len(step_slices) == len(steps)
    assert sum(e["cat"] == "warmup" for e in step_slices) == int(steps["warmup"].sum())
    by_name = {e["name"]: e for e in step_slices}
    for row in steps.itertuples():
        step = by_name[f"step {row.step}"]
        assert step["dur"] == round(row.step_time_s * 1e6, 3)
    # Every phase lies inside a step, and the phases of a step never outlast it.
    phases = [e for e in slices if e["cat"] == "phase"]
    assert {e["name"] for e in phases} == {"data wait", "h2d", "compute"}
    starts = sorted((s["ts"], s["ts"] + s["dur"]) for s in step_slices)
    for p in phases:
        inside = [s for s in starts if s[0] - 1e-3 <= p["ts"] and p["ts"] + p["dur"] <= s[1] + 1e-3]
        assert inside, p
    assert min(e["ts"] for e in events if "ts" in e) >= 0


def test_gpu_samples_become_counter_tracks():
    record = read_record(JPEG)
    gpu = record.series("gpu")
    events = perfetto_trace(record)["traceEvents"]
    for name in GPU_COUNTERS:
        assert len(_by(events, "C", name=name)) <= len(gpu)
    activity = _by(events, "C", name="activity %")
    assert len(activity) == len(gpu)
    assert [e["args"]["gpu_util_pct"] for e in activity] == list(gpu["gpu_util_pct"])
    memory = _by(events, "C", name="memory GiB")
    assert memory[-1]["args"]["mem_used_bytes"] == gpu["mem_used_bytes"].iloc[-1] / 2**30


def test_loader_workers_get_a_track_each_with_their_stages():
    record = read_record(PAIRED)
    prep = read_prep(PAIRED)
    events = perfetto_trace(record)["traceEvents"]
    names = {e["args"]["name"] for e in _by(events, "M", name="thread_name")}
    assert names >= {f"worker {int(w)}" for w in prep["worker_id"].unique()}
    loader = [e for e in events if e["ph"] == "X" and e["cat"] == "loader"]
    samples = prep[prep["read_s"].notna()]
    assert sum(e["name"] == "decode" for e in loader) == samples["decode_s"].notna().sum()
    total_read_us = sum(e["dur"] for e in loader if e["name"] == "read")
    assert abs(total_read_us - samples["read_s"].sum() * 1e6) < 1e-3 * len(samples) + 1


def test_export_command_writes_a_loadable_trace(tmp_path, capsys):
    out = tmp_path / "trace.json"
    assert main(["export", str(JPEG), "--perfetto", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    trace = json.loads(out.read_text())
    assert doc["events"] == len(trace["traceEvents"]) > 0
    assert trace["metadata"]["gpulens_run_id"] == read_record(JPEG).run_id
    assert trace["displayTimeUnit"] == "ms"


def test_export_to_a_missing_folder_is_a_usage_error(tmp_path, capsys):
    assert main(["export", str(JPEG), "--perfetto", str(tmp_path / "no" / "t.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_torch_profiler_steps_follow_the_measured_ones_and_merge_into_the_trace(tmp_path):
    """`gpulens run --torch-profiler N`: N steps after the measured window, under the
    profiler; `gpulens export --perfetto` lays them on the run's time line by the marker."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "GPULENS_HOME": str(tmp_path / "home")}
    run = subprocess.run(
        [sys.executable, "-m", "gpulens.cli", "run", "tiny_cnn", "--device", "cpu", "--steps",
         "20", "--torch-profiler", "3", "--no-store", "--json"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-1500:]
    doc = json.loads(run.stdout)
    assert doc["measured_steps"] == 20  # the profiled steps are not measured ones
    record = read_record(Path(doc["record_dir"]))
    assert record.meta["torch_profiler"]["steps"] == 3
    trace = perfetto_trace(record)
    assert trace["metadata"]["torch_profiler_aligned_by"] == "marker"
    events = trace["traceEvents"]
    ours = [e for e in events if e.get("cat") in ("step", "warmup") and e["pid"] == 1]
    last_step_end_us = max(e["ts"] + e["dur"] for e in ours)
    profiled = sorted(e["ts"] for e in events if str(e.get("name")).startswith("gpulens step"))
    assert len(profiled) == 3
    # after the measured steps, and within seconds of them (the same clock)
    assert last_step_end_us <= profiled[0] < last_step_end_us + 10e6
    names = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert any(n.startswith("torch.profiler:") for n in names)
    assert not any(e.get("name") == "gpulens:align" for e in events)


def test_an_external_profiler_trace_without_the_marker_is_aligned_by_its_clock():
    trace = {"baseTimeNanoseconds": 1_000_000_000_000_000_000, "traceEvents": [
        {"ph": "X", "name": "aten::mm", "pid": 7, "tid": 7, "ts": 2_000_000.0, "dur": 10.0},
        {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "python"}},
    ]}  # fmt: skip
    events, how = torch_events(trace, t0=1_000_000_001.0, align_unix_s=None)
    assert how == "profiler clock"
    mm = next(e for e in events if e["name"] == "aten::mm")
    assert mm["ts"] == pytest.approx(1_000_000.0) and mm["pid"] == 7 + TORCH_PID_OFFSET
    assert next(e for e in events if e["ph"] == "M")["args"]["name"] == "torch.profiler: python"

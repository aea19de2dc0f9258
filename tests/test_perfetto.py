"""`gpulens export RUN --perfetto`: a run recorded on a real H100 as a trace-event document."""

from __future__ import annotations

import json
from pathlib import Path

from gpulens.cli import main
from gpulens.record.reader import read_prep, read_record
from gpulens.report.perfetto import GPU_COUNTERS, PID_STEPS, perfetto_trace

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

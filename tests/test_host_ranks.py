"""Every rank's steps of a built-in data-parallel run on one host (`--gpus N`): one steps
series with a rank column, the straggler check over the ranks, and the readers of the steps
(report, trace, predict) that must count each step once."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from gpulens.cli import main
from gpulens.record.reader import first_rank_steps, read_record
from gpulens.report.perfetto import step_events
from gpulens.workloads.host_ranks import (
    SLOW_RANK_ENV,
    rank_summary,
    slow_rank_delay_s,
)

STEPS = 8
BATCH = 8
DELAY_S = 0.1  # rank 1 waits this long for each batch: a slow loader on one GPU


def test_two_ranks_on_one_host_keep_each_ranks_steps_and_flag_the_slow_one(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("GPULENS_HOME", str(tmp_path))
    monkeypatch.setenv(SLOW_RANK_ENV, f"1:{DELAY_S}")  # the spawned ranks inherit it
    argv = ["run", "tiny_cnn", "--gpus", "2", "--device", "cpu", "--steps", str(STEPS),
            "--batch-size", str(BATCH), "--no-store", "--json"]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["world_size"] == 2 and [r["rank"] for r in doc["ranks"]] == [0, 1]
    assert all(r["measured_steps"] == STEPS for r in doc["ranks"])
    # rank 1 waits for its data; rank 0 waits for rank 1 in the all-reduce (its compute)
    assert [(s["rank"], s["phase"]) for s in doc["stragglers"]] == [(1, "data_wait")]
    assert doc["straggler_threshold_pct"] == 10.0 and doc["step_time_median_s"] > DELAY_S
    slow, fast = doc["ranks"][1]["phases_s"], doc["ranks"][0]["phases_s"]
    assert slow["data_wait"] > 0.8 * DELAY_S > fast["data_wait"]

    # the summary counts every sample once: rank 0's steps times the global batch
    record = read_record(Path(doc["record_dir"]))
    s = record.meta["summary"]
    assert s["measured_steps"] == STEPS and s["stragglers"] == doc["stragglers"]
    assert s["throughput_samples_per_s"] == pytest.approx(2 * BATCH * STEPS / s["measured_wall_s"])
    assert s["throughput_samples_per_s"] == pytest.approx(
        sum(r["throughput_samples_per_s"] for r in s["ranks"]), rel=0.02
    )
    # one steps series, a rank column, each row the rank's own batch
    steps = pq.read_table(record.dir / "series" / "steps.parquet").to_pandas()
    measured = steps[~steps["warmup"]]
    assert measured.groupby("rank").size().to_dict() == {0: STEPS, 1: STEPS}
    assert set(steps["samples"]) == {BATCH}
    assert measured["samples"].sum() == 2 * BATCH * STEPS
    assert not list((record.dir / "series").glob("steps-rank*"))

    # runs show and the trace read it; the trace has a track per rank
    assert main(["runs", "show", record.run_id, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["summary"]["stragglers"] == doc["stragglers"]
    trace = tmp_path / "trace.json"
    assert main(["export", record.run_id, "--perfetto", str(trace)]) == 0
    tracks = {e["args"]["name"] for e in json.loads(trace.read_text())["traceEvents"]
              if e.get("name") == "thread_name" and e["pid"] == 1}  # fmt: skip
    assert tracks == {"rank 0 steps", "rank 1 steps"}


def _rows(step_s: float, data_wait_s: float, n: int = 10) -> list[dict]:
    return [
        {
            "step": i,
            "warmup": i < 2,
            "step_time_s": step_s,
            "data_wait_s": data_wait_s,
            "h2d_s": 0.0,
            "compute_s": step_s - data_wait_s,
            "samples": 16,
        }  # fmt: skip
        for i in range(n)
    ]


def test_rank_summary_names_the_rank_that_waits_for_data():
    summary = rank_summary({0: (_rows(0.1, 0.0), 0.8), 1: (_rows(0.1, 0.05), 0.8)}, 2, 8)
    assert summary["world_size"] == 2 and summary["ranks_reported"] == 2
    assert [(s["rank"], s["phase"]) for s in summary["stragglers"]] == [(1, "data_wait")]
    assert [r["samples_total"] for r in summary["ranks"]] == [64, 64]  # 8 measured x batch 8
    assert [r["throughput_samples_per_s"] for r in summary["ranks"]] == [80.0, 80.0]
    even = rank_summary({0: (_rows(0.1, 0.0), 0.8), 1: (_rows(0.1, 0.001), 0.8)}, 2, 8)
    assert even["stragglers"] == []


def test_slow_rank_hook_names_one_rank_and_ignores_nonsense():
    assert slow_rank_delay_s(1, {SLOW_RANK_ENV: "1:0.25"}) == 0.25
    assert slow_rank_delay_s(0, {SLOW_RANK_ENV: "1:0.25"}) == 0.0
    assert slow_rank_delay_s(1, {SLOW_RANK_ENV: "one"}) == 0.0
    assert slow_rank_delay_s(1, {}) == 0.0


def _two_rank_steps() -> pd.DataFrame:
    rows = []
    for rank, compute_s in ((0, 0.02), (1, 0.03)):
        for step in range(4):
            rows.append({"step": step, "rank": rank, "warmup": False, "time_unix_s": 100.0 + step,
                         "step_time_s": 0.05, "data_wait_s": 0.01, "h2d_s": 0.0,
                         "compute_s": compute_s, "samples": 8})  # fmt: skip
    return pd.DataFrame(rows)


def test_readers_take_each_step_once_from_a_series_of_several_ranks():
    steps = _two_rank_steps()
    first = first_rank_steps(steps)
    assert len(first) == 4 and set(first["rank"]) == {0}
    assert first_rank_steps(steps[steps["rank"] == 1]).equals(steps[steps["rank"] == 1])
    # the trace: one track per rank, each step's slice on its rank's track
    events = step_events(steps, 99.0)
    slices = [e for e in events if e.get("cat") == "step"]
    assert sorted((e["tid"], e["name"]) for e in slices) == sorted(
        (1 + r, f"step {s}") for r in (0, 1) for s in range(4)
    )
    one = step_events(steps[steps["rank"] == 0], 99.0)
    assert {e["tid"] for e in one if e.get("cat") == "step"} == {1}


def test_predict_and_compare_read_rank_0s_steps_of_a_run_that_keeps_every_ranks(
    tmp_path, monkeypatch
):
    """A 2-GPU run's steps series holds both ranks': predict's step-to-step spread (and the
    GPU busy time) are rank 0's, as the summary's phases are, not both ranks' pooled; the
    comparison's histogram has each step once."""
    import shutil

    from gpulens.predict.features import run_facts

    fixture = sorted((Path(__file__).parent / "fixtures" / "predict_batch_h200").iterdir())[0]
    one = read_record(fixture)
    two_dir = tmp_path / "two"
    shutil.copytree(fixture, two_dir)
    steps_file = two_dir / "series" / "steps.parquet"
    steps = pd.read_parquet(steps_file)
    other = steps.assign(compute_s=3 * steps["compute_s"], gpu_step_time_s=1.0)
    both = pd.concat([steps.assign(rank=0), other.assign(rank=1)], ignore_index=True)
    both.to_parquet(steps_file)
    meta = json.loads((two_dir / "run.json").read_text())
    (two_dir / "run.json").write_text(json.dumps({**meta, "name": "two ranks"}))
    facts, base = run_facts(read_record(two_dir)), run_facts(one)
    assert facts.compute_steps_s == base.compute_steps_s and facts.compute_steps_s
    assert facts.gpu_busy_s == base.gpu_busy_s
    assert facts.slowest_of_ratio(2) == base.slowest_of_ratio(2)

    # the comparison's step-time histogram counts each step once too
    from gpulens.report import document

    drawn = {}
    monkeypatch.setattr(document.figures, "step_time_figure", lambda t: drawn.update(t))
    document.comparison_section([one, read_record(two_dir)])
    measured = int((~steps["warmup"].astype(bool)).sum())
    assert [len(v) for v in drawn.values()] == [measured, measured]


def test_the_terminal_summary_names_the_straggler():
    """Rank 0's phases hide a slow rank (rank 0 waits for it in the all-reduce, its compute):
    the run's summary on the terminal names it."""
    import io

    from rich.console import Console

    from gpulens.report.terminal import render_train_summary

    base = {"workload": "tiny_cnn", "device": "2x cpu", "precision": "fp32", "batch_size": 8,
            "processes": 2, "global_batch_size": 16, "measured_steps": 10, "warmup_steps": 2,
            "stop_reason": "steps", "throughput_samples_per_s": 100.0,
            "phases_s": {"data_wait": 0.0, "h2d": 0.0, "compute": 0.15, "step": 0.15},
            "gpu": None, "host": None, "mfu": None}  # fmt: skip
    ranks = rank_summary({0: (_rows(0.15, 0.0), 1.2), 1: (_rows(0.15, 0.1), 1.2)}, 2, 8)

    def shown(summary: dict) -> str:
        buf = io.StringIO()
        render_train_summary(Console(file=buf, width=300), "r1", Path("/x"), summary)
        return buf.getvalue()

    assert "2 of 2; straggler: rank 1 (data wait 100.00 ms, +33% of the median step)" in shown(
        {**base, **ranks}
    )
    even = rank_summary({0: (_rows(0.15, 0.0), 1.2), 1: (_rows(0.15, 0.0), 1.2)}, 2, 8)
    assert "2 of 2, no straggler" in shown({**base, **even})
    assert "straggler" not in shown(base)  # one process: no ranks line

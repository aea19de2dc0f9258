"""The run summary names what the monitor costs for what it is, and shows the interval."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from gpulens.cli.run import train_json
from gpulens.report.terminal import render_train_summary
from gpulens.run import RunResult

BASE = {
    "workload": "tiny_cnn",
    "device": "cpu",
    "precision": "fp32",
    "batch_size": 8,
    "measured_steps": 20,
    "warmup_steps": 2,
    "stop_reason": "steps",
    "throughput_samples_per_s": 1234.5,
    "throughput_ci95_pct": 2.5,
    "phases_s": {"data_wait": 0.001, "h2d": 0.0, "compute": 0.005, "step": 0.006},
    "gpu": None,
    "host": {"cpu_util_pct": 50.0, "proc_tree_cpu_pct": 90.0},
    "mfu": None,
    "flops_per_sample": None,
    "workers": 0,
}


def _render(summary: dict) -> str:
    buf = io.StringIO()
    render_train_summary(Console(file=buf, width=200), "r1", Path("/x/[r1]"), summary)
    return buf.getvalue()


def test_new_monitor_fields_and_interval():
    summary = {
        **BASE,
        "sampler_cpu_pct_of_core": 3.25,
        "tracking_us_per_step": 41.0,
        "throughput_ci95_samples_per_s": [1200.0, 1270.0],
    }
    text = _render(summary)
    assert "sampler CPU (share of one core)" in text and "3.25%" in text
    assert "gpulens time per step" in text and "41.0 µs" in text
    assert "1,200.0–1,270.0" in text
    assert "monitor overhead" not in text
    assert "/x/[r1]" in text  # a path is not markup
    doc = train_json(RunResult(run_id="r1", record_dir=Path("/x"), kind="train", summary=summary))
    assert doc["sampler_cpu_pct_of_core"] == 3.25 and doc["tracking_us_per_step"] == 41.0
    assert doc["throughput_ci95_samples_per_s"] == [1200.0, 1270.0]
    assert "monitor_overhead_pct" not in doc


def test_old_records_fall_back_to_monitor_overhead_pct():
    summary = {**BASE, "monitor_overhead_pct": 7.6}
    text = _render(summary)
    assert "sampler CPU (share of one core)" in text and "7.60%" in text
    assert "gpulens time per step" not in text  # not measured in old records: not shown
    doc = train_json(RunResult(run_id="r1", record_dir=Path("/x"), kind="train", summary=summary))
    assert doc["sampler_cpu_pct_of_core"] == 7.6 and doc["tracking_us_per_step"] is None
    assert "throughput_ci95_samples_per_s" not in doc


def test_run_and_demo_share_one_json_builder_with_fixed_keys():
    import gpulens.cli.run as cli_run

    summary = {**BASE, "sampler_cpu_pct_of_core": 1.0, "tracking_us_per_step": 2.0}
    doc = cli_run.train_json(
        RunResult(run_id="r1", record_dir=Path("/x"), kind="demo", summary=summary)
    )
    assert list(doc) == [
        "run_id", "status", "record_dir", "workload", "device", "precision", "batch_size",
        "measured_steps", "throughput_samples_per_s", "throughput_ci95_pct", "phases_s", "gpu",
        "host", "sampler_cpu_pct_of_core", "tracking_us_per_step", "mfu", "flops_per_sample",
    ]  # fmt: skip
    with_skips = {**summary, "skipped_samples": 2, "skipped_files_total": 1, "skipped_files": []}
    result = RunResult(run_id="r1", record_dir=Path("/x"), kind="train", summary=with_skips)
    doc = cli_run.train_json(result)
    assert list(doc)[-3:] == ["skipped_samples", "skipped_files_total", "skipped_files"]


def test_a_command_stopped_at_duration_says_so_and_when_nothing_was_measured():
    """Not the signal's exit code (-2, 143): the stop was asked for. With no step measured
    (a script still starting when --duration ended it), the summary says why."""
    from types import SimpleNamespace

    from gpulens.report.terminal import render_command_summary

    buf = io.StringIO()
    result = SimpleNamespace(status="finished", returncode=143, run_id="r1", record_dir="/x",
                             summary={"stop_reason": "duration", "wall_s": 12.7})  # fmt: skip
    render_command_summary(Console(file=buf, width=200), result)
    text = buf.getvalue()
    assert "stopped at --duration" in text and "exit code" not in text
    assert "no steps measured" in text and "longer --duration" in text


def test_the_demo_names_the_run_command_its_tips_apply_to(capsys, monkeypatch, tmp_path):
    """The demo's tips said "try more --workers" and "use --until-ci 2", options the demo does
    not take: it also prints its job as a `gpulens run` command, with the data it made."""
    import gpulens.cli.run as cli_run
    from gpulens.cli import main

    monkeypatch.setenv("GPULENS_HOME", str(tmp_path))
    made = []

    def make_images(out, n, progress):  # the folder the config checks, without the JPEGs
        made.append(out)
        out.mkdir(parents=True)

    monkeypatch.setattr("gpulens.data.datagen.make_images", make_images)
    summary = {**BASE, "throughput_ci95_pct": 24.8, "workers": 1}
    monkeypatch.setattr(
        cli_run,
        "train_and_store",
        lambda config, store, kind, label: RunResult(
            run_id="r1", record_dir=tmp_path / "runs" / "r1", kind="demo", summary=summary
        ),
    )
    assert main(["demo", "--device", "cpu", "--no-store"]) == 0
    out = capsys.readouterr().out
    text = " ".join(out.split())
    assert "use --until-ci 2" in text  # a `gpulens run` option ...
    data = tmp_path / "demo-data" / "images"
    assert made == [data]
    # ... and the command to use it on, on a line of its own and never broken (a long data
    # path was split across two lines: pasted back, it named a folder that does not exist)
    command = f"gpulens run tiny_cnn --data {data} --batch-size 32 --precision fp32 --workers 1"
    assert len(command) > 80 and f"`{command}`" in [line.strip() for line in out.splitlines()]


def test_tips_break_lines_between_words_never_inside_a_command():
    from gpulens.report.terminal import wrap_keeping_commands

    tip = "compare runs with `gpulens runs compare RUN RUN`; list them with `gpulens runs list`"
    lines = wrap_keeping_commands(tip, 76)
    assert lines == [
        "compare runs with `gpulens runs compare RUN RUN`; list them with",
        "`gpulens runs list`",
    ]
    long = "try: `gpulens run tiny_cnn --data /a/very/long/path/to/the/images --batch-size 32`"
    assert wrap_keeping_commands(long, 40) == ["try:", long[5:]]  # longer than a line: whole
    assert " ".join(wrap_keeping_commands(tip, 10)) == tip

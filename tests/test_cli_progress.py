"""Progress on stderr: never `0/None`, and plain lines per phase when stderr is not a terminal."""

from __future__ import annotations

import io
import json

from rich.console import Console

import gpulens.cli.common as common
from gpulens.cli import main
from gpulens.report.progress import ProgressReporter


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _plain_console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=False, width=200), buf


def test_phases_print_a_line_when_they_start_and_end_off_a_terminal():
    console, buf = _plain_console()
    clock = FakeClock()
    with ProgressReporter(console, "stalls", clock=clock) as progress:
        progress.phase("ingestion_free run")
        clock.now += 12.34
        progress.phase("cached run")
        clock.now += 75
    assert buf.getvalue().splitlines() == [
        "stalls: ingestion_free run ...",
        "stalls: ingestion_free run done in 12.3 s",
        "stalls: cached run ...",
        "stalls: cached run done in 1 min 15 s",
    ]


def test_counts_print_at_most_one_line_per_interval_and_never_none():
    console, buf = _plain_console()
    clock = FakeClock()
    with ProgressReporter(console, "run", unit="steps", interval_s=10, clock=clock) as progress:
        for step in range(1, 101):
            clock.now += 0.5
            progress.count(step, None, "training tiny_cnn")
    lines = buf.getvalue().splitlines()
    assert lines[0] == "run: training tiny_cnn: 1 step"  # not "1 steps"
    assert lines[-1] == "run: done, 100 steps in 49.5 s"
    assert 4 <= len(lines) <= 7  # one line per 10 s of a 50 s loop, plus first and last
    assert "None" not in buf.getvalue()


def test_an_error_leaves_no_done_line():
    console, buf = _plain_console()
    try:
        with ProgressReporter(console, "stalls", clock=FakeClock()) as progress:
            progress.phase("cold run")
            raise RuntimeError("x")
    except RuntimeError:
        pass
    assert buf.getvalue().splitlines() == ["stalls: cold run ..."]


def test_a_terminal_shows_no_zero_of_none():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=100)
    with ProgressReporter(console, "colocate") as progress:
        progress.phase("[bold]resnet18[/] alone")  # a job name is not markup
        progress._rich.refresh()
    text = buf.getvalue()
    assert "0/None" not in text and "/None" not in text
    assert "[bold]resnet18[/] alone" in text


def test_stalls_reports_each_phase_on_stderr_with_json(capsys, tmp_path, monkeypatch):
    import gpulens.stalls as stalls

    class Result:
        runs = {"ingestion_free": None}
        all_runs: dict = {}

        def as_dict(self):
            return {"breakdown_pct": {}}

    def fake_run_stalls(config, runs_root, progress=None, on_step=None, budget=None):
        progress("ingestion_free run")
        on_step(5, 10, 1.0, {})  # a run's steps inside its phase: no extra line off a terminal
        progress("cached run")
        return Result()

    data = tmp_path / "images"
    data.mkdir()
    monkeypatch.setattr(stalls, "run_stalls", fake_run_stalls)
    monkeypatch.setattr(common, "err", Console(stderr=True, force_terminal=False, width=200))
    code = main(["stalls", "tiny_cnn", "--data", str(data), "--no-store", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert json.loads(captured.out) == {"breakdown_pct": {}}  # stdout: the one document
    lines = captured.err.splitlines()
    assert lines[0] == "stalls: ingestion_free run ..."
    assert lines[1].startswith("stalls: ingestion_free run done in ")
    assert lines[2] == "stalls: cached run ..."
    assert lines[3].startswith("stalls: cached run done in ")
    assert len(lines) == 4

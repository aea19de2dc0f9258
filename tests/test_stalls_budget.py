"""``gpulens stalls --time-budget``: the budget holds the whole breakdown, its runs included.

`stalls tiny_cnn --workers 1 --storage-latency-ms 20 --time-budget 60` took 131 s on an H200:
the budget only bounded the repeats, and each needed run got --max-duration (60 s) whatever the
budget. Here the runs are faked at the backend, on a fake clock: each costs a fixed start-up
plus the measured seconds it was given, so no assertion depends on this machine's speed.
"""

from __future__ import annotations

import logging
import time

import pytest

from gpulens.stalls.budget import MIN_MEASURED_S, TimeBudget


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    from gpulens.data.datagen import make_images

    out = tmp_path_factory.mktemp("budget") / "images"
    make_images(out, 160)
    return out


class _Done(Exception):
    """Raised by the fake backend once the breakdown's needed runs are made."""


def _fake_runs(monkeypatch, overhead_s: float, step_s: float, stop_after: int):
    """Fake the training backend and the clock; returns the (role, options) of each run."""
    from gpulens.data import pagecache
    from gpulens.run import RunResult
    from gpulens.stalls import runner

    clock = [1000.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    made: list[tuple[str, dict]] = []

    def fake_run(self, role, **options):
        seconds = options.get("duration_s") or options.get("duration_cap_s")
        made.append((role, options))
        clock[0] += overhead_s + (seconds or 600.0)
        if len(made) == stop_after:
            raise _Done
        summary = {
            "device": "cpu", "batch_size": 2, "workers": 1, "throughput_samples_per_s": 100.0,
            "throughput_ci95_pct": 2.0, "measured_wall_s": seconds,
            "measured_steps": int(seconds / step_s), "phases_s": {"step": 0.02, "data_wait": 0.0},
        }  # fmt: skip
        return RunResult(run_id=f"r{len(made)}", record_dir=".", kind="stalls", summary=summary)

    monkeypatch.setattr(runner.TrainingBackend, "run", fake_run)
    evicted = pagecache.EvictResult("posix_fadvise", 1.0, 0.0, "")
    monkeypatch.setattr(pagecache, "evict", lambda _files: evicted)
    monkeypatch.setattr(pagecache, "warm", lambda _files: 0)
    return made, clock


@pytest.mark.parametrize("latency_ms", [0.0, 20.0])  # a cold pass over the files; emulated
def test_the_needed_runs_share_the_budget(images, monkeypatch, latency_ms):
    from gpulens.stalls import StallsConfig, run_stalls

    made, clock = _fake_runs(monkeypatch, overhead_s=5.0, step_s=0.05, stop_after=3)
    config = StallsConfig("tiny_cnn", str(images), device="cpu", workers=1, time_budget_s=60,
                          storage_latency_s=latency_ms / 1000, fetch_design="separate")  # fmt: skip
    started_s = clock[0]  # the default budget starts with run_stalls
    with pytest.raises(_Done):
        run_stalls(config, images.parent / "runs")
    assert [role for role, _ in made] == ["ingestion_free", "cached", "cold"]
    # every run had a length, the cold pass over the files too (a cap on its steps)
    for role, options in made:
        assert (options.get("duration_s") or options.get("duration_cap_s") or 0) > 0, role
    if not latency_ms:
        assert made[2][1]["steps"] and made[2][1]["duration_cap_s"]
    # the runs end within the budget, less what is kept for after them (0.5 s), and use it
    assert 0.9 * 60.0 <= clock[0] - started_s <= 60.0, made


def test_a_budget_below_an_honest_run_says_so_with_one_that_works(images, monkeypatch, caplog):
    from gpulens.stalls import StallsConfig, run_stalls

    # runs cost 10 s beside their window, steps take 0.5 s (10 steps: 5 s each at the least)
    made, clock = _fake_runs(monkeypatch, overhead_s=10.0, step_s=0.5, stop_after=3)
    config = StallsConfig("tiny_cnn", str(images), device="cpu", workers=1, time_budget_s=30,
                          fetch_design="separate")  # fmt: skip
    started_s = clock[0]
    with caplog.at_level(logging.WARNING, "gpulens.stalls"), pytest.raises(_Done):
        run_stalls(config, images.parent / "runs")
    (line,) = [r.getMessage() for r in caplog.records if "--time-budget" in r.getMessage()]
    assert line.startswith("--time-budget 30 s is below what this breakdown needs here")
    # the least budget named would hold the runs as they went, each measured 10 steps
    named = float(line.rsplit("--time-budget ", 1)[1].split()[0])
    assert named >= clock[0] - started_s + 0.5
    assert all(o.get("duration_s", o.get("duration_cap_s")) >= 5.0 for _, o in made[1:])


def test_a_budget_that_cannot_hold_the_runs_stops_before_any_run(images, capsys, monkeypatch):
    from gpulens.cli import main
    from gpulens.stalls import runner

    def refuse(*_args, **_kwargs):
        raise AssertionError("a run started")

    monkeypatch.setattr(runner, "run_training", refuse)
    code = main(["stalls", "tiny_cnn", "--data", str(images), "--device", "cpu",
                 "--time-budget", "5", "--no-store"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2, err
    assert "cannot hold the 3 runs this breakdown needs" in err and "Traceback" not in err
    assert "give --time-budget" in err


def test_the_budget_splits_what_is_left_over_the_runs_to_come():
    b = TimeBudget(100.0, 60.0, started_s=time.perf_counter() - 10.0, finish_s=4.0)
    # 86 s left for 3 runs at a first guess of 3 s each beyond their window
    assert b.measure_s(3) == pytest.approx((100 - 10 - 4) / 3 - 3.0, abs=0.1)
    assert TimeBudget(1000.0, 60.0).measure_s(3) == 60.0  # never past --max-duration
    assert TimeBudget(5.0, 60.0).measure_s(3) == MIN_MEASURED_S  # never below an honest run
    b.ran(wall_s=20.0, measured_wall_s=12.0, measured_steps=12)  # 8 s beside, 1 s a step
    assert b.per_run_overhead_s() == 8.0 and b.least_measured_s() == pytest.approx(10.0)
    assert b.fits(2) == (b.elapsed_s() + 4.0 + 2 * 18.0 <= 100.0)

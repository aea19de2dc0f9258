"""The tracking API under torchrun: one run for all ranks, per-rank steps and summaries, the
ranks combined, stragglers named, and no failure inside gpulens ever reaching the user's loop."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpulens.record.reader import list_records, read_record
from gpulens.record.tracker import combine, read_tracker_summary
from gpulens.workloads import tracking
from gpulens.workloads.tracking import Tracker
from gpulens.workloads.tracking_ranks import RankInfo, rank_info

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_tracked.py"

# Rank R runs 12 steps of 5 ms, rank 1 of 15 ms (a straggler), and rank 0 ends first: before
# ranks had files of their own, rank 0 compacted and deleted the shared steps.arrows under
# rank 1, whose close then failed and took the job down with exit 1.
RANK_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import gpulens
    rank = int(os.environ["RANK"])
    steps, pause_s = (12, 0.005) if rank == 0 else (12, 0.015)
    with gpulens.track(name="ranks", warmup_steps=2) as tracker:
        for batch in tracker.data([list(range(8))] * steps):
            time.sleep(pause_s)
            if rank == 1 and os.environ.get("FAIL_RANK1") and len(batch) == 8:
                raise RuntimeError("rank 1 blew up")
    print(f"rank {rank} done", file=sys.stderr)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_env(rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")}
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        GPULENS_STORE="0",
        PYTHONPATH=str(REPO / "src"),
        **extra,
    )
    return env


def _run_ranks(script: Path, world: int = 2, **extra: str) -> list[subprocess.CompletedProcess]:
    """``world`` rank processes started together by this (one) parent, as a launcher does."""
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env=_rank_env(r, world, port, **extra),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    done = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


# ----------------------------------------------------------------------------- pure parts
@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, RankInfo()),
        ({"WORLD_SIZE": "1", "RANK": "0"}, RankInfo()),
        (
            {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
            RankInfo(3, 4, 1, 2),
        ),
        ({"WORLD_SIZE": "2", "LOCAL_RANK": "1"}, RankInfo(1, 2, 1, 2)),  # no RANK: LOCAL_RANK
        ({"WORLD_SIZE": "2", "RANK": "5"}, RankInfo()),  # out of range: a single process
        ({"WORLD_SIZE": "two", "RANK": "1"}, RankInfo()),  # not a number
        ({"WORLD_SIZE": "2"}, RankInfo()),  # no rank at all
    ],
)
def test_rank_info_from_the_environment(env, expected):
    assert rank_info(env) == expected


def _doc(rank, rate, step_s, wait_s, pct=None, status="finished"):
    return {
        "rank": rank,
        "status": status,
        "measured_steps": 10,
        "steps_total": 12,
        "samples_total": 96,
        "throughput_samples_per_s": rate,
        "throughput_ci95_pct": pct,
        "phases_s": {"data_wait": wait_s, "h2d": None, "compute": step_s - wait_s, "step": step_s},
    }


def test_combine_sums_throughput_takes_the_slowest_rank_and_names_stragglers():
    docs = {
        0: _doc(0, 800.0, 0.010, 0.001, pct=4.0),
        1: _doc(1, 790.0, 0.0101, 0.0011, pct=3.0),
        2: _doc(2, 500.0, 0.016, 0.006, pct=5.0),  # 60 % slower than the median
        3: _doc(3, 805.0, 0.0099, 0.001, pct=4.0),
    }
    s = combine(docs, world_size=4, pct=10.0)
    assert s["throughput_samples_per_s"] == pytest.approx(2895.0)
    assert s["samples_total"] == 4 * 96
    assert s["slowest_rank"] == 2 and s["phases_s"]["step"] == 0.016
    assert s["step_time_median_s"] == pytest.approx(0.01005)
    assert 0 < s["throughput_ci95_pct"] < 4.0  # independent ranks: tighter than each
    by_phase = {(x["rank"], x["phase"]) for x in s["stragglers"]}
    assert by_phase == {(2, "step"), (2, "data_wait")}
    worst = s["stragglers"][0]
    assert worst["rank"] == 2 and worst["above_median_pct"] == pytest.approx(59.2, abs=0.1)
    assert [r["rank"] for r in s["ranks"]] == [0, 1, 2, 3]
    assert s["ranks"][2]["throughput_samples_per_s"] == 500.0
    # under DDP all step times agree and the wait for data shows who holds the others up
    docs = {r: _doc(r, 800.0, 0.010, 0.001) for r in range(3)}
    docs[1]["phases_s"]["data_wait"] = 0.004
    s = combine(docs, world_size=3, pct=10.0)
    assert [(x["rank"], x["phase"]) for x in s["stragglers"]] == [(1, "data_wait")]
    assert s["throughput_ci95_pct"] is None  # a rank without an interval: none combined


def test_combine_within_the_threshold_names_no_straggler():
    docs = {r: _doc(r, 100.0, 0.010 + r * 0.0005, 0.001) for r in range(4)}
    assert combine(docs, 4, pct=10.0)["stragglers"] == []


# ----------------------------------------------------------------------------- never fatal
def test_a_failure_inside_the_tracker_never_reaches_the_loop(tmp_path, monkeypatch, caplog):
    run_dir = tmp_path / "run"
    (run_dir / "series").mkdir(parents=True)
    monkeypatch.setenv("GPULENS_RUN_DIR", str(run_dir))

    def broken(*_args, **_kwargs):
        raise ValueError("disk on fire")

    monkeypatch.setattr(tracking.StepTimer, "end_step", broken)
    seen = []
    logger = "gpulens.workloads.tracking"
    with caplog.at_level(logging.WARNING, logger=logger), Tracker(warmup_steps=0) as tracker:
        for batch in tracker.data([[i] * 4 for i in range(6)]):
            seen.append(batch[0])
            tracker.step()
    assert seen == list(range(6))  # every batch reached the loop
    warnings = [r for r in caplog.records if "gpulens tracking stopped" in r.getMessage()]
    assert len(warnings) == 1 and "disk on fire" in warnings[0].getMessage()
    summary = read_tracker_summary(run_dir)
    assert "step: ValueError: disk on fire" in summary["tracking_error"]


def test_a_tracker_that_cannot_start_passes_batches_through(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("GPULENS_RUN_DIR", str(tmp_path / "missing" / "run"))
    with caplog.at_level(logging.WARNING, logger="gpulens.workloads.tracking"):
        with Tracker() as tracker:
            got = [b for b in tracker.data(range(5)) if tracker.step() is None]
        assert tracker.summary()["measured_steps"] == 0
    assert got == list(range(5))
    assert "gpulens tracking stopped (start failed" in caplog.text


def test_the_loop_s_own_errors_still_reach_the_script(tmp_path, monkeypatch):
    monkeypatch.setenv("GPULENS_RUN_DIR", str(tmp_path))
    (tmp_path / "series").mkdir()

    def loader():
        yield 1
        raise OSError("image file is truncated")

    with pytest.raises(OSError, match="truncated"), Tracker() as tracker:
        for _ in tracker.data(loader()):
            pass
    assert read_tracker_summary(tmp_path)["steps_total"] == 1


# ----------------------------------------------------------------------------- ranks
def test_ranks_inside_a_run_of_gpulens_write_their_own_steps(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(RANK_SCRIPT)
    run_dir = tmp_path / "run"
    (run_dir / "series").mkdir(parents=True)
    done = _run_ranks(script, GPULENS_RUN_DIR=str(run_dir))
    for p in done:
        assert p.returncode == 0, p.stderr
    summary = read_tracker_summary(run_dir)  # what `gpulens run` does once the command ended
    assert summary["world_size"] == 2 and summary["ranks_reported"] == 2
    rates = [r["throughput_samples_per_s"] for r in summary["ranks"]]
    assert summary["throughput_samples_per_s"] == pytest.approx(sum(rates))
    assert summary["slowest_rank"] == 1
    assert summary["phases_s"]["step"] == summary["ranks"][1]["phases_s"]["step"]
    assert [s["rank"] for s in summary["stragglers"] if s["phase"] == "step"] == [1]
    series = sorted(p.name for p in (run_dir / "series").iterdir())
    assert series == ["steps.parquet"]  # the ranks' files were merged
    import pyarrow.parquet as pq

    steps = pq.read_table(run_dir / "series" / "steps.parquet").to_pandas()
    assert steps.groupby("rank").size().to_dict() == {0: 12, 1: 12}
    assert read_tracker_summary(run_dir) == summary  # idempotent


def test_ranks_on_their_own_share_one_run(tmp_path, gpulens_home):
    script = tmp_path / "train.py"
    script.write_text(RANK_SCRIPT)
    done = _run_ranks(script, GPULENS_HOME=str(gpulens_home))
    for p in done:
        assert p.returncode == 0, p.stderr
    (rec,) = list_records(gpulens_home / "runs")  # one run, not one per rank
    assert rec.status == "finished" and rec.meta["kind"] == "script"
    assert rec.meta["requested_config"]["world_size"] == 2
    s = rec.meta["summary"]
    assert s["world_size"] == 2 and [r["rank"] for r in s["ranks"]] == [0, 1]
    assert s["measured_steps"] == 10 and s["samples_total"] == 2 * 12 * 8
    assert any(x["rank"] == 1 for x in s["stragglers"])
    steps = rec.series("steps")
    assert sorted(steps["rank"].unique()) == [0, 1]
    assert len(rec.series("host")) >= 1  # the monitor ran once, in the rank that made the run
    assert not list((gpulens_home / "groups").glob("*.json"))  # the group file is gone


def test_a_failing_rank_fails_the_run_and_its_steps_are_kept(tmp_path, gpulens_home):
    script = tmp_path / "train.py"
    script.write_text(RANK_SCRIPT)
    done = _run_ranks(script, GPULENS_HOME=str(gpulens_home), FAIL_RANK1="1")
    assert done[0].returncode == 0, done[0].stderr
    assert done[1].returncode == 1 and "rank 1 blew up" in done[1].stderr  # the script's own
    (rec,) = list_records(gpulens_home / "runs")
    assert rec.status == "failed" and rec.meta["error"] == "rank 1: rank 1 blew up"
    assert rec.meta["summary"]["ranks"][1]["status"] == "failed"
    assert sorted(rec.series("steps")["rank"].unique()) == [0, 1]


def _torchrun(*args: str) -> list[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    return [*launcher, "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), *args]


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(GPULENS_HOME=str(home), GPULENS_STORE="0", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(REPO / "src")
    return env


@pytest.mark.slow
@pytest.mark.parametrize("script", ["tracked", "unmodified"])
def test_torchrun_under_gpulens_run(tmp_path, script):
    """The issue's command: `gpulens run -- torchrun --nproc_per_node 2 train_tracked.py`, with
    the tracker lines and without them (each rank's steps injected)."""
    home = tmp_path / "home"
    cmd = [sys.executable, "-m", "gpulens.cli", "run", "--no-store", "--json", "--"]
    cmd += _torchrun(str(EXAMPLE), "--epochs", "1")
    if script == "unmodified":
        cmd.append("--no-track")
    p = subprocess.run(cmd, env=_env(home), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["status"] == "finished" and doc["returncode"] == 0
    rec = read_record(Path(doc["record_dir"]))
    s = rec.meta["summary"]
    assert s["world_size"] == 2 and s["ranks_reported"] == 2
    assert s["throughput_samples_per_s"] == pytest.approx(
        sum(r["throughput_samples_per_s"] for r in s["ranks"])
    )
    steps = rec.series("steps")
    assert steps.groupby("rank").size().to_dict() == {0: 16, 1: 16}  # 4096 / 2 ranks / 128
    assert len(list_records(home / "runs")) == 1


@pytest.mark.slow
def test_torchrun_on_its_own_makes_one_run(tmp_path):
    home = tmp_path / "home"
    p = subprocess.run(
        _torchrun(str(EXAMPLE), "--epochs", "1"),
        env=_env(home),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    (rec,) = list_records(home / "runs")
    assert rec.status == "finished"
    assert rec.meta["summary"]["world_size"] == 2
    assert rec.series("steps").groupby("rank").size().to_dict() == {0: 16, 1: 16}

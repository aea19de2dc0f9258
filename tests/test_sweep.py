"""gpulens sweep: spec validation, stable cell hashes, and a real CPU sweep that is killed midway
and resumed, with one cell that fails (an invalid batch size: a usage error, not retried) and is
recorded as failed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from signals import default_sigint

from gpulens.cli import main
from gpulens.errors import UsageError
from gpulens.sweep.cells import Cell, config_hash, expand
from gpulens.sweep.spec import parse_spec

SPEC = """name: cpu-smoke
command: run
cells:
  - {workload: tiny_cnn, batch_size: 2}
  - {workload: tiny_cnn, batch_size: 3}
  - {workload: tiny_cnn, batch_size: 0}
options: {steps: 2, device: cpu, no_store: true}  # the store is not what a sweep tests
"""


def test_hash_is_stable_across_key_order_and_changes_with_a_value():
    a = {"command": "run", "workload": "tiny_cnn", "batch_size": 4, "steps": 2}
    b = dict(reversed(list(a.items())))
    assert config_hash(a) == config_hash(b)
    assert Cell(a).cell_id == Cell(b).cell_id
    assert config_hash(a) != config_hash({**a, "batch_size": 8})


def test_grid_expands_to_the_product_and_argv_is_a_cli_call():
    spec = parse_spec(
        {
            "name": "g",
            "workload": ["tiny_cnn", "resnet18"],
            "grid": {"batch_size": [2, 4], "precision": ["bf16"]},
            "options": {"steps": 3, "synthetic": True},
        }
    )
    cells = expand(spec)
    assert len(cells) == 4
    assert len({c.cell_id for c in cells}) == 4
    argv = cells[0].argv()
    assert argv[:2] == ["run", "tiny_cnn"]
    assert "--synthetic" in argv and argv[-1] == "--json"
    assert argv[argv.index("--batch-size") + 1] == "2"


@pytest.mark.parametrize(
    "doc, words",
    [
        ({"name": "x", "workload": "a", "bogus": 1}, "unknown key 'bogus'"),
        ({"name": "x", "workload": "a", "grid": {"batch_size": []}}, "grid.batch_size is empty"),
        ({"name": "x", "workload": "a", "grid": {}}, "grid is empty"),
        ({"name": "x", "command": "train", "workload": "a"}, "unknown command 'train'"),
        ({"name": "x"}, "give workload"),
    ],
)
def test_bad_specs_give_one_clear_line(doc, words):
    with pytest.raises(UsageError, match=words):
        parse_spec(doc)


def test_bad_spec_file_exits_2_with_one_line(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\ncommand: train\nworkload: tiny_cnn\n")
    assert main(["sweep", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown command 'train'" in err[0]


def _states(sweep_dir):
    out = {}
    for p in (sweep_dir / "cells").glob("*.json"):
        doc = json.loads(p.read_text())
        out[doc["config"]["batch_size"]] = doc
    return out


def test_sweep_killed_midway_then_resumed_redoes_only_unfinished_cells(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    sweep_dir = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "gpulens.cli", "sweep", str(spec), "--out", str(sweep_dir)]
    cmd += ["--retries", "1", "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # SIGKILL once the first cell is done
        if (
            any(s["status"] == "done" for s in _states(sweep_dir).values())
            if (sweep_dir / "cells").exists()
            else False
        ):
            break
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = _states(sweep_dir)
    done_before = {b: s["run_id"] for b, s in before.items() if s["status"] == "done"}
    assert 1 <= len(done_before) < 3
    time.sleep(4)  # let an orphaned child of the killed sweep finish its record

    res = subprocess.run(
        [*cmd, "--resume"], capture_output=True, text=True, timeout=120, check=False
    )
    assert res.returncode == 1, res.stderr  # one cell failed
    doc = json.loads(res.stdout)
    assert (doc["done"], doc["failed"], doc["remaining"]) == (2, 1, 0)
    by_batch = {c["config"]["batch_size"]: c for c in doc["cells"]}
    for batch, run_id in done_before.items():  # not redone
        assert by_batch[batch]["run_id"] == run_id and by_batch[batch]["attempts"] == 1
    failed = by_batch[0]
    # a usage error: one attempt (two where the killed sweep had tried it already)
    assert failed["status"] == "failed" and failed["exit_code"] == 2 and doc["usage_errors"] == 1
    assert "batch-size" in failed["error"]
    listed = subprocess.run(
        [sys.executable, "-m", "gpulens.cli", "runs", "list", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    stored = {r["run_id"] for r in json.loads(listed.stdout)["runs"]}
    for batch in (2, 3):
        assert by_batch[batch]["status"] == "done"
        assert by_batch[batch]["run_id"] in stored


def test_colocate_cells_take_jobs_and_gpu_counts_are_part_of_a_cell():
    spec = parse_spec(
        {
            "name": "c",
            "command": "colocate",
            "grid": {"jobs": [["resnet18:batch=64", "resnet50:batch=64"]]},
            "options": {"mechanisms": ["streams", "mps"], "duration": 5},
        }
    )
    (cell,) = expand(spec)
    assert cell.argv() == [
        "colocate", "resnet18:batch=64", "resnet50:batch=64",
        "--duration", "5", "--mechanisms", "streams,mps", "--json",
    ]  # fmt: skip
    spec = parse_spec({"name": "g", "workload": "resnet18", "grid": {"gpus": [1, 2]}})
    one, two = expand(spec)
    assert (one.gpus, two.gpus) == (1, 2) and one.cell_id != two.cell_id
    assert "--gpus" not in one.argv() and two.argv()[-3:] == ["--gpus", "2", "--json"]


def test_a_misspelt_option_is_one_line_before_any_cell_runs(tmp_path, capsys):
    path = tmp_path / "typo.yaml"
    path.write_text("name: t\nworkload: tiny_cnn\ngrid: {batchsize: [2]}\n")
    assert main(["sweep", str(path), "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no option --batchsize" in err[0], err
    assert not (tmp_path / "s").exists()  # nothing half-written


def test_the_summary_table_shows_what_differs_between_cells_and_why_a_cell_failed():
    from rich.console import Console

    from gpulens.cli.sweep import _table

    def cell(cid, batch, status, tput=None, error=None):
        config = {"command": "run", "workload": "tiny_cnn", "steps": 2, "batch_size": batch}
        return {"cell_id": cid, "config": config, "status": status, "attempts": 1,
                "run_id": "20261125-000000-abcdef" if tput else None, "error": error,
                "summary": {"throughput_samples_per_s": tput} if tput else {}}  # fmt: skip

    doc = {"sweep_dir": "/s", "cells": [
        cell("aaaaaaaaaaaa", 8, "done", 123.45),
        cell("bbbbbbbbbbbb", 0, "failed", error="Traceback ...\nerror: --batch-size must be > 0"),
    ]}  # fmt: skip
    console = Console(width=80, record=True)
    console.print(_table(doc))
    text = console.export_text()
    header = next(line for line in text.splitlines() if line.startswith("cell"))
    assert "batch_size" in header and "workload" not in header  # shared settings: the caption
    assert "every cell: workload=tiny_cnn steps=2" in text
    assert "123.5" in text and "20261125-000000-abcdef" in text  # never cut at 80 columns
    assert "error: --batch-size must be > 0" in " ".join(text.split())  # wrapped, whole


@pytest.mark.slow
def test_ctrl_c_stops_the_sweep_and_leaves_the_rest_for_resume(tmp_path):
    """SIGINT to the sweep alone (as `timeout -s INT` sends it): the running cell is stopped
    and not retried, no other cell starts, and the unfinished cells wait for --resume."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.replace("steps: 2", "steps: 400"))  # cells long enough to interrupt
    sweep_dir = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "gpulens.cli", "sweep", str(spec), "--out", str(sweep_dir)]
    proc = subprocess.Popen([*cmd, "--retries", "2"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, preexec_fn=default_sigint)  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # SIGINT once a cell is running
        states = _states(sweep_dir) if (sweep_dir / "cells").exists() else {}
        if any(s["status"] == "running" for s in states.values()):
            break
        time.sleep(0.2)
    time.sleep(3)
    stopped_at = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    assert time.monotonic() - stopped_at < 45
    states = _states(sweep_dir)
    assert all(s["attempts"] <= 1 for s in states.values())  # nothing retried
    assert sum(s["status"] == "done" for s in states.values()) < len(states)


def test_a_usage_error_is_not_retried_and_the_summary_says_so(tmp_path):
    """A cell that exits 2 (a bad value in the grid) would fail the same way again: failed
    after one attempt; a runtime failure (exit 1) is still retried."""
    from gpulens.launch.cli_child import ChildResult
    from gpulens.sweep.runner import SweepConfig, run_sweep

    codes = {2: 2, 3: 1}  # batch size -> the child's exit code, every attempt

    class Fake:
        def run(self, cells, on_start, on_done):
            for cell in cells:
                again = True
                while again:
                    on_start(cell)
                    code = codes[cell.config["batch_size"]]
                    again = on_done(cell, ChildResult(code, "", f"error: exit {code}"))

    spec = parse_spec({"name": "t", "workload": "tiny_cnn", "grid": {"batch_size": [2, 3]}})
    result = run_sweep(SweepConfig(spec, retries=2, out_dir=tmp_path), Fake())
    doc = result.to_dict()
    by_batch = {c["config"]["batch_size"]: c for c in doc["cells"]}
    assert by_batch[2]["status"] == "failed" and by_batch[2]["attempts"] == 1
    assert by_batch[2]["exit_code"] == 2
    assert by_batch[3]["status"] == "failed" and by_batch[3]["attempts"] == 3  # retried twice
    assert doc["usage_errors"] == 1
    from gpulens.cli.sweep import _summary_line

    line = _summary_line(doc)
    assert (
        line.startswith("done 0, failed 2 ")
        and "1 of them a usage error, exit 2: not retried" in line
    )


def test_the_shared_settings_line_is_in_the_specs_order_fresh_and_resumed(tmp_path):
    """The "every cell:" line listed options in spec order on a fresh sweep and sorted after
    --resume (done cells came back from their state files, keys sorted)."""
    from rich.console import Console

    from gpulens.cli.sweep import _table
    from gpulens.launch.cli_child import ChildResult
    from gpulens.sweep.runner import SweepConfig, run_sweep

    class Fake:
        def run(self, cells, on_start, on_done):
            for cell in cells:
                on_start(cell)
                on_done(cell, ChildResult(0, '{"run_id": "r", "status": "finished"}', ""))

    spec = parse_spec({"name": "t", "workload": "tiny_cnn", "grid": {"batch_size": [2, 3]},
                       "options": {"steps": 2, "device": "cpu", "no_store": True}})  # fmt: skip
    lines = []
    for resume in (False, True):
        doc = run_sweep(SweepConfig(spec, out_dir=tmp_path, resume=resume), Fake()).to_dict()
        assert doc["done"] == 2
        console = Console(width=200, record=True)
        console.print(_table(doc))
        text = " ".join(console.export_text().split())
        lines.append(text[text.index("every cell:") :])
    assert lines[0] == lines[1] == "every cell: workload=tiny_cnn steps=2 device=cpu no_store=True"

"""The CLI end to end on CPU: the JSON contract, bad input, commands, kills."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gpulens.cli import main
from gpulens.record.reader import list_records, read_record

RUN_KEYS = {
    "run_id", "status", "record_dir", "workload", "device", "throughput_samples_per_s",
    "throughput_ci95_pct", "phases_s", "gpu", "sampler_cpu_pct_of_core", "tracking_us_per_step",
    "mfu",
}  # fmt: skip


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def no_record_left_running(home: Path) -> bool:
    return all(r.status != "running" for r in list_records(home / "runs"))


def test_run_json_contract_on_cpu(capsys, gpulens_home):
    code, out, err = run_cli(
        capsys, "run", "tiny_cnn", "--steps", "12", "--batch-size", "8", "--device", "cpu",
        "--no-store", "--json",
    )  # fmt: skip
    assert code == 0, err
    doc = json.loads(out)  # exactly one JSON document on stdout
    assert doc.keys() >= RUN_KEYS
    assert doc["status"] == "finished" and doc["device"] == "cpu" and doc["workload"] == "tiny_cnn"
    assert doc["gpu"] is None and doc["mfu"] is None  # not measurable on CPU: null, not 0
    assert doc["measured_steps"] == 12
    assert set(doc["phases_s"]) == {"data_wait", "h2d", "compute", "step"}
    phases = doc["phases_s"]
    assert phases["compute"] <= phases["step"] * 1.05
    assert doc["throughput_samples_per_s"] == pytest.approx(8 / phases["step"], rel=0.05)
    rec = read_record(Path(doc["record_dir"]))
    assert rec.status == "finished"
    steps = rec.series("steps")
    assert len(steps) == 12 + rec.meta["effective_config"]["warmup_steps"]
    assert steps["warmup"].sum() == rec.meta["effective_config"]["warmup_steps"]
    assert rec.meta["requested_config"]["batch_size"] == 8
    assert rec.meta["effective_config"]["batch_size"] == 8
    assert rec.meta["unsupported"]["gpu"] == "the run used the CPU"
    # the host's issue time is probed on an idle GPU only: on the CPU it is null, not a guess
    summary = rec.meta["summary"]
    assert "host_issue_s_per_step" in summary and summary["host_issue_s_per_step"] is None
    assert len(rec.series("host")) >= 1


def test_until_ci_stops_early_when_tight(capsys):
    code, out, err = run_cli(
        capsys, "run", "tiny_cnn", "--batch-size", "4", "--device", "cpu", "--until-ci", "50",
        "--duration", "60", "--no-store", "--json",
    )  # fmt: skip
    assert code == 0, err
    doc = json.loads(out)
    rec = read_record(Path(doc["record_dir"]))
    assert rec.meta["summary"]["stop_reason"] == "until_ci"
    assert doc["throughput_ci95_pct"] is not None


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["run", "resnet5O"], "unknown workload 'resnet5O'"),
        (["run", "tiny_cnn", "--batch-size", "0"], "--batch-size must be a positive integer"),
        (["run", "tiny_cnn", "--batch-size", "-3"], "--batch-size must be a positive integer"),
        (["run", "tiny_cnn", "--data", "/no/such/dir"], "does not exist"),
        (["run", "tiny_cnn", "--device", "cuda:7"], "cuda:7 does not exist"),
        (["run", "tiny_cnn", "--device", "tpu"], "unknown device"),
        (["run", "tiny_cnn", "--precision", "fp8"], "unknown precision"),
        (["run", "tiny_cnn", "--steps", "5", "--duration", "5"], "not both"),
        (["data", "make", "videos", "--out", "x", "--n", "3"], "unknown data kind"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_no_running_record(capsys, gpulens_home, args, fragment):
    if "cuda:7" in args:
        import torch

        if torch.cuda.device_count() > 7:
            pytest.skip("this machine has 8 GPUs")
    code, out, err = run_cli(capsys, *args)
    assert code == 2
    assert fragment in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) <= 2  # one line, wrapped at most once by the terminal
    assert no_record_left_running(gpulens_home)


def test_empty_dataset_dir_names_the_fix(capsys, tmp_path, gpulens_home):
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run_cli(capsys, "run", "tiny_cnn", "--data", str(empty), "--no-store")
    assert code == 2
    assert "gpulens data make images" in err
    assert no_record_left_running(gpulens_home)
    assert all(r.status == "failed" for r in list_records(gpulens_home / "runs"))


@pytest.mark.parametrize(
    ("command", "fragment"),
    [
        (
            ["no-such-program-xyz", "--flag"],
            "command not found: no-such-program-xyz (is it on PATH?",
        ),
        (["./no/such/script.sh"], "'./no/such/script.sh' does not exist: check the path"),
        (["NOT_EXECUTABLE"], "is not an executable file: run it through its interpreter"),
    ],
    ids=["not-on-path", "no-such-path", "not-executable"],
)
def test_command_that_cannot_start_is_one_usage_line_and_no_record(
    capsys, tmp_path, gpulens_home, command, fragment
):
    """A mistyped command left a `failed` run record and exited 1: a usage error (exit 2), found
    before any record is opened, for `run` and `stalls` alike."""
    script = tmp_path / "train.sh"
    script.write_text("echo hi\n")  # no +x
    command = [str(script) if c == "NOT_EXECUTABLE" else c for c in command]
    for args in (["run", "--no-store"], ["stalls", "--data", str(tmp_path), "--no-store"]):
        code, _, err = run_cli(capsys, *args, "--", *command)
        assert code == 2, err
        assert fragment in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1, err  # no "monitoring: ..." above it
        assert list_records(gpulens_home / "runs") == []  # nothing left behind


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--", "no-such-program-xyz"], "command not found: no-such-program-xyz"),
        (["--steps", "0", "--", sys.executable, "-c", "pass"], "--steps must be a positive"),
        (["--steps", "3", "--no-inject", "--", sys.executable, "-c", "pass"], "drop --no-inject"),
        (["HOME_IS_A_FILE", "--", sys.executable, "-c", "pass"], "GPULENS_HOME"),
    ],
    ids=["not-found", "steps-0", "steps-no-inject", "home-a-file"],
)
def test_a_command_usage_error_comes_without_the_monitoring_line(
    capsys, tmp_path, monkeypatch, gpulens_home, args, fragment
):
    """`monitoring: CMD` was printed before the command was checked, then the error under it."""
    if args[0] == "HOME_IS_A_FILE":
        (tmp_path / "home-file").write_text("not a folder")
        monkeypatch.setenv("GPULENS_HOME", str(tmp_path / "home-file"))
        args = args[1:]
    code, _, err = run_cli(capsys, "run", "--no-store", *args)
    assert code == 2 and fragment in err, err
    assert "monitoring" not in err and len(err.strip().splitlines()) == 1, err


def test_a_command_that_starts_is_announced_once(capsys, gpulens_home):
    code, _, err = run_cli(capsys, "run", "--no-store", "--", sys.executable, "-c", "pass")
    assert code == 0, err
    assert err.count(f"monitoring: {sys.executable} -c pass") == 1, err


def test_a_command_run_is_named_after_its_script_not_the_interpreter(
    capsys, tmp_path, gpulens_home
):
    """A wrapped command's run was named after its interpreter ("python3"), the name `runs
    compare` and the report head their columns with: its script's name now."""
    script = tmp_path / "my_train.py"
    script.write_text("pass\n")
    code, out, err = run_cli(
        capsys, "run", "--no-store", "--json", "--", sys.executable, str(script)
    )
    assert code == 0, err
    rec = read_record(Path(json.loads(out)["record_dir"]))
    assert rec.meta["name"] == "my_train.py"
    assert rec.meta["requested_config"]["command"] == f"{sys.executable} {script}"


def test_failing_command_is_recorded_failed(capsys, gpulens_home):
    code, out, err = run_cli(
        capsys, "run", "--no-store", "--json", "--", sys.executable, "-c", "import sys; sys.exit(3)"
    )
    assert code == 1
    doc = json.loads(out)
    assert doc["status"] == "failed" and doc["returncode"] == 3
    assert "exit code 3" in err


TRACKED = textwrap.dedent(
    """
    import time
    import gpulens
    print("the script's own output")
    with gpulens.track(name="t", warmup_steps=2) as tracker:
        for batch in tracker.data([list(range(16))] * 12):
            time.sleep(0.01)
    """
)


def test_command_with_tracking_api_fills_the_steps(capfd, tmp_path, gpulens_home):
    script = tmp_path / "train.py"
    script.write_text(TRACKED)
    code, out, err = run_cli(
        capfd, "run", "--no-store", "--json", "--", sys.executable, str(script)
    )
    assert code == 0, err
    doc = json.loads(out)  # the script's print went to stderr, not into the JSON document
    assert "the script's own output" in err
    assert doc["status"] == "finished"
    # 12 steps of 16 samples, ~10 ms each, 2 warm-up steps excluded
    assert doc["throughput_samples_per_s"] == pytest.approx(1600, rel=0.35)
    rec = read_record(Path(doc["record_dir"]))
    steps = rec.series("steps")
    assert len(steps) == 12 and steps["warmup"].sum() == 2
    assert rec.meta["kind"] == "command"
    assert len(list_records(gpulens_home / "runs")) == 1  # the script did not make its own run


def test_tracking_api_alone_makes_its_own_run(tmp_path, gpulens_home):
    script = tmp_path / "train.py"
    script.write_text(TRACKED)
    env = dict(os.environ, GPULENS_HOME=str(gpulens_home))
    subprocess.run([sys.executable, str(script)], check=True, env=env, timeout=120)
    (rec,) = list_records(gpulens_home / "runs")
    assert rec.status == "finished" and rec.meta["kind"] == "script"
    assert rec.meta["summary"]["measured_steps"] == 10
    assert len(rec.series("host")) >= 1


@pytest.mark.parametrize("kill_after_s", [0.0, 1.5, 6.0])
def test_sigkill_of_gpulens_run_leaves_a_killed_readable_record(tmp_path, kill_after_s):
    home = tmp_path / "home"
    env = dict(os.environ, GPULENS_HOME=str(home))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpulens.cli", "run", "tiny_cnn", "--batch-size", "4",
         "--duration", "120", "--device", "cpu", "--no-store"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.time() + 60
    while not list((home / "runs").glob("*/run.json")) and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(kill_after_s)  # after the record appeared: setup, sampler start, training
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(1.0)  # the sampler notices its parent is gone and closes its series
    (rec,) = list_records(home / "runs")
    assert rec.status == "killed"
    for name in rec.series_names():
        rec.series(name)  # every series reads back
    if kill_after_s >= 6:
        assert len(rec.series("host")) >= 10
        assert len(rec.series("steps")) >= 1


def test_doctor_json(capsys):
    code, out, _ = run_cli(capsys, "doctor", "--json")
    assert code == 0
    checks = {c["name"]: c for c in json.loads(out)["checks"]}
    assert {"nvml", "torch", "cpu", "ram", "home", "store", "mps"} <= checks.keys()
    for c in checks.values():
        assert c["ok"] or c["how_to_enable"], c  # every missing piece says how to enable it


def test_cuda_out_of_memory_is_one_line_exit_1_and_a_failed_record(
    capsys, gpulens_home, monkeypatch
):
    import torch

    import gpulens.workloads.loop as loop

    def oom(_fn):  # the allocator's error, raised where the first training step runs
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(loop, "count_flops", oom)
    code, _, err = run_cli(
        capsys, "run", "tiny_cnn", "--batch-size", "512", "--device", "cpu", "--no-store"
    )
    assert code == 1
    assert "out of memory at batch size 512" in err and "--batch-size (try 256)" in err
    assert "Traceback" not in err
    (rec,) = list_records(gpulens_home / "runs")
    assert rec.status == "failed" and "out of memory" in rec.meta["error"]


def test_data_make_tokens_then_train_the_language_model_on_them(capsys, tmp_path):
    tokens = tmp_path / "tok"
    code, out, err = run_cli(
        capsys, "data", "make", "tokens", "--out", str(tokens), "--n", "20000",
        "--vocab-size", "8192", "--json",
    )  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["n_tokens"] == 20000
    code, out, err = run_cli(
        capsys, "run", "gpt2_tiny", "--data", str(tokens), "--steps", "2", "--batch-size", "2",
        "--warmup-steps", "1", "--device", "cpu", "--workers", "0", "--no-store", "--json",
    )  # fmt: skip
    assert code == 0, err
    doc = json.loads(out)
    rec = read_record(Path(doc["record_dir"]))
    assert rec.meta["effective_config"]["dataset"]["kind"] == "token_file"
    assert doc["measured_steps"] == 2

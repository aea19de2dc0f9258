"""A Ctrl-C is never lost: held inside native code, re-raised when something swallowed it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from signals import default_sigint, python_sigint_handler

from gpulens.run import interrupts


@pytest.fixture
def installed():
    with python_sigint_handler():  # not inherited as ignored from a background shell
        assert interrupts.install()
        yield
        interrupts.uninstall()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _sigint_self() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # the handler runs in the main thread at the next bytecode


def test_a_swallowed_interrupt_is_raised_again(installed):
    # What a native library's callback wrapper can do to it:
    with contextlib.suppress(KeyboardInterrupt):
        _sigint_self()
    assert interrupts.pending()
    with pytest.raises(KeyboardInterrupt):
        interrupts.raise_if_interrupted()


def test_an_interrupt_inside_a_held_region_is_raised_on_leaving_it(installed):
    reached_end = False
    with pytest.raises(KeyboardInterrupt), interrupts.held():
        _sigint_self()
        reached_end = True  # not raised inside: native code finishes its work
    assert reached_end


def test_without_interrupt_nothing_is_raised(installed):
    with interrupts.held():
        pass
    interrupts.raise_if_interrupted()
    assert not interrupts.pending()


def test_a_launchers_own_handler_is_left_alone():
    def forward(signum, frame):
        pass

    old = signal.signal(signal.SIGINT, forward)
    try:
        interrupts.install()
        assert signal.getsignal(signal.SIGINT) is forward
    finally:
        interrupts.uninstall()
        signal.signal(signal.SIGINT, old)


def test_the_cli_restores_the_handler_it_found(capsys):
    from gpulens.cli import main

    with python_sigint_handler():
        assert main(["--version"]) == 0
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    # Ignored (a job started in the background with nohup): gpulens leaves it ignored.
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert main(["--version"]) == 0
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGINT, old)


def test_ctrl_c_during_a_step_that_swallows_it_stops_the_measured_loop(tmp_path):
    """The training loop's step swallows KeyboardInterrupt (as code under torch's dispatch
    can): the CLI's handler notes the signal and the measured loop raises it after the step."""
    script = tmp_path / "swallow.py"
    script.write_text(
        textwrap.dedent("""
        import itertools, sys, time
        import torch
        from gpulens.probes.steps import StepTimer
        from gpulens.run import interrupts
        from gpulens.workloads.config import TrainConfig, resolve_config
        from gpulens.workloads.loop import measured_loop
        from gpulens.workloads.models import get_workload
        from gpulens.workloads.recipe import Prepared

        def step(x, y):
            try:
                time.sleep(0.01)
            except KeyboardInterrupt:
                pass

        cpu = torch.device("cpu")
        config = TrainConfig("tiny_cnn", duration_s=20, warmup_steps=0, count_flops=False)
        eff = resolve_config(config, get_workload("tiny_cnn"), cpu)
        batch = (torch.zeros(1), torch.zeros(1))
        prepared = Prepared(step, itertools.repeat(batch), torch.contiguous_format, eff)
        interrupts.install()
        started = []

        def progress(*_):
            if not started:
                started.append(1)
                print("ready", flush=True)

        try:
            timer = StepTimer(None, cuda=False, warmup_steps=0)
            measured_loop(prepared, eff, cpu, timer, progress, 1)
        except KeyboardInterrupt:
            sys.exit(130)
        sys.exit(0)
    """)
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, preexec_fn=default_sigint
    )
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=15) == 130


def test_a_signal_handler_sets_an_event_without_waiting_for_its_lock():
    """A handler runs on the main thread, possibly inside ``event.wait()`` after it took the
    event's lock back; ``event.set()`` there would wait for that lock forever (a served run
    hung so on SIGTERM). ``set_from_handler`` returns at once and the event is set once the
    lock is free."""
    import threading

    stop = threading.Event()
    done = threading.Event()

    def handler_inside_wait() -> None:
        with stop._cond:  # where Event.wait() is when a signal's handler runs
            interrupts.set_from_handler(stop)
            done.set()
            assert not stop.is_set()

    worker = threading.Thread(target=handler_inside_wait, daemon=True)
    worker.start()
    assert done.wait(5), "set_from_handler waited for a lock its own thread holds"
    assert stop.wait(5)


def test_no_signal_handler_sets_an_event_itself():
    """Every SIGTERM handler that ends a wait goes through interrupts.set_from_handler."""
    import re
    from pathlib import Path

    src = Path(__file__).parents[1] / "src" / "gpulens"
    direct = re.compile(r"signal\.signal\([^\n]*lambda[^\n]*\.set\(\)")
    found = [
        f"{path.relative_to(src)}:{n}"
        for path in src.rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if direct.search(line)
    ]
    assert not found, found


@pytest.mark.slow
@pytest.mark.parametrize("sigint_ignored", [False, True], ids=["foreground", "background"])
def test_sigterm_ends_the_run_killed_and_exits_143(tmp_path, sigint_ignored):
    """Slurm, Kubernetes and `kill` stop a job with SIGTERM: it ended gpulens on the spot and
    left the record `running` with no end; now it takes Ctrl-C's path and says which it was.
    Also for a job a batch script started with `&`: it starts with SIGINT ignored, and its
    SIGTERM was left to end it on the spot (seen on CPU, 2026-11-28)."""
    import json

    def ignore_sigint():
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    env = {**os.environ, "GPULENS_HOME": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpulens.cli", "run", "tiny_cnn", "--device", "cpu",
         "--steps", "100000", "--warmup-steps", "1", "--no-store"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        preexec_fn=ignore_sigint if sigint_ignored else None,
    )  # fmt: skip
    for line in proc.stderr:  # the progress lines: the run is measuring
        if "steps" in line and "/" in line:
            break
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "stopped by SIGTERM" in err, err
    (meta,) = [json.loads(p.read_text()) for p in (tmp_path / "runs").glob("*/run.json")]
    assert meta["status"] == "killed" and meta["ended_at"] and meta["error"] == "stopped by SIGTERM"


def test_an_ignored_or_someone_elses_sigterm_handler_is_left_alone(installed):
    assert signal.getsignal(signal.SIGTERM) is interrupts._on_stop_signal
    interrupts.uninstall()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    old = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        interrupts.install()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        interrupts.uninstall()
        signal.signal(signal.SIGTERM, old)
    interrupts.install()  # the fixture uninstalls


def test_sigterm_is_taken_where_sigint_is_ignored(installed):
    """A background job of a non-interactive shell starts with SIGINT ignored: that leaves
    SIGINT alone, not SIGTERM."""
    interrupts.uninstall()
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert interrupts.install()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is interrupts._on_stop_signal
    finally:
        interrupts.uninstall()
        signal.signal(signal.SIGINT, old)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    interrupts.install()  # the fixture uninstalls


@pytest.mark.parametrize(
    ("status", "returncode", "exit_code"),
    [("killed", -signal.SIGTERM, 143), ("killed", 143, 143), ("failed", 3, 1), ("failed", 143, 1)],
)
def test_a_wrapped_command_stopped_by_sigterm_exits_143_as_a_built_in_run(
    status, returncode, exit_code
):
    """`gpulens run -- CMD` stopped by SIGTERM exited 1 ("the command ended with exit code
    143") where a built-in run exits 143: a batch system would read a failure."""
    from types import SimpleNamespace

    from gpulens.cli.run import CommandFailed
    from gpulens.report.failure import classify

    result = SimpleNamespace(status=status, returncode=returncode, record_dir="/r/x")
    failure = classify(CommandFailed(result))
    assert failure.exit_code == exit_code
    assert ("stopped by SIGTERM" in failure.message) == (exit_code == 143)

"""Monitoring an arbitrary command: ``gpulens run -- python train.py ...``."""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpulens.errors import RuntimeFailure, UsageError
from gpulens.launch.injection import injected_env
from gpulens.launch.processes import check_command, reap, spawn
from gpulens.probes.monitor import ProbeSpec
from gpulens.probes.summary import summarize_gpu, summarize_host
from gpulens.record.labels import command_label
from gpulens.record.tracker import RUN_DIR_ENV, read_tracker_summary
from gpulens.run import RunSession, measured_run
from gpulens.workloads.inject import INJECT_ENV, MAX_STEPS_ENV

log = logging.getLogger(__name__)

SIGINT_GRACE_S = 10.0  # at --duration: SIGINT, this long, then SIGTERM
STOP_GRACE_S = 30.0  # after SIGTERM, before SIGKILL


@dataclass
class CommandResult:
    run_id: str
    record_dir: Path
    returncode: int
    status: str
    summary: dict[str, Any]


def run_command(
    argv: list[str],
    runs_root: Path,
    sample_hz: float = 10.0,
    name: str | None = None,
    stdout_to_stderr: bool = False,
    kind: str = "command",
    extra_env: dict[str, str] | None = None,
    config: dict[str, Any] | None = None,
    role: str | None = None,
    inject: bool = True,
    duration_s: float | None = None,
    metrics=None,
    max_steps: int | None = None,
    on_start: Callable[[], None] | None = None,
) -> CommandResult:
    """Run ``argv`` to completion under the GPU and host monitor, in a run record of ``kind``.
    The child finds the run directory in ``$GPULENS_RUN_DIR`` (the tracking API uses it), plus
    ``extra_env``; ``config`` is added to the record's requested config (secrets on the command
    line and in ``extra_env`` are redacted there). Ctrl-C and SIGTERM are passed on to the
    child; the record ends ``killed``. The child dies with this process (even by SIGKILL) and
    whatever it started is ended when it exits. ``stdout_to_stderr`` keeps the command's output
    off stdout (for ``--json``). ``role``: the run's part in an experiment (``stalls:cached``).
    ``inject``: time the steps of an unmodified Python script (:mod:`gpulens.launch.injection`).
    ``duration_s``: stop the command after this long as Ctrl-C would (SIGINT; SIGTERM after
    :data:`SIGINT_GRACE_S`); the run then ends ``finished`` with ``stop_reason: duration``.
    ``metrics``: a :class:`gpulens.web.metrics.MetricsEndpoint` serving Prometheus metrics.
    ``max_steps``: an injected script ends after this many measured steps (``stop_reason:
    steps``). ``on_start`` is called once everything is checked, as the command starts."""
    if not argv:
        raise UsageError("no command given: gpulens run -- python train.py ...")
    extra_env = dict(extra_env or {})
    if max_steps is not None:
        if max_steps <= 0:
            raise UsageError(f"--steps must be a positive integer, got {max_steps}")
        if not inject:
            raise UsageError("--steps with a command needs its steps timed: drop --no-inject")
        extra_env[MAX_STEPS_ENV] = str(max_steps)
    check_command(argv)  # a mistyped command: one usage line, and no record left behind
    # The record exists before the slow start-up (NVML, importing torch for the environment,
    # the sampler), so a run killed in its first seconds still leaves one.
    requested = {
        "command": shlex.join(argv),
        "sample_hz": sample_hz,
        **(config or {}),
        **({"env": extra_env} if extra_env else {}),
        "inject": inject,
        **({"duration_s": duration_s} if duration_s else {}),
        **({"max_steps": max_steps} if max_steps else {}),
    }
    name = name or command_label(argv)  # the script (train.py), not the interpreter
    with measured_run(
        runs_root, kind=kind, name=name, role=role, requested_config=requested, metrics=metrics
    ) as run:
        returncode = _run(
            argv, run, sample_hz, stdout_to_stderr, extra_env, inject, duration_s, on_start
        )
    result = run.result()
    summary = result.as_dict()["summary"]
    return CommandResult(result.run_id, result.record_dir, returncode, result.status, summary)


def _run(
    argv: list[str],
    run: RunSession,
    sample_hz: float,
    stdout_to_stderr: bool,
    extra_env: dict[str, str],
    inject: bool = True,
    duration_s: float | None = None,
    on_start: Callable[[], None] | None = None,
) -> int:
    env = dict(os.environ, **extra_env, **{RUN_DIR_ENV: str(run.dir)})
    with contextlib.ExitStack() as stack:
        if inject:
            env = stack.enter_context(injected_env(env))
        return _run_child(argv, run, sample_hz, stdout_to_stderr, env, duration_s, on_start)


def _wait(child, duration_s: float | None, injected: bool = False) -> tuple[int, bool]:
    """The child's exit code, and whether gpulens stopped it at ``duration_s``."""
    if not duration_s:
        return child.wait(), False
    try:
        return child.wait(timeout=duration_s), False
    except subprocess.TimeoutExpired:
        pass
    # SIGINT first (what Ctrl-C sends); a child started with SIGINT ignored (a background job)
    # gets SIGTERM soon after, which an injected script turns into a clean exit. An injected
    # Python script gets SIGTERM first: it ends the same way without printing the
    # KeyboardInterrupt traceback of wherever the stop found it.
    stops = [(signal.SIGINT, SIGINT_GRACE_S), (signal.SIGTERM, STOP_GRACE_S)]
    for sig, grace_s in stops[1:] if injected else stops:
        child.send_signal(sig)
        try:
            return child.wait(timeout=grace_s), True
        except subprocess.TimeoutExpired:
            continue
    child.kill()
    return child.wait(), True


def _run_child(
    argv: list[str],
    run: RunSession,
    sample_hz: float,
    stdout_to_stderr: bool,
    env: dict,
    duration_s: float | None = None,
    on_start: Callable[[], None] | None = None,
) -> int:
    gpus = run.writer.meta.get("environment", {}).get("gpus") or []
    if on_start is not None:
        on_start()
    try:
        # SIGTERM when gpulens dies: the command may stop its own children (torchrun does).
        # Same process group as gpulens: a terminal's Ctrl-C and reads from it work as before.
        child = spawn(
            argv,
            env=env,
            death_signal=signal.SIGTERM,
            own_group=False,
            stdout=2 if stdout_to_stderr else None,
        )
    except OSError as exc:
        reason = "command not found" if isinstance(exc, FileNotFoundError) else str(exc)
        message = f"could not start '{argv[0]}': {reason}; check the command name and your PATH"
        raise RuntimeFailure(message) from exc
    run.set_effective({"command": shlex.join(argv), "pid": child.pid})
    probes = [ProbeSpec("gpu"), ProbeSpec("host", {"root_pid": child.pid})]
    interrupted: list[int] = []

    def forward(signum, _frame):
        interrupted.append(signum)
        if child.poll() is None:
            child.send_signal(signum)

    # A signal gpulens was started with ignored (SIGINT in a shell's background job) stays
    # ignored, as the child inherits it ignored and a built-in run ignores it: caught and passed
    # on, it left the command running to its end and the record saying "killed".
    caught = [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) != signal.SIG_IGN]
    old = {s: signal.signal(s, forward) for s in caught}
    t0_unix = time.time()
    t0 = time.perf_counter()
    try:
        with run.monitor(probes, hz=sample_hz):
            python = Path(argv[0]).name.startswith("python")
            returncode, stopped = _wait(child, duration_s, python and env.get(INJECT_ENV) == "1")
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        reap(child)  # what the command left running (its orphans) ends with it
    wall_s = time.perf_counter() - t0
    t1_unix = time.time()

    summary: dict[str, Any] = {"wall_s": wall_s, "returncode": returncode}
    tracker = read_tracker_summary(run.dir)
    if tracker:
        summary.update(tracker)
    if stopped:
        summary["stop_reason"] = "duration"
    limit = env.get(MAX_STEPS_ENV)
    if returncode == 0 and limit and (summary.get("measured_steps") or 0) >= int(limit):
        summary["stop_reason"] = "steps"  # the injected script ended at --steps
    summary.setdefault("tracking_us_per_step", None)
    gpu_df = run.writer.read_series("gpu")
    # No energy per sample here: the command's samples and its wall window do not line up.
    per_gpu = [summarize_gpu(gpu_df, t0_unix, t1_unix, g["index"], None) for g in gpus]
    summary["gpus"] = [g for g in per_gpu if g]
    summary["gpu"] = summary["gpus"][0] if summary["gpus"] else None
    summary["host"] = summarize_host(run.writer.read_series("host"), t0_unix, t1_unix)
    summary.update(run.monitor_costs())
    run.set_summary(summary)
    if stopped and not interrupted:
        pass  # stopped by gpulens at --duration, as asked: a finished run
    elif interrupted:
        run.end_as("killed", f"stopped by signal {signal.Signals(interrupted[0]).name}")
    elif returncode < 0 and -returncode in (signal.SIGINT, signal.SIGTERM):
        run.end_as("killed", f"stopped by signal {signal.Signals(-returncode).name}")
    elif returncode != 0:
        run.end_as("failed", f"command exited with code {returncode}")
    return returncode

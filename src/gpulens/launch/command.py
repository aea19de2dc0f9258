"""Monitoring an arbitrary command: ``gpulens run -- python train.py ...``."""

from __future__ import annotations

import logging
import os
import shlex
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpulens.errors import RuntimeFailure, UsageError
from gpulens.launch.processes import reap, spawn
from gpulens.probes.environment import capture_environment
from gpulens.probes.nvml.inventory import describe_gpus
from gpulens.probes.monitor import Monitor, ProbeSpec
from gpulens.probes.summary import summarize_gpu, summarize_host
from gpulens.record import schema
from gpulens.record.writer import RunWriter
from gpulens.workloads.tracking import RUN_DIR_ENV, read_tracker_summary

log = logging.getLogger(__name__)


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
) -> CommandResult:
    """Run ``argv`` to completion under the GPU and host monitor, in a run record of ``kind``.
    The child finds the run directory in ``$GPULENS_RUN_DIR`` (the tracking API uses it), plus
    ``extra_env``; ``config`` is added to the record's requested config (secrets on the command
    line and in ``extra_env`` are redacted there). Ctrl-C and SIGTERM are passed on to the
    child; the record ends ``killed``. The child dies with this process (even by SIGKILL) and
    whatever it started is ended when it exits. ``stdout_to_stderr`` keeps the command's output
    off stdout (for ``--json``)."""
    if not argv:
        raise UsageError("no command given: gpulens run -- python train.py ...")
    extra_env = dict(extra_env or {})
    # The record exists before the slow start-up (NVML, importing torch for the environment,
    # the sampler), so a run killed in its first seconds still leaves one.
    writer = RunWriter(
        runs_root,
        kind=kind,
        name=name or Path(argv[0]).name,
        requested_config={
            "command": shlex.join(argv), "sample_hz": sample_hz, **(config or {}),
            **({"env": extra_env} if extra_env else {}),
        },
    )  # fmt: skip
    try:
        return _run(argv, writer, sample_hz, stdout_to_stderr, extra_env)
    except KeyboardInterrupt:
        if writer.meta["status"] == schema.STATUS_RUNNING:
            writer.finish(schema.STATUS_KILLED, error="interrupted (Ctrl-C)")
        raise
    except BaseException as exc:
        if writer.meta["status"] == schema.STATUS_RUNNING:
            writer.finish(schema.STATUS_FAILED, error=str(exc) or type(exc).__name__)
        raise


def _run(
    argv: list[str],
    writer: RunWriter,
    sample_hz: float,
    stdout_to_stderr: bool,
    extra_env: dict[str, str],
) -> CommandResult:
    gpus = describe_gpus()
    writer.update(environment=capture_environment(gpus))
    env = dict(os.environ, **extra_env, **{RUN_DIR_ENV: str(writer.dir)})
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
        writer.finish("failed", error=message)
        raise RuntimeFailure(message) from exc
    writer.update(effective_config={"command": shlex.join(argv), "pid": child.pid})
    monitor = Monitor(
        writer, [ProbeSpec("gpu"), ProbeSpec("host", {"root_pid": child.pid})], hz=sample_hz
    )
    interrupted: list[int] = []

    def forward(signum, _frame):
        interrupted.append(signum)
        if child.poll() is None:
            child.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    t0_unix = time.time()
    t0 = time.perf_counter()
    try:
        with monitor:
            returncode = child.wait()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        reap(child)  # what the command left running (its orphans) ends with it
    wall_s = time.perf_counter() - t0
    t1_unix = time.time()

    summary: dict[str, Any] = {"wall_s": wall_s, "returncode": returncode}
    tracker = read_tracker_summary(writer.dir)
    if tracker:
        summary.update(tracker)
    summary.setdefault("tracking_us_per_step", None)
    gpu_df = writer.read_series("gpu")
    # No energy per sample here: the command's samples and its wall window do not line up.
    per_gpu = [summarize_gpu(gpu_df, t0_unix, t1_unix, g["index"], None) for g in gpus]
    summary["gpus"] = [g for g in per_gpu if g]
    summary["gpu"] = summary["gpus"][0] if summary["gpus"] else None
    summary["host"] = summarize_host(writer.read_series("host"), t0_unix, t1_unix)
    summary.update(monitor.overhead().as_dict())
    writer.update(summary=summary)
    if interrupted:
        status, error = "killed", f"stopped by signal {signal.Signals(interrupted[0]).name}"
    elif returncode < 0 and -returncode in (signal.SIGINT, signal.SIGTERM):
        status, error = "killed", f"stopped by signal {signal.Signals(-returncode).name}"
    elif returncode != 0:
        status, error = "failed", f"command exited with code {returncode}"
    else:
        status, error = "finished", None
    writer.finish(status, error=error)
    return CommandResult(writer.run_id, writer.dir, returncode, status, summary)

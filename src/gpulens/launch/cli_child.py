"""Running one ``gpulens`` command as a child process (a sweep cell): exactly what a user would
run, so a crashing cell cannot take the caller down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class ChildResult:
    """Exit code, stdout (the ``--json`` document) and stderr of a finished child."""

    returncode: int
    stdout: str
    stderr: str


def _die_with_parent() -> None:
    """Linux: the child gets SIGTERM when the process (thread) that started it dies, so a
    sweep killed with SIGKILL leaves no cell running on a GPU nobody accounts for."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux/glibc: children may outlive a killed sweep
        pass


def run_gpulens(
    args: list[str], env_overrides: dict[str, str] | None = None, running: set | None = None
) -> ChildResult:
    """Run ``python -m gpulens.cli <args>`` and wait; ``env_overrides`` are added to the
    environment (CUDA_VISIBLE_DEVICES for the cell's GPUs). ``running`` holds the child while
    it runs, so that whoever stops the sweep can pass the stop on."""
    env = {**os.environ, **(env_overrides or {})}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpulens.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
    )
    if running is not None:
        running.add(proc)
    try:
        stdout, stderr = proc.communicate()
    finally:
        if running is not None:
            running.discard(proc)
    return ChildResult(proc.returncode, stdout, stderr)

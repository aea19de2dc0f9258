"""A group of processes started together: each warms up, all start on one clock, each runs for
the same window; outcomes (results, errors, out-of-memory, timeouts) collected per job."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpulens.launch.processes import (
    reap,
    spawn,
)
from gpulens.probes.window import GpuWindow
from gpulens.record.redact import redact_argv
from gpulens.workloads.jobspec import JobSpec, ProcessSpec

log = logging.getLogger(__name__)


GO_DELAY_S = 0.05


KILL_GRACE_S = 5.0


# --------------------------------------------------------------------------- processes
@dataclass
class Proc:
    """One process of a run: built-in jobs (several = streams) or one command."""

    jobs: list[JobSpec]
    env: dict[str, str]
    device: str
    priorities: list[int | None] = field(default_factory=list)


@dataclass
class GroupOutcome:
    jobs: dict[str, dict[str, Any]]
    error: str | None = None
    error_kind: str | None = None  # "oom", "failed", "timeout"
    window: dict[str, Any] = field(default_factory=dict)
    process_peaks: list[int | None] = field(default_factory=list)


def tail_text(path: Path, n: int = 600) -> str:
    try:
        return path.read_text(errors="replace")[-n:].strip()
    except OSError:
        return ""


def kill_all(popens: list[subprocess.Popen]) -> None:
    """End every process of a run and whatever each started (process group and orphans)."""
    for p in popens:
        if p.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(p.pid, signal.SIGTERM)
    for p in popens:
        reap(p, grace_s=KILL_GRACE_S)


def exit_clock(popen: subprocess.Popen) -> list[float]:
    """A list that gets ``time.perf_counter()`` at the moment ``popen`` exits (a thread waits
    for it): a ``cmd:`` job's wall time ends when the command does, not when the group gets
    round to reaping it, after the built-in jobs' window or a longer command."""
    ended: list[float] = []

    def watch() -> None:
        with contextlib.suppress(Exception):
            popen.wait()
        ended.append(time.perf_counter())

    threading.Thread(target=watch, name=f"cmd-exit-{popen.pid}", daemon=True).start()
    return ended


def stderr_path(logf: Path) -> Path:
    return logf.with_suffix(".err")


def command_outcome(job: JobSpec, returncode: int, wall_s: float, logf: Path) -> dict[str, Any]:
    """A ``cmd:`` job's result: one run of the command; a non-zero exit is a failed job with
    its exit code and the tail of what it printed on stderr (stdout when stderr is empty)."""
    err = None
    tail = None
    if returncode != 0:
        tail = tail_text(stderr_path(logf), 400) or tail_text(logf, 400) or None
        how = (
            f"was stopped by signal {-returncode}"
            if returncode < 0
            else f"exited with code {returncode}"
        )
        err = f"cmd job {job.name} ({shlex.join(redact_argv(list(job.command)))}) {how}"
        if tail:
            err += f": {tail.splitlines()[-1][-200:]}"
    return {
        "name": job.name,
        "key": job.key,
        "kind": "cmd",
        "steps": 1,
        "samples": 1,
        "window_s": wall_s,
        "throughput_samples_per_s": (1.0 / wall_s) if returncode == 0 and wall_s > 0 else None,
        "step_time_p50_s": wall_s,
        "step_time_p99_s": wall_s,
        "step_times_s": [wall_s],
        "peak_mem_bytes": None,
        "error": err,
        "error_kind": "failed" if err else None,
        "exit_code": returncode,
        "stderr_tail": tail,
    }


def run_group(
    procs: list[Proc],
    work_dir: Path,
    duration_s: float,
    warmup_s: float,
    window: GpuWindow | None,
    setup_timeout_s: float = 300.0,
    command_timeout_s: float | None = None,
    cpu_threads: int | None = None,
) -> GroupOutcome:
    """Start the processes, wait until all are warm, start them together, collect results."""
    d = Path(tempfile.mkdtemp(prefix="group-", dir=work_dir))
    go_file = d / "go"
    builtin: list[tuple[Proc, subprocess.Popen, Path, Path, Path]] = []
    commands: list[tuple[Proc, Path]] = []
    started: list[subprocess.Popen] = []
    outcome = GroupOutcome(jobs={})
    try:
        for i, p in enumerate(procs):
            logf = d / f"proc{i}.log"
            if p.jobs[0].kind == "cmd":
                commands.append((p, logf))
                continue
            spec = ProcessSpec(
                jobs=[j.to_dict() for j in p.jobs], device=p.device, duration_s=duration_s,
                warmup_s=warmup_s, ready_file=str(d / f"ready{i}"), go_file=str(go_file),
                result_file=str(d / f"result{i}.json"),
                stream_priorities=p.priorities or [None] * len(p.jobs), cpu_threads=cpu_threads,
            )  # fmt: skip
            spec_path = d / f"spec{i}.json"
            spec_path.write_text(json.dumps(spec.__dict__))
            with open(logf, "wb") as log_fh:
                popen = spawn(
                    [sys.executable, "-m", "gpulens.workloads.colocate_job", str(spec_path)],
                    env=p.env, stdout=log_fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    death_signal=signal.SIGKILL, own_group=True,
                )  # fmt: skip
            started.append(popen)
            builtin.append((p, popen, Path(spec.ready_file), Path(spec.result_file), logf))
        # 1. everyone warm
        deadline = time.monotonic() + setup_timeout_s
        while not all(r.exists() for _, _, r, _, _ in builtin):
            if any(po.poll() is not None for _, po, r, _, _ in builtin if not r.exists()):
                break
            if time.monotonic() > deadline:
                outcome.error_kind = "timeout"
                outcome.error = f"the jobs did not warm up within {setup_timeout_s:.0f} s"
                break
            time.sleep(0.02)
        early_exit = any(po.poll() is not None for _, po, r, _, _ in builtin if not r.exists())
        early_errors = []
        for _, _, r, _, _ in builtin:
            if r.exists():
                with contextlib.suppress(ValueError, OSError):
                    early_errors += json.loads(r.read_text()).get("errors") or []
        if outcome.error is None and not early_exit and not early_errors:
            # 2. go, together
            with window.measure(outcome.window) if window else contextlib.nullcontext():
                go_file.write_text(repr(time.time() + GO_DELAY_S))
                time.sleep(GO_DELAY_S)
                cmd_popens = []
                for p, logf in commands:
                    with open(logf, "wb") as log_fh, open(stderr_path(logf), "wb") as err_fh:
                        cp = spawn(
                            list(p.jobs[0].command), env=p.env, stdout=log_fh,
                            stderr=err_fh, stdin=subprocess.DEVNULL,
                            death_signal=signal.SIGTERM, own_group=True,
                        )  # fmt: skip
                    started.append(cp)
                    cmd_popens.append((p, cp, time.perf_counter(), exit_clock(cp), logf))
                limit = time.monotonic() + duration_s + max(60.0, duration_s)
                for _, po, _, _, _ in builtin:
                    po.wait(timeout=max(1.0, limit - time.monotonic()))
                cmd_limit = None if command_timeout_s is None else \
                    time.monotonic() + command_timeout_s  # fmt: skip
                for p, cp, t0, ended, logf in cmd_popens:
                    timeout = None if cmd_limit is None else max(1.0, cmd_limit - time.monotonic())
                    rc = cp.wait(timeout=timeout)
                    for _ in range(100):  # the watcher notes the exit just after wait() sees it
                        if ended:
                            break
                        time.sleep(0.001)
                    wall = (ended[0] if ended else time.perf_counter()) - t0
                    outcome.jobs[p.jobs[0].name] = command_outcome(p.jobs[0], rc, wall, logf)
        # 3. results
        for _, po, _, res, logf in builtin:
            with contextlib.suppress(subprocess.TimeoutExpired):
                po.wait(timeout=0 if outcome.error else 5)
            doc = None
            with contextlib.suppress(OSError, ValueError):
                doc = json.loads(res.read_text())
            if doc is None:
                if outcome.error is None:
                    outcome.error_kind = "failed"
                    outcome.error = (
                        f"a job process ended with exit code {po.poll()} and no result: "
                        f"{tail_text(logf) or '(no output)'}"
                    )
                continue
            outcome.process_peaks.append(doc.get("process_peak_mem_bytes"))
            for j in doc.get("jobs") or []:
                outcome.jobs[j["name"]] = j
            if doc.get("error") and outcome.error_kind != "oom":
                outcome.error_kind = doc.get("error_kind") or "failed"
                outcome.error = doc["error"]
        for j in outcome.jobs.values():
            if j.get("error") and not outcome.error:
                outcome.error_kind, outcome.error = j.get("error_kind") or "failed", j["error"]
    except subprocess.TimeoutExpired:
        outcome.error_kind = "timeout"
        outcome.error = "a job did not finish in time (the run was stopped)"
    finally:
        kill_all(started)
    if outcome.error is None:
        shutil.rmtree(d, ignore_errors=True)
    return outcome

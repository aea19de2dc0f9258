"""Sharing one GPU between jobs: time-slice, streams, MPS and MIG (``gpulens colocate``).

Each job first runs alone on the whole GPU (its baseline: throughput, step times, peak memory,
energy). Then, per mechanism and setting, all jobs run together, started by a common clock after
every job has warmed up, for the same measured window:

- ``time-slice``: one process per job, default scheduling.
- ``streams``: one process, one thread and one CUDA stream per job; with inference and training
  mixed, a second setting gives the inference streams the highest priority.
- ``mps``: a private MPS daemon (``gpulens.launch.mps``) per setting; each setting is a
  ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` applied to every job, or only to the training jobs when
  inference is in the mix (``mps_limit_target``), plus an optional pinned memory limit.
- ``mig``: existing MIG instances only, one job per instance, addressed by UUID.

Numbers: ``slowdown`` = throughput alone / throughput together (1.0 = unaffected, 2.0 = half
speed); ``normalized_aggregate_throughput`` = sum over jobs of together/alone (above 1.0 the GPU
does more together than the jobs one after another); ``jain_fairness`` = Jain's index over the
per-job together/alone ratios (1.0 = all slowed alike); ``energy_per_sample_j`` = GPU energy in
the window / samples of all jobs. A mechanism that fails is recorded with its error; it never
stops the others.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpulens.errors import RuntimeFailure, UsageError
from gpulens.launch.processes import (
    check_command,
    make_work_dir,
    reap,
    remove_work_dir,
    spawn,
)
from gpulens.record.redact import redact_argv
from gpulens.run.result import role_name
from gpulens.workloads.colocate_job import JobSpec, ProcessSpec, unique_names

log = logging.getLogger(__name__)

MECHANISMS = ("time-slice", "streams", "mps", "mig")
DEFAULT_MECHANISMS = ("time-slice", "streams", "mps", "mig")
# A CUDA context (and the libraries torch loads into it) costs memory beyond what the caching
# allocator reserves; about 0.5 GiB on an H100 with torch 2.x. Counted once per process.
CONTEXT_BYTES = 600 * 2**20
MEM_USABLE_FRACTION = 0.97
GO_DELAY_S = 0.05
KILL_GRACE_S = 5.0
HIGH_PRIORITY = -5  # torch maps it to the highest priority the device has
SAMPLE_PERIOD_S = 0.2

ProgressFn = Callable[[str], None]


@dataclass
class ColocateConfig:
    """A collocation experiment. ``jobs`` are :class:`JobSpec` (see ``parse_job``)."""

    jobs: list[JobSpec]
    mechanisms: tuple[str, ...] = DEFAULT_MECHANISMS
    mps_thread_pcts: tuple[float, ...] = (25.0, 50.0, 100.0)
    mps_limit_target: str = "auto"  # all, train, or auto (train when inference is in the mix)
    mps_mem_limit: str | None = None
    stream_priorities: bool = True
    duration_s: float = 15.0
    warmup_s: float = 3.0
    device: str | None = None
    max_slowdown: float | None = None
    setup_timeout_s: float = 300.0
    command_timeout_s: float | None = None
    cpu_threads: int | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        if len(self.jobs) < 2:
            raise UsageError("give at least two jobs to run together, e.g. resnet18 resnet50")
        self.jobs = unique_names(list(self.jobs))
        for job in self.jobs:
            if job.kind == "cmd":
                check_command(list(job.command), what=f"cmd: job {job.name}")
        bad = [m for m in self.mechanisms if m not in MECHANISMS]
        if bad or not self.mechanisms:
            raise UsageError(
                f"unknown mechanism {', '.join(bad) or '(none)'}: use {', '.join(MECHANISMS)}"
            )
        self.mechanisms = tuple(dict.fromkeys(self.mechanisms))
        for pct in self.mps_thread_pcts:
            if not 0 < pct <= 100:
                raise UsageError(f"--mps-thread-pct values must be in (0, 100], got {pct:g}")
        if self.mps_limit_target not in ("auto", "all", "train"):
            raise UsageError("--mps-limit must be auto, all or train")
        if self.duration_s <= 0 or self.warmup_s < 0:
            raise UsageError("--duration must be positive and --warmup-s zero or more")
        if self.max_slowdown is not None and self.max_slowdown < 1:
            raise UsageError(
                f"--max-slowdown is a factor >= 1 (1.5 = each job keeps 2/3 of its speed), "
                f"got {self.max_slowdown:g}"
            )
        if self.mps_mem_limit:
            from gpulens.launch.mps import _parse_mem_limit

            _parse_mem_limit(self.mps_mem_limit)

    def as_dict(self) -> dict[str, Any]:
        return {
            "jobs": [j.to_dict() for j in self.jobs],
            "mechanisms": list(self.mechanisms),
            "mps_thread_pcts": list(self.mps_thread_pcts),
            "mps_limit_target": self.mps_limit_target,
            "mps_mem_limit": self.mps_mem_limit,
            "stream_priorities": self.stream_priorities,
            "duration_s": self.duration_s,
            "warmup_s": self.warmup_s,
            "device": self.device,
            "max_slowdown": self.max_slowdown,
        }


# ------------------------------------------------------------------------------ arithmetic
def slowdown(alone: float | None, together: float | None) -> float | None:
    """alone / together: 1.0 unaffected, 2.0 half speed; None when either is missing."""
    if not alone or together is None:
        return None
    if together <= 0:
        return float("inf")
    return alone / together


def normalized_throughputs(pairs: list[tuple[float | None, float | None]]) -> list[float] | None:
    """together/alone per job; None if any is missing."""
    out = []
    for alone, together in pairs:
        if not alone or together is None:
            return None
        out.append(together / alone)
    return out


def jain_index(xs: list[float]) -> float | None:
    """Jain's fairness index (sum x)^2 / (n sum x^2): 1.0 all equal, 1/n one job gets all."""
    if not xs:
        return None
    sq = sum(x * x for x in xs)
    if sq == 0:
        return None
    return sum(xs) ** 2 / (len(xs) * sq)


def energy_per_sample(energy_j: float | None, samples: float | None) -> float | None:
    if energy_j is None or not samples:
        return None
    return energy_j / samples


def memory_fit(
    peaks_bytes: list[int | None],
    total_bytes: int | None,
    processes: int,
    context_bytes: int = CONTEXT_BYTES,
) -> tuple[bool | None, int | None, str | None]:
    """(fits, bytes needed, why not) from alone-run peaks. ``None`` fits = cannot tell."""
    if total_bytes is None or any(p is None for p in peaks_bytes):
        return None, None, None
    needed = int(sum(p for p in peaks_bytes if p is not None) + processes * context_bytes)
    usable = int(total_bytes * MEM_USABLE_FRACTION)
    if needed > usable:
        return (
            False,
            needed,
            (
                f"does not fit: needs about {needed / 2**30:.1f} GiB (alone-run peaks plus "
                f"{processes} CUDA context(s)) of {total_bytes / 2**30:.1f} GiB"
            ),
        )
    return True, needed, None


def summarize_result(result: dict[str, Any]) -> dict[str, Any]:
    """Fill a result's overall numbers from its jobs (used for measured and loaded results)."""
    jobs = result["jobs"]
    ratios = normalized_throughputs([(j["throughput_alone"], j["throughput_together"])
                                     for j in jobs])  # fmt: skip
    result["normalized_aggregate_throughput"] = sum(ratios) if ratios is not None else None
    result["jain_fairness"] = jain_index(ratios) if ratios is not None else None
    return result


# ------------------------------------------------------------------------ recommendation
def _pct_slower(s: float) -> str:
    return f"{100 * (1 - 1 / s):.0f}%" if s and s != float("inf") else "all"


def best_result(results: list[dict[str, Any]], max_slowdown: float | None) -> dict | None:
    """The measured result with the highest normalized aggregate throughput whose jobs all stay
    within ``max_slowdown``."""
    ok = []
    for r in results:
        agg = r.get("normalized_aggregate_throughput")
        if r.get("status") != "ok" or agg is None:
            continue
        worst = max((j["slowdown"] or 0) for j in r["jobs"])
        if max_slowdown is not None and worst > max_slowdown:
            continue
        ok.append(r)
    return max(ok, key=lambda r: r["normalized_aggregate_throughput"], default=None)


def recommend(doc: dict[str, Any], max_slowdown: float | None = None) -> str:
    """One sentence from the results."""
    results = doc["results"]
    names = [j["name"] for j in doc["jobs"]]
    who = " and ".join(names) if len(names) <= 2 else ", ".join(names[:-1]) + f" and {names[-1]}"
    best = best_result(results, max_slowdown)
    cap = f" within the {max_slowdown:g}x slowdown cap" if max_slowdown else ""
    if best is None:
        measured = [r for r in results if r.get("status") == "ok"]
        if not measured:
            return f"no mechanism ran {who} together successfully: run them on separate GPUs"
        return f"run {who} on separate GPUs or one after another: no mechanism kept every job{cap}"
    agg = best["normalized_aggregate_throughput"]
    label = _label(best)
    if agg <= 1.0:
        return (
            f"run {who} one after another or on separate GPUs: the best mechanism ({label}) "
            f"gives only {agg:.2f}x combined throughput"
        )
    worst = max(best["jobs"], key=lambda j: j["slowdown"] or 0)
    text = (
        f"run {who} together under {label}: {agg:.2f}x combined throughput, "
        f"{worst['name']} slows {_pct_slower(worst['slowdown'])}"
    )
    infer = [j for j in best["jobs"] if j.get("kind") == "infer"]
    for j in infer[:1]:
        if j.get("step_time_p99_alone_s") and j.get("step_time_p99_s"):
            text += (
                f"; {j['name']} p99 latency {1000 * j['step_time_p99_alone_s']:.1f} ms alone, "
                f"{1000 * j['step_time_p99_s']:.1f} ms together"
            )
    return text


def experiment_status(doc: dict[str, Any]) -> tuple[str, str | None]:
    """``("finished", None)`` when at least one mechanism measured the jobs together, else
    ``("failed", why)``: a job that failed alone, or what stopped every mechanism."""
    if any(r.get("status") == "ok" for r in doc["results"]):
        return "finished", None
    for job in doc["jobs"]:
        if job.get("error"):
            return "failed", f"nothing could be measured: job {job['name']} failed alone: " + str(
                job["error"]
            )
    reasons = [f"{r['mechanism']}: {r.get('error') or r.get('status')}" for r in doc["results"]]
    return "failed", "nothing could be measured: " + ("; ".join(reasons) or "no mechanism ran")


def _label(result: dict[str, Any]) -> str:
    mech = {"mps": "MPS", "mig": "MIG", "streams": "streams", "time-slice": "time-slicing"}
    setting = result.get("setting")
    name = mech.get(result["mechanism"], result["mechanism"])
    return f"{name} ({setting})" if setting and setting != "default" else name


# ------------------------------------------------------------------------- GPU window
class GpuWindow:
    """Energy and SM activity of the GPU over a measured window (NVML in this process)."""

    def __init__(self, nvml_index: int | None):
        self.reason: str | None = None
        self._probe = None
        if nvml_index is None:
            self.reason = "the jobs ran on the CPU"
            return
        from gpulens.probes.nvml.probe import open_gpu_probe

        try:
            self._probe = open_gpu_probe([nvml_index], energy_every_n=1)
        except Exception as exc:  # the experiment runs without energy numbers
            self.reason = f"GPU probe failed: {exc}"
            return
        self.reason = getattr(self._probe, "reason", None)

    @contextlib.contextmanager
    def measure(self, out: dict[str, Any]):
        rows: list[dict[str, Any]] = []
        stop = threading.Event()

        def loop() -> None:
            while True:
                with contextlib.suppress(Exception):
                    rows.extend(self._probe.sample())
                if stop.wait(SAMPLE_PERIOD_S):
                    break
            with contextlib.suppress(Exception):
                rows.extend(self._probe.sample())

        thread = None
        if self._probe is not None and self.reason is None:
            thread = threading.Thread(target=loop, name="gpulens-colocate-gpu", daemon=True)
            thread.start()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            stop.set()
            if thread is not None:
                thread.join()
            out["window_s"] = time.perf_counter() - t0
            energy = [r["energy_j"] for r in rows if r.get("energy_j") is not None]
            out["energy_j"] = energy[-1] - energy[0] if len(energy) >= 2 else None
            sm = [r["sm_activity_pct"] for r in rows if r.get("sm_activity_pct") is not None]
            out["sm_activity_pct"] = sum(sm) / len(sm) if sm else None
            util = [r["gpu_util_pct"] for r in rows if r.get("gpu_util_pct") is not None]
            out["gpu_util_pct"] = sum(util) / len(util) if util else None
            mem = [r["mem_used_bytes"] for r in rows if r.get("mem_used_bytes") is not None]
            out["gpu_mem_used_max_bytes"] = max(mem) if mem else None

    def close(self) -> None:
        if self._probe is not None:
            with contextlib.suppress(Exception):
                self._probe.close()


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


def _tail(path: Path, n: int = 600) -> str:
    try:
        return path.read_text(errors="replace")[-n:].strip()
    except OSError:
        return ""


def _kill(popens: list[subprocess.Popen]) -> None:
    """End every process of a run and whatever each started (process group and orphans)."""
    for p in popens:
        if p.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(p.pid, signal.SIGTERM)
    for p in popens:
        reap(p, grace_s=KILL_GRACE_S)


def _err_path(logf: Path) -> Path:
    return logf.with_suffix(".err")


def command_outcome(job: JobSpec, returncode: int, wall_s: float, logf: Path) -> dict[str, Any]:
    """A ``cmd:`` job's result: one run of the command; a non-zero exit is a failed job with
    its exit code and the tail of what it printed on stderr (stdout when stderr is empty)."""
    err = None
    tail = None
    if returncode != 0:
        tail = _tail(_err_path(logf), 400) or _tail(logf, 400) or None
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
                    with open(logf, "wb") as log_fh, open(_err_path(logf), "wb") as err_fh:
                        cp = spawn(
                            list(p.jobs[0].command), env=p.env, stdout=log_fh,
                            stderr=err_fh, stdin=subprocess.DEVNULL,
                            death_signal=signal.SIGTERM, own_group=True,
                        )  # fmt: skip
                    started.append(cp)
                    cmd_popens.append((p, cp, time.perf_counter(), logf))
                limit = time.monotonic() + duration_s + max(60.0, duration_s)
                for _, po, _, _, _ in builtin:
                    po.wait(timeout=max(1.0, limit - time.monotonic()))
                cmd_limit = None if command_timeout_s is None else \
                    time.monotonic() + command_timeout_s  # fmt: skip
                for p, cp, t0, logf in cmd_popens:
                    timeout = None if cmd_limit is None else max(1.0, cmd_limit - time.monotonic())
                    rc = cp.wait(timeout=timeout)
                    wall = time.perf_counter() - t0
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
                        f"{_tail(logf) or '(no output)'}"
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
        _kill(started)
    if outcome.error is None:
        shutil.rmtree(d, ignore_errors=True)
    return outcome


# --------------------------------------------------------------------------- experiment
@dataclass
class DeviceInfo:
    device: str  # "cpu" or "cuda:0" as the children see it
    name: str | None = None
    uuid: str | None = None
    memory_total_bytes: int | None = None
    nvml_index: int | None = None

    @property
    def cuda(self) -> bool:
        return self.device != "cpu"

    def as_dict(self) -> dict[str, Any] | None:
        if not self.cuda:
            return None
        return {"name": self.name, "uuid": self.uuid, "memory_total_bytes":
                self.memory_total_bytes, "nvml_index": self.nvml_index}  # fmt: skip


def probe_device(device: str | None) -> DeviceInfo:
    """Ask a child process what ``device`` is (the parent never creates a CUDA context)."""
    if device and device.strip().lower() == "cpu":
        return DeviceInfo("cpu")
    proc = spawn(
        [sys.executable, "-m", "gpulens.workloads.colocate_job", "--probe", device or "auto"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
        death_signal=signal.SIGKILL, own_group=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        stdout, stderr = "", "no answer within 300 s"
    finally:
        reap(proc, grace_s=1.0)
    try:
        info = json.loads(stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise RuntimeFailure(
            f"could not start a job process ({(stderr or '').strip()[-300:]}); "
            "check that torch imports: python -c 'import torch'"
        ) from None
    if info.get("error"):
        raise UsageError(info["error"])
    if info["device"] == "cpu":
        return DeviceInfo("cpu")
    from gpulens.probes.nvml.inventory import nvml_index_for_uuid

    nvml_index = nvml_index_for_uuid(info.get("uuid")).index
    return DeviceInfo("cuda:0", info.get("name"), info.get("uuid"),
                      info.get("memory_total_bytes"), nvml_index)  # fmt: skip


class ColocateExperiment:
    """Runs a :class:`ColocateConfig`; ``alone_cache`` (key -> alone result) may be shared
    between experiments on the same device."""

    def __init__(
        self,
        config: ColocateConfig,
        work_dir: Path,
        progress: ProgressFn | None = None,
        alone_cache: dict[str, dict[str, Any]] | None = None,
        device_info: DeviceInfo | None = None,
        mps_factory: Callable[..., Any] | None = None,
    ):
        self.config = config
        self.work_dir = Path(work_dir)
        self.progress = progress or (lambda _msg: None)
        self.alone_cache = {} if alone_cache is None else alone_cache
        self.info = device_info
        self.mps_factory = mps_factory
        self.window: GpuWindow | None = None
        self.warnings: list[str] = []

    # --- environment per process ----------------------------------------------------------
    def _env(self, visible: str | None = None) -> dict[str, str]:
        env = dict(os.environ)
        for k in ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"):
            env.pop(k, None)
        env["PYTHONUNBUFFERED"] = "1"
        if self.info and self.info.cuda:
            vis = visible or self.info.uuid
            if vis:
                env["CUDA_VISIBLE_DEVICES"] = vis
        return env

    def _device(self) -> str:
        return self.info.device if self.info else "cpu"

    def _group(self, procs: list[Proc]) -> GroupOutcome:
        c = self.config
        return run_group(
            procs, self.work_dir, c.duration_s, c.warmup_s, self.window,
            setup_timeout_s=c.setup_timeout_s, command_timeout_s=c.command_timeout_s,
            cpu_threads=c.cpu_threads or (None if self.info and self.info.cuda else 1),
        )  # fmt: skip

    # --- alone ------------------------------------------------------------------------------
    def alone(self, job: JobSpec) -> dict[str, Any]:
        if job.key in self.alone_cache:
            return self.alone_cache[job.key]
        self.progress(f"{job.name} alone")
        out = self._group([Proc([job], self._env(), self._device())])
        j = next(iter(out.jobs.values()), {})
        samples = j.get("samples")
        res = {
            "throughput": j.get("throughput_samples_per_s") if not out.error else None,
            "throughput_ci95_pct": j.get("throughput_ci95_pct") if not out.error else None,
            "step_time_p50_s": j.get("step_time_p50_s"),
            "step_time_p99_s": j.get("step_time_p99_s"),
            "peak_mem_bytes": j.get("peak_mem_bytes"),
            "energy_per_sample_j": energy_per_sample(out.window.get("energy_j"), samples),
            "sm_activity_pct": out.window.get("sm_activity_pct"),
            "error": out.error,
            "error_kind": out.error_kind,
            "exit_code": j.get("exit_code"),
            "stderr_tail": j.get("stderr_tail"),
        }
        self.alone_cache[job.key] = res
        return res

    # --- together -----------------------------------------------------------------------------
    def _result(
        self, mechanism: str, setting: str, out: GroupOutcome | None, *,
        status: str | None = None, error: str | None = None, fits: bool | None = True,
        mem_needed: int | None = None, job_extra: dict[str, dict[str, Any]] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        jobs = []
        samples = 0.0
        for job in self.config.jobs:
            a = self.alone_cache.get(job.key, {})
            t = (out.jobs.get(job.name) if out else None) or {}
            together = t.get("throughput_samples_per_s") if out and not out.error else None
            samples += t.get("samples") or 0
            jobs.append({
                "name": job.name, "key": job.key, "kind": job.kind,
                "throughput_alone": a.get("throughput"), "throughput_together": together,
                "slowdown": slowdown(a.get("throughput"), together),
                "throughput_alone_ci95_pct": a.get("throughput_ci95_pct"),
                "throughput_together_ci95_pct": t.get("throughput_ci95_pct")
                if out and not out.error else None,
                # a ratio's relative CI: the two runs' relative CIs in quadrature (first order)
                "slowdown_ci95_pct": _quadrature(
                    a.get("throughput_ci95_pct"), t.get("throughput_ci95_pct")
                ),
                "step_time_p50_s": t.get("step_time_p50_s"),
                "step_time_p99_s": t.get("step_time_p99_s"),
                "step_time_p50_alone_s": a.get("step_time_p50_s"),
                "step_time_p99_alone_s": a.get("step_time_p99_s"),
                "peak_mem_bytes": t.get("peak_mem_bytes") if t.get("peak_mem_bytes") is not None
                else a.get("peak_mem_bytes"),
                "steps": t.get("steps"),
                "error": t.get("error"),
                **((job_extra or {}).get(job.name, {})),
            })  # fmt: skip
        if out is not None and out.error:
            status = status or ("does_not_fit" if out.error_kind == "oom" else "failed")
            error = error or (
                f"does not fit: out of memory during the run ({out.error})"
                if out.error_kind == "oom" else out.error
            )  # fmt: skip
            if out.error_kind == "oom":
                fits = False
        window = out.window if out else {}
        result = {
            "mechanism": mechanism, "setting": setting, "status": status or "ok",
            "error": error, "fits": fits, "mem_needed_bytes": mem_needed,
            "jobs": jobs,
            "energy_j": window.get("energy_j"),
            "energy_per_sample_j": energy_per_sample(window.get("energy_j"), samples)
            if (status or "ok") == "ok" else None,
            "sm_activity_pct": window.get("sm_activity_pct"),
            "gpu_util_pct": window.get("gpu_util_pct"),
            "gpu_mem_used_max_bytes": window.get("gpu_mem_used_max_bytes"),
            "window_s": window.get("window_s"),
            "process_peak_mem_bytes": out.process_peaks if out else [],
        }  # fmt: skip
        return summarize_result(result)

    def _fit(self, processes: int, total: int | None = None) -> tuple[bool | None, int | None,
                                                                      str | None]:  # fmt: skip
        if not (self.info and self.info.cuda):
            return True, None, None
        peaks = [self.alone_cache.get(j.key, {}).get("peak_mem_bytes")
                 for j in self.config.jobs if j.builtin]  # fmt: skip
        return memory_fit(peaks, total or self.info.memory_total_bytes, processes)

    def _unavailable(self, mechanism: str, setting: str, why: str) -> dict[str, Any]:
        return self._result(mechanism, setting, None, status="unavailable", error=why, fits=None)

    def _run_checked(self, mechanism: str, setting: str, procs: list[Proc], *,
                     n_contexts: int, extra=None) -> dict[str, Any]:  # fmt: skip
        fits, needed, why = self._fit(n_contexts)
        if fits is False:
            return self._result(mechanism, setting, None, status="does_not_fit", error=why,
                                fits=False, mem_needed=needed)  # fmt: skip
        self.progress(f"{mechanism} {setting}")
        try:
            out = self._group(procs)
        except Exception as exc:  # a broken mechanism must not stop the experiment
            log.exception("%s %s failed", mechanism, setting)
            return self._result(mechanism, setting, None, status="failed",
                                error=f"{type(exc).__name__}: {exc}", fits=fits)  # fmt: skip
        return self._result(mechanism, setting, out, fits=fits, mem_needed=needed,
                            job_extra=extra)  # fmt: skip

    def _mixed(self) -> bool:
        kinds = {j.kind for j in self.config.jobs}
        return "infer" in kinds and ("train" in kinds or "cmd" in kinds)

    def time_slice(self) -> list[dict[str, Any]]:
        procs = [Proc([j], self._env(), self._device()) for j in self.config.jobs]
        return [self._run_checked("time-slice", "default", procs, n_contexts=len(procs))]

    def streams(self) -> list[dict[str, Any]]:
        c = self.config
        if not (self.info and self.info.cuda):
            return [self._unavailable("streams", "default", "unavailable: CUDA streams need a "
                                      "GPU (this run uses the CPU)")]  # fmt: skip
        if any(not j.builtin for j in c.jobs):
            why = "unavailable: streams run built-in jobs in one process; cmd: jobs cannot share it"
            return [self._unavailable("streams", "default", why)]
        settings = [("default", [None] * len(c.jobs))]
        if c.stream_priorities and self._mixed():
            prios = [HIGH_PRIORITY if j.kind == "infer" else 0 for j in c.jobs]
            settings.append(("inference high priority", prios))
        out = []
        for setting, prios in settings:
            extra = {j.name: {"stream_priority": p} for j, p in zip(c.jobs, prios, strict=True)}
            out.append(self._run_checked(
                "streams", setting, [Proc(list(c.jobs), self._env(), self._device(), prios)],
                n_contexts=1, extra=extra,
            ))  # fmt: skip
        return out

    def mps(self) -> list[dict[str, Any]]:
        from gpulens.launch.mps import (
            PrivateMps,
            find_foreign_daemons,
            foreign_daemon_message,
            mps_available,
        )

        c = self.config
        target = c.mps_limit_target
        if target == "auto":
            target = "train" if self._mixed() else "all"
        settings = [f"thread_pct={p:g}" + (" (training jobs)" if target == "train" else "")
                    for p in c.mps_thread_pcts]  # fmt: skip
        if not (self.info and self.info.cuda):
            why = "unavailable: MPS needs a GPU (this run uses the CPU)"
            return [self._unavailable("mps", s, why) for s in settings]
        factory = self.mps_factory or PrivateMps
        if self.mps_factory is None:
            why = mps_available()
            if why:
                return [self._unavailable("mps", s, why) for s in settings]
            foreign = find_foreign_daemons()
            if foreign:
                why = "unavailable: " + foreign_daemon_message(foreign)
                return [self._unavailable("mps", s, why) for s in settings]
        results = []
        for pct, setting in zip(c.mps_thread_pcts, settings, strict=True):
            fits, needed, why = self._fit(len(c.jobs))
            if fits is False:
                results.append(self._result("mps", setting, None, status="does_not_fit",
                                            error=why, fits=False, mem_needed=needed))  # fmt: skip
                continue
            self.progress(f"mps {setting}")
            try:
                with factory(gpu_uuid=self.info.uuid) as daemon:
                    procs, extra = [], {}
                    for j in c.jobs:
                        limited = target == "all" or j.kind != "infer"
                        env = daemon.client_env(pct if limited else None, c.mps_mem_limit)
                        env["PYTHONUNBUFFERED"] = "1"
                        procs.append(Proc([j], env, "cuda:0"))
                        extra[j.name] = {"mps_thread_pct": pct if limited else 100.0}
                    out = self._group(procs)
                results.append(self._result("mps", setting, out, fits=fits, mem_needed=needed,
                                            job_extra=extra))  # fmt: skip
            except Exception as exc:
                log.warning("mps %s failed: %s", setting, exc)
                results.append(
                    self._result(
                        "mps",
                        setting,
                        None,
                        status="failed",
                        error=f"{type(exc).__name__}: {exc}",
                        fits=fits,
                    )
                )
        return results

    def mig(self) -> list[dict[str, Any]]:
        from gpulens.probes.nvml.mig import mig_layout

        if not (self.info and self.info.cuda) or self.info.nvml_index is None:
            why = "unavailable: MIG needs an NVIDIA GPU that NVML can see"
            return [self._unavailable("mig", "existing instances", why)]
        layout = mig_layout(self.info.nvml_index)
        if layout.reason:
            return [self._unavailable("mig", "existing instances", layout.reason)]
        jobs = self.config.jobs
        if len(layout.instances) < len(jobs):
            why = (f"unavailable: {len(layout.instances)} MIG instance(s) exist and {len(jobs)} "
                   "jobs need one each; gpulens does not change the MIG layout")  # fmt: skip
            return [self._unavailable("mig", "existing instances", why)]
        procs, extra = [], {}
        for j, inst in zip(jobs, layout.instances, strict=False):
            peak = self.alone_cache.get(j.key, {}).get("peak_mem_bytes")
            fits, needed, why = memory_fit([peak], inst.memory_total_bytes, 1)
            if fits is False:
                return [
                    self._result(
                        "mig",
                        "existing instances",
                        None,
                        status="does_not_fit",
                        error=f"{j.name} on {inst.uuid}: {why}",
                        fits=False,
                    )
                ]
            procs.append(Proc([j], self._env(visible=inst.uuid), "cuda:0"))
            extra[j.name] = {"mig_uuid": inst.uuid}
        self.progress("mig")
        out = self._group(procs)
        return [self._result("mig", "existing instances", out, fits=True, job_extra=extra)]

    # --- all ------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        c = self.config
        if self.info is None:
            self.progress("probing the device")
            self.info = probe_device(c.device)
        if self.info.cuda:
            from gpulens.launch.mps import find_foreign_daemons, foreign_daemon_message

            foreign = find_foreign_daemons()
            if foreign:
                self.warnings.append(
                    foreign_daemon_message(foreign) + "; processes of the non-MPS mechanisms may "
                    "become its clients"
                )
        self.window = GpuWindow(self.info.nvml_index if self.info.cuda else None)
        try:
            for job in c.jobs:
                self.alone(job)
            alone_failed = [j for j in c.jobs if self.alone_cache[j.key]["error"]]
            results: list[dict[str, Any]] = []
            for mech in c.mechanisms:
                if alone_failed:
                    j = alone_failed[0]
                    a = self.alone_cache[j.key]
                    why = (
                        f"does not fit: {j.name} runs out of memory alone"
                        if a["error_kind"] == "oom"
                        else f"{j.name} failed alone: {a['error']}"
                    )
                    st = "does_not_fit" if a["error_kind"] == "oom" else "failed"
                    results.append(
                        self._result(
                            mech,
                            "-",
                            None,
                            status=st,
                            error=why,
                            fits=False if st == "does_not_fit" else None,
                        )
                    )
                    continue
                try:
                    results += getattr(self, mech.replace("-", "_"))()
                except Exception as exc:  # never let one mechanism end the experiment
                    log.exception("mechanism %s failed", mech)
                    results.append(
                        self._result(
                            mech,
                            "-",
                            None,
                            status="failed",
                            error=f"{type(exc).__name__}: {exc}",
                            fits=None,
                        )
                    )
        finally:
            self.window.close()
        doc = {
            "gpu": self.info.as_dict(),
            "device": "cpu" if not self.info.cuda else self.info.device,
            "jobs": [self._job_doc(j) for j in c.jobs],
            "results": results,
            "recommendation": "",
            "warnings": self.warnings,
            "duration_s": c.duration_s,
            "warmup_s": c.warmup_s,
            "max_slowdown": c.max_slowdown,
        }
        doc["recommendation"] = recommend(doc, c.max_slowdown)
        doc["status"], doc["error"] = experiment_status(doc)
        return doc

    def _job_doc(self, job: JobSpec) -> dict[str, Any]:
        a = self.alone_cache.get(job.key, {})
        return {
            **job.to_dict(),
            "throughput_alone": a.get("throughput"),
            "throughput_alone_ci95_pct": a.get("throughput_ci95_pct"),
            "step_time_p50_alone_s": a.get("step_time_p50_s"),
            "step_time_p99_alone_s": a.get("step_time_p99_s"),
            "peak_mem_bytes": a.get("peak_mem_bytes"),
            "energy_per_sample_alone_j": a.get("energy_per_sample_j"),
            "sm_activity_alone_pct": a.get("sm_activity_pct"),
            "error": a.get("error"),
            "exit_code": a.get("exit_code"),
            "stderr_tail": a.get("stderr_tail"),
        }


def _quadrature(*pcts: float | None) -> float | None:
    if any(p is None for p in pcts):
        return None
    return math.sqrt(sum(p * p for p in pcts))


def run_colocate(
    config: ColocateConfig,
    runs_root: Path | None,
    progress: ProgressFn | None = None,
    alone_cache: dict[str, dict[str, Any]] | None = None,
    device_info: DeviceInfo | None = None,
) -> dict[str, Any]:
    """Run the experiment; with ``runs_root`` it is stored as a run record of kind
    ``colocate`` (the summary holds the result document, which ``--plan`` reads back)."""
    writer = None
    if runs_root is not None:
        from gpulens.record.writer import RunWriter

        # The record first (status running, the requested config); the environment, which
        # imports torch and initialises NVML, after it.
        writer = RunWriter(
            runs_root, kind="colocate",
            name=config.name or "colocate-" + "+".join(j.name for j in config.jobs),
            requested_config=config.as_dict(), role=role_name("colocate", "experiment"),
        )  # fmt: skip
    work = None
    try:
        if writer:
            from gpulens.probes.environment import capture_environment
            from gpulens.probes.nvml.inventory import describe_gpus

            writer.update(environment=capture_environment(describe_gpus()))
        work = make_work_dir("gpulens-colocate-")
        doc = ColocateExperiment(config, work, progress, alone_cache, device_info).run()
    except KeyboardInterrupt:
        if writer:
            writer.finish("killed", error="interrupted (Ctrl-C)")
        raise
    except BaseException as exc:
        if writer:
            writer.finish("failed", error=str(exc) or type(exc).__name__)
        raise
    finally:
        if work is not None:
            remove_work_dir(work)
    if writer:
        doc["run_id"] = writer.run_id
        doc["record_dir"] = str(writer.dir)
        writer.update(effective_config=config.as_dict(), summary={"colocate": _strip(doc)})
        writer.finish(doc["status"], error=doc.get("error"))
    return doc


def _strip(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k not in ("run_id", "record_dir")}

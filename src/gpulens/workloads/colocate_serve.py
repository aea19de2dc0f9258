"""A ``serve:`` job of ``gpulens colocate``: a ``gpulens serve`` process serving one model over
HTTP, driven by gpulens's open-loop load generator for the measured window.

This process uses no GPU itself. It starts the server as its child with its own environment (so
the server is an MPS client, or sees its MIG instance, as any job of the experiment would), waits
until the server is ready, warms it up with the tenant's own load for ``warmup_s``, reports
ready, and from the common start time drives the tenant's schedule for ``duration_s``. Latency
counts from each scheduled arrival; a request that failed or got no answer counts as the load's
timeout, a miss for any SLO below it. The server's own run record goes to a scratch store that is
deleted with the experiment's group directory.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from gpulens.launch.group import tail_text
from gpulens.workloads.jobspec import JobSpec, ProcessSpec, percentile, wait_for_go, write_json

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 10.0
FAIL_EXIT_CODE = 4


def _wait_ready(url: str, server: subprocess.Popen, log_path: Path) -> str | None:
    """None once ``/v2/health/ready`` answers 200; else why not."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            tail = tail_text(log_path)
            return f"the server exited ({server.returncode}) before it was ready: {tail}"
        try:
            with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=1) as r:
                if r.status == 200:
                    return None
        except OSError:
            time.sleep(0.2)
    return f"the server was not ready within {READY_TIMEOUT_S:.0f} s: {tail_text(log_path)}"


def _stop(server: subprocess.Popen | None) -> None:
    if server is None or server.poll() is not None:
        return
    server.send_signal(signal.SIGTERM)  # the server ends its run cleanly on SIGTERM
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def _load(url: str, job: JobSpec, duration_s: float, seed: int):
    from gpulens.serve.load_config import LoadConfig, TenantSpec
    from gpulens.serve.loadgen import run_load

    tenant = TenantSpec(model=job.workload or "", rate_rps=job.rate_per_s, slo_ms=job.slo_ms,
                        arrival=job.arrivals, batch=job.batch_size or 1)  # fmt: skip
    config = LoadConfig(url, (tenant,), duration_s=duration_s, warmup_s=0.0, seed=seed,
                        timeout_s=REQUEST_TIMEOUT_S)  # fmt: skip
    return run_load(config).records


def job_result(job: JobSpec, records, window_s: float) -> dict[str, Any]:
    """The job's figures from the load run's records, in the form of the built-in jobs'."""
    measured = records.measured()
    ok = records.ok()[measured]
    latency_s = records.latency_s[measured]
    answered = ok & np.isfinite(latency_s)
    times = np.where(answered, latency_s, REQUEST_TIMEOUT_S).tolist()
    done = int(answered.sum())
    failed = int(measured.sum()) - done
    return {
        "name": job.name,
        "key": job.key,
        "kind": job.kind,
        "steps": len(times),
        "samples": done * (job.batch_size or 1),
        "window_s": window_s,
        "throughput_samples_per_s": done * (job.batch_size or 1) / window_s if done else None,
        "throughput_ci95_pct": None,
        "step_time_mean_s": sum(times) / len(times) if times else None,
        "step_time_p50_s": percentile(times, 50),
        "step_time_p99_s": percentile(times, 99),
        "step_times_s": [round(t, 6) for t in times],
        "peak_mem_bytes": None,  # the server's, not measured from here
        # failed requests are SLO misses (and lower throughput), not a failed job
        "requests_failed": failed,
        "error": None,
        "error_kind": None,
    }


def run_serve_process(spec: ProcessSpec) -> int:
    """Serve, warm up, wait for go, drive the load, write the result. Returns the exit code."""
    from gpulens.workloads.distributed import free_port

    parent_pid = os.getppid()
    job = JobSpec.from_dict(spec.jobs[0])
    group_dir = Path(spec.result_file).parent
    log_path = group_dir / f"{Path(spec.result_file).stem}.server.log"
    doc: dict[str, Any] = {"pid": os.getpid(), "jobs": [], "error": None, "error_kind": None}
    server = None
    try:
        url = f"http://127.0.0.1:{free_port()}"
        cmd = [sys.executable, "-m", "gpulens.cli", "serve", "--model", job.workload or "",
               "--device", spec.device, "--precision", job.precision,
               "--port", url.rsplit(":", 1)[1], "--no-store"]  # fmt: skip
        env = {**os.environ, "GPULENS_HOME": str(group_dir / "serve-home")}
        with open(log_path, "wb") as fh:
            server = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL)  # fmt: skip
        why = _wait_ready(url, server, log_path)
        if why is None and spec.warmup_s > 0:
            _load(url, job, spec.warmup_s, spec.seed + 1000)
        if why is not None:
            doc.update(error=f"serve:{job.workload}: {why}"[:800], error_kind="failed")
        write_json(spec.ready_file, {"errors": [doc["error"]] if doc["error"] else []})
        if doc["error"] is None:
            start = wait_for_go(spec.go_file, parent_pid)
            time.sleep(max(0.0, start - time.time()))
            records = _load(url, job, spec.duration_s, spec.seed)
            doc["jobs"] = [job_result(job, records, spec.duration_s)]
    except Exception as exc:  # the parent reads the reason from the result file
        log.exception("serve job failed")
        doc.update(error=f"serve:{job.workload}: {type(exc).__name__}: {exc}"[:800],
                   error_kind="failed")  # fmt: skip
        if not Path(spec.ready_file).exists():
            write_json(spec.ready_file, {"errors": [doc["error"]]})
    finally:
        _stop(server)
    write_json(spec.result_file, doc)
    return FAIL_EXIT_CODE if doc["error_kind"] else 0

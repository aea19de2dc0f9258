"""The monitor: samples probes at a fixed rate into the run record.

By default the sampling runs in a separate process (``gpulens.probes.sampler_process``), so the
monitor never competes with the training loop for Python's interpreter lock; only a spare core's
time is spent. Probe objects given directly are sampled in a thread of this process instead
(tests use this with fake probes).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpulens.errors import RuntimeFailure, UsageError
from gpulens.launch.processes import forget, reap, spawn
from gpulens.probes.base import Probe
from gpulens.probes.nvml.probe import GPM_INTERVAL_S
from gpulens.record.writer import RunWriter, SeriesWriter

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ProbeSpec:
    """How to build a probe in the sampler process: ``kind`` is ``gpu`` or ``host``."""

    kind: str
    options: dict[str, Any] = field(default_factory=dict)


def build_probe(spec: ProbeSpec) -> Probe:
    if spec.kind == "gpu":
        from gpulens.probes.nvml.probe import open_gpu_probe

        options = {k: v for k, v in spec.options.items() if k != "indices"}
        return open_gpu_probe(spec.options.get("indices"), **options)
    if spec.kind == "host":
        from gpulens.probes.host import HostProbe

        return HostProbe(root_pid=spec.options.get("root_pid"))
    raise ValueError(f"unknown probe kind {spec.kind!r}")


def probe_unsupported(probes: list[Probe]) -> dict[str, str]:
    """``name.metric -> reason`` for every probe, plus a probe-wide reason for a null probe."""
    out: dict[str, str] = {}
    for p in probes:
        reason = getattr(p, "reason", None)
        if reason:
            out[p.name] = reason
            continue
        out.update({f"{p.name}.{k}": v for k, v in p.unsupported.items()})
    return out


@dataclass
class MonitorOverhead:
    """What the monitor cost: samples taken and the sampler's CPU time.

    ``sampler_cpu_pct_of_core`` is the sampler's CPU time over the wall time, as a percentage of
    one core: in the isolated process (the default) it runs on a spare core beside the training
    loop, so it is not a slowdown of the workload. A slowdown is only known where one was
    measured against a run without gpulens; the time gpulens spends on the training thread is
    ``tracking_us_per_step`` (from the step timer)."""

    samples: int
    cpu_s: float
    wall_s: float
    isolated: bool
    sampler_wall_s: float | None = None  # how long the sampler sampled, when it said so

    def as_dict(self) -> dict[str, Any]:
        sampling_s = self.sampler_wall_s or self.wall_s
        return {
            "monitor_samples": self.samples,
            "monitor_cpu_s": round(self.cpu_s, 4),
            "monitor_mean_sample_cost_ms": round(1000 * self.cpu_s / max(self.samples, 1), 3),
            "monitor_achieved_hz": round(self.samples / sampling_s, 2) if sampling_s else 0.0,
            # over the sampler's own sampling time: a run shorter than its first sample
            # would otherwise show many cores' worth
            "sampler_cpu_pct_of_core": round(100 * self.cpu_s / sampling_s, 3)
            if sampling_s
            else None,
            "monitor_isolated_process": self.isolated,
            # GPM's columns (SM, tensor, DRAM activity) are read at most this often, not at
            # every sample: each of their rows averages the window since the last one
            "gpm_interval_s": GPM_INTERVAL_S,
        }


def sample_loop(
    probes: list[Probe],
    series: dict[str, SeriesWriter],
    period_s: float,
    should_stop,
    wait,
) -> tuple[int, float]:
    """Sample until ``should_stop()``; returns (samples, cpu seconds spent sampling).

    A probe that raises is logged once and switched off, so a flaky sensor never stops the run.
    """
    samples, cpu_s = 0, 0.0
    broken: set[str] = set()
    next_t = time.monotonic()
    while not should_stop():
        c0 = time.thread_time()
        for probe in probes:
            if probe.name in broken:
                continue
            try:
                for row in probe.sample():
                    series[probe.name].append(row)
            except Exception as exc:
                broken.add(probe.name)
                log.warning("probe %s failed and is switched off: %s", probe.name, exc)
        samples += 1
        cpu_s += time.thread_time() - c0
        next_t += period_s
        delay = next_t - time.monotonic()
        if delay < 0:  # fell behind (a slow NVML call): skip ahead instead of bursting
            next_t, delay = time.monotonic(), 0.0
        wait(delay)
    return samples, cpu_s


class Monitor:
    """Samples probes at ``hz`` into ``writer``'s series, one series per probe name.

    ``probes`` are either :class:`ProbeSpec` (sampled in a separate process) or probe objects
    (sampled in a thread). Use as a context manager.
    """

    def __init__(self, writer: RunWriter, probes: list, hz: float = 10.0, metrics=None):
        if hz <= 0:
            raise ValueError("sampling rate must be positive")
        self.writer = writer
        self.hz = hz
        self.period_s = 1.0 / hz
        self.isolated = all(isinstance(p, ProbeSpec) for p in probes)
        if not self.isolated and any(isinstance(p, ProbeSpec) for p in probes):
            raise ValueError("give either probe specs or probe objects, not both")
        self._probes = list(probes)
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._result: tuple[int, float] = (0, 0.0)
        self._t0 = 0.0
        self._wall_s = 0.0
        self._sampler_wall_s: float | None = None
        self.unsupported: dict[str, str] = {}
        self.metrics = metrics  # a web.metrics.MetricsEndpoint: serve /metrics while sampling
        self.metrics_url: str | None = None
        self._metrics_server = None

    # --- thread mode ----------------------------------------------------------------------
    def _start_thread(self) -> None:
        series = {p.name: self.writer.series(p.name, p.schema) for p in self._probes}
        self.unsupported = probe_unsupported(self._probes)
        if self.metrics is not None:
            from gpulens.web.metrics import start_live_metrics

            self._metrics_server, self.metrics_url, series = start_live_metrics(
                self.metrics, self.writer.dir, series
            )

        def run():
            self._result = sample_loop(
                self._probes, series, self.period_s, self._stop.is_set, self._stop.wait
            )
            for s in series.values():
                s.flush()

        self._thread = threading.Thread(target=run, name="gpulens-monitor", daemon=True)
        self._thread.start()

    # --- process mode ---------------------------------------------------------------------
    def _start_process(self) -> None:
        specs = json.dumps([asdict(s) for s in self._probes])
        metrics_args = ["--metrics", self.metrics.as_arg()] if self.metrics else []
        src_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src_root, env.get("PYTHONPATH")]))
        # Its own process group: a terminal's Ctrl-C goes to the workload and gpulens, which
        # stops the sampler itself; SIGTERM (handled as "stop") when gpulens dies.
        self._proc = spawn(
            [sys.executable, "-m", "gpulens.probes.sampler_process", "--run-dir",
             str(self.writer.dir), "--hz", str(self.hz), "--specs", specs, *metrics_args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
            death_signal=signal.SIGTERM, own_group=True,
        )  # fmt: skip
        ready = self._read_message(READY_TIMEOUT_S)
        if ready and ready.get("error"):  # e.g. the --prometheus-port is taken
            reap(self._proc, grace_s=1.0)
            raise UsageError(ready["error"])
        if not ready or "ready" not in ready:
            reap(self._proc, grace_s=1.0)
            raise RuntimeFailure(
                "the gpulens sampler process did not start; run with --debug and see its "
                f"error above (got {ready!r})"
            )
        self.unsupported = ready.get("unsupported", {})
        self.metrics_url = ready.get("metrics_url")

    def _read_message(self, timeout_s: float) -> dict[str, Any] | None:
        result: list[str] = []
        reader = threading.Thread(target=lambda: result.append(self._proc.stdout.readline()))
        reader.daemon = True
        reader.start()
        reader.join(timeout_s)
        if not result or not result[0]:
            return None
        try:
            return json.loads(result[0])
        except json.JSONDecodeError:
            return None

    def start(self) -> Monitor:
        if self.isolated:
            self._start_process()
        else:
            self._start_thread()
        if self.unsupported:
            self.writer.update(unsupported=self.unsupported)
        if self.metrics_url:
            self.writer.update(metrics_url=self.metrics_url)
            log.info("Prometheus metrics at %s", self.metrics_url)
        self._t0 = time.monotonic()
        return self

    def stop(self) -> MonitorOverhead:
        if self._wall_s:
            return self.overhead()
        self._wall_s = time.monotonic() - self._t0
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=10)
            for p in self._probes:
                try:
                    p.close()
                except Exception as exc:
                    log.debug("closing probe %s: %s", p.name, exc)
        if self._proc is not None:
            try:
                self._proc.stdin.write("stop\n")
                self._proc.stdin.flush()
            except (BrokenPipeError, OSError):
                pass
            done = self._read_message(30.0)
            if done and "done" in done:
                self._result = (done["done"]["samples"], done["done"]["cpu_s"])
                self._sampler_wall_s = done["done"].get("wall_s")
            else:
                log.warning("the sampler process ended without a report; its series are kept")
            try:
                self._proc.wait(timeout=10)
                forget(self._proc)
            except subprocess.TimeoutExpired:
                reap(self._proc, grace_s=1.0)
        return self.overhead()

    def overhead(self) -> MonitorOverhead:
        wall = self._wall_s or (time.monotonic() - self._t0)
        samples, cpu_s = self._result
        return MonitorOverhead(
            samples=samples,
            cpu_s=cpu_s,
            wall_s=wall,
            isolated=self.isolated,
            sampler_wall_s=self._sampler_wall_s,
        )

    def __enter__(self) -> Monitor:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

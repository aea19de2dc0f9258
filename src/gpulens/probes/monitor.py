"""The monitor: samples every probe at a fixed rate in a background thread into the run record."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from gpulens.probes.base import Probe
from gpulens.record.writer import RunWriter, SeriesWriter

log = logging.getLogger(__name__)


@dataclass
class MonitorOverhead:
    """What the monitor itself cost. ``cpu_pct_of_one_core`` bounds the GIL time it took away."""

    samples: int
    cpu_s: float
    wall_s: float
    mean_sample_cost_ms: float
    achieved_hz: float

    @property
    def cpu_pct_of_one_core(self) -> float:
        return 100.0 * self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "monitor_samples": self.samples,
            "monitor_cpu_s": round(self.cpu_s, 4),
            "monitor_mean_sample_cost_ms": round(self.mean_sample_cost_ms, 3),
            "monitor_achieved_hz": round(self.achieved_hz, 2),
            "monitor_overhead_pct": round(self.cpu_pct_of_one_core, 3),
        }


class Monitor:
    """Samples ``probes`` at ``hz`` into ``writer``'s series, one series per probe name.

    Use as a context manager. A probe that raises is logged once and skipped from then on, so a
    flaky sensor never stops the workload.
    """

    def __init__(self, writer: RunWriter, probes: list[Probe], hz: float = 10.0):
        if hz <= 0:
            raise ValueError("sampling rate must be positive")
        self.writer = writer
        self.probes = list(probes)
        self.period_s = 1.0 / hz
        self._series: dict[str, SeriesWriter] = {
            p.name: writer.series(p.name, p.schema) for p in self.probes
        }
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gpulens-monitor", daemon=True)
        self._cpu_s = 0.0
        self._samples = 0
        self._t0 = 0.0
        self._wall_s = 0.0
        unsupported = {}
        for p in self.probes:
            unsupported.update({f"{p.name}.{k}": v for k, v in p.unsupported.items()})
        if unsupported:
            writer.update(unsupported=unsupported)

    def _loop(self) -> None:
        next_t = time.monotonic()
        broken: set[str] = set()
        while not self._stop.is_set():
            c0 = time.thread_time()
            for probe in self.probes:
                if probe.name in broken:
                    continue
                try:
                    for row in probe.sample():
                        self._series[probe.name].append(row)
                except Exception as exc:
                    broken.add(probe.name)
                    log.warning("probe %s failed and is switched off: %s", probe.name, exc)
            self._samples += 1
            self._cpu_s += time.thread_time() - c0
            next_t += self.period_s
            delay = next_t - time.monotonic()
            if delay < 0:  # fell behind (a slow NVML call): skip ahead instead of bursting
                next_t = time.monotonic()
                delay = 0
            self._stop.wait(delay)

    def start(self) -> Monitor:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> MonitorOverhead:
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join(timeout=5)
        self._wall_s = time.monotonic() - self._t0
        for s in self._series.values():
            s.flush()
        for p in self.probes:
            try:
                p.close()
            except Exception as exc:
                log.debug("closing probe %s: %s", p.name, exc)
        return self.overhead()

    def overhead(self) -> MonitorOverhead:
        wall = self._wall_s or (time.monotonic() - self._t0)
        return MonitorOverhead(
            samples=self._samples,
            cpu_s=self._cpu_s,
            wall_s=wall,
            mean_sample_cost_ms=1000.0 * self._cpu_s / max(self._samples, 1),
            achieved_hz=self._samples / wall if wall > 0 else 0.0,
        )

    def __enter__(self) -> Monitor:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

"""Tracking API for one's own training script: two lines in the loop.

    import gpulens
    with gpulens.track(name="my-train") as tracker:
        for x, y in tracker.data(loader):   # times the wait for each batch
            ...                              # forward, backward, optimizer
            tracker.step()                   # optional: marks the end of the step

Under ``gpulens run -- python train.py`` the steps go into the run that gpulens made (it already
monitors the GPU and host); run on its own, the script gets a run record and monitor of its own.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from gpulens.probes.steps import STEPS_SCHEMA, StepTimer
from gpulens.record import schema
from gpulens.record.writer import SeriesWriter, atomic_write_json
from gpulens.stats import throughput_ci

log = logging.getLogger(__name__)

RUN_DIR_ENV = "GPULENS_RUN_DIR"
TRACKER_FILE = "tracker.json"


def _batch_size(batch: Any) -> int | None:
    """Samples in a batch: the leading dimension of its first tensor-like part."""
    if hasattr(batch, "shape") and len(batch.shape) > 0:
        return int(batch.shape[0])
    if isinstance(batch, (list, tuple)) and batch:
        first = batch[0]
        if isinstance(first, (int, float, str, bytes)):
            return len(batch)  # a plain list of samples
        return _batch_size(first)
    if isinstance(batch, dict) and batch:
        return _batch_size(next(iter(batch.values())))
    return None


class Tracker:
    """Times the steps of a user's loop. Use :func:`track` to make one."""

    def __init__(
        self,
        name: str | None = None,
        samples_per_step: int | None = None,
        warmup_steps: int = 5,
        sample_hz: float = 10.0,
        runs_root: Path | None = None,
    ):
        self.samples_per_step = samples_per_step
        self._owned_writer = None
        self._monitor = None
        parent_dir = os.environ.get(RUN_DIR_ENV)
        if parent_dir:
            self.run_dir = Path(parent_dir)
            series = SeriesWriter(self.run_dir / schema.SERIES_DIR / "steps", STEPS_SCHEMA)
        else:
            self._start_own_run(name, sample_hz, runs_root)
            series = self._owned_writer.series("steps", STEPS_SCHEMA)
        self._series = series
        self._timer = StepTimer(series, cuda=False, warmup_steps=warmup_steps)
        self._in_step = False
        self._t0 = time.perf_counter()
        self._last_batch_samples: int | None = None

    def _start_own_run(self, name, sample_hz, runs_root) -> None:
        import sys

        from gpulens.paths import runs_dir
        from gpulens.probes.environment import capture_environment
        from gpulens.probes.gpu import describe_gpus
        from gpulens.probes.monitor import Monitor, ProbeSpec
        from gpulens.record.writer import RunWriter

        self._owned_writer = RunWriter(
            runs_root or runs_dir(),
            kind="script",
            name=name or Path(sys.argv[0] or "script").stem,
            requested_config={"argv": sys.argv},
            environment=capture_environment(describe_gpus()),
        )
        self.run_dir = self._owned_writer.dir
        self._monitor = Monitor(
            self._owned_writer,
            [ProbeSpec("gpu"), ProbeSpec("host", {"root_pid": os.getpid()})],
            sample_hz,
        )
        self._monitor.start()

    def data(self, iterable: Iterable) -> Iterator:
        """Yield from ``iterable``, timing how long each batch took to arrive."""
        iterator = iter(iterable)
        while True:
            if self._in_step:
                self.step()
            self._timer.begin_step()
            try:
                batch = next(iterator)
            except StopIteration:
                self._timer._prev_begin = None  # the epoch's end is not a step
                return
            self._timer.batch_ready()
            self._timer.copy_done()
            self._last_batch_samples = _batch_size(batch)
            self._in_step = True
            yield batch

    def step(self, samples: int | None = None) -> None:
        """Mark the end of a step. ``samples`` defaults to the batch's leading dimension."""
        if not self._in_step:
            return
        n = samples or self.samples_per_step or self._last_batch_samples or 1
        self._timer.end_step(samples=n)
        self._in_step = False

    def summary(self) -> dict[str, Any]:
        rows = self._timer.measured_rows()
        times = [r["step_time_s"] for r in rows if r["step_time_s"] is not None]
        samples = [r["samples"] for r in rows if r["step_time_s"] is not None]
        ci = throughput_ci(times, samples) if times else None

        def mean(key):
            vals = [r[key] for r in rows if r[key] is not None]
            return sum(vals) / len(vals) if vals else None

        return {
            "measured_steps": len(rows),
            "throughput_samples_per_s": ci.samples_per_s if ci else None,
            "throughput_ci95_pct": ci.ci95_pct if ci and math.isfinite(ci.ci95_pct) else None,
            "phases_s": {
                "data_wait": mean("data_wait_s"),
                "h2d": None,  # inside the user's compute: the tracker cannot separate it
                "compute": mean("compute_s"),
                "step": mean("step_time_s"),
            },
        }

    def close(self, error: BaseException | None = None) -> None:
        if self._in_step:
            self.step()
        self._timer.finish()
        summary = self.summary()
        if self._owned_writer is None:
            self._series.close(compact=True)
            atomic_write_json(self.run_dir / TRACKER_FILE, summary)
            return
        overhead = self._monitor.stop()
        summary.update(overhead.as_dict())
        self._owned_writer.update(summary=summary)
        if error is None:
            self._owned_writer.finish("finished")
        elif isinstance(error, KeyboardInterrupt):
            self._owned_writer.finish("killed", error="interrupted (Ctrl-C)")
        else:
            self._owned_writer.finish("failed", error=str(error) or type(error).__name__)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(exc)


def track(name: str | None = None, samples_per_step: int | None = None, **kwargs) -> Tracker:
    """Start tracking this script's training loop (see the module docstring)."""
    return Tracker(name=name, samples_per_step=samples_per_step, **kwargs)


def read_tracker_summary(run_dir: Path) -> dict[str, Any] | None:
    path = Path(run_dir) / TRACKER_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None

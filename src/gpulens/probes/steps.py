"""Per-step phase timing: data wait, host-to-device copy, compute and step time.

GPU phases are timed with CUDA events that are read back only once the GPU has passed them
(``Event.query()``), so timing never inserts a synchronize that would destroy the overlap between
the host queuing work and the GPU running it.

Events cost host time on the training thread (about 100 us a step on an H100 host: three event
records, a query and three read-backs), which is over 1% of a launch-bound step of a few
milliseconds. So by default (``gpu_every=None``) the first :data:`CALIBRATION_STEPS` steps are all
timed on the GPU, and from then on one step in ``gpu_every``: every step when steps last
:data:`LONG_STEP_S` or more, else one in as many as keeps the events' cost (as measured on the
calibration steps) under :data:`GPU_TIMING_BUDGET` of a step. The calibration steps, all timed,
cost less per timed step than sampled ones do (those add a lone event and a query of their
own: on an H200 host about 150 us against the calibration's 70), so every
:data:`RECALIBRATE_STEPS` steps the interval is chosen again from what the events cost per timed
step in the run itself. The host times (data wait, step time) are taken on
every step; the GPU times (``h2d_s``, ``compute_s``, ``gpu_step_time_s``) are None on the steps
not sampled, and the summary says how they were sampled (``gpu_timing_every_n_steps``, the
interval in use at the end).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from gpulens.record.schema import STEPS_SCHEMA
from gpulens.record.writer import SeriesWriter

__all__ = [
    "CALIBRATION_STEPS",
    "GPU_TIMING_BUDGET",
    "RECALIBRATE_STEPS",
    "STEPS_SCHEMA",
    "StepTimer",
]

CALIBRATION_STEPS = 20  # steps all timed on the GPU before the sampling interval is chosen
# Steps this long are all timed: events cost under 0.5% of them even on a slow host, and a
# loader-bound run's interval needs every step's GPU time (its waits come in bursts).
LONG_STEP_S = 0.03
GPU_TIMING_BUDGET = 0.002  # at most this share of a step goes to CUDA events
MAX_GPU_EVERY = 64
RECALIBRATE_STEPS = 256  # the interval is chosen again over windows of this many steps (or more)


@dataclass
class _Pending:
    index: int  # the row's position in StepTimer.rows
    row: dict[str, Any]
    start: Any  # torch.cuda.Event
    copied: Any
    done: Any
    next_start: Any = None  # the next step's start: the end of this step's GPU step time
    next_is_lone: bool = False  # next_start belongs to no timed step (freed after use)


@dataclass
class StepTimer:
    """Collects one row per step into ``series`` (may be None) and keeps them for the summary.

    Call order per step: ``begin_step()`` before fetching the batch, ``batch_ready()`` once it is
    in hand, ``copy_done()`` after the host-to-device copy was queued, ``end_step()`` after the
    optimizer step was queued. On CPU the phases are host times.

    ``gpu_every``: time one step in this many on the GPU (1: every step); None chooses it after
    :data:`CALIBRATION_STEPS` steps (see the module's docstring).

    ``tracking_s`` adds up the host time spent inside these calls (gpulens's own work on the
    training thread: clocks, CUDA events, writing rows); :meth:`tracking_us_per_step` is its
    mean per step.
    """

    series: SeriesWriter | None
    cuda: bool
    warmup_steps: int
    gpu_every: int | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    _pending: deque = field(default_factory=deque)
    _step: int = 0
    _t_begin: float = 0.0
    _t_ready: float = 0.0
    _t_copied: float = 0.0
    _prev_begin: float | None = None
    _events: Any = None
    _await_next: _Pending | None = None
    _free_events: list = field(default_factory=list)
    _calibration: list = field(default_factory=list)  # (host step time, tracking time) per step
    _every: int = 1
    _next_timed: int = 0
    _timed: bool = False
    _step_tracking_s: float = 0.0
    _events_s: float = 0.0  # the part of tracking_s spent on CUDA events (records, read-back)
    _window: dict = field(default_factory=dict)  # steps since the interval was last chosen
    # Completed events are read back in batches: fewer driver calls on the training thread.
    resolve_every: int = 4
    tracking_s: float = 0.0
    _emitted: int = 0

    def __post_init__(self) -> None:
        if self.gpu_every is not None:
            if self.gpu_every < 1:
                raise ValueError(f"gpu_every must be 1 or more, got {self.gpu_every}")
            self._every = self.gpu_every

    @property
    def gpu_timing_every_n_steps(self) -> int | None:
        """One step in this many is timed on the GPU (None off CUDA)."""
        return self._every if self.cuda else None

    def begin_step(self) -> None:
        self._t_begin = time.perf_counter()
        if self._prev_begin is not None and self.rows:
            # Host step time: from one step's start to the next, which includes everything.
            step_time_s = self._t_begin - self._prev_begin
            self.rows[-1]["step_time_s"] = step_time_s
            if self.cuda and self.gpu_every is None and len(self._calibration) < CALIBRATION_STEPS:
                self._calibrate(step_time_s)
        self._prev_begin = self._t_begin
        self._step_tracking_s = time.perf_counter() - self._t_begin
        self.tracking_s += self._step_tracking_s

    def _calibrate(self, step_time_s: float) -> None:
        self._calibration.append((step_time_s, self._step_tracking_s))
        if len(self._calibration) < CALIBRATION_STEPS:
            return
        # The first steps carry start-up (allocations, autotuning): judge on the later half.
        later = self._calibration[CALIBRATION_STEPS // 2 :]
        step_s = statistics.median(t for t, _ in later)
        cost_s = statistics.median(c for _, c in later)
        self._every = self._interval(cost_s, step_s, self._every)
        self._next_timed = self._step  # sampling starts with this step
        self._window = {"steps": 0, "timed": 0, "events_s": self._events_s}

    @staticmethod
    def _interval(events_s: float, step_s: float, current: int) -> int:
        """Steps per GPU-timed step that keep ``events_s`` (the events' cost per timed step)
        under :data:`GPU_TIMING_BUDGET` of a ``step_s`` step; 1 for long steps."""
        if step_s >= LONG_STEP_S:
            return 1
        if step_s <= 0:
            return current
        return min(MAX_GPU_EVERY, max(1, math.ceil(events_s / (GPU_TIMING_BUDGET * step_s))))

    def _recalibrate(self, timed: bool) -> None:
        """Once a window of steps is over, chooses the interval again from what the events
        cost per timed step in it (their lone starts and read-backs included)."""
        w = self._window
        w["steps"] += 1
        w["timed"] += timed
        if w["steps"] < max(RECALIBRATE_STEPS, 8 * self._every):
            return
        host_s = [r["step_time_s"] for r in self.rows[-w["steps"] :] if r["step_time_s"]]
        if w["timed"] and host_s:
            events_s = (self._events_s - w["events_s"]) / w["timed"]
            self._every = self._interval(events_s, statistics.median(host_s), self._every)
        self._window = {"steps": 0, "timed": 0, "events_s": self._events_s}

    def batch_ready(self) -> None:
        self._t_ready = time.perf_counter()
        recorded = False
        if self.cuda:
            self._timed = self._step >= self._next_timed
            recorded = self._timed or self._await_next is not None
            if self._timed:
                self._next_timed = self._step + self._every
                self._events = [self._event(), self._event(), self._event()]
                self._events[0].record()
                if self._await_next is not None:
                    self._await_next.next_start = self._events[0]
            elif self._await_next is not None:
                lone = self._event()
                lone.record()
                self._await_next.next_start, self._await_next.next_is_lone = lone, True
            self._await_next = None
        spent = time.perf_counter() - self._t_ready
        self._step_tracking_s += spent
        self.tracking_s += spent
        # Only where an event was recorded: charging every untimed step's few microseconds to
        # the events kept the interval at its maximum on a slow host (64 steps x ~10 us per
        # timed step read as ~0.6 ms of events, however cheap they were).
        if recorded:
            self._events_s += spent

    def _event(self):
        """A timing event, reused once read back: creating one is a driver call."""
        if self._free_events:
            return self._free_events.pop()
        import torch

        return torch.cuda.Event(enable_timing=True)

    def copy_done(self) -> None:
        self._t_copied = time.perf_counter()
        if self.cuda and self._timed:
            self._events[1].record()
            self._events_s += time.perf_counter() - self._t_copied
        self._step_tracking_s += time.perf_counter() - self._t_copied
        self.tracking_s += time.perf_counter() - self._t_copied

    def end_step(self, samples: int) -> None:
        t_end = time.perf_counter()
        row = {
            "step": self._step,
            "time_unix_s": time.time(),
            "warmup": self._step < self.warmup_steps,
            "samples": samples,
            "data_wait_s": self._t_ready - self._t_begin,
            "h2d_s": None,
            "compute_s": None,
            "step_time_s": None,
            "gpu_step_time_s": None,
        }
        if self.cuda and self._timed:
            t_event = time.perf_counter()
            self._events[2].record()
            self._events_s += time.perf_counter() - t_event
            pending = _Pending(len(self.rows), row, *self._events)
            self._pending.append(pending)
            self._await_next = pending
        elif not self.cuda:
            row["h2d_s"] = self._t_copied - self._t_ready
            row["compute_s"] = t_end - self._t_copied
        self.rows.append(row)
        self._step += 1
        # Read back in batches of resolve_every timed steps, or once the oldest timed step is
        # that many steps behind (sampled timing: rows reach the series within a few steps).
        if self._pending and (
            len(self._pending) >= self.resolve_every
            or self._step - self._pending[0].index > self.resolve_every
        ):
            t_resolve = time.perf_counter()
            self._resolve(block=False)
            self._events_s += time.perf_counter() - t_resolve
        self._emit_complete()
        spent = time.perf_counter() - t_end
        self._step_tracking_s += spent
        self.tracking_s += spent
        if self._window:  # sampling, with the interval chosen by calibration
            self._recalibrate(self._timed)

    def tracking_us_per_step(self) -> float | None:
        """Mean host time (microseconds) this timer spent per step on the training thread;
        None before the first step."""
        if not self._step:
            return None
        return round(1e6 * self.tracking_s / self._step, 2)

    def _resolve(self, block: bool) -> None:
        while self._pending:
            p = self._pending[0]
            if p.next_start is None and not block:
                return  # its GPU step time ends at a start not yet recorded
            if not block and not p.next_start.query():
                return
            if block:
                (p.next_start or p.done).synchronize()
            p.row["h2d_s"] = p.start.elapsed_time(p.copied) / 1000.0
            p.row["compute_s"] = p.copied.elapsed_time(p.done) / 1000.0
            if p.next_start is not None:
                p.row["gpu_step_time_s"] = p.start.elapsed_time(p.next_start) / 1000.0
                if p.next_is_lone:
                    self._free_events.append(p.next_start)
            self._free_events.extend((p.start, p.copied, p.done))
            self._pending.popleft()

    def _emit_complete(self) -> None:
        """Write the rows whose fields are all known (next step begun, GPU done), in order."""
        if self.series is None:
            return
        limit = len(self.rows) - 1  # the last row waits for its step time
        if self._pending:
            limit = min(limit, self._pending[0].index)
        while self._emitted < limit:
            self.series.append(self.rows[self._emitted])
            self._emitted += 1

    def finish(self) -> None:
        """Resolve outstanding events and write every remaining row. Call after a synchronize."""
        t = time.perf_counter()
        if self.rows and self.rows[-1]["step_time_s"] is None and self._prev_begin is not None:
            self.rows[-1]["step_time_s"] = t - self._prev_begin
        self._resolve(block=True)
        if self.series is not None:
            while self._emitted < len(self.rows):
                self.series.append(self.rows[self._emitted])
                self._emitted += 1

    def measured_rows(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if not r["warmup"]]

"""Per-step phase timing: data wait, host-to-device copy, compute and step time.

GPU phases are timed with CUDA events that are read back only once the GPU has passed them
(``Event.query()``), so timing never inserts a synchronize that would destroy the overlap between
the host queuing work and the GPU running it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from gpulens.record.writer import SeriesWriter


@dataclass
class _Pending:
    row: dict[str, Any]
    start: Any  # torch.cuda.Event
    copied: Any
    done: Any


@dataclass
class StepTimer:
    """Collects one row per step into ``series`` (may be None) and keeps them for the summary.

    Call order per step: ``begin_step()`` before fetching the batch, ``batch_ready()`` once it is
    in hand, ``copy_done()`` after the host-to-device copy was queued, ``end_step()`` after the
    optimizer step was queued. On CPU the phases are host times.

    ``tracking_s`` adds up the host time spent inside these calls (gpulens's own work on the
    training thread: clocks, CUDA events, writing rows); :meth:`tracking_us_per_step` is its
    mean per step.
    """

    series: SeriesWriter | None
    cuda: bool
    warmup_steps: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    _pending: deque = field(default_factory=deque)
    _step: int = 0
    _t_begin: float = 0.0
    _t_ready: float = 0.0
    _t_copied: float = 0.0
    _prev_begin: float | None = None
    _prev_gpu_start: Any = None
    _events: Any = None
    _free_events: list = field(default_factory=list)
    # Completed events are read back in batches: fewer driver calls on the training thread.
    resolve_every: int = 4
    tracking_s: float = 0.0

    def begin_step(self) -> None:
        self._t_begin = time.perf_counter()
        if self._prev_begin is not None and self.rows:
            # Host step time: from one step's start to the next, which includes everything.
            self.rows[-1]["step_time_s"] = self._t_begin - self._prev_begin
        self._prev_begin = self._t_begin
        self.tracking_s += time.perf_counter() - self._t_begin

    def batch_ready(self) -> None:
        self._t_ready = time.perf_counter()
        if self.cuda:
            self._events = [self._event(), self._event(), self._event()]
            self._events[0].record()
        self.tracking_s += time.perf_counter() - self._t_ready

    def _event(self):
        """A timing event, reused once read back: creating one is a driver call."""
        if self._free_events:
            return self._free_events.pop()
        import torch

        return torch.cuda.Event(enable_timing=True)

    def copy_done(self) -> None:
        self._t_copied = time.perf_counter()
        if self.cuda:
            self._events[1].record()
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
        if self.cuda:
            self._events[2].record()
            self._pending.append(_Pending(row, *self._events))
        else:
            row["h2d_s"] = self._t_copied - self._t_ready
            row["compute_s"] = t_end - self._t_copied
        self.rows.append(row)
        self._step += 1
        if not self.cuda:
            self._emit_complete()
        elif len(self._pending) >= self.resolve_every:
            self._resolve(block=False)
            self._emit_complete()
        self.tracking_s += time.perf_counter() - t_end

    def tracking_us_per_step(self) -> float | None:
        """Mean host time (microseconds) this timer spent per step on the training thread;
        None before the first step."""
        if not self._step:
            return None
        return round(1e6 * self.tracking_s / self._step, 2)

    def _resolve(self, block: bool) -> None:
        while self._pending:
            p = self._pending[0]
            if not block and not p.done.query():
                return
            if block:
                p.done.synchronize()
            p.row["h2d_s"] = p.start.elapsed_time(p.copied) / 1000.0
            p.row["compute_s"] = p.copied.elapsed_time(p.done) / 1000.0
            if self._prev_gpu_start is not None:
                prev_row, prev_start = self._prev_gpu_start
                prev_row["gpu_step_time_s"] = prev_start.elapsed_time(p.start) / 1000.0
                self._free_events.append(prev_start)
            self._prev_gpu_start = (p.row, p.start)
            self._free_events.extend((p.copied, p.done))
            self._pending.popleft()

    _emitted: int = 0

    def _emit_complete(self) -> None:
        """Write the rows whose fields are all known (next step begun, GPU done)."""
        if self.series is None:
            return
        limit = len(self.rows) - 1 - len(self._pending)  # the last row waits for its step time
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

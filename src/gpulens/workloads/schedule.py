"""When the steps of a measured loop start, and what their times mean (no torch).

- closed loop: each step starts as soon as the one before ends; a step's time is its service
  time, and the throughput is what the system can do.
- constant rate / Poisson: steps (requests) arrive on a schedule fixed in advance, whatever the
  system does (an open loop, as LoadGen's server scenario); a step's time is its latency from
  its scheduled arrival, so time spent waiting behind earlier requests counts.

:class:`ScheduledLoop` runs a step function on a schedule until a deadline. The colocate jobs
and the loader benchmark use it; the training loop (:mod:`gpulens.workloads.loop`) is the
closed loop with phases, warm-up and stop rules of its own.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from gpulens.errors import UsageError

SCHEDULES = ("closed", "constant", "poisson")


@dataclass(frozen=True)
class Schedule:
    """``kind``: closed, constant or poisson; ``rate_per_s``: mean arrivals per second (open
    loops only); ``seed``: the Poisson draws, so that a run can be repeated exactly."""

    kind: str = "closed"
    rate_per_s: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise UsageError(f"unknown schedule {self.kind!r}: use one of {', '.join(SCHEDULES)}")
        if self.kind == "closed" and self.rate_per_s is not None:
            raise UsageError("a closed loop has no rate: leave the rate out, or pick arrivals")
        if self.kind != "closed" and (self.rate_per_s is None or not self.rate_per_s > 0):
            raise UsageError(f"{self.kind} arrivals need a positive rate in requests per second")

    @property
    def open_loop(self) -> bool:
        return self.kind != "closed"

    def arrival_offsets_s(self) -> Iterator[float]:
        """Seconds from the start at which request 0, 1, 2, ... arrive (open loops only)."""
        if self.rate_per_s is None:
            raise ValueError("a closed loop has no arrival times")
        rate = self.rate_per_s
        if self.kind == "constant":
            k = 0
            while True:
                yield k / rate
                k += 1
        draws = random.Random(self.seed)
        t = 0.0
        while True:
            yield t
            t += draws.expovariate(rate)


class Marker(Protocol):
    """A point in a device's queue of work (a recorded CUDA event): ``wait()`` blocks until the
    device has passed it; ``seconds_since(earlier)`` is the device time between two passed
    markers."""

    def wait(self) -> None: ...

    def seconds_since(self, earlier: Marker) -> float: ...


@dataclass
class ScheduledLoop:
    """Run ``step`` on ``schedule`` until ``end_unix_s``. ``step_times_s`` holds one entry per
    completed step (service time in a closed loop, latency from the arrival in an open one) and
    ``window_s`` the loop's length; both hold what was done when a step raises."""

    schedule: Schedule = field(default_factory=Schedule)
    step_times_s: list[float] = field(default_factory=list)
    window_s: float = 0.0
    start_unix_s: float | None = None
    end_unix_s: float | None = None

    def run(self, step: Callable[[], object], end_unix_s: float, min_steps: int = 0) -> None:
        """Steps until the deadline (an open loop stops at the first arrival past it), and at
        least ``min_steps`` steps."""
        t0 = time.perf_counter()
        self.start_unix_s = time.time()
        try:
            if self.schedule.open_loop:
                self._open(step, t0, end_unix_s, min_steps)
            else:
                self._closed(step, end_unix_s, min_steps)
        finally:
            self.window_s = time.perf_counter() - t0
            self.end_unix_s = time.time()

    def run_queued(
        self,
        queue_step: Callable[[], object],
        mark: Callable[[], Marker],
        end_unix_s: float,
        depth: int = 2,
    ) -> int:
        """A closed loop whose steps are only queued on a device: the host runs at most ``depth``
        steps ahead of the device (as a plain training loop does, bounded), never waiting for
        each step. A step's time is the device time from the previous step's end marker to its
        own (the period at which steps complete). Returns the steps done; ``window_s`` ends once
        the device has finished every step counted."""
        if depth < 1:
            raise ValueError(f"depth must be 1 or more, got {depth}")
        times = self.step_times_s
        t0 = time.perf_counter()
        self.start_unix_s = time.time()
        pending: deque = deque()
        prev = mark()
        done = 0
        try:
            while time.time() < end_unix_s:
                queue_step()
                end = mark()
                pending.append((prev, end))
                prev = end
                done += 1
                if len(pending) > depth:
                    start, stop = pending.popleft()
                    stop.wait()
                    times.append(stop.seconds_since(start))
            while pending:
                start, stop = pending.popleft()
                stop.wait()
                times.append(stop.seconds_since(start))
        finally:
            self.window_s = time.perf_counter() - t0
            self.end_unix_s = time.time()
        return done

    def _closed(self, step: Callable[[], object], end_unix_s: float, min_steps: int) -> None:
        times = self.step_times_s
        while time.time() < end_unix_s or len(times) < min_steps:
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)

    def _open(
        self, step: Callable[[], object], t0: float, end_unix_s: float, min_steps: int
    ) -> None:
        times = self.step_times_s
        assert self.start_unix_s is not None
        budget_s = end_unix_s - self.start_unix_s
        for offset_s in self.schedule.arrival_offsets_s():
            if offset_s >= budget_s and len(times) >= min_steps:
                return
            arrival = t0 + offset_s
            wait_s = arrival - time.perf_counter()
            if wait_s > 0:
                time.sleep(wait_s)
            step()
            times.append(time.perf_counter() - arrival)

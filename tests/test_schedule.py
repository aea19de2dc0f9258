"""Closed-loop, constant-rate and Poisson schedules of the shared measured loop."""

from __future__ import annotations

import itertools
import statistics
import time

import pytest

from gpulens.errors import UsageError
from gpulens.workloads import schedule as schedule_module
from gpulens.workloads.jobspec import JobSpec, parse_job
from gpulens.workloads.schedule import Schedule, ScheduledLoop


def test_constant_arrivals_are_evenly_spaced():
    offsets = list(itertools.islice(Schedule("constant", 200.0).arrival_offsets_s(), 5))
    assert offsets == pytest.approx([0.0, 0.005, 0.010, 0.015, 0.020])


def test_poisson_arrivals_have_the_mean_rate_and_repeat_with_the_seed():
    def gaps(seed):
        xs = list(itertools.islice(Schedule("poisson", 50.0, seed).arrival_offsets_s(), 20001))
        return [b - a for a, b in itertools.pairwise(xs)]

    g = gaps(1)
    assert statistics.fmean(g) == pytest.approx(1 / 50, rel=0.03)
    # Exponential gaps: the standard deviation equals the mean (constant gaps would give 0).
    assert statistics.pstdev(g) == pytest.approx(1 / 50, rel=0.05)
    assert g[:10] == gaps(1)[:10] and g[:10] != gaps(2)[:10]


@pytest.mark.parametrize(
    ("kind", "rate", "message"),
    [("closed", 5.0, "no rate"), ("poisson", None, "positive rate"),
     ("constant", 0.0, "positive rate"), ("bursty", 1.0, "unknown schedule")],
)  # fmt: skip
def test_bad_schedules_are_usage_errors(kind, rate, message):
    with pytest.raises(UsageError, match=message):
        Schedule(kind, rate)


def test_closed_loop_times_each_step_and_runs_at_least_min_steps():
    loop = ScheduledLoop()
    loop.run(lambda: time.sleep(0.002), time.time() - 1.0, min_steps=3)  # deadline passed
    assert len(loop.step_times_s) == 3
    assert all(t >= 0.002 for t in loop.step_times_s)
    assert loop.window_s >= sum(loop.step_times_s)


def test_open_loop_latency_includes_the_wait_behind_earlier_requests():
    # Requests every 5 ms, each served in 10 ms: request k arrives at 5k ms and cannot finish
    # before 10(k+1) ms, so its latency is at least 5k + 10 ms, whatever the machine's load.
    loop = ScheduledLoop(Schedule("constant", 200.0))
    loop.run(lambda: time.sleep(0.010), time.time() + 0.06)
    lat = loop.step_times_s
    assert len(lat) >= 5
    for k, t in enumerate(lat):
        assert t >= 0.005 * k + 0.010 - 1e-4


def test_open_loop_serves_exactly_the_arrivals_before_the_deadline():
    loop = ScheduledLoop(Schedule("constant", 100.0))
    end = time.time() + 0.05
    loop.run(lambda: None, end)
    assert loop.start_unix_s is not None
    budget_s = end - loop.start_unix_s
    assert len(loop.step_times_s) == sum(1 for k in range(100) if k / 100.0 < budget_s)


def test_a_failing_step_keeps_what_was_measured():
    calls = []

    def step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")

    loop = ScheduledLoop()
    with pytest.raises(RuntimeError):
        loop.run(step, time.time() + 10)
    assert len(loop.step_times_s) == 2 and loop.window_s > 0


def test_jobs_choose_their_arrivals():
    job = parse_job("infer:tiny_cnn:rate=50,arrivals=poisson")
    assert job.schedule(seed=3) == Schedule("poisson", 50.0, 3)
    assert job.key.endswith(",rate=50,arrivals=poisson")
    assert JobSpec.from_dict(job.to_dict()) == job
    constant = parse_job("infer:tiny_cnn:rate=50")
    assert constant.schedule() == Schedule("constant", 50.0) and "arrivals" not in constant.key
    assert parse_job("tiny_cnn").schedule() == Schedule()
    with pytest.raises(UsageError, match="arrivals= needs rate="):
        parse_job("infer:tiny_cnn:arrivals=poisson")
    with pytest.raises(UsageError, match="constant or poisson"):
        parse_job("infer:tiny_cnn:rate=5,arrivals=bursty")


class _FakeClock:
    """Virtual time for the loop and the fake device: only the host's work and its waits on
    markers advance it, so a loaded CI machine cannot open gaps that the loop did not cause."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def perf_counter(self) -> float:
        return self.now_s

    def time(self) -> float:
        return 1.0e9 + self.now_s


class _FakeDevice:
    """A device that runs queued steps one after another, each taking ``step_s`` of device time,
    while queuing a step costs the host ``host_s`` (a fake at the CUDA boundary: markers are its
    events)."""

    def __init__(self, clock: _FakeClock, step_s: float, host_s: float):
        self.clock = clock
        self.step_s = step_s
        self.host_s = host_s
        self.queued_until = 0.0  # device time at which the queued work ends
        self.max_ahead = 0

    def queue(self) -> None:
        self.clock.now_s += self.host_s
        now = self.clock.now_s
        self.queued_until = max(self.queued_until, now) + self.step_s
        self.max_ahead = max(self.max_ahead, round((self.queued_until - now) / self.step_s))

    def mark(self):
        clock = self.clock

        class Marker:
            at = self.queued_until

            def wait(self) -> None:
                clock.now_s = max(clock.now_s, self.at)

            def seconds_since(self, earlier) -> float:
                return self.at - earlier.at

        return Marker()


def _run_queued(monkeypatch, depth: int) -> tuple[ScheduledLoop, _FakeDevice, int]:
    clock = _FakeClock()
    monkeypatch.setattr(schedule_module, "time", clock)
    device = _FakeDevice(clock, step_s=0.004, host_s=0.001)
    loop = ScheduledLoop()
    steps = loop.run_queued(device.queue, device.mark, clock.time() + 0.3, depth=depth)
    return loop, device, steps


def test_queued_loop_keeps_the_device_busy_and_bounded_ahead(monkeypatch):
    loop, device, steps = _run_queued(monkeypatch, depth=2)
    # The host never waited for a step to finish before queuing the next: steps complete every
    # 4 ms of device time although each costs the host 1 ms to queue, and the throughput is
    # the device's (no gap between steps).
    assert steps == len(loop.step_times_s) >= 70
    assert all(t == pytest.approx(0.004, abs=1e-9) for t in loop.step_times_s[1:])
    assert steps * 0.004 / loop.window_s > 0.95
    # ...nor ran away: at most depth + 1 steps were queued beyond the device at any time.
    assert device.max_ahead <= 3
    # The window ends after the device finished every step counted.
    assert loop.window_s >= device.queued_until


def test_queued_loop_with_depth_one_still_overlaps_the_host_with_the_device(monkeypatch):
    # With one step in hand the host queues the next while the device runs the current one:
    # its 1 ms of work hides behind the device's 4 ms, so no gap opens (a loop that waited for
    # each step before queuing the next would give 5 ms steps).
    loop, device, _ = _run_queued(monkeypatch, depth=1)
    assert all(t == pytest.approx(0.004, abs=1e-9) for t in loop.step_times_s[1:])
    assert device.max_ahead <= 2


def test_queued_loop_rejects_a_depth_below_one():
    with pytest.raises(ValueError, match="depth"):
        ScheduledLoop().run_queued(lambda: None, lambda: None, time.time(), depth=0)

"""The step timer on a GPU, faked at the CUDA boundary (``torch.cuda.Event`` over a simulated
stream clock): GPU phases on every step or on a sample of them, rows written in order, and the
sampling interval chosen from what the events cost against the step time."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from gpulens.probes import steps
from gpulens.probes.steps import StepTimer
from gpulens.record.reader import read_record
from gpulens.record.schema import STEPS_SCHEMA
from gpulens.record.writer import RunWriter
from gpulens.stats import throughput_ci
from gpulens.workloads.loop import ci_step_times

H2D_S, COMPUTE_S = 0.001, 0.004  # per step on the simulated stream


class FakeStream:
    """Where the GPU's clock stands; an event records its time when recorded. The host's clock
    (what the timer reads with ``time.perf_counter``) is simulated too: each reading moves it
    ``tick_s`` on (the timer's own Python), an event record ``record_cost_s``, the training
    step's host work ``host_step_s``. So the interval the timer chooses from what the events
    cost is the same on any machine, loaded or not (on the wall clock a slow CI host's
    ~10 us of Python a step read as event cost)."""

    def __init__(self, record_cost_s: float = 0.0):
        self.now_s = 0.0
        self.host_s = 0.0
        self.tick_s = 1e-6
        self.record_cost_s = record_cost_s
        self.created = 0
        self.records = 0

    def perf_counter(self) -> float:
        self.host_s += self.tick_s
        return self.host_s


@pytest.fixture
def stream(monkeypatch):
    s = FakeStream()
    monkeypatch.setattr(steps, "time", SimpleNamespace(perf_counter=s.perf_counter, time=time.time))

    class FakeEvent:
        def __init__(self, enable_timing: bool = False):
            assert enable_timing
            s.created += 1
            self.t_s = None

        def record(self):
            s.host_s += s.record_cost_s
            s.records += 1
            self.t_s = s.now_s

        def query(self):
            assert self.t_s is not None, "queried before it was recorded"
            return True

        def synchronize(self):
            assert self.t_s is not None

        def elapsed_time(self, end):
            return (end.t_s - self.t_s) * 1000.0

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    return s


def _train(timer: StepTimer, stream: FakeStream, n: int, host_step_s: float = 0.0) -> None:
    for _ in range(n):
        timer.begin_step()
        timer.batch_ready()
        stream.now_s += H2D_S
        timer.copy_done()
        stream.now_s += COMPUTE_S
        stream.host_s += host_step_s
        timer.end_step(samples=8)
    timer.finish()


def test_every_step_timed_on_the_gpu_when_asked(stream, tmp_path):
    w = RunWriter(tmp_path, kind="train")
    timer = StepTimer(w.series("steps", STEPS_SCHEMA), cuda=True, warmup_steps=0, gpu_every=1)
    _train(timer, stream, 10)
    w.finish()
    df = read_record(w.dir).series("steps")
    assert list(df["step"]) == list(range(10))
    assert df["h2d_s"].round(6).eq(H2D_S).all() and df["compute_s"].round(6).eq(COMPUTE_S).all()
    gpu = df["gpu_step_time_s"]
    assert gpu[:-1].round(6).eq(H2D_S + COMPUTE_S).all() and gpu.isna().iloc[-1]
    assert timer.gpu_timing_every_n_steps == 1
    # events are reused once read back (at most resolve_every + 1 steps in flight)
    assert stream.records == 30 and stream.created <= 3 * (timer.resolve_every + 1)


def test_a_sample_of_steps_is_timed_and_rows_stay_in_order(stream, tmp_path):
    w = RunWriter(tmp_path, kind="train")
    timer = StepTimer(w.series("steps", STEPS_SCHEMA), cuda=True, warmup_steps=0, gpu_every=3)
    _train(timer, stream, 12)
    w.finish()
    df = read_record(w.dir).series("steps")
    assert list(df["step"]) == list(range(12))
    timed = df["compute_s"].notna()
    assert list(df.index[timed]) == [0, 3, 6, 9]
    assert df.loc[timed, "h2d_s"].round(6).eq(H2D_S).all()
    # each timed step ends at the next step's start (a lone event when that step is not timed)
    assert df.loc[timed, "gpu_step_time_s"].round(6).eq(H2D_S + COMPUTE_S).all()
    assert df.loc[~timed, ["h2d_s", "gpu_step_time_s"]].isna().all().all()
    # host phases on every step
    assert df["data_wait_s"].notna().all() and df["step_time_s"].notna().all()
    assert stream.records == 4 * 3 + 4  # three per timed step, one lone start after each
    assert ci_step_times(timer.rows) == pytest.approx([H2D_S + COMPUTE_S] * 4)


def test_sampled_gpu_step_times_give_the_interval(stream):
    timer = StepTimer(None, cuda=True, warmup_steps=0, gpu_every=4)
    _train(timer, stream, 120)
    times = ci_step_times(timer.rows)
    assert len(times) == 30 and times == pytest.approx([H2D_S + COMPUTE_S] * 30)
    assert throughput_ci(times, 8).ci95_pct < 0.01


def test_a_loader_paced_run_takes_its_interval_from_every_step_on_the_host():
    """A real H100 run (resnet18 b256, 8 JPEG workers, 90 measured steps) whose steps were
    short enough for the GPU to be timed one step in six: the sample fell in step with the
    workers' bursts and its interval was +-292% of the throughput, which the run reported."""
    import csv
    import json
    from pathlib import Path

    fixture = Path(__file__).parent / "fixtures" / "steps_h100_resnet18_w8"
    reported = json.loads((fixture / "summary.json").read_text())
    with open(fixture / "steps.csv") as handle:
        rows = [
            {k: (None if v == "" else v == "True" if k == "warmup" else float(v))
             for k, v in row.items()}
            for row in csv.DictReader(handle)
        ]  # fmt: skip
    measured = [r for r in rows if not r["warmup"]]
    assert len(measured) == reported["measured_steps"] == 90
    sampled = [r["gpu_step_time_s"] for r in measured if r["gpu_step_time_s"] is not None]
    assert len(sampled) < len(measured) / 4  # the GPU timed a sample of the steps
    assert throughput_ci(sampled, 256).ci95_pct > 200  # what the run reported
    times = ci_step_times(measured)
    assert times == [r["step_time_s"] for r in measured]
    ci = throughput_ci(times, 256)
    assert ci.ci95_pct < 20
    # the interval holds the run's own throughput (total samples over the measured wall time)
    assert abs(ci.samples_per_s - reported["throughput_samples_per_s"]) < ci.ci95_half_width


def test_many_sampled_steps_take_the_interval_from_every_step_on_the_host(stream):
    timer = StepTimer(None, cuda=True, warmup_steps=0, gpu_every=4)
    _train(timer, stream, 400)
    times = ci_step_times(timer.rows)
    assert times == [r["step_time_s"] for r in timer.rows]


def test_costly_events_on_a_short_step_are_sampled(stream):
    stream.record_cost_s = 0.0005  # events take most of the step: the longest interval
    timer = StepTimer(None, cuda=True, warmup_steps=0)
    _train(timer, stream, steps.CALIBRATION_STEPS + 40)
    every = timer.gpu_timing_every_n_steps
    assert every == steps.MAX_GPU_EVERY
    calibrated = timer.rows[: steps.CALIBRATION_STEPS]
    assert all(r["compute_s"] is not None for r in calibrated)
    later = timer.rows[steps.CALIBRATION_STEPS :]
    assert sum(r["compute_s"] is not None for r in later) <= 40 // every + 1


def test_the_interval_follows_what_sampled_events_cost_later_in_the_run(stream):
    # cheap events while calibrating, dear ones afterwards (as on a busy host): the interval
    # chosen at calibration is chosen again from the run's own timed and untimed steps
    timer = StepTimer(None, cuda=True, warmup_steps=0)
    _train(timer, stream, steps.CALIBRATION_STEPS + 5, host_step_s=0.002)
    calibrated = timer.gpu_timing_every_n_steps
    assert calibrated < steps.MAX_GPU_EVERY
    stream.record_cost_s = 0.0005  # 2 ms of records per timed step against 8 us allowed
    timer_steps = max(steps.RECALIBRATE_STEPS, 8 * calibrated) + 10
    _train(timer, stream, timer_steps, host_step_s=0.002)
    assert timer.gpu_timing_every_n_steps == steps.MAX_GPU_EVERY


def test_the_interval_shrinks_when_events_turn_cheap(stream):
    stream.record_cost_s = 0.0005
    timer = StepTimer(None, cuda=True, warmup_steps=0)
    _train(timer, stream, steps.CALIBRATION_STEPS + 5, host_step_s=0.002)
    assert timer.gpu_timing_every_n_steps == steps.MAX_GPU_EVERY
    stream.record_cost_s = 0.0
    # the first window still holds a dear step from before; the second is all cheap
    _train(timer, stream, 2 * 8 * steps.MAX_GPU_EVERY + 10, host_step_s=0.006)
    assert timer.gpu_timing_every_n_steps <= steps.MAX_GPU_EVERY // 4
    timed = [r for r in timer.rows if r["compute_s"] is not None]
    assert timed and all(r["compute_s"] == pytest.approx(COMPUTE_S) for r in timed)


def test_the_timers_own_python_on_untimed_steps_is_not_charged_to_the_events(stream):
    # short steps on a slow host: ~10 us of the timer's own Python a step, events free. Charged
    # to the events, 63 untimed steps' worth per timed step (~0.6 ms, against the 4 us a 2 ms
    # step allows) kept the interval at its maximum however cheap the events were
    stream.tick_s = 5e-6
    timer = StepTimer(None, cuda=True, warmup_steps=0)
    stream.record_cost_s = 0.0005  # calibrated on dear events: the longest interval
    _train(timer, stream, steps.CALIBRATION_STEPS + 5, host_step_s=0.002)
    assert timer.gpu_timing_every_n_steps == steps.MAX_GPU_EVERY
    stream.record_cost_s = 0.0
    _train(timer, stream, 4 * 8 * steps.MAX_GPU_EVERY, host_step_s=0.002)
    assert timer.gpu_timing_every_n_steps <= steps.MAX_GPU_EVERY // 4


def test_long_steps_are_all_timed_whatever_the_events_cost(stream):
    stream.record_cost_s = 0.001
    timer = StepTimer(None, cuda=True, warmup_steps=0)
    _train(timer, stream, steps.CALIBRATION_STEPS + 10, host_step_s=steps.LONG_STEP_S)
    assert timer.gpu_timing_every_n_steps == 1
    assert all(r["compute_s"] is not None for r in timer.rows)


def test_no_gpu_sampling_off_cuda():
    timer = StepTimer(None, cuda=False, warmup_steps=0)
    assert timer.gpu_timing_every_n_steps is None
    with pytest.raises(ValueError, match="gpu_every"):
        StepTimer(None, cuda=True, warmup_steps=0, gpu_every=0)


def test_sampled_rows_reach_the_series_within_a_few_steps(stream, tmp_path):
    w = RunWriter(tmp_path, kind="train")
    timer = StepTimer(w.series("steps", STEPS_SCHEMA), cuda=True, warmup_steps=0, gpu_every=64)
    for _ in range(20):
        timer.begin_step()
        timer.batch_ready()
        stream.now_s += H2D_S
        timer.copy_done()
        stream.now_s += COMPUTE_S
        timer.end_step(samples=8)
    # step 0 is timed; it is read back a few steps later, and the rows after it follow
    assert timer.rows[0]["gpu_step_time_s"] == pytest.approx(H2D_S + COMPUTE_S)
    assert len(w.read_series("steps")) >= 20 - 1 - timer.resolve_every - 1


# ------------------------------------------------------------------- host issue probe
def test_the_host_probe_times_each_step_from_an_idle_gpu(monkeypatch):
    import time as _time

    import torch

    from gpulens.workloads import loop

    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))
    batches = iter([(1, 1)] * 3)  # fewer batches than probe steps: the probe stops with them

    def step(x, y):
        events.append("step")
        _time.sleep(0.004)

    issue_s = loop.probe_host_issue(lambda: next(batches), step, torch.device("cpu"), steps=5)
    # every step starts after a synchronize, and the GPU is drained before the run goes on
    assert events == ["sync", "step"] * 3 + ["sync"]
    assert 0.004 <= issue_s < 0.05


def test_the_host_probe_keeps_to_its_budget_and_says_none_without_data(monkeypatch):
    import time as _time

    import torch

    from gpulens.workloads import loop

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    calls = []

    def slow_step(x, y):
        calls.append(1)
        _time.sleep(0.03)

    batches = iter([(1, 1)] * 10)
    issue_s = loop.probe_host_issue(
        lambda: next(batches), slow_step, torch.device("cpu"), steps=10, budget_s=0.05
    )
    assert len(calls) == 2 and issue_s >= 0.03  # stopped once the budget was spent

    def no_data():
        raise StopIteration

    assert loop.probe_host_issue(no_data, slow_step, torch.device("cpu")) is None

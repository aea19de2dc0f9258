"""Throughput CI arithmetic, the step timer and the monitor, on CPU."""

from __future__ import annotations

import math
import time

import numpy as np
import pyarrow as pa
import pytest

from gpulens.probes.host import HostProbe
from gpulens.probes.monitor import Monitor
from gpulens.probes.steps import StepTimer
from gpulens.probes.summary import summarize_gpu
from gpulens.record.reader import read_record
from gpulens.record.schema import STEPS_SCHEMA
from gpulens.record.writer import RunWriter
from gpulens.stats import t95, throughput_ci


def test_t95_matches_known_quantiles():
    assert t95(1) == pytest.approx(12.706)
    assert t95(9) == pytest.approx(2.262)
    assert t95(60) == pytest.approx(2.000, abs=0.005)
    assert math.isinf(t95(0))


def test_throughput_ci_constant_steps_has_zero_width():
    ci = throughput_ci([0.1] * 50, 32)
    assert ci.samples_per_s == pytest.approx(320.0)
    assert ci.ci95_half_width == pytest.approx(0.0, abs=1e-9)


def test_throughput_ci_covers_true_rate_about_95_percent():
    rng = np.random.default_rng(0)
    true_rate, hits, trials = 100.0, 0, 400
    for _ in range(trials):
        times = rng.normal(1.0, 0.1, size=200) * 32 / true_rate
        ci = throughput_ci(times, 32, n_batches=20)
        # the estimator targets samples / mean time
        hits += abs(ci.samples_per_s - true_rate) <= ci.ci95_half_width
    assert 0.90 <= hits / trials <= 0.99


def test_throughput_ci_too_few_steps():
    assert throughput_ci([0.1], 8) is None
    assert throughput_ci([], 8) is None


def test_step_timer_cpu_phases_and_warmup(tmp_path):
    w = RunWriter(tmp_path, kind="train")
    timer = StepTimer(w.series("steps", STEPS_SCHEMA), cuda=False, warmup_steps=2)
    for _ in range(6):
        timer.begin_step()
        time.sleep(0.01)  # data wait
        timer.batch_ready()
        timer.copy_done()
        time.sleep(0.02)  # compute
        timer.end_step(samples=4)
    timer.finish()
    w.finish()
    df = read_record(w.dir).series("steps")
    assert list(df["step"]) == list(range(6))
    assert list(df["warmup"]) == [True, True, False, False, False, False]
    assert (df["data_wait_s"] >= 0.009).all() and (df["data_wait_s"] < 0.05).all()
    assert (df["compute_s"] >= 0.019).all()
    # step time spans from one step's start to the next: at least wait + compute
    assert (df["step_time_s"] >= df["data_wait_s"] + df["compute_s"] - 1e-4).all()
    assert len(timer.measured_rows()) == 4


class FakeProbe:
    name = "fake"
    schema = pa.schema([("time_unix_s", pa.float64()), ("x", pa.float64())])

    def __init__(self, fail_after=None):
        self.unsupported = {"y": "not on this fake"}
        self.calls = 0
        self.fail_after = fail_after

    def sample(self):
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise RuntimeError("sensor fell off")
        return [{"time_unix_s": time.time(), "x": float(self.calls)}]

    def close(self):
        pass


def test_monitor_samples_at_rate_and_reports_overhead(tmp_path):
    w = RunWriter(tmp_path, kind="train")
    probe = FakeProbe()
    with Monitor(w, [probe, HostProbe()], hz=50) as m:
        time.sleep(0.5)
    overhead = m.overhead()
    w.finish()
    rec = read_record(w.dir)
    assert 15 <= len(rec.series("fake")) <= 30
    host = rec.series("host")
    assert len(host) >= 15
    assert host["cpu_util_pct"].between(0, 100).all()
    assert rec.meta["unsupported"] == {"fake.y": "not on this fake"}
    d = overhead.as_dict()
    assert 20 <= d["monitor_achieved_hz"] <= 55
    assert 0 < d["sampler_cpu_pct_of_core"] < 100
    # the sampler's CPU share is not a slowdown: the old name said it was
    assert "monitor_overhead_pct" not in d


def test_monitor_switches_off_a_failing_probe(tmp_path):
    w = RunWriter(tmp_path, kind="train")
    probe = FakeProbe(fail_after=3)
    with Monitor(w, [probe, HostProbe()], hz=100):
        time.sleep(0.2)
    w.finish()
    rec = read_record(w.dir)
    assert len(rec.series("fake")) == 3
    assert probe.calls == 4  # not called again after the failure
    assert len(rec.series("host")) > 5


def test_summarize_gpu_energy_from_counter_and_nulls():
    import pandas as pd

    t = np.arange(0, 10, 0.1)
    df = pd.DataFrame(
        {
            "time_unix_s": t,
            "gpu_index": 0,
            "gpu_util_pct": 90.0,
            "mem_util_pct": 40.0,
            "mem_used_bytes": 1 << 30,
            "power_w": 300.0,
            "energy_j": 300.0 * t,
            "sm_clock_mhz": 1980.0,
            "sm_activity_pct": None,
        }
    )
    s = summarize_gpu(df, 2.0, 8.0, gpu_index=0, samples=6000)
    assert s["energy_source"] == "nvml_energy_counter"
    assert s["energy_j"] == pytest.approx(300 * 6.0, rel=0.02)
    assert s["energy_per_sample_j"] == pytest.approx(0.3, rel=0.02)
    assert s["sm_activity_pct"] is None  # unsupported stays null, never 0
    no_counter = df.assign(energy_j=None)
    s2 = summarize_gpu(no_counter, 2.0, 8.0, gpu_index=0, samples=6000)
    assert s2["energy_source"] == "power_integral"
    assert s2["energy_j"] == pytest.approx(300 * 6.0, rel=0.02)
    assert summarize_gpu(df, 2.0, 8.0, gpu_index=1, samples=10) is None


def test_monitor_in_its_own_process_writes_series_and_reports(tmp_path):
    from gpulens.probes.monitor import ProbeSpec

    w = RunWriter(tmp_path, kind="train")
    m = Monitor(w, [ProbeSpec("gpu"), ProbeSpec("host")], hz=20)
    with m:
        time.sleep(1.0)
    d = m.overhead().as_dict()
    w.finish()
    rec = read_record(w.dir)
    host = rec.series("host")
    assert 10 <= len(host) <= 25
    assert (w.dir / "series" / "host.parquet").exists()  # the sampler compacted its series
    assert d["monitor_isolated_process"] is True
    assert 10 <= d["monitor_samples"] <= 25
    # No GPU here (or no NVML): the GPU probe says why instead of writing zeros.
    if rec.series("gpu").empty:
        assert "gpu" in rec.meta["unsupported"]


def test_sampler_process_exits_when_its_parent_dies(tmp_path):
    import subprocess
    import sys

    script = (
        "import sys, time\n"
        "from gpulens.record.writer import RunWriter\n"
        "from gpulens.probes.monitor import Monitor, ProbeSpec\n"
        "w = RunWriter(sys.argv[1], kind='train', run_id='r')\n"
        "m = Monitor(w, [ProbeSpec('host')], hz=20).start()\n"
        "print(m._proc.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    sampler_pid = int(parent.stdout.readline())
    time.sleep(0.5)
    parent.kill()
    parent.wait()
    import psutil

    # the sampler must go (it compacts its series first); how fast depends on the machine's
    # load: a full CI run once took more than 10 s
    deadline = time.time() + 30
    while psutil.pid_exists(sampler_pid) and time.time() < deadline:
        try:
            if psutil.Process(sampler_pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.1)
    alive = psutil.pid_exists(sampler_pid) and (
        psutil.Process(sampler_pid).status() != psutil.STATUS_ZOMBIE
    )
    assert not alive
    rec = read_record(tmp_path / "r")
    assert rec.status == "killed"
    assert len(rec.series("host")) >= 5


def test_step_timer_measures_its_own_time_per_step():
    timer = StepTimer(None, cuda=False, warmup_steps=0)
    assert timer.tracking_us_per_step() is None
    for _ in range(50):
        timer.begin_step()
        timer.batch_ready()
        timer.copy_done()
        timer.end_step(8)
    timer.finish()
    per_step = timer.tracking_us_per_step()
    assert per_step is not None and 0 < per_step < 1e5
    # gpulens's own calls cost far less than the steps they time (which include only them here)
    assert timer.tracking_s <= sum(r["step_time_s"] for r in timer.rows[:-1]) + 1.0


def test_sampler_process_ignores_ctrl_c_and_stops_quietly(tmp_path, capfd):
    """Ctrl-C reaches the terminal's process group: the sampler is not in it, ignores SIGINT
    even when sent to it directly, and reports its samples when the parent stops it."""
    import os
    import signal

    from gpulens.probes.monitor import ProbeSpec

    w = RunWriter(tmp_path, kind="train")
    m = Monitor(w, [ProbeSpec("host")], hz=20).start()
    sampler = m._proc
    assert os.getpgid(sampler.pid) != os.getpgrp()
    os.kill(sampler.pid, signal.SIGINT)
    deadline = time.monotonic() + 5
    while m._proc.poll() is None and time.monotonic() < deadline and len(w.read_series("host")) < 3:
        time.sleep(0.05)
    assert sampler.poll() is None, "the sampler died of SIGINT"
    overhead = m.stop()
    w.finish()
    assert sampler.returncode == 0
    assert overhead.samples > 0
    err = capfd.readouterr().err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err


def test_sampler_cpu_share_is_over_its_own_sampling_time(tmp_path):
    """A command shorter than the sampler's first sample showed 4173% of one core."""
    from gpulens.probes.monitor import MonitorOverhead, ProbeSpec

    d = MonitorOverhead(samples=2, cpu_s=0.04, wall_s=0.001, isolated=True, sampler_wall_s=0.05)
    assert d.as_dict()["sampler_cpu_pct_of_core"] == pytest.approx(80.0)
    w = RunWriter(tmp_path, kind="command")
    with Monitor(w, [ProbeSpec("host")], hz=10) as m:
        pass  # a command that ends at once
    w.finish()
    assert 0 <= m.overhead().as_dict()["sampler_cpu_pct_of_core"] <= 100

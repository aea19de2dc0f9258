"""Intervals that respect their quantity's range: throughputs stay positive, shares in [0, 100]."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gpulens.stats import bounded_interval, log_interval, rate_ci95, throughput_ci


def test_log_interval_is_the_symmetric_one_to_first_order_and_always_positive():
    low, high = log_interval(100.0, 0.01)
    assert low == pytest.approx(99.0, abs=0.01) and high == pytest.approx(101.0, abs=0.01)
    assert low * high == pytest.approx(100.0**2)  # symmetric on the log scale
    # a half-width of 289% (a CPU run's): the symmetric interval would reach -189 samples/s
    low, high = rate_ci95(100.0, 289.0)
    assert low == pytest.approx(100.0 / math.exp(2.89)) and high == pytest.approx(
        100.0 * math.exp(2.89)
    )
    assert 0 < low < 100.0 < high
    assert rate_ci95(None, 3.0) is None and rate_ci95(100.0, None) is None
    assert rate_ci95(0.0, 3.0) is None and rate_ci95(100.0, math.inf) is None


@pytest.mark.parametrize(
    ("sigma", "steps"),
    [(0.3, 200), (1.0, 100), (1.5, 60), (2.0, 40)],
)
def test_rate_interval_covers_the_true_rate_95_percent_of_the_time(sigma, steps):
    """Simulated runs with log-normal step times (sigma 2 is a loaded CPU: a few steps 50x
    slower than most): the log-scale interval around the measured rate holds the true rate
    (samples over the mean step time) in 95% of the runs, within simulation error, and never
    reaches zero, where the symmetric one goes negative in most of the noisiest runs."""
    rng = np.random.default_rng(int(sigma * 10))
    batch, n_runs = 8, 1000
    true_rate = batch / math.exp(sigma**2 / 2)  # mean of a log-normal(0, sigma)
    covered = negative = 0
    for _ in range(n_runs):
        times = rng.lognormal(0.0, sigma, steps)
        ci = throughput_ci(times, batch)
        rate = batch * steps / times.sum()
        low, high = rate_ci95(rate, ci.ci95_pct)
        assert 0 < low <= rate <= high
        covered += low <= true_rate <= high
        negative += rate * (1 - ci.ci95_pct / 100) <= 0
    assert covered / n_runs == pytest.approx(0.95, abs=0.025)
    if sigma >= 2.0:
        assert negative / n_runs > 0.5


def test_share_interval_stays_within_0_and_100():
    assert bounded_interval(40.0, 5.0) == [35.0, 45.0]
    assert bounded_interval(3.0, 211.8) == [0.0, 100.0]  # a CPU run's ±211.8 points
    assert bounded_interval(0.0, 4.0) == [0.0, 4.0]  # a clipped stall keeps its upper side
    assert bounded_interval(98.0, 5.0) == [93.0, 100.0]
    assert bounded_interval(None, 1.0) is None and bounded_interval(5.0, None) is None
    assert bounded_interval(5.0, math.inf) == [0.0, 100.0]


def test_share_interval_covers_as_often_as_the_symmetric_one():
    """The true share lies in [0, 100], so cutting the symmetric interval there loses no
    coverage: checked on simulated shares near the boundary."""
    rng = np.random.default_rng(3)
    true, sd = 2.0, 3.0
    draws = rng.normal(true, sd, 4000)
    sym = np.mean(np.abs(draws - true) <= 1.96 * sd)
    cut = np.mean([lo <= true <= hi for lo, hi in (bounded_interval(d, 1.96 * sd) for d in draws)])
    assert cut == pytest.approx(sym)
    assert all(0.0 <= v <= 100.0 for d in draws[:200] for v in bounded_interval(d, 1.96 * sd))


def test_stall_json_gives_ranges_beside_the_half_widths():
    from gpulens.stalls import StallResult

    result = StallResult(workload="tiny_cnn", device="cpu")
    result.throughput = {"ingestion_free": 100.0, "cached": 50.0, "cold": None}
    result.throughput_ci95_pct = {"ingestion_free": 289.0, "cached": 2.0, "cold": None}
    result.breakdown_pct = {"compute": 50.0, "prep_stall": 50.0, "fetch_stall": None}
    result.breakdown_ci95_pp = {"compute": 211.8, "prep_stall": 3.0, "fetch_stall": None}
    doc = result.as_dict()
    rates = doc["throughput_ci95_samples_per_s"]
    assert rates["cold"] is None
    assert rates["cached"] == pytest.approx([50.0 / math.exp(0.02), 50.0 * math.exp(0.02)])
    assert 0 < rates["ingestion_free"][0] < 100.0 < rates["ingestion_free"][1]
    assert doc["breakdown_ci95_range_pct"] == {
        "compute": [0.0, 100.0],
        "prep_stall": [47.0, 53.0],
        "fetch_stall": None,
    }
    # the half-widths stay as they were
    assert doc["throughput_ci95_pct"]["ingestion_free"] == 289.0
    assert doc["breakdown_ci95_pp"]["compute"] == 211.8

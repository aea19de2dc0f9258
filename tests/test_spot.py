"""Spot servers: Poisson revocations, checkpoints and restarts (gpulens.predict.spot), checked
against the closed form and the Young/Daly interval."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gpulens.errors import UsageError
from gpulens.predict.spot import (
    SpotParams,
    expected_time_h,
    simulate_time_h,
    spot_outcome,
    young_daly_interval_h,
)


@pytest.mark.parametrize(
    "work_h,interval_h,ckpt_h,restart_h,rate",
    [(10, 0.5, 0.01, 0.1, 0.2), (100, 1.0, 0.02, 0.1, 0.05), (5, 10, 0.01, 0.1, 0.3)],
)
def test_simulated_mean_matches_the_closed_form(work_h, interval_h, ckpt_h, restart_h, rate):
    times, revoked = simulate_time_h(work_h, interval_h, ckpt_h, restart_h, rate, 20000, 1)
    expected = expected_time_h(work_h, interval_h, ckpt_h, restart_h, rate)
    assert times.mean() == pytest.approx(expected, rel=0.01)
    assert revoked.mean() > 0
    assert expected > work_h  # revocations and checkpoints cost time


def test_p90_at_least_p50_and_both_above_the_work():
    out = spot_outcome(50.0, 0.01, 0.1, 0.2)
    assert out.time_h_p90 >= out.time_h_p50 > 50.0
    assert out.time_h_p90 > out.time_h_p50  # ~10 revocations: a real spread
    assert out.revocations_mean == pytest.approx(0.2 * out.time_h_mean, rel=0.1)


def test_no_revocations_is_the_deterministic_time():
    out = spot_outcome(12.5, 0.01, 0.1, 0.0)
    assert out.time_h_p50 == out.time_h_p90 == out.time_h_mean == 12.5
    assert math.isinf(out.interval_h) and out.revocations_mean == 0.0
    times, _ = simulate_time_h(12.5, 1.0, 0.01, 0.1, 0.0, 500)
    assert times == pytest.approx(np.full(500, 12.5 + 12 * 0.01))  # checkpoints still cost


def test_fixed_seed_is_reproducible_and_another_seed_differs():
    a = simulate_time_h(20, 0.5, 0.01, 0.1, 0.3, 2000, seed=7)[0]
    b = simulate_time_h(20, 0.5, 0.01, 0.1, 0.3, 2000, seed=7)[0]
    c = simulate_time_h(20, 0.5, 0.01, 0.1, 0.3, 2000, seed=8)[0]
    assert np.array_equal(a, b) and not np.array_equal(a, c)


@pytest.mark.parametrize("ckpt_h,rate", [(0.01, 0.1), (0.05, 0.5), (0.002, 0.02)])
def test_young_daly_interval_is_near_the_simulated_optimum(ckpt_h, rate):
    work_h, restart_h = 200.0, 0.05
    young = young_daly_interval_h(ckpt_h, rate)
    assert young == pytest.approx(math.sqrt(2 * ckpt_h / rate))
    grid = young * np.geomspace(0.2, 5.0, 25)
    means = [simulate_time_h(work_h, t, ckpt_h, restart_h, rate, 4000, 3)[0].mean() for t in grid]
    best = grid[int(np.argmin(means))]
    assert 0.5 < best / young < 2.0
    # Near the optimum the curve is flat: Young/Daly costs at most 1% more than the best.
    at_young = simulate_time_h(work_h, young, ckpt_h, restart_h, rate, 4000, 3)[0].mean()
    assert at_young <= min(means) * 1.01
    # ... and a badly chosen interval costs clearly more overhead (the test can fail).
    assert max(means) - work_h > 1.5 * (min(means) - work_h)


def test_spot_outcome_picks_an_interval_no_worse_than_young_daly():
    out = spot_outcome(100.0, 0.02, 0.1, 0.1)
    young_mean = simulate_time_h(100.0, out.young_daly_h, 0.02, 0.1, 0.1, 4000, 0)[0].mean()
    assert out.time_h_mean <= young_mean + 1e-9
    assert out.time_h_mean == pytest.approx(out.expected_time_h, rel=0.01)


def test_short_job_needs_no_checkpoint():
    out = spot_outcome(0.1, 0.5, 0.1, 0.01)  # Young/Daly 10 h >> the job
    assert out.interval_h >= 0.1
    assert out.time_h_p50 == pytest.approx(0.1)


@pytest.mark.parametrize(
    "kwargs,flag",
    [
        ({"checkpoint_s": -1, "restart_s": 0}, "--checkpoint-s"),
        ({"checkpoint_s": 1, "restart_s": float("nan")}, "--restart-s"),
        ({"checkpoint_s": 1, "restart_s": 1, "revocations_per_h": -0.1}, "--revocations-per-h"),
    ],
)
def test_spot_params_reject_bad_values(kwargs, flag):
    with pytest.raises(UsageError, match=flag):
        SpotParams(**kwargs)


def test_the_prediction_error_spreads_the_time_even_without_revocations():
    sigma = 0.0777  # a 6.2% mean absolute error
    exact = spot_outcome(12.5, 0.01, 0.1, 0.0, samples=20000)
    spread = spot_outcome(12.5, 0.01, 0.1, 0.0, samples=20000, error_sigma=sigma)
    assert exact.time_h_p90 == exact.time_h_p50 == 12.5
    assert spread.time_h_p50 == pytest.approx(12.5, rel=0.01)
    assert spread.time_h_p90 == pytest.approx(12.5 * math.exp(1.2816 * sigma), rel=0.01)
    # with revocations, the error's draws come on top of theirs, on a stream of their own
    base = spot_outcome(50.0, 0.05, 0.1, 0.2, seed=3)
    both = spot_outcome(50.0, 0.05, 0.1, 0.2, seed=3, error_sigma=sigma)
    assert both.interval_h == base.interval_h and both.time_h_p90 > base.time_h_p90

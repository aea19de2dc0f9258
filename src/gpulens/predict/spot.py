"""Time and cost of a job on spot (transient) servers: Poisson revocations, periodic
checkpoints, a restart after each revocation, and the checkpoint interval.

The model: the job needs ``work_h`` of uninterrupted time. It checkpoints after every
``interval_h`` of work (``checkpoint_h`` each, not after the last piece). A revocation (rate
``rate_per_h``, memoryless) loses the work since the last checkpoint and costs ``restart_h``
(new server, start-up, reloading the checkpoint); revocations during a restart are not modelled.
A segment of length L then takes ``(1/rate + restart)(exp(rate L) - 1)`` on average (exact for
this model), and the Monte Carlo draws the whole distribution with a fixed seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from gpulens.errors import UsageError

MIN_INTERVAL_H = 1.0 / 60.0  # no checkpoint more often than once a minute
# Above this many revocations in one simulation, their lost times are summed by the normal
# approximation instead of one draw each (the regime of intervals far too long).
EXACT_DRAWS_MAX = 2_000_000
INTERVAL_GRID = np.geomspace(0.25, 4.0, 17)  # around Young/Daly, checked by simulation


@dataclass(frozen=True)
class SpotParams:
    """What a spot run pays for a revocation. ``revocations_per_h`` None: the catalog's rate."""

    checkpoint_s: float
    restart_s: float
    revocations_per_h: float | None = None
    samples: int = 4000
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("checkpoint_s", "restart_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 0 seconds, got {value}")
        rate = self.revocations_per_h
        if rate is not None and (not math.isfinite(rate) or rate < 0):
            raise UsageError(f"--revocations-per-h must be >= 0, got {rate}")
        if self.samples < 100:
            raise UsageError(f"Monte Carlo samples must be >= 100, got {self.samples}")


@dataclass(frozen=True)
class SpotOutcome:
    """Elapsed hours on spot servers (restarts included) at the chosen checkpoint interval."""

    time_h_p50: float
    time_h_p90: float
    time_h_mean: float
    expected_time_h: float  # the closed form at the predicted work, to check the simulation
    interval_h: float  # math.inf: no checkpoints (no revocations)
    young_daly_h: float
    revocations_mean: float


def young_daly_interval_h(checkpoint_h: float, rate_per_h: float) -> float:
    """Young's first-order optimum sqrt(2 C MTBF) (Daly's refinement differs by < C)."""
    if rate_per_h <= 0:
        return math.inf
    return max(MIN_INTERVAL_H, math.sqrt(2.0 * checkpoint_h / rate_per_h))


def _segments(work_h: float, interval_h: float, checkpoint_h: float) -> tuple[int, float, float]:
    """(full segments, their length with the checkpoint, the last segment's length)."""
    if not math.isfinite(interval_h) or interval_h >= work_h:
        return 0, 0.0, work_h
    full = math.ceil(work_h / interval_h) - 1
    return full, interval_h + checkpoint_h, work_h - full * interval_h


def expected_time_h(
    work_h: float, interval_h: float, checkpoint_h: float, restart_h: float, rate_per_h: float
) -> float:
    """Mean elapsed hours (closed form of the model above)."""
    full, length, last = _segments(work_h, interval_h, checkpoint_h)
    if rate_per_h <= 0:
        return full * length + last

    def seg(length_h: float) -> float:
        return (1.0 / rate_per_h + restart_h) * math.expm1(rate_per_h * length_h)

    return full * seg(length) + seg(last)


def _lost_h(rng: np.random.Generator, failures: np.ndarray, length_h: float, rate: float):
    """Sum, per sample, of ``failures`` times-to-revocation, each below ``length_h``."""
    total = int(failures.sum())
    if total == 0:
        return np.zeros(len(failures))
    q = -math.expm1(-rate * length_h)  # P(revoked within the segment)
    if total > EXACT_DRAWS_MAX:
        # Truncated exponential's mean and variance, summed by the central limit theorem.
        p = 1.0 - q
        mean = 1.0 / rate - length_h * p / q
        second = 2.0 / rate**2 - length_h * (length_h + 2.0 / rate) * p / q
        var = max(second - mean**2, 0.0)
        draw = rng.standard_normal(len(failures)) * np.sqrt(failures * var)
        return np.maximum(failures * mean + draw, 0.0)
    u = rng.random(total)
    times = -np.log1p(-u * q) / rate  # inverse CDF of the exponential truncated to [0, L)
    owner = np.repeat(np.arange(len(failures)), failures)
    return np.bincount(owner, weights=times, minlength=len(failures))


def simulate_time_h(
    work_h: float,
    interval_h: float,
    checkpoint_h: float,
    restart_h: float,
    rate_per_h: float,
    samples: int = 4000,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Monte Carlo elapsed hours and revocations per sample (fixed seed: reproducible)."""
    full, length, last = _segments(work_h, interval_h, checkpoint_h)
    base = full * length + last
    if rate_per_h <= 0:
        return np.full(samples, base), np.zeros(samples)
    rng = np.random.default_rng(seed)
    elapsed = np.full(samples, base)
    revoked = np.zeros(samples)
    for count, seg in ((full, length), (1, last)):
        if count == 0 or seg <= 0:
            continue
        p_ok = math.exp(-rate_per_h * seg)
        if p_ok <= 0.0:
            raise UsageError(
                f"a {seg:.1f} h stretch without a checkpoint cannot finish at "
                f"{rate_per_h:g} revocations/h: give a smaller --revocations-per-h"
            )
        failures = rng.negative_binomial(count, p_ok, size=samples)  # revocations before done
        elapsed += _lost_h(rng, failures, seg, rate_per_h) + failures * restart_h
        revoked += failures
    return elapsed, revoked


def spread_by_error(times_h: np.ndarray, error_sigma: float, seed: int) -> np.ndarray:
    """``times_h`` each times a lognormal factor of median 1 and log-sd ``error_sigma``: the
    predicted work is itself uncertain, independently of the revocations."""
    if error_sigma <= 0:
        return times_h
    rng = np.random.default_rng([seed, 1])  # a stream of its own: revocations draw the same
    return times_h * np.exp(error_sigma * rng.standard_normal(len(times_h)))


def spot_outcome(
    work_h: float, checkpoint_h: float, restart_h: float, rate_per_h: float,
    samples: int = 4000, seed: int = 0, error_sigma: float = 0.0,
) -> SpotOutcome:  # fmt: skip
    """The distribution at the best interval: Young/Daly first, then the grid around it by
    simulated mean (the same seed for every interval, so their comparison is fair). With
    ``error_sigma``, each sample's time is also spread by the prediction's error
    (``spread_by_error``); the interval is chosen on the predicted work."""
    young = young_daly_interval_h(checkpoint_h, rate_per_h)
    if not math.isfinite(young):
        times = spread_by_error(np.full(samples, work_h), error_sigma, seed)
        return SpotOutcome(float(np.percentile(times, 50)), float(np.percentile(times, 90)),
                           float(times.mean()), work_h, math.inf, math.inf, 0.0)  # fmt: skip
    best, best_mean = young, math.inf
    for factor in INTERVAL_GRID:
        interval = max(MIN_INTERVAL_H, young * float(factor))
        if interval > 2 * work_h and factor > 1:
            break  # one segment already: longer intervals are the same run
        mean = float(
            simulate_time_h(work_h, interval, checkpoint_h, restart_h, rate_per_h, samples, seed)[
                0
            ].mean()
        )
        if mean < best_mean - 1e-12:
            best, best_mean = interval, mean
    times, revoked = simulate_time_h(
        work_h, best, checkpoint_h, restart_h, rate_per_h, samples, seed
    )
    times = spread_by_error(times, error_sigma, seed)
    return SpotOutcome(
        time_h_p50=float(np.percentile(times, 50)),
        time_h_p90=float(np.percentile(times, 90)),
        time_h_mean=float(times.mean()),
        expected_time_h=expected_time_h(work_h, best, checkpoint_h, restart_h, rate_per_h),
        interval_h=best,
        young_daly_h=young,
        revocations_mean=float(revoked.mean()),
    )

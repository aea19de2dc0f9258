"""Small statistics used by every measurement: throughput with a confidence interval."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Two-sided 95% Student t quantiles for small degrees of freedom; beyond 30 the normal value.
_T95 = {
    1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
    10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110,
    18: 2.101, 19: 2.093, 20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060,
    26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045, 30: 2.042,
}  # fmt: skip


def t95(dof: int) -> float:
    if dof < 1:
        return math.inf
    return _T95.get(dof, 1.96 + 2.5 / dof)  # within 0.3% of the exact quantile above 30


@dataclass(frozen=True)
class Throughput:
    """Samples per second with the half-width of its 95% confidence interval."""

    samples_per_s: float
    ci95_half_width: float
    n_batches: int

    @property
    def ci95_pct(self) -> float:
        if not self.samples_per_s:
            return math.inf
        return 100.0 * self.ci95_half_width / self.samples_per_s


def throughput_ci(step_times_s, samples_per_step, n_batches: int = 10) -> Throughput | None:
    """Throughput and its 95% CI by the method of batch means.

    Consecutive steps are correlated (queues, caches, an asynchronous GPU), so single steps are not
    independent samples; the means of ``n_batches`` contiguous blocks are close to independent.
    The point estimate is total samples over total time, the CI comes from the batch throughputs.
    Returns None with fewer than 2 steps.
    """
    times = np.asarray(step_times_s, dtype=float)
    samples = np.broadcast_to(np.asarray(samples_per_step, dtype=float), times.shape)
    if times.size < 2 or times.sum() <= 0:
        return None
    k = int(min(n_batches, times.size))
    blocks = np.array_split(np.arange(times.size), k)
    rates = np.array([samples[b].sum() / times[b].sum() for b in blocks if times[b].sum() > 0])
    mean_rate = samples.sum() / times.sum()
    if rates.size < 2:
        return Throughput(mean_rate, math.inf, int(rates.size))
    half = t95(rates.size - 1) * rates.std(ddof=1) / math.sqrt(rates.size)
    return Throughput(float(mean_rate), float(half), int(rates.size))


def log_interval(value: float | None, rel_half_width: float | None) -> list[float] | None:
    """The 95% interval ``[value / e^r, value * e^r]`` of a positive quantity whose 95%
    half-width is ``r = rel_half_width`` times the value, built on the log scale.

    By the delta method the standard error of ``log x`` is that of ``x`` over ``x``, so the
    symmetric interval ``log x ± r`` maps back to this one: always positive and finite, equal
    to ``x (1 ± r)`` to first order when ``r`` is small, and asymmetric as a rate's sampling
    distribution is (a few slow blocks can halve a rate, not make it negative). None when the
    value is not positive or the half-width is unknown.
    """
    if value is None or rel_half_width is None or not value > 0:
        return None
    if not math.isfinite(value) or not math.isfinite(rel_half_width) or rel_half_width < 0:
        return None
    factor = math.exp(rel_half_width)
    return [value / factor, value * factor]


def rate_ci95(samples_per_s: float | None, ci95_pct: float | None) -> list[float] | None:
    """``[low, high]`` samples/s for a throughput given with a symmetric 95% half-width of
    ``ci95_pct`` percent (:func:`log_interval`); the JSON's ``*_ci95_samples_per_s``."""
    return log_interval(samples_per_s, None if ci95_pct is None else ci95_pct / 100.0)


def bounded_interval(
    value: float | None, half_width: float | None, low: float = 0.0, high: float = 100.0
) -> list[float] | None:
    """``value ± half_width`` intersected with ``[low, high]`` (a share's interval: its true
    value lies in [0, 100], so the intersection covers it whenever the symmetric interval
    does, and never shows an impossible share). None when either is unknown."""
    if value is None or half_width is None or not math.isfinite(value):
        return None
    if not math.isfinite(half_width):
        return [low, high]
    return [max(low, min(high, value - half_width)), min(high, max(low, value + half_width))]

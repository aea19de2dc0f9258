"""The fetch stall as the loader workers' own read timers see it, and whether a run waited on
its loader. Pure: works on ``RunResult``s and imports no torch."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from gpulens.probes.environment import usable_cpus
from gpulens.run.result import RunResult
from gpulens.run.thresholds import LOADER_BOUND_DATA_WAIT
from gpulens.stalls.model import Z95, pool_estimates

# The one bar for "loader-bound" in the stall breakdown: the training loop waits on its loader
# at least this share of its time (the bar at which the prep summary calls the loader the
# bottleneck). The loader then sets the pace, and what slows the workers slows the loop by as
# much: the premise of the paired design (judged on the cached run) and of the fetch stall as
# the workers' read timers see it (judged on the cold or paired runs). Below it, the GPU's
# pace could absorb part of a slower loader, which only a separate cold run shows.
__all__ = ["LOADER_BOUND_DATA_WAIT"]


def wait_pct(run: RunResult) -> float:
    phases = run.summary.get("phases_s") or {}
    step, wait = phases.get("step"), phases.get("data_wait")
    return 100.0 * wait / step if step and wait is not None else 0.0


def is_loader_bound(run: RunResult) -> bool:
    """The run waited on its loader at least ``LOADER_BOUND_DATA_WAIT`` of its time."""
    return wait_pct(run) >= 100.0 * LOADER_BOUND_DATA_WAIT


def read_stall_from_paired(
    runs: list[RunResult], workers: int, cold_s_per_sample: float
) -> dict[str, Any] | None:
    """``read_stall_from_timers`` from paired cold runs: only the read part of the workers'
    extra time per cold sample (no slower decoding after a wait), as a share of the cold time
    per sample; None (with the read times) unless every paired run was loader-bound."""
    parts = [r.summary["paired_fetch"] for r in runs if r.summary.get("paired_fetch")]
    if not parts or workers < 1 or cold_s_per_sample <= 0:
        return None
    mean, var, _ = pool_estimates(
        [f["extra_read_s_per_sample"] for f in parts],
        [(f["extra_read_ci95_s"] / Z95) ** 2 for f in parts],
        [f["cold_samples"] for f in parts],
    )
    scale = 100.0 / (workers * cold_s_per_sample)

    def read_ms(kind: str) -> float:
        weights = [f["cold_samples"] for f in parts]
        values = [f[f"read_s_per_sample_{kind}"] for f in parts]
        return 1000.0 * float(np.average(values, weights=weights))

    loader_bound = all(is_loader_bound(r) for r in runs if r.summary.get("paired_fetch"))
    return {
        "fetch_read_pct": scale * mean if loader_bound else None,
        "ci95_pp": scale * Z95 * math.sqrt(var) if loader_bound else None,
        "read_ms_per_sample_cached": read_ms("cached"),
        "read_ms_per_sample_cold": read_ms("cold"),
        "loader_bound": loader_bound,
        "cpu_oversubscribed": workers + 1 > usable_cpus(),
    }


def _read_time(run: RunResult) -> tuple[float, float, int] | None:
    """Mean read time per sample in a run's loader workers over its measured window, the
    variance of that mean (batch means over 10 blocks in time order) and the sample count."""
    from gpulens.record.reader import read_prep

    s = run.summary
    df = read_prep(run.record_dir, s.get("measured_start_unix_s"), s.get("measured_end_unix_s"))
    read_s = df[df["collate_s"].isna()].sort_values("time_unix_s")["read_s"].dropna().to_numpy()
    if read_s.size < 20:
        return None
    blocks = [b.mean() for b in np.array_split(read_s, 10)]
    return float(read_s.mean()), float(np.var(blocks, ddof=1) / len(blocks)), int(read_s.size)


def _pooled_read(runs: list[RunResult]) -> tuple[float, float] | None:
    """Sample-weighted mean read time per sample over runs and the variance of that mean
    (with the spread between runs where they disagree)."""
    parts = [r for r in (_read_time(run) for run in runs) if r is not None]
    if not parts:
        return None
    mean, var, _ = pool_estimates(
        [m for m, _, _ in parts], [v for _, v, _ in parts], [k for *_, k in parts]
    )
    return mean, var


def read_stall_from_timers(
    cached_runs: list[RunResult],
    cold_runs: list[RunResult],
    workers: int,
    cold_s_per_sample: float,
) -> dict[str, Any] | None:
    """The fetch stall as the loader workers' own read timers see it: the extra read time per
    sample of the cold runs over the cached ones, shared by ``workers``, as a percentage of the
    cold time per sample, with its 95% CI half-width in points.

    It does not move with the loader's speed from run to run. It is the fetch stall while the
    loader sets the pace (every cold run loader-bound: it waits on data at least
    ``LOADER_BOUND_DATA_WAIT`` of its time; else the share is None) and reading changes
    nothing else: a worker that decodes more slowly after a storage wait makes the real stall
    larger (0.3-1.1 ms per sample in the H100 validation), and on an oversubscribed CPU a
    waiting worker leaves the CPU to the others and makes it smaller. None without prep timing
    rows."""
    cached, cold = _pooled_read(cached_runs), _pooled_read(cold_runs)
    if cached is None or cold is None or workers < 1 or cold_s_per_sample <= 0:
        return None
    loader_bound = all(is_loader_bound(r) for r in cold_runs)
    scale = 100.0 / (workers * cold_s_per_sample)
    return {
        "fetch_read_pct": scale * (cold[0] - cached[0]) if loader_bound else None,
        "ci95_pp": scale * Z95 * math.sqrt(cold[1] + cached[1]) if loader_bound else None,
        "read_ms_per_sample_cached": 1000.0 * cached[0],
        "read_ms_per_sample_cold": 1000.0 * cold[0],
        "loader_bound": loader_bound,
        "cpu_oversubscribed": workers + 1 > usable_cpus(),
    }

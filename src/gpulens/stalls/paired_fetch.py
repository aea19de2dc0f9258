"""The fetch stall from a paired cold run (:mod:`gpulens.data.paired`): the loader workers'
extra time per sample on cold files over cached ones, each cold block of samples compared with
the cached blocks the same worker read just before and just after it.

Comparing neighbours cancels what drifts slowly (the CPU's speed on a shared host, which moves
a separate cold run by 10% against a cached one); what remains is the storage's cost as the
workers pay it: the wait for the data and the slower decoding that follows a wait.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from gpulens.run.result import RunResult
from gpulens.stalls.model import Measured
from gpulens.stalls.read_stall import is_loader_bound
from gpulens.stats import t95

TIME_GROUPS = 20  # consecutive groups of pairs whose means give the interval


def paired_blocks(samples: pd.DataFrame, cold: np.ndarray) -> pd.DataFrame:
    """Runs of consecutive same-kind samples of each worker, in time order: ``worker_id``,
    ``cold``, ``samples``, ``time_unix_s`` (mean), and the mean ``work_s`` (read + decode +
    augment) and ``read_s`` per sample."""
    df = samples.dropna(subset=["index"]).sort_values(["worker_id", "time_unix_s"])
    df = df.assign(
        cold=cold[df["index"].to_numpy(dtype=np.int64)],
        work_s=df["read_s"] + df["decode_s"].fillna(0.0) + df["augment_s"].fillna(0.0),
    )
    change = (df["cold"] != df.groupby("worker_id")["cold"].shift()) | (
        df["worker_id"] != df["worker_id"].shift()
    )
    df["block"] = change.cumsum()
    blocks = df.groupby("block").agg(
        worker_id=("worker_id", "first"),
        cold=("cold", "first"),
        samples=("work_s", "size"),
        time_unix_s=("time_unix_s", "mean"),
        work_s=("work_s", "mean"),
        read_s=("read_s", "mean"),
    )
    return blocks.reset_index(drop=True)


def paired_differences(blocks: pd.DataFrame) -> pd.DataFrame:
    """For each cold block between two cached blocks of the same worker: its time per sample
    minus the mean of theirs (``d_work_s``, ``d_read_s``), with its ``samples`` and time."""
    rows = []
    for _, b in blocks.groupby("worker_id", sort=False):
        b = b.reset_index(drop=True)
        for i in range(1, len(b) - 1):
            if b.at[i, "cold"] and not b.at[i - 1, "cold"] and not b.at[i + 1, "cold"]:
                rows.append(
                    {
                        "worker_id": b.at[i, "worker_id"],
                        "time_unix_s": b.at[i, "time_unix_s"],
                        "samples": b.at[i, "samples"],
                        "d_work_s": b.at[i, "work_s"]
                        - 0.5 * (b.at[i - 1, "work_s"] + b.at[i + 1, "work_s"]),
                        "d_read_s": b.at[i, "read_s"]
                        - 0.5 * (b.at[i - 1, "read_s"] + b.at[i + 1, "read_s"]),
                    }
                )
    return pd.DataFrame(
        rows, columns=["worker_id", "time_unix_s", "samples", "d_work_s", "d_read_s"]
    )


def _mean_and_half_width(pairs: pd.DataFrame, column: str) -> tuple[float, float]:
    """Sample-weighted mean of ``column`` and its 95% CI half-width from the means of
    consecutive groups of pairs in time order (pairs close in time share the CPU's state, so
    single pairs are not independent; groups of a few seconds nearly are)."""
    pairs = pairs.sort_values("time_unix_s")
    w, x = pairs["samples"].to_numpy(float), pairs[column].to_numpy(float)
    mean = float((w * x).sum() / w.sum())
    k = min(TIME_GROUPS, len(pairs) // 2)
    if k < 2:
        return mean, math.inf
    groups = [(w[g] * x[g]).sum() / w[g].sum() for g in np.array_split(np.arange(len(x)), k)]
    return mean, float(t95(k - 1) * np.std(groups, ddof=1) / math.sqrt(k))


def paired_fetch(
    run_dir: str | Path,
    n_samples: int,
    seed: int,
    start_unix_s: float | None = None,
    end_unix_s: float | None = None,
) -> dict[str, Any] | None:
    """The workers' extra time per sample on cold files, from a paired cold run's prep rows
    over its measured window, with 95% CI half-widths; None when the run holds no paired
    blocks (no prep timing, or too short for a cold block between two cached ones)."""
    from gpulens.data.paired import cold_mask
    from gpulens.record.reader import read_prep

    rows = read_prep(run_dir, start_unix_s, end_unix_s)
    samples = rows[rows["collate_s"].isna() & rows["read_s"].notna()]
    if samples.empty or samples["index"].isna().all():
        return None
    blocks = paired_blocks(samples, cold_mask(n_samples, seed))
    pairs = paired_differences(blocks)
    if len(pairs) < 4:
        return None
    work, work_hw = _mean_and_half_width(pairs, "d_work_s")
    read, read_hw = _mean_and_half_width(pairs, "d_read_s")

    def kind_mean(cold: bool, column: str) -> float:
        b = blocks[blocks["cold"] == cold]
        return float((b[column] * b["samples"]).sum() / b["samples"].sum())

    return {
        "extra_s_per_sample": work,
        "extra_ci95_s": work_hw,
        "extra_read_s_per_sample": read,
        "extra_read_ci95_s": read_hw,
        "work_s_per_sample_cached": kind_mean(False, "work_s"),
        "work_s_per_sample_cold": kind_mean(True, "work_s"),
        "read_s_per_sample_cached": kind_mean(False, "read_s"),
        "read_s_per_sample_cold": kind_mean(True, "read_s"),
        "pairs": len(pairs),
        "cold_samples": int(pairs["samples"].sum()),
        "workers_seen": int(blocks["worker_id"].nunique()),
    }


def paired_runs_summary(
    runs: list[RunResult], cached: Measured, fetch: Measured, workers: int
) -> dict[str, Any]:
    """What the paired cold runs measured, and a check: a paired run's own pace, half its
    samples cold, against the pace the breakdown implies for it."""
    per_run = []
    for r in runs:
        f = r.summary["paired_fetch"]
        tput = r.summary.get("throughput_samples_per_s")
        expected = 1.0 / (cached.per_sample_s + 0.5 * fetch.per_sample_s)
        per_run.append(
            {
                "run_id": r.run_id,
                "extra_ms_per_cold_sample": 1000.0 * f["extra_s_per_sample"],
                "extra_ci95_ms": 1000.0 * f["extra_ci95_s"],
                "extra_read_ms_per_cold_sample": 1000.0 * f["extra_read_s_per_sample"],
                "pairs": f["pairs"],
                "cold_samples": f["cold_samples"],
                "samples_per_s": tput,
                "samples_per_s_ci95_pct": r.summary.get("throughput_ci95_pct"),
                "expected_samples_per_s": expected,
                "loader_bound": is_loader_bound(r),
            }
        )
    return {
        "fetch_ms_per_sample": 1000.0 * fetch.per_sample_s,
        "fetch_ci95_ms": 1000.0 * fetch.half_width_s,
        "workers": workers,
        "runs": per_run,
    }

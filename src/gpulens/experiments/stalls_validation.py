"""Ground truth for the stall breakdown: inject known storage delays and worker limits, and
check that the differential attribution recovers them.

Fetch: the cold run reads through emulated storage with latency ``L`` per file (taken as it
happened: the workers' measured read time per file, cold minus cached, plus the slower decoding
that follows a storage wait, also measured in the workers). With ``W``
loader workers the loader then needs ``t_load + L / W`` per sample, where ``t_load`` is its
time per sample in the cached run (measured inside the workers); the training takes whichever
is slower, itself (``t_cached``) or the loader. So the expected cold time per sample is
``max(t_cached, t_load + L / W)`` (``t_load = t_cached`` when the cached run already waited
on its loader) and the expected fetch stall is its excess over ``t_cached``,
as a share of the measured cold time; the breakdown reports ``(t_cold - t_cached) / t_cold``.

Prep: with the data cached and ``W`` workers, the loader delivers ``W / t_prep`` samples/s, where
``t_prep`` is the CPU time per sample measured inside the workers; the expected prep stall is
``max(0, t_prep / W - t_if) / t_cached``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from gpulens.workloads.train import TrainConfig, run_training


def _per_sample_s(result) -> float:
    return 1.0 / result.summary["throughput_samples_per_s"]


def _ci(result) -> float:
    ci_pct = result.summary.get("throughput_ci95_pct")
    return (ci_pct if ci_pct is not None else float("inf")) / 100.0


def _stage_s(result, stages: tuple[str, ...]) -> float:
    """Mean seconds per sample that the loader workers spent in ``stages``."""
    from gpulens.workloads.prep_timing import summarize_prep

    prep = summarize_prep(result.record_dir, result.summary["throughput_samples_per_s"])
    return sum(prep["stages"][s]["mean_s_per_sample"] or 0.0 for s in stages)


_CPU_STAGES = ("decode", "augment", "collate")


def validate(
    workload: str,
    data: str,
    runs_root: Path,
    latencies_s: tuple[float, ...] = (0.005, 0.010, 0.020),
    workers: tuple[int, ...] = (1,),
    batch_size: int = 8,
    steps: int = 40,
    device: str | None = None,
    precision: str = "fp32",
) -> pd.DataFrame:
    """One row per (workers, latency): expected and measured fetch and prep stall shares (%)."""
    from gpulens.workloads.datasets import dataset_files
    from gpulens.workloads.pagecache import warm
    from gpulens.workloads.prep_timing import summarize_prep

    warm(dataset_files(data))
    common: dict[str, Any] = dict(
        workload=workload, batch_size=batch_size, steps=steps, device=device,
        precision=precision,
    )  # fmt: skip
    t_if = _per_sample_s(run_training(TrainConfig(data="synthetic", **common), runs_root))
    rows = []
    for w in workers:
        cached = run_training(
            TrainConfig(data=data, workers=w, prep_timing=True, **common), runs_root
        )
        t_cached = _per_sample_s(cached)
        prep = summarize_prep(cached.record_dir, cached.summary["throughput_samples_per_s"])
        t_prep = prep.get("cpu_s_per_sample") if prep else None
        phases = cached.summary["phases_s"]
        if phases["data_wait"] > 0.5 * phases["step"]:
            # The loop waited on the loader most of the time: the loader's pace is t_cached,
            # including what the workers' own timers miss (collation, handing batches over).
            t_load = t_cached
        else:
            t_load = prep.get("prep_s_per_sample") / max(w, 1) if prep else 0.0
        expected_prep = (
            100.0 * max(0.0, t_prep / w - t_if) / t_cached if t_prep is not None else None
        )
        measured_prep = 100.0 * max(0.0, t_cached - t_if) / t_cached
        for latency_s in latencies_s:
            cold = run_training(
                TrainConfig(
                    data=data, workers=w, storage_latency_s=latency_s, prep_timing=True, **common
                ),
                runs_root,
            )
            t_cold = _per_sample_s(cold)
            # The delay as it happened (a sleep wakes up late on a busy machine): the workers'
            # read time per file, cold minus cached.
            injected_s = _stage_s(cold, ("read",)) - _stage_s(cached, ("read",))
            # A worker waking from a storage wait decodes more slowly at first (cold CPU caches,
            # rescheduling): part of the real cost of slow storage, measured in the workers.
            induced_s = _stage_s(cold, _CPU_STAGES) - _stage_s(cached, _CPU_STAGES)
            rows.append(
                {
                    "workers": w,
                    "latency_ms": 1000 * latency_s,
                    "t_if_ms": 1000 * t_if,
                    "t_cached_ms": 1000 * t_cached,
                    "t_cold_ms": 1000 * t_cold,
                    "injected_ms": 1000 * injected_s,
                    "induced_cpu_ms": 1000 * induced_s,
                    "fetch_expected_pct": 100.0
                    * (max(t_cached, t_load + (injected_s + induced_s) / max(w, 1)) - t_cached)
                    / t_cold,
                    "fetch_measured_pct": 100.0 * max(0.0, t_cold - t_cached) / t_cold,
                    # the measurement's own 95% CI, from the two runs' throughput intervals
                    "fetch_ci95_pp": 100.0
                    * ((t_cold * _ci(cold)) ** 2 + (t_cached * _ci(cached)) ** 2) ** 0.5
                    / t_cold,
                    "prep_expected_pct": expected_prep,
                    "prep_measured_pct": measured_prep,
                    "loader_bound_cold": cold.summary["phases_s"]["data_wait"]
                    > 0.5 * cold.summary["phases_s"]["step"],
                    "cold_run": cold.run_id,
                    "cached_run": cached.run_id,
                }
            )
    df = pd.DataFrame(rows)
    df["fetch_error_pp"] = df["fetch_measured_pct"] - df["fetch_expected_pct"]
    df["prep_error_pp"] = df["prep_measured_pct"] - df["prep_expected_pct"]
    return df

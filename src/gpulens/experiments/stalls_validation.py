"""Ground truth for the stall breakdown: limit the loader workers and inject known storage
delays, and check that the differential attribution recovers what they should cost.

The expected times per sample come from parts measured on their own:
- ``t_if``: the training with no ingestion (synthetic batches on the device);
- ``t_load``: the loader alone with ``W`` workers over cached data, each batch copied to the
  device and no model to feed (``gpulens.workloads.loader_bench``): its capacity, hand-over and
  pinning included;
- the injected delay ``L`` per file as it happened (the workers' measured read time per file,
  cold minus cached: a sleep wakes late on a busy machine), plus the slower decoding that
  follows a storage wait, also measured in the workers (``induced``).

A training run goes at the pace of the slower side, so the expected cached time is
``max(t_if, t_load)`` and the expected cold time ``max(t_if, t_load + (L + induced) / W)``.
Expected shares are of the expected cold time, as the breakdown's are of the measured one; the
measured shares are those ``gpulens.experiments.stalls.breakdown`` reports for the three runs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from gpulens.workloads.train import TrainConfig, run_training


def _stage_s(result, stages: tuple[str, ...]) -> float:
    """Mean seconds per sample that the loader workers spent in ``stages``."""
    from gpulens.workloads.prep_timing import summarize_prep

    prep = summarize_prep(result.record_dir, result.summary["throughput_samples_per_s"])
    return sum(prep["stages"][s]["mean_s_per_sample"] or 0.0 for s in stages)


_CPU_STAGES = ("decode", "augment", "collate")


def expected_shares(t_if: float, t_load: float, delay_s: float, workers: int) -> dict[str, float]:
    """Expected compute, prep and fetch shares (%) from the parts' own times per sample."""
    t_cached = max(t_if, t_load)
    t_cold = max(t_if, t_load + delay_s / max(workers, 1))
    return {
        "compute": 100.0 * t_if / t_cold,
        "prep_stall": 100.0 * (t_cached - t_if) / t_cold,
        "fetch_stall": 100.0 * (t_cold - t_cached) / t_cold,
    }


def validate(
    workload: str,
    data: str,
    runs_root: Path,
    latencies_s: tuple[float, ...] = (0.005, 0.010, 0.020),
    workers: tuple[int, ...] = (1,),
    batch_size: int = 8,
    steps: int | None = 40,
    duration_s: float | None = None,
    loader_duration_s: float = 10.0,
    device: str | None = None,
    precision: str = "fp32",
    progress: Callable[[str], None] | None = None,
) -> pd.DataFrame:
    """One row per (workers, latency): expected and measured compute, prep and fetch shares
    (%), their differences (points) and the measurement's own 95% CI half-widths (points).

    Each training run lasts ``steps`` measured steps or, with ``duration_s``, that long."""
    from gpulens.experiments.stalls import _measured, breakdown
    from gpulens.workloads.datasets import dataset_files
    from gpulens.workloads.loader_bench import measure_loader
    from gpulens.workloads.pagecache import warm

    say = progress or (lambda _msg: None)
    warm(dataset_files(data))
    length = {"duration_s": duration_s} if duration_s else {"steps": steps}
    common: dict[str, Any] = dict(
        workload=workload, batch_size=batch_size, device=device, precision=precision,
    )  # fmt: skip
    say("ingestion-free run")
    free = run_training(TrainConfig(data="synthetic", **common, **length), runs_root)
    t_if = 1.0 / free.summary["throughput_samples_per_s"]
    rows = []
    for w in workers:
        say(f"{w} workers: loader alone")
        pace = measure_loader(TrainConfig(data=data, workers=w, **common), loader_duration_s)
        say(f"{w} workers: cached run")
        cached = run_training(
            TrainConfig(data=data, workers=w, prep_timing=True, **common, **length), runs_root
        )
        for latency_s in latencies_s:
            say(f"{w} workers: {1000 * latency_s:g} ms storage latency")
            cold = run_training(
                TrainConfig(
                    data=data, workers=w, storage_latency_s=latency_s, prep_timing=True,
                    **common, **length,
                ),
                runs_root,
            )  # fmt: skip
            injected_s = _stage_s(cold, ("read",)) - _stage_s(cached, ("read",))
            induced_s = _stage_s(cold, _CPU_STAGES) - _stage_s(cached, _CPU_STAGES)
            expected = expected_shares(t_if, pace.per_sample_s, injected_s + induced_s, w)
            measured, ci_pp = breakdown(_measured(free), _measured(cached), _measured(cold))
            row: dict[str, Any] = {
                "workers": w,
                "latency_ms": 1000 * latency_s,
                "t_if_ms": 1000 * t_if,
                "t_load_ms": 1000 * pace.per_sample_s,
                "t_load_ci95_pct": pace.ci95_pct,
                "t_cached_ms": 1000 / cached.summary["throughput_samples_per_s"],
                "t_cold_ms": 1000 / cold.summary["throughput_samples_per_s"],
                "injected_ms": 1000 * injected_s,
                "induced_cpu_ms": 1000 * induced_s,
            }
            for part in ("compute", "prep_stall", "fetch_stall"):
                key = part.removesuffix("_stall")
                row[f"{key}_expected_pct"] = expected[part]
                row[f"{key}_measured_pct"] = measured[part]
                row[f"{key}_ci95_pp"] = ci_pp[part]
                row[f"{key}_error_pp"] = measured[part] - expected[part]
            row.update(
                loader_bound_cold=cold.summary["phases_s"]["data_wait"]
                > 0.5 * cold.summary["phases_s"]["step"],
                free_run=free.run_id,
                cached_run=cached.run_id,
                cold_run=cold.run_id,
            )
            rows.append(row)
    return pd.DataFrame(rows)

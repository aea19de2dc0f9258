"""Ground truth for the stall breakdown: limit the loader workers and inject known storage
delays, and check that the differential attribution recovers what they should cost.

The expected times per sample come from parts measured on their own:
- ``t_if``: the training with no ingestion (synthetic batches on the device);
- ``t_load``: the pace of ``W`` loader workers over cached data, bottom-up: each worker's
  timed work per sample (read, decode, augment, collate) as measured inside the workers during
  the cached training run (so it includes what sharing the CPU with the training costs them),
  plus what else a worker spends per sample (handing the batch over, fetching indices),
  measured with the loader alone, no model to feed (``gpulens.stalls.loader_bench``);
  ``t_load = (work + hand-over) / W``;
- the injected delay ``L`` per file as it happened (the workers' measured read time per file,
  cold minus cached: a sleep wakes late on a busy machine), plus the slower decoding that
  follows a storage wait, also measured in the workers (``induced``).

The differential result comes from the training loop's end-to-end pace instead, so the two
meet only if the attribution is right. A training run goes at the pace of the slower side, so
the expected cached time is ``max(t_if, t_load)`` and the expected cold time
``max(t_if, t_load + (L + induced) / W)``. Expected shares are of the expected cold time, as
the breakdown's are of the measured one; the measured shares are those
``gpulens.stalls.breakdown`` reports for the three runs.

Every row also holds the shares expected from the delay as configured (``*_nominal``): an
outside truth, but one that leaves out the slower decoding after a wait, which the measured
stall rightly includes, so the measured fetch share should sit a little above it.

With ``paired``, each cell also gets a paired cold run (what ``gpulens stalls`` uses when the
loop waits on its loader): the fetch stall from the workers' extra time per cold sample,
compared with both expectations and with the separate cold run's (``paired_minus_separate``);
and the paired run's own pace (half its samples slow) against the pace the breakdown implies
for it, an end-to-end check of the attribution. The separate runs' "induced" term compares
two runs and carries their difference in CPU speed (it can come out negative); the paired
run's (``paired_extra_ms - paired_extra_read_ms``) does not.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from gpulens.workloads.config import TrainConfig
from gpulens.workloads.train import run_training


def _prep(result) -> dict[str, Any]:
    """The workers' timing over the run's measured window."""
    from gpulens.stalls.prep_summary import summarize_prep

    s = result.summary
    return summarize_prep(
        result.record_dir,
        s["throughput_samples_per_s"],
        start_unix_s=s.get("measured_start_unix_s"),
        end_unix_s=s.get("measured_end_unix_s"),
    )


def _stage_s(prep: dict[str, Any], stages: tuple[str, ...]) -> float:
    """Mean seconds per sample that the loader workers spent in ``stages``."""
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


def nominal_columns(row: dict[str, Any]) -> dict[str, float]:
    """The shares expected from the injected delay as configured (``latency_ms``, nothing
    else: no late wake-ups, no slower decoding after a wait), and each design's error against
    them (``*_error_nominal_pp``), from a row's ``t_if_ms``, ``t_load_ms`` and ``workers``."""
    expected = expected_shares(
        row["t_if_ms"] / 1000, row["t_load_ms"] / 1000, row["latency_ms"] / 1000, row["workers"]
    )
    out: dict[str, float] = {}
    for part in ("compute", "prep_stall", "fetch_stall"):
        key = part.removesuffix("_stall")
        out[f"{key}_expected_nominal_pct"] = expected[part]
        for design in ("", "paired_"):
            measured = row.get(f"{design}{key}_measured_pct")
            if measured is not None:
                out[f"{design}{key}_error_nominal_pp"] = measured - expected[part]
    return out


def _paired_row(pair, free, cached, expected, separate, separate_ci, workers) -> dict[str, Any]:
    """A paired cold run's breakdown beside the expected and the separate runs' shares."""
    from gpulens.run.result import RunResult
    from gpulens.stalls.model import Measured, breakdown, measure_run
    from gpulens.stalls.paired_fetch import paired_fetch

    stored = RunResult.from_record(pair.record_dir)
    s, eff = stored.summary, stored.effective_config
    got = paired_fetch(
        pair.record_dir,
        eff["paired_cold_samples"],
        eff["seed"],
        s["measured_start_unix_s"],
        s["measured_end_unix_s"],
    )
    if got is None:
        return {"paired_run": pair.run_id}
    w = max(workers, 1)
    fetch = Measured(got["extra_s_per_sample"] / w, got["extra_ci95_s"] / w)
    m_cached = measure_run(cached)
    shares, cis = breakdown(measure_run(free), m_cached, None, fetch=fetch)
    implied = 1.0 / (m_cached.per_sample_s + 0.5 * fetch.per_sample_s)
    row: dict[str, Any] = {
        "paired_run": pair.run_id,
        "paired_extra_ms": 1000 * got["extra_s_per_sample"],
        "paired_extra_read_ms": 1000 * got["extra_read_s_per_sample"],
        "paired_pairs": got["pairs"],
        "paired_samples_per_s": s["throughput_samples_per_s"],
        "paired_implied_samples_per_s": implied,
        "paired_pace_error_pct": 100 * (s["throughput_samples_per_s"] / implied - 1),
        "paired_pace_ci95_pct": s["throughput_ci95_pct"],
    }
    for part in ("compute", "prep_stall", "fetch_stall"):
        key = part.removesuffix("_stall")
        row[f"paired_{key}_measured_pct"] = shares[part]
        row[f"paired_{key}_ci95_pp"] = cis[part]
        row[f"paired_{key}_error_pp"] = shares[part] - expected[part]
    row["paired_minus_separate_fetch_pp"] = shares["fetch_stall"] - separate["fetch_stall"]
    row["separate_fetch_ci95_pp"] = separate_ci["fetch_stall"]
    return row


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
    paired: bool = False,
) -> pd.DataFrame:
    """One row per (workers, latency): expected and measured compute, prep and fetch shares
    (%), their differences (points) and the measurement's own 95% CI half-widths (points).

    Each training run lasts ``steps`` measured steps or, with ``duration_s``, that long."""
    from gpulens.data.datasets import dataset_files
    from gpulens.data.pagecache import warm
    from gpulens.stalls import breakdown, is_loader_bound, measure_run
    from gpulens.stalls.loader_bench import measure_loader

    say = progress or (lambda _msg: None)
    warm(dataset_files(data))
    length = {"duration_s": duration_s} if duration_s else {"steps": steps}
    common: dict[str, Any] = dict(
        workload=workload,
        batch_size=batch_size,
        device=device,
        precision=precision,
    )
    say("ingestion-free run")
    free = run_training(TrainConfig(data="synthetic", **common, **length), runs_root)
    t_if = 1.0 / free.summary["throughput_samples_per_s"]
    rows = []
    for w in workers:
        say(f"{w} workers: loader alone")
        pace = measure_loader(
            TrainConfig(data=data, workers=w, **common),
            loader_duration_s,
            timing_dir=Path(tempfile.mkdtemp(prefix=f"loader-w{w}-", dir=runs_root)),
        )
        say(f"{w} workers: cached run")
        cached = run_training(
            TrainConfig(data=data, workers=w, prep_timing=True, **common, **length), runs_root
        )
        cached_prep = _prep(cached)
        work_s = cached_prep["prep_s_per_sample"] or 0.0
        t_load = (work_s + (pace.handover_s_per_sample or 0.0)) / max(w, 1)
        for latency_s in latencies_s:
            say(f"{w} workers: {1000 * latency_s:g} ms storage latency")
            cold = run_training(
                TrainConfig(
                    data=data,
                    workers=w,
                    storage_latency_s=latency_s,
                    prep_timing=True,
                    **common,
                    **length,
                ),
                runs_root,
            )
            cold_prep = _prep(cold)
            # The delay as it happened (a sleep wakes up late on a busy machine): the workers'
            # read time per file, cold minus cached.
            injected_s = _stage_s(cold_prep, ("read",)) - _stage_s(cached_prep, ("read",))
            # A worker waking from a storage wait decodes more slowly at first (cold CPU caches,
            # rescheduling): part of the real cost of slow storage, measured in the workers.
            induced_s = _stage_s(cold_prep, _CPU_STAGES) - _stage_s(cached_prep, _CPU_STAGES)
            expected = expected_shares(t_if, t_load, injected_s + induced_s, w)
            measured, ci_pp = breakdown(measure_run(free), measure_run(cached), measure_run(cold))
            row: dict[str, Any] = {
                "workers": w,
                "latency_ms": 1000 * latency_s,
                "t_if_ms": 1000 * t_if,
                "t_load_ms": 1000 * t_load,
                "worker_work_ms": 1000 * work_s,
                "worker_handover_ms": 1000 * (pace.handover_s_per_sample or 0.0),
                "t_loader_alone_ms": 1000 * pace.per_sample_s,
                "t_loader_alone_ci95_pct": pace.ci95_pct,
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
                loader_bound_cold=is_loader_bound(cold),
                free_run=free.run_id,
                cached_run=cached.run_id,
                cold_run=cold.run_id,
            )
            if paired:
                say(f"{w} workers: {1000 * latency_s:g} ms, paired cold run")
                pair = run_training(
                    TrainConfig(
                        data=data,
                        workers=w,
                        storage_latency_s=latency_s,
                        prep_timing=True,
                        paired_cold_block=batch_size,
                        **common,
                        **length,
                    ),
                    runs_root,
                )
                row.update(_paired_row(pair, free, cached, expected, measured, ci_pp, w))
            row.update(nominal_columns(row))
            rows.append(row)
    return pd.DataFrame(rows)

"""Where data-prep time goes, from the per-stage rows that :mod:`gpulens.data.prep_timing`
records in each loader worker: stage totals and shares, per-worker busy fractions, and whether the
loader keeps up with the training. Pure analysis: no torch at import time (the rows are read
through :func:`gpulens.record.reader.read_prep` when a summary is asked for).
"""

from __future__ import annotations

import math
import os
from typing import Any

STAGES = ("read", "decode", "augment", "collate")
STARVED_CAPACITY_RATIO = 1.1  # loader capacity at or below this x consumption: prep-bound
MAIN_PROCESS_PREP_FRACTION = 0.1  # workers=0: prep above this share of the time is a bottleneck
# The training loop waiting for data longer than this share of its time: the loader is the
# bottleneck whatever the workers' timed work says (hand-over and pinning are not timed).
STARVED_DATA_WAIT_FRACTION = 0.2


def _rounded(x: float | None, digits: int = 9) -> float | None:
    return None if x is None or not math.isfinite(x) else round(float(x), digits)


def summarize_prep(
    run_dir: str | os.PathLike,
    consumed_samples_per_s: float | None = None,
    *,
    workers: int | None = None,
    start_unix_s: float | None = None,
    end_unix_s: float | None = None,
    data_wait_fraction: float | None = None,
) -> dict[str, Any]:
    """Where data-prep time goes, per stage and per worker, and whether the loader keeps up.

    ``consumed_samples_per_s`` is the training's throughput (all ranks together when the
    timing directory is shared); without it the rate the loader delivered is used. Rows outside
    ``[start_unix_s, end_unix_s]`` (warm-up) are left out; ``workers`` overrides the number of
    worker processes seen in the rows.

    The loader can deliver ``workers / prep_s_per_sample`` samples/s; at or below
    ``1.1 x`` the consumption, data prep is the bottleneck (``workers_starved`` is True: the
    training waits on workers that cannot keep up). So it is, too, when the training loop waits
    for data more than 20% of its time (``data_wait_fraction``, from the step timer): then the
    workers' untimed time (handing batches over, pinning) makes up the difference. With
    ``workers=0`` prep runs in the training loop itself and counts as a bottleneck above 10% of
    the time. ``prep_s_per_sample`` is wall time (read + decode + augment + collate per
    sample), ``cpu_s_per_sample`` the CPU part of it and ``wait_s_per_sample`` the rest
    (storage, emulated delay, CPU contention). Returns plain data; what was not recorded is
    None.
    """
    from gpulens.record.reader import read_prep

    df = read_prep(run_dir, start_unix_s, end_unix_s)
    samples = df[df["collate_s"].isna()]
    batches = df[df["collate_s"].notna()]
    n_samples = len(samples)
    out: dict[str, Any] = {
        "n_samples": n_samples,
        "n_batches": len(batches),
        "stages": {},
        "prep_s_per_sample": None,
        "cpu_s_per_sample": None,
        "wait_s_per_sample": None,
        "total_bytes": int(samples["nbytes"].sum()) if n_samples else 0,
        "read_bytes_per_s_per_worker": None,
        "workers": [],
        "n_workers": 0,
        "main_process_loading": False,
        "loader_capacity_samples_per_s": None,
        "consumed_samples_per_s": consumed_samples_per_s,
        "consumed_source": "argument" if consumed_samples_per_s else None,
        "capacity_ratio": None,
        "workers_starved": None,
        "explanation": "",
    }
    if not n_samples:
        out["explanation"] = "no prep timing rows: run with prep timing on (timing_dir set)"
        return out

    totals_s = {
        "read": float(samples["read_s"].sum()),
        "decode": float(samples["decode_s"].fillna(0).sum()),
        "augment": float(samples["augment_s"].fillna(0).sum()),
        "collate": float(batches["collate_s"].sum()) if len(batches) else None,
    }
    batch_samples = int(batches["batch_samples"].fillna(0).sum()) if len(batches) else 0
    if not batch_samples:  # collate rows without their batch sizes: no per-sample figure
        totals_s["collate"] = None
    per_sample_s = {
        k: (v / (batch_samples if k == "collate" else n_samples) if v is not None else None)
        for k, v in totals_s.items()
    }
    prep_s = sum(v for v in per_sample_s.values() if v is not None)
    for k in STAGES:
        mean = per_sample_s[k]
        out["stages"][k] = {
            "total_s": _rounded(totals_s[k]),
            "mean_s_per_sample": _rounded(mean),
            "share_pct": _rounded(100 * mean / prep_s, 2) if mean is not None and prep_s else None,
        }
    out["prep_s_per_sample"] = _rounded(prep_s)
    if samples["cpu_s"].notna().all() and (not len(batches) or batches["cpu_s"].notna().all()):
        cpu_s = samples["cpu_s"].sum() / n_samples
        if len(batches):
            cpu_s += batches["cpu_s"].sum() / batch_samples
        out["cpu_s_per_sample"] = _rounded(cpu_s)
        out["wait_s_per_sample"] = _rounded(max(0.0, prep_s - cpu_s))
    if totals_s["read"] > 0:
        out["read_bytes_per_s_per_worker"] = _rounded(out["total_bytes"] / totals_s["read"], 1)

    # Per worker: busy time over the span from its first sample's start to its last row.
    df = df.assign(
        busy_s=df[["read_s", "decode_s", "augment_s", "collate_s"]].fillna(0).sum(axis=1)
    )
    df = df.assign(start_unix_s=df["time_unix_s"] - df["busy_s"])
    for (rank, wid, pid), g in df.groupby(["rank", "worker_id", "pid"], sort=True):
        span_s = float(g["time_unix_s"].max() - g["start_unix_s"].min())
        busy_s = float(g["busy_s"].sum())
        out["workers"].append(
            {
                "rank": int(rank),
                "worker_id": int(wid),
                "pid": int(pid),
                "n_samples": int(g["collate_s"].isna().sum()),
                "n_batches": int(g["collate_s"].notna().sum()),
                "busy_s": _rounded(busy_s),
                "span_s": _rounded(span_s),
                "busy_fraction": _rounded(min(1.0, busy_s / span_s), 4) if span_s > 0 else None,
            }
        )
    worker_keys = df.loc[df["worker_id"] >= 0, ["rank", "worker_id"]].drop_duplicates()
    main = len(worker_keys) == 0
    n_workers = workers if workers is not None else (1 if main else len(worker_keys))
    out["n_workers"] = 0 if main and workers is None else n_workers
    out["main_process_loading"] = main

    if consumed_samples_per_s is None:
        window_s = float(df["time_unix_s"].max() - df["start_unix_s"].min())
        if window_s > 0:
            consumed_samples_per_s = n_samples / window_s
            out["consumed_samples_per_s"] = _rounded(consumed_samples_per_s, 3)
            out["consumed_source"] = "delivered"
    capacity = n_workers / prep_s if prep_s > 0 and n_workers > 0 else None
    out["loader_capacity_samples_per_s"] = _rounded(capacity, 3)
    if capacity is None or not consumed_samples_per_s:
        out["explanation"] = "cannot judge: no prep time or no consumption rate"
        return out
    ratio = capacity / consumed_samples_per_s
    out["capacity_ratio"] = _rounded(ratio, 3)
    top = max(
        (k for k in STAGES if per_sample_s[k] is not None), key=lambda k: per_sample_s[k] or 0
    )
    top_pct = out["stages"][top]["share_pct"]
    if main:
        fraction = consumed_samples_per_s * prep_s
        out["workers_starved"] = bool(fraction > MAIN_PROCESS_PREP_FRACTION)
        out["explanation"] = (
            f"data is loaded in the training process (workers=0): prep takes {fraction:.0%} of "
            f"the time ({prep_s * 1e3:.2f} ms per sample, {top} {top_pct:.0f}%)"
            + ("; use worker processes" if out["workers_starved"] else "")
        )
        return out
    waits = data_wait_fraction is not None and data_wait_fraction > STARVED_DATA_WAIT_FRACTION
    out["workers_starved"] = bool(ratio <= STARVED_CAPACITY_RATIO or waits)
    verdict = (
        "data prep is the bottleneck: add workers or make the "
        f"{top} stage cheaper ({top_pct:.0f}% of prep)"
        if out["workers_starved"]
        else "the loader keeps up"
    )
    if waits and ratio > STARVED_CAPACITY_RATIO:
        verdict = (
            f"yet the training waits for data {data_wait_fraction:.0%} of the time: the workers "
            "lose the rest handing batches over (inter-process copy, pinning), so the loader is "
            "the bottleneck: add workers, or make batches cheaper to hand over"
        )
    out["explanation"] = (
        f"{n_workers} worker{'s' * (n_workers != 1)} x 1/{prep_s * 1e3:.2f} ms per sample can "
        f"deliver {capacity:.1f} samples/s, {ratio:.2f}x the {consumed_samples_per_s:.1f} "
        "samples/s "
        f"{'consumed' if out['consumed_source'] == 'argument' else 'delivered'}: {verdict}"
    )
    return out

"""The stall model: times per sample (pooled over runs), the breakdown into compute and
stalls with delta-method intervals, what-if predictions and recommendations. Pure: works on
``RunResult``s (or anything with a ``summary`` mapping) and imports no torch."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from gpulens.predict.workers import worker_decline_ratio
from gpulens.run.result import RunResult

log = logging.getLogger(__name__)

COMPONENTS = ("compute", "prep_stall", "fetch_stall", "interconnect_stall", "network_stall")
Z95 = 1.96  # two-sided 95% normal quantile
PAIRED_KIND = "paired_cold"


@dataclass(frozen=True)
class Measured:
    per_sample_s: float
    half_width_s: float  # 95% CI half-width of per_sample_s
    between_runs_pct: float = 0.0  # pooled runs: their spread beyond their own errors (SD, %)


def measure_run(result: RunResult | None) -> Measured | None:
    """Time per sample and GPU, with its CI half-width."""
    if result is None:
        return None
    tput = result.summary.get("throughput_samples_per_s")
    if not tput:
        return None
    ci_pct = result.summary.get("throughput_ci95_pct")
    t = max(1, result.summary.get("processes") or 1) / tput
    # A relative CI on the rate is (to first order) the same relative CI on its inverse.
    return Measured(t, t * (ci_pct if ci_pct is not None else math.inf) / 100.0)


def _samples(summary: dict) -> float:
    """The samples a run measured, its weight in a pool; a wrapped command's run records its
    steps' throughput but no measured wall time: its measured steps stand in (equal weights
    where neither is known)."""
    tput, wall = summary.get("throughput_samples_per_s"), summary.get("measured_wall_s")
    if tput and wall:
        return tput * wall
    return float(summary.get("measured_steps") or 1)


def pooled(passes: list[RunResult]) -> Measured | None:
    """Several runs of the same thing as one: time per sample weighted by the samples each run
    measured. Its interval combines the runs' own errors and, when the runs disagree by more
    than those allow, the spread between runs (DerSimonian-Laird random effects): on a VM, one
    cold pass can read at another speed than the next, and a run's own interval cannot see
    that."""
    parts = [(m, _samples(r.summary)) for r in passes if (m := measure_run(r)) is not None]
    if not parts:
        return None
    t, var, tau2 = pool_estimates(
        [m.per_sample_s for m, _ in parts],
        [(m.half_width_s / Z95) ** 2 for m, _ in parts],
        [samples for _, samples in parts],
    )
    return Measured(t, Z95 * math.sqrt(var), 100.0 * math.sqrt(tau2) / t)


def pooled_paired(runs: list[RunResult]) -> Measured | None:
    """The fetch stall per sample from paired cold runs: the workers' extra time per cold
    sample (``summary["paired_fetch"]``) over the number of workers, pooled like ``pooled``
    (weights: cold samples compared)."""
    parts = [
        (r.summary["paired_fetch"], max(1, r.summary.get("workers") or 1))
        for r in runs
        if r.summary.get("paired_fetch")
    ]
    if not parts:
        return None
    t, var, tau2 = pool_estimates(
        [f["extra_s_per_sample"] / w for f, w in parts],
        [(f["extra_ci95_s"] / w / Z95) ** 2 for f, w in parts],
        [f["cold_samples"] for f, _ in parts],
    )
    return Measured(t, Z95 * math.sqrt(var), 100.0 * math.sqrt(tau2) / t if t > 0 else 0.0)


def measure_kind(kind: str, runs: list[RunResult]) -> Measured | None:
    return pooled_paired(runs) if kind == PAIRED_KIND else pooled(runs)


def measure_all(repeats: dict[str, list[RunResult]]) -> dict[str, Measured | None]:
    return {kind: measure_kind(kind, runs) for kind, runs in repeats.items()}


def pool_estimates(
    means: list[float], variances: list[float], weights: list[float]
) -> tuple[float, float, float]:
    """Weighted mean of runs' estimates, the variance of that mean (each run's own variance
    plus the spread between runs) and that spread."""
    total = sum(weights)
    mean = sum(m * w for m, w in zip(means, weights, strict=True)) / total
    tau2 = _between_run_variance(means, variances)
    var = sum((w / total) ** 2 * (v + tau2) for v, w in zip(variances, weights, strict=True))
    return mean, var, tau2


def _between_run_variance(means: list[float], variances: list[float]) -> float:
    """DerSimonian-Laird estimate of the variance between runs beyond their own (0 when they
    agree within their errors, or with one run)."""
    if len(means) < 2 or any(not math.isfinite(v) or v <= 0 for v in variances):
        return 0.0
    w = [1.0 / v for v in variances]
    s1, s2 = sum(w), sum(x * x for x in w)
    fixed = sum(wi * m for wi, m in zip(w, means, strict=True)) / s1
    q = sum(wi * (m - fixed) ** 2 for wi, m in zip(w, means, strict=True))
    return max(0.0, (q - (len(means) - 1)) / (s1 - s2 / s1))


def breakdown(
    ingestion_free: Measured,
    cached: Measured,
    cold: Measured | None,
    multi_gpu: Measured | None = None,
    multi_gpu_socket: Measured | None = None,
    fetch: Measured | None = None,
) -> tuple[dict[str, float | None], dict[str, float | None]]:
    """Shares (percent) of the total time per sample and GPU, and their 95% CI half-widths in
    percentage points (first-order propagation of the runs' own intervals, taken as
    independent). ``fetch``, the fetch stall per sample measured directly (a paired cold run),
    stands for ``cold - cached`` when given.

    All times are per sample and per GPU (an N-GPU run's is N / its total throughput). The
    total is the compute time plus every stall, which, when no run is faster than the one it
    is compared with, is the slowest data run (cold, else cached) plus the interconnect and
    network excesses."""
    runs = {
        "free": ingestion_free,
        "cached": cached,
        "cold": cold,
        "multi": multi_gpu,
        "socket": multi_gpu_socket,
        "fetch": fetch,
    }
    fetch_term = {"fetch": 1.0} if fetch else {"cold": 1.0, "cached": -1.0} if cold else None
    # Each component is a difference of run times: {run: coefficient}.
    terms: dict[str, dict[str, float] | None] = {
        "compute": {"free": 1.0},
        "prep_stall": {"cached": 1.0, "free": -1.0},
        "fetch_stall": fetch_term,
        "interconnect_stall": {"multi": 1.0, "free": -1.0} if multi_gpu else None,
        "network_stall": (
            {"socket": 1.0, "multi": -1.0} if multi_gpu and multi_gpu_socket else None
        ),
    }

    def raw(term: dict[str, float]) -> float:
        return sum(c * runs[r].per_sample_s for r, c in term.items())  # type: ignore[union-attr]

    # Differences are clipped at zero (a faster "slower" run is noise), and the total is their
    # sum, so the shares are never negative and always add up to 100.
    values = {k: (None if t is None else max(0.0, raw(t))) for k, t in terms.items()}
    total = sum(v for v in values.values() if v)
    in_total: dict[str, float] = {}  # d total / d run time
    for k, t in terms.items():
        if t is not None and (values[k] or k == "compute"):
            for r, c in t.items():
                in_total[r] = in_total.get(r, 0.0) + c

    shares: dict[str, float | None] = {}
    cis: dict[str, float | None] = {}
    for k, t in terms.items():
        if t is None:
            shares[k] = cis[k] = None
            continue
        value = values[k] or 0.0
        shares[k] = 100.0 * value / total
        # First-order (delta method) propagation of the independent runs' half-widths through
        # share = value / total; a clipped component keeps the interval of its difference.
        var = 0.0
        for r in set(t) | set(in_total):
            d_share = t.get(r, 0.0) / total - value * in_total.get(r, 0.0) / total**2
            var += (d_share * runs[r].half_width_s) ** 2  # type: ignore[union-attr]
        cis[k] = 100.0 * math.sqrt(var)
    return shares, cis


def what_if(
    ingestion_free: Measured,
    cached: Measured,
    cold: Measured | None,
    workers: int,
    cpu_count: int,
    mean_file_bytes: float | None,
    prep_cpu_s_per_sample: float | None,
) -> dict[str, Any]:
    """Predicted throughput (samples/s) for other workers (with the storage as measured: cold
    when there is a cold run), cache sizes and storage.

    The model: the GPU needs ``t_if`` per sample; ``W`` loader processes each need ``t_prep``
    of CPU (and ``t_fetch`` waiting on storage) per sample; the slower side sets the pace. At
    another worker count each worker's CPU time per sample follows ``predict --workers``'s
    pace (the decline per extra worker, and the CPUs' share beyond ``cpu_count``).
    """
    t_if = ingestion_free.per_sample_s
    # The loader's time per sample and worker: at least its CPU time, and at least what the
    # cached run showed when the loop waited on it (W workers delivered one sample per t_cached).
    t_prep = max(prep_cpu_s_per_sample or 0.0, cached.per_sample_s * max(workers, 1))
    if t_prep <= t_if * max(workers, 1) and prep_cpu_s_per_sample:
        t_prep = prep_cpu_s_per_sample  # GPU-bound: the cached pace says nothing of the loader
    out: dict[str, Any] = {
        "model": "per sample: max(compute time, loader time per worker / workers); each "
        "worker's CPU time grows with the workers beside it (as predict --workers) and with "
        "more workers than CPUs; each file's fetch adds latency + size / bandwidth"
    }
    # Under the storage the breakdown measured (cold when there is a cold run), as the current
    # throughput the recommendations compare with: each worker also waits on its reads.
    t_fetch = 0.0
    if cold is not None:
        t_fetch = max(0.0, cold.per_sample_s - cached.per_sample_s) * max(workers, 1)
    worker_pred = {}
    for w in sorted({1, 2, 4, 8, 16, 32, workers, cpu_count}):
        if w < 1 or w > max(cpu_count, workers):
            continue
        t_prep_at_w = t_prep / worker_decline_ratio(max(workers, 1), w, cpu_count)
        worker_pred[str(w)] = 1.0 / max(t_if, (t_prep_at_w + t_fetch) / w)
    out["workers"] = worker_pred
    if cold is not None:
        cache_pred = {}
        for pct in (0, 25, 50, 75, 90, 100):
            f = pct / 100.0
            cache_pred[str(pct)] = 1.0 / (f * cached.per_sample_s + (1 - f) * cold.per_sample_s)
        out["page_cache_pct"] = cache_pred
    if mean_file_bytes:
        storage_pred = {}
        for name, latency_s, bw in STORAGE_PROFILES:
            t_fetch = latency_s + mean_file_bytes / bw
            storage_pred[name] = 1.0 / max(t_if, (t_prep + t_fetch) / max(workers, 1))
        out["storage"] = storage_pred
    return out


# name, per-file latency (s), bandwidth (bytes/s) per reader: typical published figures.
STORAGE_PROFILES = (
    ("local_nvme", 100e-6, 2.0e9),
    ("cloud_ssd_volume", 1e-3, 250e6),
    ("cloud_hdd_volume", 8e-3, 60e6),
    ("network_file_system", 2e-3, 100e6),
    ("object_store", 30e-3, 50e6),
)


def recommend(
    shares: dict[str, float | None], predictions: dict[str, Any], current: float, workers: int
) -> list[dict[str, Any]]:
    """Actions ranked by predicted gain (percent over the current throughput)."""
    recs = []
    by_workers = predictions.get("workers", {})
    best_w = max(by_workers.items(), key=lambda kv: kv[1], default=None)
    if best_w and int(best_w[0]) > workers and best_w[1] > current * 1.02:
        recs.append(
            {
                "action": f"use {best_w[0]} data-loader workers (now {workers})",
                "predicted_samples_per_s": best_w[1],
            }
        )
    cache = predictions.get("page_cache_pct", {})
    if cache and (shares.get("fetch_stall") or 0) > 2:
        recs.append(
            {
                # the prediction is the cached run's measured pace: it says nothing of NVMe
                "action": "keep the whole dataset in the page cache (more RAM), as in the "
                "cached run",
                "predicted_samples_per_s": cache["100"],
            }
        )

    def without(component: str) -> float:
        """Throughput once ``component`` is gone: shares are of the whole time per sample."""
        share = min(shares.get(component) or 0.0, 99.0)
        return current * 100.0 / (100.0 - share)

    if (shares.get("prep_stall") or 0) > 5:
        recs.append(
            {
                "action": "decode and augment on the GPU (e.g. NVIDIA DALI), or pre-process the "
                "dataset offline: removes the prep stall",
                "predicted_samples_per_s": without("prep_stall"),
            }
        )
    if (shares.get("interconnect_stall") or 0) > 5:
        recs.append(
            {
                "action": "hide more of the gradient all-reduce: a larger per-GPU batch or "
                "gradient accumulation, larger DDP buckets (--ddp-bucket-mb), or bf16 "
                "gradients; at best removes the interconnect stall",
                "predicted_samples_per_s": without("interconnect_stall"),
            }
        )
    if (shares.get("network_stall") or 0) > 5:
        recs.append(
            {
                "action": "keep the GPUs that exchange gradients on NVLink/P2P (one host), or "
                "use RDMA networking between hosts: removes the network stall",
                "predicted_samples_per_s": without("network_stall"),
            }
        )
    for r in recs:
        r["predicted_gain_pct"] = 100.0 * (r["predicted_samples_per_s"] / current - 1.0)
    recs.sort(key=lambda r: r["predicted_gain_pct"], reverse=True)
    return recs


def breakdown_of(measured: dict[str, Measured | None]):
    return breakdown(
        measured["ingestion_free"],
        measured["cached"],
        measured.get("cold"),  # type: ignore[arg-type]
        measured.get("multi_gpu"),
        measured.get("multi_gpu_socket"),
        measured.get(PAIRED_KIND),
    )


def cold_from_paired(cached: Measured, fetch: Measured) -> Measured:
    """The cold time per sample that a paired run implies: cached plus the fetch stall (none
    when the cold batches came out faster, which is noise, as the breakdown takes it)."""
    return Measured(
        cached.per_sample_s + max(0.0, fetch.per_sample_s),
        math.hypot(cached.half_width_s, fetch.half_width_s),
    )

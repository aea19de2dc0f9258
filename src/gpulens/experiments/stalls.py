"""Stall breakdown by differential runs (DS-Analyzer's method, VLDB 2021).

Three single-GPU runs of the same training give the time per sample with
- no ingestion (synthetic batches already on the device): compute only;
- data fully in the page cache: compute + CPU prep (decode, augment, collate);
- cold data (evicted from the page cache, or behind emulated slow storage): + fetch from storage.
Their differences are the prep stall and the fetch stall.

When the cached run waits on its loader (the usual case for image training), the fetch stall
comes from one paired cold run instead of a separate cold run (:mod:`gpulens.workloads.paired`):
the loader workers alternate, batch by batch, between the cached half of the files and the
evicted half, and each cold batch is compared with the same worker's cached batches just before
and after it. Separate cached and cold runs on a VM differ by 10% or more from the CPU's speed
alone; neighbours a second apart do not. The workers' extra time per sample, shared by ``W``
workers, is what the cold data adds to the loader's (and so the loop's) time per sample.

With ``gpus`` N > 1, two more runs without ingestion, each process with the same per-GPU batch:
- N GPUs with real DDP (gradient all-reduce overlapped with the backward pass, as DDP does by
  default; Stash switched the overlap off): its excess time per step over the 1-GPU run is the
  interconnect stall;
- the same with NCCL forced onto its socket transport (no P2P/NVLink, no shared memory): its
  excess over the P2P run is the network stall, the closest one host gets to a network.
As in Stash, the components are taken to add up: the shares are of the time per step of a cold
N-GPU run, ``t_cold + (t_N - t_1) + (t_socket - t_N)``, per GPU.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from gpulens.errors import UsageError
from gpulens.stats import bounded_interval, rate_ci95
from gpulens.workloads.affinity import WORKER_AFFINITIES
from gpulens.workloads.bad_samples import SKIPPED_FILES_SHOWN
from gpulens.workloads.prep_timing import STARVED_DATA_WAIT_FRACTION
from gpulens.workloads.train import LOADER_PREFETCH, TrainConfig, TrainResult, run_training

log = logging.getLogger(__name__)

COMPONENTS = ("compute", "prep_stall", "fetch_stall", "interconnect_stall", "network_stall")
MAX_REPEATS = 8  # runs of one kind (cached, cold) pooled at most
Z95 = 1.96  # two-sided 95% normal quantile
COST_MARGIN = 1.1  # a repeat may run longer than the slowest one so far
RUN_KINDS = ("ingestion_free", "cached", "cold", "multi_gpu", "multi_gpu_socket")
# How the fetch stall is measured: "paired" (one run alternating evicted and cached files),
# "separate" (a cold run beside the cached one) or "auto" (paired when the cached run waits on
# its loader, see LOADER_BOUND_DATA_WAIT).
FETCH_DESIGNS = ("auto", "paired", "separate")


@dataclass
class StallsConfig:
    """What ``gpulens stalls`` was asked for."""

    workload: str
    data: str
    gpus: int = 1
    batch_size: int | None = None
    workers: int | None = None
    device: str | None = None
    precision: str = "fp32"
    # Target 95% CI half-width of every share, in percentage points.
    until_ci_pct: float = 3.0
    max_duration_s: float = 60.0
    # Repeat the cached run or the cold pass (evicting again) while a share misses the CI
    # target and one more run still fits in this many seconds of the whole breakdown.
    time_budget_s: float = 300.0
    storage_latency_s: float = 0.0
    storage_bandwidth_bytes_per_s: float | None = None
    # Loader workers where the scheduler puts them ("os") or one per physical core ("cores").
    worker_affinity: str = "os"
    fetch_design: str = "auto"  # one of FETCH_DESIGNS
    # Images that cannot be decoded: stop (False) or put the next readable one in their place.
    skip_bad_samples: bool = False

    def __post_init__(self) -> None:
        if self.data == "synthetic":
            raise UsageError(
                "the stall breakdown needs an on-disk dataset: give --data PATH "
                "(make one with `gpulens data make images --out PATH --n 20000`)"
            )
        if not Path(self.data).expanduser().exists():
            raise UsageError(
                f"dataset path {self.data} does not exist: make one with "
                f"`gpulens data make images --out {self.data} --n 20000`"
            )
        if self.gpus < 1:
            raise UsageError(f"--gpus must be 1 or more, got {self.gpus}")
        if not 0 < self.until_ci_pct < 100:
            raise UsageError(f"--until-ci must be in (0, 100) points, got {self.until_ci_pct}")
        if self.max_duration_s <= 0:
            raise UsageError(f"--max-duration must be positive, got {self.max_duration_s}")
        if self.worker_affinity not in WORKER_AFFINITIES:
            raise UsageError(
                f"unknown worker affinity '{self.worker_affinity}': use one of "
                f"{', '.join(WORKER_AFFINITIES)}"
            )
        if self.time_budget_s <= 0:
            raise UsageError(f"--time-budget must be positive seconds, got {self.time_budget_s}")
        if self.fetch_design not in FETCH_DESIGNS:
            raise UsageError(
                f"unknown fetch design '{self.fetch_design}': use one of {', '.join(FETCH_DESIGNS)}"
            )

    @property
    def emulated_storage(self) -> bool:
        return self.storage_latency_s > 0 or self.storage_bandwidth_bytes_per_s is not None


@dataclass
class StallResult:
    """The breakdown and everything it rests on; ``as_dict()`` is the JSON contract."""

    workload: str
    device: str
    runs: dict[str, str | None] = field(default_factory=dict)
    # Every run of each kind; repeats of a kind (to narrow its interval) are pooled.
    all_runs: dict[str, list[str]] = field(default_factory=dict)
    throughput: dict[str, float | None] = field(default_factory=dict)
    throughput_ci95_pct: dict[str, float | None] = field(default_factory=dict)
    breakdown_pct: dict[str, float | None] = field(default_factory=dict)
    breakdown_ci95_pp: dict[str, float | None] = field(default_factory=dict)
    single_run_estimate_pct: dict[str, Any] | None = None
    what_if: dict[str, Any] = field(default_factory=dict)
    recommendations: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    fetch_method: str | None = None
    # The paired cold runs behind the fetch stall, when it came from them.
    fetch_paired: dict[str, Any] | None = None
    # "paired" or "separate": how the fetch stall was measured (None: it was not).
    fetch_design: str | None = None
    # Bad samples skipped over all runs (skip_bad_samples; None when off).
    skipped_samples: int | None = None
    skipped_files: list[str] | None = None
    wall_s: float | None = None  # the whole breakdown, every run and the cache handling

    def as_dict(self) -> dict[str, Any]:
        """The JSON contract. Beside each symmetric half-width, a ``[low, high]`` interval that
        respects the quantity's range: throughputs on the log scale (always positive),
        shares within [0, 100]."""
        return {
            "workload": self.workload,
            "device": self.device,
            "runs": self.runs,
            "all_runs": self.all_runs,
            "throughput_samples_per_s": self.throughput,
            "throughput_ci95_pct": self.throughput_ci95_pct,
            "throughput_ci95_samples_per_s": {
                k: rate_ci95(v, self.throughput_ci95_pct.get(k)) for k, v in self.throughput.items()
            },
            "breakdown_pct": self.breakdown_pct,
            "breakdown_ci95_pp": self.breakdown_ci95_pp,
            "breakdown_ci95_range_pct": {
                k: bounded_interval(v, self.breakdown_ci95_pp.get(k))
                for k, v in self.breakdown_pct.items()
            },
            "fetch_method": self.fetch_method,
            "fetch_design": self.fetch_design,
            "fetch_paired": self.fetch_paired,
            "single_run_estimate_pct": self.single_run_estimate_pct,
            "what_if": self.what_if,
            "recommendations": self.recommendations,
            "notes": self.notes,
            "skipped_samples": self.skipped_samples,
            "skipped_files": self.skipped_files,
            "wall_s": self.wall_s,
        }


PAIRED_KIND = "paired_cold"
# The one bar for "loader-bound" in the stall breakdown: the training loop waits on its loader
# at least this share of its time (the bar at which the prep summary calls the loader the
# bottleneck). The loader then sets the pace, and what slows the workers slows the loop by as
# much: the premise of the paired design (judged on the cached run) and of the fetch stall as
# the workers' read timers see it (judged on the cold or paired runs). Below it, the GPU's
# pace could absorb part of a slower loader, which only a separate cold run shows.
LOADER_BOUND_DATA_WAIT = STARVED_DATA_WAIT_FRACTION


@dataclass(frozen=True)
class _Measured:
    per_sample_s: float
    half_width_s: float  # 95% CI half-width of per_sample_s
    between_runs_pct: float = 0.0  # pooled runs: their spread beyond their own errors (SD, %)


def _measured(result: TrainResult | None) -> _Measured | None:
    """Time per sample and GPU, with its CI half-width."""
    if result is None:
        return None
    tput = result.summary.get("throughput_samples_per_s")
    if not tput:
        return None
    ci_pct = result.summary.get("throughput_ci95_pct")
    t = max(1, result.summary.get("processes") or 1) / tput
    # A relative CI on the rate is (to first order) the same relative CI on its inverse.
    return _Measured(t, t * (ci_pct if ci_pct is not None else math.inf) / 100.0)


def pooled(passes: list[TrainResult]) -> _Measured | None:
    """Several runs of the same thing as one: time per sample weighted by the samples each run
    measured. Its interval combines the runs' own errors and, when the runs disagree by more
    than those allow, the spread between runs (DerSimonian-Laird random effects): on a VM, one
    cold pass can read at another speed than the next, and a run's own interval cannot see
    that."""
    parts = [(m, r.summary.get("throughput_samples_per_s") * r.summary.get("measured_wall_s"))
             for r in passes if (m := _measured(r)) is not None]  # fmt: skip
    if not parts:
        return None
    t, var, tau2 = _pool(
        [m.per_sample_s for m, _ in parts],
        [(m.half_width_s / Z95) ** 2 for m, _ in parts],
        [samples for _, samples in parts],
    )
    return _Measured(t, Z95 * math.sqrt(var), 100.0 * math.sqrt(tau2) / t)


def pooled_paired(runs: list[TrainResult]) -> _Measured | None:
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
    t, var, tau2 = _pool(
        [f["extra_s_per_sample"] / w for f, w in parts],
        [(f["extra_ci95_s"] / w / Z95) ** 2 for f, w in parts],
        [f["cold_samples"] for f, _ in parts],
    )
    return _Measured(t, Z95 * math.sqrt(var), 100.0 * math.sqrt(tau2) / t if t > 0 else 0.0)


def _measure(kind: str, runs: list[TrainResult]) -> _Measured | None:
    return pooled_paired(runs) if kind == PAIRED_KIND else pooled(runs)


def _measure_all(repeats: dict[str, list[TrainResult]]) -> dict[str, _Measured | None]:
    return {kind: _measure(kind, runs) for kind, runs in repeats.items()}


def _pool(
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
    ingestion_free: _Measured,
    cached: _Measured,
    cold: _Measured | None,
    multi_gpu: _Measured | None = None,
    multi_gpu_socket: _Measured | None = None,
    fetch: _Measured | None = None,
) -> tuple[dict[str, float | None], dict[str, float | None]]:
    """Shares (percent) of the total time per sample and GPU, and their 95% CI half-widths in
    percentage points (first-order propagation of the runs' own intervals, taken as
    independent). ``fetch``, the fetch stall per sample measured directly (a paired cold run),
    stands for ``cold - cached`` when given.

    All times are per sample and per GPU (an N-GPU run's is N / its total throughput). The
    total is the compute time plus every stall, which, when no run is faster than the one it
    is compared with, is the slowest data run (cold, else cached) plus the interconnect and
    network excesses."""
    runs = {"free": ingestion_free, "cached": cached, "cold": cold, "multi": multi_gpu,
            "socket": multi_gpu_socket, "fetch": fetch}  # fmt: skip
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
    ingestion_free: _Measured,
    cached: _Measured,
    cold: _Measured | None,
    workers: int,
    cpu_count: int,
    mean_file_bytes: float | None,
    prep_cpu_s_per_sample: float | None,
) -> dict[str, Any]:
    """Predicted throughput (samples/s) for other workers (with the storage as measured: cold
    when there is a cold run), cache sizes and storage.

    The model: the GPU needs ``t_if`` per sample; ``W`` loader processes each need ``t_prep``
    of CPU (and ``t_fetch`` waiting on storage) per sample; the slower side sets the pace.
    """
    t_if = ingestion_free.per_sample_s
    # The loader's time per sample and worker: at least its CPU time, and at least what the
    # cached run showed when the loop waited on it (W workers delivered one sample per t_cached).
    t_prep = max(prep_cpu_s_per_sample or 0.0, cached.per_sample_s * max(workers, 1))
    if t_prep <= t_if * max(workers, 1) and prep_cpu_s_per_sample:
        t_prep = prep_cpu_s_per_sample  # GPU-bound: the cached pace says nothing of the loader
    out: dict[str, Any] = {
        "model": "per sample: max(compute time, loader time per worker / workers); workers "
        "scale linearly up to the CPU count, each file's fetch adds latency + size / bandwidth"
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
        worker_pred[str(w)] = 1.0 / max(t_if, (t_prep + t_fetch) / w)
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
                "action": "keep the dataset in the page cache (more RAM) or on local NVMe",
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


ProgressFn = Callable[[str], None]


def warm_page_cache(files: list[Path], notes: list[str]) -> None:
    """Read the dataset into the page cache; a note when RAM cannot hold it."""
    from gpulens.workloads import pagecache

    pagecache.warm(files)
    resident = pagecache.resident_fraction(files)
    if resident is not None and resident < 0.95:
        notes.append(
            f"only {100 * resident:.0f}% of the dataset stayed in the page cache (RAM too small "
            "for it): the 'cached' run includes some storage reads"
        )


def _effective_config(result: TrainResult) -> dict[str, Any]:
    import json

    try:
        run = json.loads((result.record_dir / "run.json").read_text())
    except (OSError, ValueError):
        return {}
    return run.get("effective_config") or {}


def _effective_transport(result: TrainResult) -> list[str] | None:
    return _effective_config(result).get("transport_effective")


def _describe_transport(result: TrainResult) -> str:
    got = _effective_transport(result)
    return "NCCL reported " + ", ".join(got) if got else "transport not reported"


def _breakdown_of(measured: dict[str, _Measured | None]):
    return breakdown(
        measured["ingestion_free"], measured["cached"], measured.get("cold"),  # type: ignore[arg-type]
        measured.get("multi_gpu"), measured.get("multi_gpu_socket"), measured.get(PAIRED_KIND),
    )  # fmt: skip


def _cold_from_paired(cached: _Measured, fetch: _Measured) -> _Measured:
    """The cold time per sample that a paired run implies: cached plus the fetch stall (none
    when the cold batches came out faster, which is noise, as the breakdown takes it)."""
    return _Measured(
        cached.per_sample_s + max(0.0, fetch.per_sample_s),
        math.hypot(cached.half_width_s, fetch.half_width_s),
    )


def _wait_pct(run: TrainResult) -> float:
    phases = run.summary.get("phases_s") or {}
    step, wait = phases.get("step"), phases.get("data_wait")
    return 100.0 * wait / step if step and wait is not None else 0.0


def is_loader_bound(run: TrainResult) -> bool:
    """The run waited on its loader at least ``LOADER_BOUND_DATA_WAIT`` of its time."""
    return _wait_pct(run) >= 100.0 * LOADER_BOUND_DATA_WAIT


def read_stall_from_paired(
    runs: list[TrainResult], workers: int, cold_s_per_sample: float
) -> dict[str, Any] | None:
    """``read_stall_from_timers`` from paired cold runs: only the read part of the workers'
    extra time per cold sample (no slower decoding after a wait), as a share of the cold time
    per sample; None (with the read times) unless every paired run was loader-bound."""
    parts = [r.summary["paired_fetch"] for r in runs if r.summary.get("paired_fetch")]
    if not parts or workers < 1 or cold_s_per_sample <= 0:
        return None
    mean, var, _ = _pool(
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
        "cpu_oversubscribed": workers + 1 > (os.cpu_count() or 1),
    }


def _read_time(run: TrainResult) -> tuple[float, float, int] | None:
    """Mean read time per sample in a run's loader workers over its measured window, the
    variance of that mean (batch means over 10 blocks in time order) and the sample count."""
    from gpulens.workloads.prep_timing import read_prep

    s = run.summary
    df = read_prep(run.record_dir, s.get("measured_start_unix_s"), s.get("measured_end_unix_s"))
    read_s = df[df["collate_s"].isna()].sort_values("time_unix_s")["read_s"].dropna().to_numpy()
    if read_s.size < 20:
        return None
    blocks = [b.mean() for b in np.array_split(read_s, 10)]
    return float(read_s.mean()), float(np.var(blocks, ddof=1) / len(blocks)), int(read_s.size)


def _pooled_read(runs: list[TrainResult]) -> tuple[float, float] | None:
    """Sample-weighted mean read time per sample over runs and the variance of that mean
    (with the spread between runs where they disagree)."""
    parts = [r for r in (_read_time(run) for run in runs) if r is not None]
    if not parts:
        return None
    mean, var, _ = _pool([m for m, _, _ in parts], [v for _, v, _ in parts], [k for *_, k in parts])
    return mean, var


def read_stall_from_timers(
    cached_runs: list[TrainResult],
    cold_runs: list[TrainResult],
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
        "cpu_oversubscribed": workers + 1 > (os.cpu_count() or 1),
    }


def _widest(measured: dict[str, _Measured | None]) -> float:
    _, cis = _breakdown_of(measured)
    return max((v for v in cis.values() if v is not None), default=0.0)


def _best_repeat(
    measured: dict[str, _Measured | None],
    counts: dict[str, int],
    kinds: list[str],
    cost_s: dict[str, float],
) -> tuple[str | None, dict[str, _Measured | None]]:
    """The kind whose next run narrows the widest share most per second, and the intervals
    expected after it (``measured`` unchanged when none helps)."""
    worst = _widest(measured)
    best, best_rate, after = None, 0.0, measured
    for kind in kinds:
        m, n = measured.get(kind), counts.get(kind, 0)
        if m is None or n == 0:
            continue
        # One more run like the others shrinks the pooled interval by sqrt(n / (n + 1)).
        narrower = {
            **measured,
            kind: replace(m, half_width_s=m.half_width_s * math.sqrt(n / (n + 1))),
        }
        rate = (worst - _widest(narrower)) / cost_s[kind]
        if rate > best_rate:
            best, best_rate, after = kind, rate, narrower
    return best, after


def _time_to_target(
    measured: dict[str, _Measured | None],
    counts: dict[str, int],
    kinds: list[str],
    cost_s: dict[str, float],
    target_pp: float,
    limit: int = 32,
) -> float | None:
    """Seconds of further runs that would bring every share within ``target_pp``, if the runs
    to come scatter like those so far; None when ``limit`` more runs would not."""
    counts, total_s = dict(counts), 0.0
    for _ in range(limit):
        if _widest(measured) <= target_pp:
            return total_s
        open_kinds = [k for k in kinds if counts.get(k, 0) < MAX_REPEATS]
        kind, measured = _best_repeat(measured, counts, open_kinds, cost_s)
        if kind is None:
            return None
        counts[kind] += 1
        total_s += cost_s[kind]
    return total_s if _widest(measured) <= target_pp else None


def _refine(
    config: StallsConfig,
    repeats: dict[str, list[TrainResult]],
    rerun: dict[str, Callable[[], TrainResult | None]],
    cost_s: dict[str, float],
    t0: float,
    say: Callable[[str], None],
    notes: list[str],
) -> None:
    """While a share's 95% interval is wider than the target, repeat the run (cached, a cold
    pass or a paired cold run) that narrows the widest share most per second, if it fits in
    the time budget; repeats of a kind are pooled. ``rerun[kind]`` returns None when it
    cannot repeat. ``cost_s[kind]`` is the slowest run of that kind so far (updated here)."""
    import time

    while True:
        measured = _measure_all(repeats)
        worst = _widest(measured)
        if worst <= config.until_ci_pct:
            return
        elapsed_s = time.perf_counter() - t0
        counts = {k: len(v) for k, v in repeats.items()}
        fits = [
            kind for kind in rerun
            if counts.get(kind, 0) < MAX_REPEATS
            and elapsed_s + COST_MARGIN * cost_s[kind] <= config.time_budget_s
        ]  # fmt: skip
        best, _ = _best_repeat(measured, counts, fits, cost_s)
        if best is None:
            more_s = _time_to_target(measured, counts, list(rerun), cost_s, config.until_ci_pct)
            need = (
                f"; about {more_s:.0f} s more of runs would reach it "
                f"(--time-budget {config.time_budget_s + more_s:.0f})"
                if more_s is not None
                else f"; even {MAX_REPEATS} runs of each would likely not reach it"
            )
            notes.append(
                f"the widest share's 95% interval is ±{worst:.1f} points, short of "
                f"±{config.until_ci_pct:g}: no further repeat of the cached run or the cold one "
                f"fits in the {config.time_budget_s:.0f} s budget (--time-budget) or under the "
                f"limit of {MAX_REPEATS} runs of each{need}"
            )
            return
        say(f"widest interval ±{worst:.1f} points: repeating the {best} run")
        t_run0 = time.perf_counter()
        again = rerun[best]()
        if again is None:
            del rerun[best]
            continue
        repeats[best].append(again)
        cost_s[best] = max(cost_s[best], time.perf_counter() - t_run0)


def _paired_summary(
    runs: list[TrainResult], cached: _Measured, fetch: _Measured, workers: int
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


def run_stalls(
    config: StallsConfig,
    runs_root: Path,
    progress: ProgressFn | None = None,
    on_step: Callable[[int, int | None, float, dict[str, Any]], None] | None = None,
) -> StallResult:
    """Make the runs the breakdown needs (all stored) and compute it. ``progress`` hears each
    phase, ``on_step`` each run's steps (as ``run_training``'s progress)."""
    import os
    import time

    from gpulens.experiments.paired_fetch import paired_fetch
    from gpulens.workloads.datasets import dataset_files, describe_dataset
    from gpulens.workloads.prep_timing import summarize_prep

    say = progress or (lambda _msg: None)
    t0 = time.perf_counter()
    preflight(config)
    files = dataset_files(config.data)
    info = describe_dataset(config.data)
    n_files = len(files)
    common = dict(
        workload=config.workload, batch_size=config.batch_size, device=config.device,
        precision=config.precision, workers=config.workers,
        worker_affinity=config.worker_affinity, skip_bad_samples=config.skip_bad_samples,
    )  # fmt: skip
    result = StallResult(workload=config.workload, device=config.device or "")

    def train(kind: str, **kw) -> TrainResult:
        say(f"{kind} run")
        cfg = TrainConfig(name=f"stalls-{config.workload}-{kind}", **{**common, **kw})
        r = run_training(cfg, runs_root, progress=on_step, kind="stalls")
        result.runs[kind] = r.run_id
        if kind in RUN_KINDS:
            result.throughput[kind] = r.summary["throughput_samples_per_s"]
            result.throughput_ci95_pct[kind] = r.summary["throughput_ci95_pct"]
        return r

    # A share's interval combines two runs' intervals (a stall is a difference of two runs);
    # runs known to within target/sqrt(2) percent keep it near the target in points.
    run_ci_pct = config.until_ci_pct / math.sqrt(2)
    budget = dict(until_ci_pct=run_ci_pct, duration_s=config.max_duration_s)
    free = train("ingestion_free", data="synthetic", **budget)
    result.device = free.summary["device"]
    batch = free.summary["batch_size"]

    from gpulens.workloads import pagecache

    cost_s: dict[str, float] = {}
    t_run0 = time.perf_counter()
    say("warming the page cache")
    warm_page_cache(files, result.notes)
    cached = train("cached", data=config.data, prep_timing=True, **budget)
    cost_s["cached"] = time.perf_counter() - t_run0
    workers = cached.summary.get("workers") or 0
    repeats: dict[str, list[TrainResult]] = {"ingestion_free": [free], "cached": [cached]}

    def again_cached() -> TrainResult:
        warm_page_cache(files, [])  # a cold pass may have left part of it out
        return train("cached", data=config.data, prep_timing=True, **budget)

    rerun: dict[str, Callable[[], TrainResult | None]] = {"cached": again_cached}
    cold: TrainResult | None = None
    warmup = 2 * max(workers, 1) * LOADER_PREFETCH
    first_touch_steps = n_files // batch - warmup - max(workers, 1) * LOADER_PREFETCH - 1
    left_cached_pct: list[float] = []

    def cold_pass() -> TrainResult | None:
        say("evicting the dataset from the page cache")
        evicted = pagecache.evict(files)
        if evicted.method is None:
            result.notes.append(
                f"fetch stall not measured: {evicted.note}"
                if not left_cached_pct
                else f"no further cold pass: the eviction failed: {evicted.note}"
            )
            return None
        result.fetch_method = evicted.method
        left_cached_pct.append(100 * (evicted.resident_after or 0))
        return train(
            "cold", data=config.data, steps=min(first_touch_steps, 10_000), warmup_steps=warmup,
            prep_timing=True,
        )  # fmt: skip

    def paired_pass() -> TrainResult | None:
        """A paired cold run (cold half evicted or emulated, the other half cached), analysed."""
        if config.emulated_storage:
            result.fetch_method = "emulated_storage"
        else:
            say("evicting half of the dataset from the page cache")
            evicted = pagecache.evict(cold_files)
            if evicted.method is None:
                result.notes.append(f"no paired cold run: {evicted.note}")
                return None
            result.fetch_method = evicted.method
            left_cached_pct.append(100 * (evicted.resident_after or 0))
        say("warming the other half")
        pagecache.warm(cached_files)
        run = train(
            PAIRED_KIND, data=config.data, paired_cold_block=batch, prep_timing=True,
            duration_s=config.max_duration_s, warmup_steps=warmup,
            storage_latency_s=config.storage_latency_s,
            storage_bandwidth_bytes_per_s=config.storage_bandwidth_bytes_per_s,
        )  # fmt: skip
        s = run.summary
        eff = _effective_config(run)
        run.summary["paired_fetch"] = paired_fetch(
            run.record_dir, eff.get("paired_cold_samples") or n_files, eff.get("seed", 0),
            s.get("measured_start_unix_s"), s.get("measured_end_unix_s"),
        )  # fmt: skip
        if run.summary["paired_fetch"] is None:
            result.notes.append(
                f"the paired cold run {run.run_id} compared no cold batch with its neighbours "
                "(too short): fetch stall not measured"
            )
            return None
        return run

    paired: TrainResult | None = None
    t_run0 = time.perf_counter()
    design = choose_fetch_design(config.fetch_design, info.get("kind"), workers, cached)
    if design == "paired":
        from gpulens.workloads.paired import split_files

        if not is_loader_bound(cached):
            result.notes.append(
                f"paired cold run as asked (fetch design 'paired'), though the cached run waited "
                f"on its loader only {_wait_pct(cached):.0f}% of the time (the design assumes "
                f"at least {100 * LOADER_BOUND_DATA_WAIT:.0f}%): where the GPU sets the pace, "
                "part of a slower loader is hidden and the fetch stall may be overstated"
            )
        cold_files, cached_files = split_files(config.data, seed=0)
        paired = paired_pass()
    elif info.get("kind") == "image_folder" and config.fetch_design == "separate":
        result.notes.append(
            "fetch stall from a separate cold run, as asked (fetch design 'separate')"
        )
    elif info.get("kind") == "image_folder":
        result.notes.append(
            "fetch stall from a separate cold run: the cached run waited on its loader only "
            f"{_wait_pct(cached):.0f}% of the time; the paired cold run needs a loop that waits "
            f"on its loader (at least {100 * LOADER_BOUND_DATA_WAIT:.0f}%)"
        )
    if paired is not None:
        repeats[PAIRED_KIND] = [paired]
        rerun[PAIRED_KIND] = paired_pass
        cost_s[PAIRED_KIND] = time.perf_counter() - t_run0
        half = "emulated-slow" if config.emulated_storage else "evicted"
        result.notes.append(
            f"fetch stall from a paired cold run: the loader workers alternate batch by batch "
            f"between the {half} half of the files and the cached half; each cold batch's "
            "extra time per sample over the same worker's cached batches just before and "
            f"after it, shared by {workers} workers, adds to the cached time per sample (the "
            "cold throughput shown is that sum)"
        )
    elif config.emulated_storage:
        result.fetch_method = "emulated_storage"
        rerun["cold"] = lambda: train(
            "cold", data=config.data, storage_latency_s=config.storage_latency_s,
            storage_bandwidth_bytes_per_s=config.storage_bandwidth_bytes_per_s, prep_timing=True,
            **budget,
        )  # fmt: skip
        cold = rerun["cold"]()
    elif first_touch_steps < 10:
        result.notes.append(
            f"fetch stall not measured: the dataset ({n_files} files) is too small for a cold "
            f"run of at least 10 steps of {batch} samples that reads every file once; make a "
            f"larger one (at least {(warmup + 10 + 2 * max(workers, 1) * 2) * batch} files)"
        )
    else:
        cold = cold_pass()
        if cold is not None:
            rerun["cold"] = cold_pass
    if cold is not None:
        repeats["cold"] = [cold]
        cost_s["cold"] = time.perf_counter() - t_run0
    multi = multi_socket = None
    if config.gpus > 1:
        multi_common = dict(
            data="synthetic", gpus=config.gpus, count_flops=False,
            device="cpu" if (config.device or "").startswith("cpu") else None, **budget,
        )  # fmt: skip
        multi = train("multi_gpu", **multi_common)
        if multi_common["device"] == "cpu":
            result.notes.append(
                f"interconnect: {config.gpus} CPU processes over gloo vs 1; network stall not "
                "measured: CPU processes already talk over TCP (gloo), there is no faster "
                "path to compare with"
            )
        else:
            multi_socket = train("multi_gpu_socket", nccl_transport="socket", **multi_common)
            got = _effective_transport(multi_socket)
            if got and "NET/Socket" not in got:
                result.notes.append(
                    f"the socket run's NCCL reported {', '.join(got)}, not NET/Socket: its "
                    "network stall is not a socket measurement"
                )
            result.notes.append(
                f"interconnect: {config.gpus} GPUs with DDP ({_describe_transport(multi)}) vs "
                f"1, same per-GPU batch; network: NCCL on sockets "
                f"({_describe_transport(multi_socket)}) over the loopback of one host, faster "
                "than a real network between hosts"
            )
    for kind in ("cold", "multi_gpu", "multi_gpu_socket"):
        result.runs.setdefault(kind, None)
        result.throughput.setdefault(kind, None)
        result.throughput_ci95_pct.setdefault(kind, None)
    if config.gpus == 1:
        result.notes.append(
            "interconnect and network stalls not measured: give --gpus N (2 or more) to run "
            "N GPUs with DDP, with and without NCCL's peer-to-peer transport"
        )

    if multi is not None:
        repeats["multi_gpu"] = [multi]
    if multi_socket is not None:
        repeats["multi_gpu_socket"] = [multi_socket]
    _refine(config, repeats, rerun, cost_s, t0, say, result.notes)
    measured = _measure_all(repeats)
    for kind, runs in repeats.items():
        result.all_runs[kind] = [r.run_id for r in runs]
        m = measured[kind]
        if len(runs) > 1 and m is not None and kind in RUN_KINDS:
            result.throughput[kind] = 1.0 / m.per_sample_s
            result.throughput_ci95_pct[kind] = 100.0 * m.half_width_s / m.per_sample_s
            rates = ", ".join(f"{r.summary['throughput_samples_per_s']:.0f}" for r in runs)
            spread = (
                f"; they differ by more than their own intervals allow, so the interval includes "
                f"the spread between runs (±{m.between_runs_pct:.1f}% SD)"
                if m.between_runs_pct > 0
                else ""
            )
            result.notes.append(
                f"{kind}: {len(runs)} runs pooled ({rates} samples/s; all_runs){spread}"
            )
    if left_cached_pct:
        what, once = (
            ("paired cold run", "the evicted half")
            if PAIRED_KIND in repeats
            else ("cold run", "the data")
        )
        result.notes.append(
            f"{what}: {result.fetch_method} left at most {max(left_cached_pct):.1f}% of {once} "
            "cached; each of its files read once per run"
        )
    result.breakdown_pct, result.breakdown_ci95_pp = _breakdown_of(measured)
    m_free, m_cached, m_cold = measured["ingestion_free"], measured["cached"], measured.get("cold")
    m_fetch = measured.get(PAIRED_KIND)
    if m_fetch is not None and m_cached is not None:
        m_cold = _cold_from_paired(m_cached, m_fetch)
        result.throughput["cold"] = 1.0 / m_cold.per_sample_s
        result.throughput_ci95_pct["cold"] = 100.0 * m_cold.half_width_s / m_cold.per_sample_s
        result.fetch_paired = _paired_summary(repeats[PAIRED_KIND], m_cached, m_fetch, workers)
        if len(repeats[PAIRED_KIND]) > 1:
            result.notes.append(
                f"{PAIRED_KIND}: {len(repeats[PAIRED_KIND])} paired runs pooled"
                + (
                    f"; they differ by more than their own intervals allow (±"
                    f"{m_fetch.between_runs_pct:.1f}% SD between runs, included)"
                    if m_fetch.between_runs_pct > 0
                    else ""
                )
            )

    phases = cached.summary["phases_s"]
    prep = summarize_prep(
        cached.record_dir, cached.summary["throughput_samples_per_s"],
        start_unix_s=cached.summary.get("measured_start_unix_s"),
        end_unix_s=cached.summary.get("measured_end_unix_s"),
        data_wait_fraction=phases["data_wait"] / phases["step"] if phases["step"] else None,
    )  # fmt: skip
    stages = (prep or {}).get("stages") or {}
    result.single_run_estimate_pct = {
        "data_wait": 100.0 * phases["data_wait"] / phases["step"] if phases["step"] else None,
        "prep_stages": {k: v.get("share_pct") for k, v in stages.items()} or None,
        "workers_starved": prep.get("workers_starved") if prep else None,
        "explanation": prep.get("explanation") if prep else None,
        "from_run": cached.run_id,
        "read_stall_from_timers": (
            read_stall_from_timers(repeats["cached"], repeats["cold"], workers, m_cold.per_sample_s)
            if m_cold is not None and "cold" in repeats
            else read_stall_from_paired(repeats[PAIRED_KIND], workers, m_cold.per_sample_s)
            if m_cold is not None and PAIRED_KIND in repeats
            else None
        ),
    }
    current = result.throughput.get("cold") or result.throughput["cached"]
    result.what_if = what_if(
        m_free, m_cached, m_cold, workers, os.cpu_count() or 1,
        info.get("mean_file_bytes"), prep.get("cpu_s_per_sample") if prep else None,
    )  # fmt: skip
    result.recommendations = recommend(result.breakdown_pct, result.what_if, current, workers)
    result.fetch_design = "paired" if PAIRED_KIND in repeats else "separate" if m_cold else None
    if config.skip_bad_samples:
        every = [r for runs in repeats.values() for r in runs]
        result.skipped_samples = sum(r.summary.get("skipped_samples") or 0 for r in every)
        names = (f for r in every for f in (r.summary.get("skipped_files") or []))
        result.skipped_files = list(dict.fromkeys(names))[:SKIPPED_FILES_SHOWN]
    result.wall_s = round(time.perf_counter() - t0, 1)
    return result


def choose_fetch_design(
    asked: str, dataset_kind: str | None, workers: int, cached: TrainResult
) -> str:
    """The fetch design to use, "paired" or "separate": the paired design needs an image
    folder (one file per sample) and loader workers; "auto" takes it when the cached run is
    loader-bound."""
    if dataset_kind != "image_folder" or workers < 1 or asked == "separate":
        return "separate"
    return "paired" if asked == "paired" or is_loader_bound(cached) else "separate"


def preflight(config: StallsConfig) -> dict[str, Any]:
    """Check everything the runs need before the first one starts, so that a bad option fails
    in a second, not after minutes of runs: the workload, the device, precision and batch size
    on it, the GPUs for ``gpus`` > 1, the dataset (readable, holds one batch, fits the model)
    and the fetch design. Returns the effective config a cached run would get."""
    import torch

    from gpulens.workloads.datasets import build_dataset
    from gpulens.workloads.devices import resolve_device
    from gpulens.workloads.models import get_workload
    from gpulens.workloads.train import resolve_config

    spec = get_workload(config.workload)
    device = resolve_device(config.device)
    cfg = TrainConfig(
        workload=config.workload,
        batch_size=config.batch_size,
        device=config.device,
        precision=config.precision,
        workers=config.workers,
        data=config.data,
        worker_affinity=config.worker_affinity,
        prep_timing=True,
        storage_latency_s=config.storage_latency_s,
        storage_bandwidth_bytes_per_s=config.storage_bandwidth_bytes_per_s,
        skip_bad_samples=config.skip_bad_samples,
    )
    eff = resolve_config(cfg, spec, device)
    # The N-GPU runs use cuda:0..N-1 unless --device cpu (CPU processes over gloo).
    if config.gpus > 1 and (config.device or "").strip().lower() != "cpu":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count < config.gpus:
            have = f"has {count}" if count else "has none visible (see `gpulens doctor`)"
            raise UsageError(
                f"--gpus {config.gpus} needs {config.gpus} GPUs and this machine {have}: "
                + (f"use --gpus {count}, or " if count > 1 else "leave out --gpus, or ")
                + f"use --device cpu to run {config.gpus} CPU processes (gloo) instead"
            )
    dataset = build_dataset(spec, config.data, n_synthetic=0)
    if hasattr(dataset, "samples") and not config.skip_bad_samples:
        # Empty files cost one stat each to find; files that are damaged inside are found by
        # the loader, in the cached run.
        for path, _ in dataset.samples:
            try:
                size = os.stat(path).st_size
            except OSError as exc:
                raise UsageError(
                    f"cannot read {path} ({exc.strerror}): fix or remove it, or pass "
                    "--skip-bad-samples"
                ) from None
            if size == 0:
                raise UsageError(
                    f"{path} is empty (0 bytes): remove it, or pass --skip-bad-samples to put "
                    "the next readable image in its place"
                )
    if len(dataset) < eff["batch_size"]:
        raise UsageError(
            f"dataset {config.data} has {len(dataset)} samples, fewer than one batch of "
            f"{eff['batch_size']}: make more data or lower --batch-size"
        )
    if config.fetch_design == "paired":
        from gpulens.workloads.datasets import TokenFileDataset

        if isinstance(dataset, TokenFileDataset):
            raise UsageError(
                "--fetch-design paired needs an image folder (one file per sample): use "
                "--fetch-design separate (or auto) for a token file"
            )
        if eff["workers"] < 1:
            raise UsageError("--fetch-design paired needs loader workers: give --workers 1 or more")
    return eff

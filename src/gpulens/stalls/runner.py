"""Makes the runs a stall breakdown needs (all stored, each with its role) and computes it."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpulens.data.bad_samples import SKIPPED_FILES_SHOWN
from gpulens.errors import UsageError
from gpulens.record.writer import amend_summary
from gpulens.run.result import RunResult, role_name
from gpulens.run.thresholds import LOADER_BOUND_DATA_WAIT
from gpulens.stalls.config import RUN_KINDS, ProgressFn, StallResult, StallsConfig
from gpulens.stalls.model import (
    PAIRED_KIND,
    Measured,
    breakdown_of,
    cold_from_paired,
    measure_all,
    recommend,
    what_if,
)
from gpulens.stalls.read_stall import (
    is_loader_bound,
    read_stall_from_paired,
    read_stall_from_timers,
    wait_pct,
)
from gpulens.stalls.refine import refine
from gpulens.workloads.config import LOADER_PREFETCH, TrainConfig
from gpulens.workloads.train import run_training

log = logging.getLogger(__name__)


def warm_page_cache(files: list[Path], notes: list[str]) -> None:
    """Read the dataset into the page cache; a note when RAM cannot hold it."""
    from gpulens.data import pagecache

    pagecache.warm(files)
    resident = pagecache.resident_fraction(files)
    if resident is not None and resident < 0.95:
        notes.append(
            f"only {100 * resident:.0f}% of the dataset stayed in the page cache (RAM too small "
            "for it): the 'cached' run includes some storage reads"
        )


def _effective_transport(result: RunResult) -> list[str] | None:
    transports = result.effective_config.get("transport_effective")
    return list(transports) if transports else None


def _describe_transport(result: RunResult) -> str:
    got = _effective_transport(result)
    return "NCCL reported " + ", ".join(got) if got else "transport not reported"


def _paired_summary(
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

    from gpulens.data.datasets import dataset_files, describe_dataset
    from gpulens.stalls.paired_fetch import paired_fetch
    from gpulens.stalls.prep_summary import summarize_prep

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

    def train(kind: str, **kw) -> RunResult:
        say(f"{kind} run")
        cfg = TrainConfig(name=f"stalls-{config.workload}-{kind}", **{**common, **kw})
        made = run_training(
            cfg, runs_root, progress=on_step, kind="stalls", role=role_name("stalls", kind)
        )
        r = RunResult.from_record(made.record_dir)  # as stored: what any analysis reads
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

    from gpulens.data import pagecache

    cost_s: dict[str, float] = {}
    t_run0 = time.perf_counter()
    say("warming the page cache")
    warm_page_cache(files, result.notes)
    cached = train("cached", data=config.data, prep_timing=True, **budget)
    cost_s["cached"] = time.perf_counter() - t_run0
    workers = cached.summary.get("workers") or 0
    repeats: dict[str, list[RunResult]] = {"ingestion_free": [free], "cached": [cached]}

    def again_cached() -> RunResult:
        warm_page_cache(files, [])  # a cold pass may have left part of it out
        return train("cached", data=config.data, prep_timing=True, **budget)

    rerun: dict[str, Callable[[], RunResult | None]] = {"cached": again_cached}
    cold: RunResult | None = None
    warmup = 2 * max(workers, 1) * LOADER_PREFETCH
    first_touch_steps = n_files // batch - warmup - max(workers, 1) * LOADER_PREFETCH - 1
    left_cached_pct: list[float] = []

    def cold_pass() -> RunResult | None:
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

    def paired_pass() -> RunResult | None:
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
        s, eff = run.summary, run.effective_config
        fetch = paired_fetch(
            run.record_dir,
            eff.get("paired_cold_samples") or n_files,
            eff.get("seed", 0),
            s.get("measured_start_unix_s"),
            s.get("measured_end_unix_s"),
        )
        # the run's own measurement, so it belongs in its record (and reaches the store)
        amend_summary(run.record_dir, paired_fetch=fetch)
        run = RunResult.from_record(run.record_dir)
        if fetch is None:
            result.notes.append(
                f"the paired cold run {run.run_id} compared no cold batch with its neighbours "
                "(too short): fetch stall not measured"
            )
            return None
        return run

    paired: RunResult | None = None
    t_run0 = time.perf_counter()
    design = choose_fetch_design(config.fetch_design, info.get("kind"), workers, cached)
    if design == "paired":
        from gpulens.data.paired import split_files

        if not is_loader_bound(cached):
            result.notes.append(
                f"paired cold run as asked (fetch design 'paired'), though the cached run waited "
                f"on its loader only {wait_pct(cached):.0f}% of the time (the design assumes "
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
            f"{wait_pct(cached):.0f}% of the time; the paired cold run needs a loop that waits "
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
    refine(config, repeats, rerun, cost_s, t0, say, result.notes)
    measured = measure_all(repeats)
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
    result.breakdown_pct, result.breakdown_ci95_pp = breakdown_of(measured)
    m_free, m_cached, m_cold = measured["ingestion_free"], measured["cached"], measured.get("cold")
    m_fetch = measured.get(PAIRED_KIND)
    if m_fetch is not None and m_cached is not None:
        m_cold = cold_from_paired(m_cached, m_fetch)
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
    asked: str, dataset_kind: str | None, workers: int, cached: RunResult
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

    from gpulens.data.datasets import build_dataset
    from gpulens.workloads.config import resolve_config
    from gpulens.workloads.devices import resolve_device
    from gpulens.workloads.models import get_workload

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
        from gpulens.data.datasets import TokenFileDataset

        if isinstance(dataset, TokenFileDataset):
            raise UsageError(
                "--fetch-design paired needs an image folder (one file per sample): use "
                "--fetch-design separate (or auto) for a token file"
            )
        if eff["workers"] < 1:
            raise UsageError("--fetch-design paired needs loader workers: give --workers 1 or more")
    return eff

"""The stall breakdown of a built-in workload: the runs it needs (through
:class:`~gpulens.stalls.runner.StallRunner` and its training backend, all stored, each with its
role), the fetch design, repeats while a share misses its target, and the breakdown."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path

from gpulens.data.bad_samples import SKIPPED_FILES_SHOWN
from gpulens.errors import UsageError
from gpulens.record.writer import amend_summary
from gpulens.run.result import RunResult
from gpulens.run.thresholds import LOADER_BOUND_DATA_WAIT
from gpulens.stalls.budget import TimeBudget
from gpulens.stalls.config import ProgressFn, StallResult, StallsConfig, preflight
from gpulens.stalls.model import PAIRED_KIND, cold_from_paired, measure_all
from gpulens.stalls.paired_fetch import paired_runs_summary
from gpulens.stalls.read_stall import (
    is_loader_bound,
    read_stall_from_paired,
    read_stall_from_timers,
    wait_pct,
)
from gpulens.stalls.refine import refine
from gpulens.stalls.runner import StallRunner, StepFn, TrainingBackend, warm_page_cache
from gpulens.workloads.config import LOADER_PREFETCH

log = logging.getLogger(__name__)


def _effective_transport(result: RunResult) -> list[str] | None:
    transports = result.effective_config.get("transport_effective")
    return list(transports) if transports else None


def _describe_transport(result: RunResult) -> str:
    got = _effective_transport(result)
    return "NCCL reported " + ", ".join(got) if got else "transport not reported"


def run_stalls(
    config: StallsConfig,
    runs_root: Path,
    progress: ProgressFn | None = None,
    on_step: StepFn | None = None,
    budget: TimeBudget | None = None,
) -> StallResult:
    """Make the runs the breakdown needs (all stored) and compute it. ``progress`` hears each
    phase, ``on_step`` each run's steps (as ``run_training``'s progress). ``budget``: the
    clock of ``config.time_budget_s`` (the CLI's starts with the process; default: now)."""
    import time

    from gpulens.data.datasets import dataset_files, describe_dataset
    from gpulens.stalls.paired_fetch import paired_fetch
    from gpulens.stalls.prep_summary import summarize_prep

    common = {
        "workload": config.workload,
        "batch_size": config.batch_size,
        "device": config.device,
        "precision": config.precision,
        "workers": config.workers,
        "worker_affinity": config.worker_affinity,
        "skip_bad_samples": config.skip_bad_samples,
    }
    result = StallResult(workload=config.workload, device=config.device or "")
    if budget is None:
        budget = TimeBudget(config.time_budget_s, config.max_duration_s)
    runner = StallRunner(
        TrainingBackend(config.workload, common, runs_root, on_step), result, progress, budget
    )
    say, t0, train = runner.say, runner.t0, runner.run
    preflight(config)
    # the runs the breakdown needs: ingestion-free, cached, cold (or paired), N-GPU ones
    multi_runs = 0
    if config.gpus > 1 or config.nodes is not None:
        multi_runs = 1 if (config.device or "").startswith("cpu") else 2
    runs_to_make = [3 + multi_runs]
    if not budget.fits(runs_to_make[0]):
        raise UsageError(budget.cannot_hold(runs_to_make[0]))

    def timed(**options) -> dict:
        """A needed run's measured seconds, so that the runs still to come fit the budget."""
        left = runs_to_make[0]
        if budget.runs_made and not budget.short and not budget.fits(left):
            budget.short = True  # said once, as soon as a run has shown what one costs
            log.warning("%s", budget.too_small(left))
            result.notes.append(budget.too_small(left))
        runs_to_make[0] = max(left - 1, 1)
        return {**options, "duration_s": budget.measure_s(left)}

    files = dataset_files(config.data)
    info = describe_dataset(config.data)
    n_files = len(files)

    # A share's interval combines two runs' intervals (a stall is a difference of two runs);
    # runs known to within target/sqrt(2) percent keep it near the target in points.
    run_ci_pct = config.until_ci_pct / math.sqrt(2)
    free = train("ingestion_free", data="synthetic", **timed(until_ci_pct=run_ci_pct))
    result.device = free.summary["device"]
    batch = free.summary["batch_size"]

    from gpulens.data import pagecache

    cost_s: dict[str, float] = {}
    t_run0 = time.perf_counter()
    say("warming the page cache")
    warm_page_cache(files, result.notes)
    cached_opts = timed(until_ci_pct=run_ci_pct)  # its repeats are as long
    cached = train("cached", data=config.data, prep_timing=True, **cached_opts)
    cost_s["cached"] = time.perf_counter() - t_run0
    workers = cached.summary.get("workers") or 0
    repeats: dict[str, list[RunResult]] = {"ingestion_free": [free], "cached": [cached]}

    def again_cached() -> RunResult:
        warm_page_cache(files, [])  # a cold pass may have left part of it out
        return train("cached", data=config.data, prep_timing=True, **cached_opts)

    rerun: dict[str, Callable[[], RunResult | None]] = {"cached": again_cached}
    cold: RunResult | None = None
    warmup = 2 * max(workers, 1) * LOADER_PREFETCH
    first_touch_steps = n_files // batch - warmup - max(workers, 1) * LOADER_PREFETCH - 1
    left_cached_pct: list[float] = []
    fetch_opts: dict = {}  # the fetch run's measured seconds, its repeats' too

    def fetch_s() -> float:
        if not fetch_opts:
            fetch_opts.update(timed())
        return fetch_opts["duration_s"]

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
            "cold",
            data=config.data,
            steps=min(first_touch_steps, 10_000),
            duration_cap_s=fetch_s(),
            warmup_steps=warmup,
            prep_timing=True,
        )

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
            PAIRED_KIND,
            data=config.data,
            paired_cold_block=batch,
            prep_timing=True,
            duration_s=fetch_s(),
            warmup_steps=warmup,
            storage_latency_s=config.storage_latency_s,
            storage_bandwidth_bytes_per_s=config.storage_bandwidth_bytes_per_s,
        )
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
            f"after it, shared by {workers} worker{'s' * (workers != 1)}, adds to the cached "
            "time per sample (the cold throughput shown is that sum)"
        )
    elif config.emulated_storage:
        result.fetch_method = "emulated_storage"
        rerun["cold"] = lambda: train(
            "cold",
            data=config.data,
            storage_latency_s=config.storage_latency_s,
            storage_bandwidth_bytes_per_s=config.storage_bandwidth_bytes_per_s,
            prep_timing=True,
            until_ci_pct=run_ci_pct,
            duration_s=fetch_s(),
        )
        cold = rerun["cold"]()
    elif first_touch_steps < 10:
        result.notes.append(
            f"fetch stall not measured: the dataset ({n_files} files) is too small for a cold "
            f"run of at least 10 steps of {batch} samples that reads every file once; make a "
            f"larger one (at least {(warmup + 10 + 2 * max(workers, 1) * 2) * batch} files)"
        )
        runs_to_make[0] = max(runs_to_make[0] - 1, 1)  # no fetch run: its time goes to others
    else:
        cold = cold_pass()
        if cold is not None:
            rerun["cold"] = cold_pass
    if cold is not None:
        repeats["cold"] = [cold]
        cost_s["cold"] = time.perf_counter() - t_run0
    multi = multi_socket = None
    if config.gpus > 1 or config.nodes is not None:
        multi_common = dict(
            data="synthetic",
            gpus=config.gpus,
            nodes=config.nodes,
            count_flops=False,
            device="cpu" if (config.device or "").startswith("cpu") else None,
            until_ci_pct=run_ci_pct,
        )
        multi = train("multi_gpu", **timed(**multi_common))
        procs = config.gpus * (config.nodes.nnodes if config.nodes else 1)
        if multi_common["device"] == "cpu":
            result.notes.append(
                f"interconnect: {procs} CPU processes over gloo vs 1; network stall not "
                "measured: CPU processes already talk over TCP (gloo), there is no faster "
                "path to compare with"
            )
        else:
            multi_socket = train(
                "multi_gpu_socket", nccl_transport="socket", **timed(**multi_common)
            )
            got = _effective_transport(multi_socket)
            if got and "NET/Socket" not in got:
                result.notes.append(
                    f"the socket run's NCCL reported {', '.join(got)}, not NET/Socket: its "
                    "network stall is not a socket measurement"
                )
            result.notes.append(
                f"interconnect: {procs} GPUs with DDP ({_describe_transport(multi)}) vs "
                f"1, same per-GPU batch; network: NCCL on sockets "
                f"({_describe_transport(multi_socket)}) "
                + (
                    "between the nodes"
                    if config.nodes
                    else "over the loopback of one host, faster than a real network between hosts"
                )
            )
        if config.nodes is not None:
            result.notes.append(
                f"the interconnect runs span {config.nodes.nnodes} nodes ({config.gpus} "
                f"processes each; this is node {config.nodes.node_rank}): the network between "
                "the nodes is in the interconnect stall, the other runs are this node's alone"
            )
            for r in (multi, multi_socket):  # said once, here (the run logs it at info level)
                join = (r.summary.get("join") or {}) if r is not None else {}
                if join.get("hint"):
                    result.notes.append(f"one node's shard of run {join['run_id']}: {join['hint']}")
    runner.fill_missing()
    if config.gpus == 1 and config.nodes is None:
        result.notes.append(
            "interconnect and network stalls not measured: give --gpus N (2 or more) to run "
            "N GPUs with DDP, with and without NCCL's peer-to-peer transport"
        )

    if multi is not None:
        repeats["multi_gpu"] = [multi]
    if multi_socket is not None:
        repeats["multi_gpu_socket"] = [multi_socket]
    refine(config, repeats, rerun, cost_s, t0, say, result.notes, budget=budget)
    measured = measure_all(repeats)
    runner.pool(repeats, measured)
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
    runner.set_breakdown(measured)
    m_free, m_cached, m_cold = measured["ingestion_free"], measured["cached"], measured.get("cold")
    m_fetch = measured.get(PAIRED_KIND)
    if m_fetch is not None and m_cached is not None:
        m_cold = cold_from_paired(m_cached, m_fetch)
        result.throughput["cold"] = 1.0 / m_cold.per_sample_s
        result.throughput_ci95_pct["cold"] = 100.0 * m_cold.half_width_s / m_cold.per_sample_s
        result.fetch_paired = paired_runs_summary(repeats[PAIRED_KIND], m_cached, m_fetch, workers)
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
        cached.record_dir,
        cached.summary["throughput_samples_per_s"],
        start_unix_s=cached.summary.get("measured_start_unix_s"),
        end_unix_s=cached.summary.get("measured_end_unix_s"),
        data_wait_fraction=phases["data_wait"] / phases["step"] if phases["step"] else None,
    )
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
    result.fetch_design = "paired" if PAIRED_KIND in repeats else "separate" if m_cold else None
    if config.skip_bad_samples:
        every = [r for runs in repeats.values() for r in runs]
        result.skipped_samples = sum(r.summary.get("skipped_samples") or 0 for r in every)
        names = (f for r in every for f in (r.summary.get("skipped_files") or []))
        result.skipped_files = list(dict.fromkeys(names))[:SKIPPED_FILES_SHOWN]
    return runner.finish(
        m_free,
        m_cached,
        m_cold,
        workers,
        info.get("mean_file_bytes"),
        prep.get("cpu_s_per_sample") if prep else None,
    )


def choose_fetch_design(
    asked: str, dataset_kind: str | None, workers: int, cached: RunResult
) -> str:
    """The fetch design to use, "paired" or "separate": the paired design needs an image
    folder (one file per sample) and loader workers; "auto" takes it when the cached run is
    loader-bound."""
    if dataset_kind != "image_folder" or workers < 1 or asked == "separate":
        return "separate"
    return "paired" if asked == "paired" or is_loader_bound(cached) else "separate"

"""Data-loader workers for concurrent jobs that share the host's CPUs (A-Dloader's problem):
each job's throughput curve over its workers, and the split of C CPUs that maximises the
aggregate, against an even split. Pure: curves come from run summaries (dicts), no I/O."""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass

import numpy as np
import pandas as pd

from gpulens.data.loader_scaling import pace_at
from gpulens.errors import UsageError
from gpulens.predict.features import loader_workers

log = logging.getLogger(__name__)

# A run whose data wait is above this share of its step was waiting for its loader.
LOADER_BOUND_SHARE = 0.05
OBJECTIVES = ("normalized", "samples")
# More CPUs than any one host has (the largest cloud hosts: 448 vCPUs): the exact split's
# programme grows with the square of the CPUs, and --cpus 1000000 ran for minutes unanswered.
MAX_CPUS = 1024


@dataclass(frozen=True)
class Curve:
    """Throughput (samples/s) of one job at some worker counts, ascending. Between points it is
    linear; below the first point proportional to the workers (a loader-bound job); beyond the
    last point flat (no gain assumed that was not seen)."""

    job: str
    workers: tuple[int, ...]
    throughput_samples_per_s: tuple[float, ...]
    source: str  # "measured" (runs at several worker counts) or "predicted" (one run, a model)
    note: str = ""

    def __post_init__(self) -> None:
        if not self.workers or len(self.workers) != len(self.throughput_samples_per_s):
            raise UsageError(f"job {self.job}: a curve needs as many throughputs as points")
        if list(self.workers) != sorted(set(self.workers)) or self.workers[0] < 0:
            raise UsageError(f"job {self.job}: worker counts must be distinct, ascending, >= 0")
        if any(not t >= 0 for t in self.throughput_samples_per_s):
            raise UsageError(f"job {self.job}: throughputs must be >= 0")

    def at(self, workers: int) -> float:
        w, t = np.asarray(self.workers, float), np.asarray(self.throughput_samples_per_s, float)
        if workers < w[0]:
            return float(t[0] * workers / w[0]) if w[0] > 0 else float(t[0])
        return float(np.interp(workers, w, t))


def predicted_curve(
    job: str,
    batch_size: int,
    step_s: float,
    data_wait_s: float,
    workers: int,
    cpus: int,
    host_cpus: int | None = None,
) -> Curve:
    """From one run: per sample the GPU needs ``(step - data wait) / batch``; each worker
    prepares a sample in ``t_prep``, slower as more workers run beside it (the decline
    ``predict --workers`` uses, on the run's ``host_cpus``); the slower side sets the pace."""
    if step_s <= 0 or batch_size < 1:
        raise UsageError(f"job {job}: its run has no measured step time to build a curve from")
    t_gpu = max(step_s - data_wait_s, 1e-12) / batch_size
    if workers == 0:  # loading in the training process: its wait is one worker's pace
        t_prep, how = max(data_wait_s, 0.0) / batch_size, "loaded in-process"
    elif data_wait_s > LOADER_BOUND_SHARE * step_s:
        t_prep, how = step_s / batch_size * workers, f"loader-bound at {workers} workers"
    else:  # the loader kept up: each worker was at most this slow (a pessimistic curve)
        t_prep, how = t_gpu * workers, f"GPU-bound at {workers} workers (loader speed a bound)"
    ws = tuple(range(1, max(cpus, 1) + 1))
    source = max(workers, 1)  # loading in-process: one worker's pace
    tput = tuple(
        1.0 / max(t_gpu, t_prep / (w * worker_decline_ratio(source, w, host_cpus))) for w in ws
    )
    return Curve(job, ws, tput, "predicted", f"from one run, {how}; each worker's pace declining")


def _num(value) -> float | None:
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return f if f == f else None


def _loader_runs(job: str, metas: list[dict]) -> list[dict]:
    """Finished runs of ``job`` that used a data loader (not data already on the device)."""
    out = []
    for meta in metas:
        s, eff = meta.get("summary") or {}, meta.get("effective_config") or {}
        if meta.get("status") != "finished" or (s.get("workload") or eff.get("workload")) != job:
            continue
        if str(eff.get("data") or "synthetic") == "synthetic":
            continue
        if s.get("measured_steps") and _num(s.get("throughput_samples_per_s")):
            out.append(meta)
    return out


def curve_for_job(job: str, metas: list[dict], cpus: int, run: dict | None = None) -> Curve:
    """The job's curve from the store's run.json documents (oldest first): measured where runs
    at two or more worker counts exist (same batch size and GPU as the newest, or as ``run``,
    a run the user named, then labelled by its run id), else predicted from that run."""
    runs = _loader_runs(job, metas)
    label = f"{job} ({run['run_id']})" if run is not None and run.get("run_id") else job
    if run is not None:
        if run.get("kind") == "command":  # its loader is the script's own: nothing to scale
            raise UsageError(
                f"run {run.get('run_id')} is a command (`gpulens run -- ...`): allocate-workers "
                "needs a built-in workload's run with a data loader: `gpulens run WORKLOAD "
                "--data DIR --workers N`"
            )
        if not _loader_runs(job, [run]):
            raise UsageError(
                f"run {run.get('run_id')} is no finished run of {job} with a data loader: give "
                f"one of `gpulens run {job} --data DIR --workers N`"
            )
        runs = [m for m in runs if m.get("run_id") != run.get("run_id")] + [run]
    if not runs:
        raise UsageError(
            f"no finished run of {job} with a data loader in the store: run "
            f"`gpulens run {job} --data DIR --workers N` first (at two or more N for a measured "
            "curve)"
        )
    newest = runs[-1]["summary"]

    def same(s: dict) -> bool:
        return s.get("batch_size") == newest.get("batch_size") and (s.get("gpu") or {}).get(
            "name"
        ) == (newest.get("gpu") or {}).get("name")

    by_workers: dict[int, list[float]] = {}
    for meta in runs:
        s = meta["summary"]
        if same(s):
            by_workers.setdefault(loader_workers(meta), []).append(
                float(s["throughput_samples_per_s"])
            )
    if len(by_workers) >= 2:
        ws = sorted(by_workers)
        tput = tuple(statistics.median(by_workers[w]) for w in ws)
        runs_n = sum(len(v) for v in by_workers.values())
        return Curve(label, tuple(ws), tput, "measured", f"{runs_n} runs at workers {ws}")
    phases = newest.get("phases_s") or {}
    return predicted_curve(
        label,
        int(newest.get("batch_size") or 1),
        _num(phases.get("step")) or 0.0,
        _num(phases.get("data_wait")) or 0.0,
        loader_workers(runs[-1]),
        cpus,
        host_cpus(runs[-1]),
    )


@dataclass(frozen=True)
class Allocation:
    jobs: tuple[str, ...]
    workers: tuple[int, ...]
    samples_per_s: tuple[float, ...]
    even_workers: tuple[int, ...]
    even_samples_per_s: tuple[float, ...]
    objective: str
    value: float  # the objective at the allocation
    even_value: float

    @property
    def gain_pct(self) -> float:
        return 100.0 * (self.value / self.even_value - 1.0) if self.even_value > 0 else 0.0


def _values(curves: list[Curve], cpus: int, objective: str) -> np.ndarray:
    """values[j, w]: job j's objective at w workers (w = 0..cpus; 0 unused)."""
    table = np.array([[c.at(w) for w in range(cpus + 1)] for c in curves])
    if objective == "normalized":  # each job's share of its own best: samples of unlike jobs
        peak = table[:, 1:].max(axis=1, keepdims=True)  # are not added up as if alike
        table = np.divide(table, peak, out=np.zeros_like(table), where=peak > 0)
    return table


def even_split(jobs: int, cpus: int) -> tuple[int, ...]:
    base, extra = divmod(cpus, jobs)
    return tuple(base + (1 if j < extra else 0) for j in range(jobs))


def greedy(values: np.ndarray, cpus: int) -> tuple[int, ...]:
    """One worker each, then each further CPU to the job that gains most from it (optimal on
    concave curves)."""
    alloc = [1] * len(values)
    for _ in range(cpus - len(values)):
        gains = [values[j, alloc[j] + 1] - values[j, alloc[j]] for j in range(len(values))]
        alloc[int(np.argmax(gains))] += 1
    return tuple(alloc)


def dynamic_programme(values: np.ndarray, cpus: int) -> tuple[int, ...]:
    """The exact optimum (any curve shape): best[j][c] over the first j jobs and c CPUs."""
    jobs = len(values)
    best = np.full((jobs + 1, cpus + 1), -np.inf)
    best[0, 0] = 0.0
    choice = np.zeros((jobs + 1, cpus + 1), dtype=int)
    for j in range(1, jobs + 1):
        for c in range(j, cpus + 1):
            for w in range(1, c - (j - 1) + 1):
                v = best[j - 1, c - w] + values[j - 1, w]
                if v > best[j, c] + 1e-12:
                    best[j, c], choice[j, c] = v, w
    alloc, c = [], int(np.argmax(best[jobs]))
    for j in range(jobs, 0, -1):
        alloc.append(int(choice[j, c]))
        c -= choice[j, c]
    return tuple(reversed(alloc))


def check_cpus(cpus: int, jobs: int) -> None:
    """A UsageError unless ``cpus`` is from the number of jobs to ``MAX_CPUS``."""
    if isinstance(cpus, bool) or cpus < jobs:
        raise UsageError(f"--cpus must be at least the number of jobs ({jobs}), got {cpus}")
    if cpus > MAX_CPUS:
        raise UsageError(f"--cpus must be at most {MAX_CPUS} (one host's CPUs), got {cpus}")


def allocate(
    curves: list[Curve], cpus: int, objective: str = "normalized", method: str = "dp"
) -> Allocation:
    """Workers per job (at least one each, ``cpus`` in all) maximising the aggregate
    ``objective``: ``normalized`` (sum of each job's share of its best throughput) or
    ``samples`` (sum of samples/s)."""
    if objective not in OBJECTIVES:
        raise UsageError(f"--objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    if not curves:
        raise UsageError("give at least one job")
    check_cpus(cpus, len(curves))
    values = _values(curves, cpus, objective)
    workers = greedy(values, cpus) if method == "greedy" else dynamic_programme(values, cpus)
    even = even_split(len(curves), cpus)

    def total(alloc: tuple[int, ...]) -> float:
        return float(sum(values[j, w] for j, w in enumerate(alloc)))

    if total(even) >= total(workers) - 1e-9 * abs(total(workers)):
        workers = even  # no gain: keep the split nobody has to explain

    return Allocation(
        jobs=tuple(c.job for c in curves),
        workers=workers,
        samples_per_s=tuple(c.at(w) for c, w in zip(curves, workers, strict=True)),
        even_workers=even,
        even_samples_per_s=tuple(c.at(w) for c, w in zip(curves, even, strict=True)),
        objective=objective,
        value=total(workers),
        even_value=total(even),
    )


def allocation_frame(alloc: Allocation, curves: list[Curve]) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "job": alloc.jobs,
            "curve": [c.source for c in curves],
            "workers": alloc.workers,
            "samples_per_s": alloc.samples_per_s,
            "even_workers": alloc.even_workers,
            "even_samples_per_s": alloc.even_samples_per_s,
        }
    )


# Each worker's pace falls as more workers of its loader run beside it (memory bandwidth,
# caches, clocks; the training process receiving and pinning their batches): by about
# 1 / (1 + WORKER_DECLINE (W - 1)) at W workers, whatever the host's CPU count. Nine ladders
# on 16-vCPU hosts (six H100, three H200; 1-12 workers) gave the constant; two on a 32-CPU
# H200 host, one with all 32 CPUs and one under `taskset -c 0-7` (2026-11-27), showed it does
# not scale with the CPUs: at 8 workers each worker kept 0.86 of its pace on 32 CPUs and 0.85
# on 8, where a decline per CPU share had predicted 0.93 and 0.76.
# With several ranks on one host, each counts its own loader's workers for the decline; the
# ranks' workers together share the CPUs (below). A decline over all the host's workers was
# tried first: on one H200 host (ef78583, resnet18, 8 workers a rank, 1 -> 2 GPUs, 3 rounds) it
# gave 1.68x on 16 CPUs and 0.84x on 8, where the pairs measured 1.82x and 0.99x; a decline per
# loader gives 1.95x and 0.97x (the form chosen after these two ladders were seen). Measured
# after, on another H200 pair (dcce8d3, the ranks' workers forked, no longer spawned), 12
# workers a rank on all 32 CPUs: 1.94x, predicted 2.0x (1.63x by the decline over the host);
# the same two ladders again: 1.82x and 1.01x.
WORKER_DECLINE = 0.024
# Where the workers and the training process need more CPUs than the run has, the workers
# share what the training process leaves them: each gets (CPUs - TRAINING_PROCESS_CPUS) / W of
# a CPU, on top of the decline. The training process keeps about a tenth to a third of a CPU
# busy beside loader-bound workers (its records' process-tree CPU less one per worker, 8-32
# CPUs). Ladders under `taskset` on 4 and 2 CPUs (5dc77d4, H200, resnet18 and
# mobilenet_v3_small, 2026-11-27) kept 0.88-0.92 of one worker's pace at 4 workers on 4 CPUs
# and 0.40 at 8, 0.87 at 2 workers on 2 CPUs and 0.41 at 4; the bound used before,
# min(decline, CPUs / (W + 1)), gave 0.80, 0.44, 0.67 and 0.40. 0.2 was read off the 4-CPU
# ladders and then predicted the 2-CPU one (0.88 and 0.42) before it was run.
TRAINING_PROCESS_CPUS = 0.2
# What the ranks' share of one host was checked on (the 2-GPU runs' medians of 3 against the
# medians of 3 one-GPU runs, benchmarks/predict_same_gpu.py).
RANKS_VALIDATION = (
    "checked on 1 -> 2 GPUs from loader-bound runs on H200 pairs, medians of 3 runs: 12 "
    "workers a rank on 32 CPUs 2.8% (measured after the form was chosen), 8 a rank on 16 and "
    "8 CPUs 7.1% and 3.7% (the form chosen on an earlier pair of these ladders); 2.8%, 8.8% "
    "and 4.7% run by run"
)


def _outnumbered(workers: int, cpus: int | None, training_cpus: float) -> bool:
    """Whether the workers and the training process need more CPUs than the run has."""
    return bool(cpus) and workers + training_cpus > cpus


def worker_pace(
    workers: int,
    cpus: int | None,
    decline: float = WORKER_DECLINE,
    training_cpus: float = TRAINING_PROCESS_CPUS,
    host_workers: int | None = None,
) -> float:
    """One worker's pace with ``workers`` in its loader over its pace alone on an idle host.
    ``host_workers`` (default ``workers``) counts every loader's workers on the host, which
    share its CPUs with ``training_cpus`` of the training processes."""
    sharing = workers if host_workers is None else host_workers
    pace = 1.0 / (1.0 + decline * (workers - 1))
    if _outnumbered(sharing, cpus, training_cpus):
        pace *= max(cpus - training_cpus, 0.0) / sharing
    return pace


def worker_decline_ratio(
    from_workers: int,
    to_workers: int,
    cpus: int | None = None,
    decline: float = WORKER_DECLINE,
    training_cpus: float = TRAINING_PROCESS_CPUS,
) -> float:
    """One worker's pace at ``to_workers`` over its pace at ``from_workers``."""
    return worker_pace(to_workers, cpus, decline, training_cpus) / worker_pace(
        from_workers, cpus, decline, training_cpus
    )


def host_cpus(meta: dict) -> int | None:
    """The CPUs the run's process could use (its affinity), as its record says."""
    env = meta.get("environment") or {}
    cpus = env.get("cpu_affinity_count") or env.get("cpu_count_logical")
    return int(cpus) if cpus else None


def probe_pace_ratio(meta: dict, from_workers: int, to_workers: int) -> tuple[float, str | None]:
    """One worker's pace at ``to_workers`` over ``from_workers`` by the run's loader probe
    (``--prep-timing``), and what it saw; 1.0 where the run has no probe."""
    scaling = meta.get("loader_scaling")
    if from_workers == to_workers or not scaling:
        return 1.0, None
    # the training process is busy beside the workers (it launches the steps and pins the
    # batches), so w workers keep w + 1 processes busy
    before = pace_at(scaling, from_workers + 1)
    after = pace_at(scaling, to_workers + 1)
    seen = (
        f"the run's loader probe saw one process prepare {after:,.0f} samples/s with "
        f"{to_workers + 1} processes busy against {before:,.0f} with {from_workers + 1} "
        f"({after / before:.2f}x); not used, as it caught half of the decline or less"
    )
    return after / before, seen


def worker_pace_ratio(
    meta: dict, from_workers: int, to_workers: int, from_ranks: int = 1, to_ranks: int = 1
) -> tuple[float, list[str]]:
    """How one worker's pace at ``to_workers`` per rank compares with its pace at
    ``from_workers`` on the run's host, and notes. Each rank's workers slow each other; all
    ranks' workers and training processes share the host's CPUs."""
    if from_workers == to_workers and from_ranks == to_ranks:
        return 1.0, []
    cpus = host_cpus(meta)
    host_from, host_to = from_workers * from_ranks, to_workers * to_ranks
    ratio = worker_pace(
        to_workers, cpus, training_cpus=TRAINING_PROCESS_CPUS * to_ranks, host_workers=host_to
    ) / worker_pace(
        from_workers,
        cpus,
        training_cpus=TRAINING_PROCESS_CPUS * from_ranks,
        host_workers=host_from,
    )
    decline = "the decline measured on seventeen workers ladders, hosts of 2-32 CPUs"
    if from_ranks == to_ranks == 1:
        notes = [
            f"each worker's pace scaled by {ratio:.2f} for {to_workers} workers instead of "
            f"{from_workers} ({decline})"
        ]
    else:
        notes = [
            f"each worker's pace scaled by {ratio:.2f} for {to_workers} workers a rank on "
            f"{to_ranks} ranks ({host_to} on the host) instead of {from_workers} on "
            f"{from_ranks}: each rank's workers slow each other ({decline}), and every rank's "
            f"share the host's CPUs ({RANKS_VALIDATION})"
        ]
    if _outnumbered(host_to, cpus, TRAINING_PROCESS_CPUS * to_ranks):
        processes = "the training process" if to_ranks == 1 else f"{to_ranks} training processes"
        leave = "it leaves" if to_ranks == 1 else "the training processes leave"
        notes.append(
            f"{host_to} workers and {processes} outnumber the run's {cpus} CPUs: the workers "
            f"share what {leave} of them (validated on 4 and 2 CPUs with one training "
            f"process, 16 and 8 with two)"
        )
        delivered = to_workers * ratio / from_workers
        if to_workers > from_workers and delivered < 1.0:
            notes.append(
                f"so {to_workers} workers would prepare {delivered:.2f}x what {from_workers} "
                f"did: on {cpus} CPUs, more workers slow the loader"
            )
        if host_to > 2 * cpus:
            notes.append(
                f"{host_to} on {cpus} is an extrapolation, likely optimistic: the one ladder "
                f"beyond twice as many workers as CPUs measured 6 workers on 2 CPUs at 0.78x "
                f"what 2 prepared, where this rule gives 0.91x"
            )
    elif not cpus:
        notes.append("the run did not record its CPU count: no bound for workers beyond it")
    _, seen = probe_pace_ratio(meta, from_workers, to_workers)
    return ratio, notes + ([seen] if seen else [])

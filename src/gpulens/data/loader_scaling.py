"""How one loader process's pace falls as more processes prepare samples at once on this host.

Loader workers share the host's cores with each other and with the training process: past some
count they land on SMT siblings of busy cores, or the all-core clock is lower than the clock one
busy core gets. Scaling a measured loader linearly in its workers then overshoots (8 workers on
16 vCPUs prepared 10% fewer samples each than 1 to 4 workers did). The probe measures it on the
run's own dataset: after the measured window, ``k`` processes prepare samples at once for a short
window, for several ``k`` up to the CPUs the run may use. ``gpulens predict --workers`` scales
the loader's measured pace by the ratio of two such paces.

The processes time the dataset alone. The pipeline probe times the run's own DataLoader (its
batch size, collate, shared-memory transfer and pinning thread) with ``k`` workers, drained as
fast as the workers fill it; where a run has both, ``predict`` reads the pipeline's.
"""

from __future__ import annotations

import copy
import logging
import multiprocessing
import os
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

PROBE_WINDOW_S = 0.5  # each process's timed window per process count
POOL_SAMPLES = 64  # the samples every probe process cycles through (read once beforehand)
WARMUP_SAMPLES = 2  # prepared untimed in each process before the window (imports, caches)
PIPELINE_ROUNDS = 2  # batches of each worker timed per worker count
# batches of each worker untimed first: a worker can be as many batches ahead as the loader
# prefetches when the first batch reaches the training process late (start-up)
PIPELINE_WARMUP_ROUNDS = 2
PIPELINE_BUDGET_S = 30.0  # the pipeline probe stops at the count that passes this


def host_cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pipeline_counts(cpus: int) -> list[int]:
    """The worker counts the pipeline probe times: 1, 2, 4, ... below ``cpus``, three
    quarters of ``cpus`` and ``cpus`` (each count costs a few batches per worker)."""
    doubling = [2**i for i in range(cpus.bit_length()) if 2**i < cpus]
    return sorted({*doubling, max(1, 3 * cpus // 4), cpus})


def probe_counts(cpus: int) -> list[int]:
    """The process counts probed: 1, 2 and steps of ``max(2, cpus // 8)`` up to ``cpus``."""
    step = max(2, cpus // 8)
    return sorted({1, min(2, cpus), *range(step, cpus + 1, step), cpus})


def untimed(dataset: Any) -> Any:
    """The dataset without prep-timing rows or skipped-sample lines: the probe must not add
    to the run's own."""
    if getattr(dataset, "timing_dir", None) is None and getattr(dataset, "skip_log", None) is None:
        return dataset
    quiet = copy.copy(dataset)
    quiet.timing_dir = quiet.skip_log = None
    return quiet


def _prepare_for(dataset, pool, offset, window_s, barrier, paces, slot) -> None:
    import torch

    torch.set_num_threads(1)  # as in a DataLoader worker
    for i in range(WARMUP_SAMPLES):
        dataset[pool[(offset + i) % len(pool)]]
    barrier.wait(timeout=60)  # a sibling that failed must not hold the others forever
    t0 = time.perf_counter()
    done, elapsed_s = 0, 0.0
    while elapsed_s < window_s:
        dataset[pool[(offset + done) % len(pool)]]
        done += 1
        elapsed_s = time.perf_counter() - t0
    paces[slot] = done / elapsed_s


def probe_loader_scaling(
    dataset: Any,
    cpus: int | None = None,
    window_s: float = PROBE_WINDOW_S,
    seed: int = 0,
) -> dict[str, Any] | None:
    """Samples/s of one process while ``k`` processes prepare ``dataset``'s samples at once,
    for each ``k`` of :func:`probe_counts`: ``{"processes", "samples_per_s_per_process",
    "window_s"}`` (the median process at each ``k``); None when the probe could not run."""
    cpus = cpus or host_cpus()
    n = len(dataset)
    if n == 0:
        return None
    probe_set = untimed(dataset)
    pool = probe_pool(probe_set, POOL_SAMPLES, seed)
    if pool is None:
        return None
    ctx = multiprocessing.get_context()
    counts, paces = [], []
    t_start = time.perf_counter()
    for k in probe_counts(cpus):
        barrier, out = ctx.Barrier(k), ctx.Array("d", k)
        procs = [
            ctx.Process(
                target=_prepare_for,
                args=(probe_set, pool, j * len(pool) // k, window_s, barrier, out, j),
                daemon=True,
            )
            for j in range(k)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=window_s * 4 + 60)
        if any(p.is_alive() or p.exitcode != 0 for p in procs):
            for p in procs:
                if p.is_alive():
                    p.kill()
            log.warning("loader scaling probe stopped at %d processes (a process failed)", k)
            break
        counts.append(k)
        paces.append(statistics.median(out[:]))
    log.info(
        "loader scaling probe: %d counts in %.1f s", len(counts), time.perf_counter() - t_start
    )
    if not counts:
        return None
    return {"processes": counts, "samples_per_s_per_process": paces, "window_s": window_s}


def non_increasing(values: list[float]) -> list[float]:
    """The closest non-increasing sequence (least squares; pool adjacent violators): more
    processes busy at once cannot make each faster, so a probe point above an earlier one is
    its window's noise (one 0.5 s pace moves by about a fifth from run to run)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
    return [m for m, n in blocks for _ in range(int(n))]


def probe_pool(dataset: Any, size: int, seed: int = 0) -> list[int] | None:
    """``size`` sample indices (fewer in a smaller dataset), each read once so that every
    count meets them in the page cache; None where one fails (the probe is then not run)."""
    pool = random.Random(seed).sample(range(len(dataset)), min(size, len(dataset)))
    for index in pool:
        try:
            dataset[index]
        except Exception as exc:  # a sample the run's loader skipped or never met
            log.warning("loader scaling probe not run: sample %d failed: %s", index, exc)
            return None
    return pool


def probe_pipeline_scaling(
    make_loader: Callable[[int, int], Any],
    counts: list[int],
    rounds: int = PIPELINE_ROUNDS,
    budget_s: float = PIPELINE_BUDGET_S,
    warmup_rounds: int = PIPELINE_WARMUP_ROUNDS,
) -> dict[str, Any] | None:
    """Samples/s of each worker of a DataLoader drained as fast as its ``k`` workers fill it,
    for each ``k`` in ``counts``: ``{"workers", "samples_per_s_per_worker", "rounds"}``.
    ``make_loader(k, n_batches)`` builds the loader (k workers, n_batches batches). Each count
    times ``rounds`` batches of every worker after ``warmup_rounds`` untimed ones, from the
    arrival of batch ``warmup_rounds * k`` to that of the last; None when no count could be
    timed."""
    done_counts, paces = [], []
    t_start = time.perf_counter()
    for k in counts:
        if done_counts and time.perf_counter() - t_start > budget_s:
            log.info("loader pipeline probe stopped at %d workers: past %.0f s", k, budget_s)
            break
        n_batches = (warmup_rounds + rounds) * k
        loader = make_loader(k, n_batches)
        batches = iter(loader)
        arrivals = []
        try:
            for _ in range(n_batches):
                next(batches)
                arrivals.append(time.perf_counter())
        except Exception as exc:  # a worker failed or timed out: keep the counts timed
            log.warning("loader pipeline probe stopped at %d workers: %s", k, exc)
            break
        finally:
            stop = getattr(batches, "_shutdown_workers", None)
            if stop is not None:  # now, not when the iterator is collected
                stop()
        window_s = arrivals[-1] - arrivals[warmup_rounds * k - 1]
        if window_s <= 0:
            break
        done_counts.append(k)
        paces.append(rounds * k * loader.batch_size / window_s / k)
    log.info(
        "loader pipeline probe: %d counts in %.1f s",
        len(done_counts),
        time.perf_counter() - t_start,
    )
    if not done_counts:
        return None
    return {"workers": done_counts, "samples_per_s_per_worker": paces, "rounds": rounds}


def pace_at(counts: list[int], paces_measured: list[float], busy: float) -> float:
    """One process's (or worker's) samples/s with ``busy`` of them at once, from a probe's
    ``counts`` and paces made non-increasing: linear between probed counts; past the last,
    that count's processes shared among more (time slicing)."""
    paces = non_increasing(paces_measured)
    processes = busy
    if processes <= counts[0]:
        return float(paces[0])
    for i in range(1, len(counts)):
        if processes <= counts[i]:
            k0, k1, p0, p1 = counts[i - 1], counts[i], paces[i - 1], paces[i]
            return float(p0 + (p1 - p0) * (processes - k0) / (k1 - k0))
    return float(paces[-1] * counts[-1] / processes)

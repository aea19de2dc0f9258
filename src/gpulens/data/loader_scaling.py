"""How one loader process's pace falls as more processes prepare samples at once on this host.

Loader workers share the host's cores with each other and with the training process: past some
count they land on SMT siblings of busy cores, or the all-core clock is lower than the clock one
busy core gets. Scaling a measured loader linearly in its workers then overshoots (8 workers on
16 vCPUs prepared 10% fewer samples each than 1 to 4 workers did). The probe measures it on the
run's own dataset: after the measured window, ``k`` processes prepare samples at once for a short
window, for several ``k`` up to the CPUs the run may use. ``gpulens predict --workers`` scales
the loader's measured pace by the ratio of two such paces.
"""

from __future__ import annotations

import copy
import logging
import multiprocessing
import os
import random
import statistics
import time
from typing import Any

log = logging.getLogger(__name__)

PROBE_WINDOW_S = 0.5  # each process's timed window per process count
POOL_SAMPLES = 64  # the samples every probe process cycles through (read once beforehand)
WARMUP_SAMPLES = 2  # prepared untimed in each process before the window (imports, caches)


def probe_counts(cpus: int) -> list[int]:
    """The process counts probed: 1, 2 and steps of ``max(2, cpus // 8)`` up to ``cpus``."""
    step = max(2, cpus // 8)
    return sorted({1, min(2, cpus), *range(step, cpus + 1, step), cpus})


def _untimed(dataset: Any) -> Any:
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
    cpus = cpus or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    n = len(dataset)
    if n == 0:
        return None
    probe_set = _untimed(dataset)
    pool = random.Random(seed).sample(range(n), min(POOL_SAMPLES, n))
    try:  # the pool from the page cache at every count, the first included
        for index in pool:
            probe_set[index]
    except Exception as exc:  # a sample the run's loader skipped or never met
        log.warning("loader scaling probe not run: sample %d failed: %s", index, exc)
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


def pace_at(scaling: dict[str, Any], processes: float) -> float:
    """One process's samples/s with ``processes`` busy at once, from the probe made
    non-increasing: linear between probed counts; past the last, that count's processes
    shared among more (time slicing)."""
    counts = scaling["processes"]
    paces = non_increasing(scaling["samples_per_s_per_process"])
    if processes <= counts[0]:
        return float(paces[0])
    for i in range(1, len(counts)):
        if processes <= counts[i]:
            k0, k1, p0, p1 = counts[i - 1], counts[i], paces[i - 1], paces[i]
            return float(p0 + (p1 - p0) * (processes - k0) / (k1 - k0))
    return float(paces[-1] * counts[-1] / processes)

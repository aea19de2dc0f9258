"""Where data-loader workers run: left to the OS scheduler, or one physical core each.

Left to the scheduler, two decoding workers can share the hyper-threads of one core for a while
and both slow down; which pairs share is decided afresh in every run, so a loader-bound run's
throughput moves from run to run. Pinning each worker to its own core (its first hardware
thread; siblings only once every core has a worker) takes that chance out. The training
process itself is left where the scheduler puts it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

WORKER_AFFINITIES = ("os", "cores")
_SYSFS_CPU = Path("/sys/devices/system/cpu")


def _core_of(cpu: int, sysfs: Path) -> tuple[int, int] | None:
    """(package, core) of a logical CPU from sysfs, or None where the topology is not there."""
    topo = sysfs / f"cpu{cpu}" / "topology"
    try:
        package = int((topo / "physical_package_id").read_text())
        core = int((topo / "core_id").read_text())
    except (OSError, ValueError):
        return None
    return package, core


def physical_cores(allowed_cpus: set[int], sysfs: Path = _SYSFS_CPU) -> list[list[int]]:
    """The allowed logical CPUs grouped by physical core, each group sorted, groups ordered by
    their lowest CPU. Without a readable topology every CPU is its own core."""
    groups: dict[tuple[int, int] | int, list[int]] = {}
    for cpu in sorted(allowed_cpus):
        key = _core_of(cpu, sysfs)
        groups.setdefault(key if key is not None else -1 - cpu, []).append(cpu)
    return sorted(groups.values(), key=lambda g: g[0])


def worker_cpus(workers: int, allowed_cpus: set[int], sysfs: Path = _SYSFS_CPU) -> list[int]:
    """One logical CPU per worker: the first thread of each core, beginning with the second
    core (the first stays for the training process while cores last), then the siblings,
    cycling when there are more workers than CPUs."""
    cores = physical_cores(allowed_cpus, sysfs)
    if not cores:
        return []
    order = cores[1:] + cores[:1]
    depth = max(len(c) for c in cores)
    slots = [c[i] for i in range(depth) for c in order if i < len(c)]
    return [slots[w % len(slots)] for w in range(workers)]


class PinWorkers:
    """A DataLoader ``worker_init_fn`` pinning worker i to ``cpus[i]`` (picklable)."""

    def __init__(self, cpus: list[int]):
        self.cpus = list(cpus)

    def __call__(self, worker_id: int) -> None:
        cpu = self.cpus[worker_id % len(self.cpus)]
        try:
            os.sched_setaffinity(0, {cpu})
        except OSError as err:  # a cpuset changed under us: run where the OS puts us
            log.warning("could not pin loader worker %d to CPU %d: %s", worker_id, cpu, err)


def worker_init(affinity: str, workers: int, rank: int = 0) -> PinWorkers | None:
    """The ``worker_init_fn`` for ``affinity`` ("os": None), or None where pinning is not
    possible (no ``sched_setaffinity`` on this platform). Ranks of one host take successive
    slots, so their workers do not share CPUs while there are enough."""
    if affinity == "os" or workers == 0 or not hasattr(os, "sched_setaffinity"):
        return None
    cpus = worker_cpus(workers * (rank + 1), set(os.sched_getaffinity(0)))[rank * workers :]
    return PinWorkers(cpus) if cpus else None

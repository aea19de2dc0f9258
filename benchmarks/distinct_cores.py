"""Print N CPUs of this process's affinity set, one per physical core, as a taskset list.

Skips the first core (it takes most interrupts) when there are enough. Used by pending_gpu.sh
to pin a launch-bound benchmark so that no two of its busy threads share a core's hyperthreads.

    taskset -c "$(python3 benchmarks/distinct_cores.py 4)" python3 ...
"""

from __future__ import annotations

import os
import sys


def distinct_cores(n: int) -> list[int]:
    """One CPU per physical core (by thread_siblings_list), in CPU order, at most ``n``."""
    seen: set[str] = set()
    picked: list[int] = []
    for cpu in sorted(os.sched_getaffinity(0)):
        path = f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
        try:
            with open(path) as fh:
                siblings = fh.read().strip()
        except OSError:
            siblings = str(cpu)
        if siblings not in seen:
            seen.add(siblings)
            picked.append(cpu)
    if len(picked) > n:
        picked = picked[1:]
    return picked[:n]


if __name__ == "__main__":
    print(",".join(map(str, distinct_cores(int(sys.argv[1]) if len(sys.argv) > 1 else 4))))

"""The stall breakdown by differential runs (DS-Analyzer's method, VLDB 2021).

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

Layout: ``model`` (pooling, the breakdown, what-if, recommendations), ``read_stall`` (the read
timers, loader-bound), ``refine`` (the repeat planner), ``prep_summary`` (where data-prep time
goes), ``paired_fetch`` (the paired design's estimate), ``analysis`` (a breakdown from stored
runs, by role), ``config`` (what is asked, the checks before any run, what comes back),
``runner`` (the one orchestrator: each run made through a backend, training or command, and
the books kept), ``workload`` and ``command`` (the two flows over it), ``validation`` (against
injected storage latency). All but ``runner``, ``workload``, ``command`` and ``validation``
import without torch.
"""

from __future__ import annotations

from typing import Any

from gpulens.stalls.analysis import StallAnalysis
from gpulens.stalls.config import (
    FETCH_DESIGNS,
    RUN_KINDS,
    StallResult,
    StallsConfig,
    preflight,
)
from gpulens.stalls.model import (
    COMPONENTS,
    PAIRED_KIND,
    STORAGE_PROFILES,
    Z95,
    Measured,
    breakdown,
    breakdown_of,
    measure_run,
    pooled,
    pooled_paired,
    recommend,
    what_if,
)
from gpulens.stalls.read_stall import (
    LOADER_BOUND_DATA_WAIT,
    is_loader_bound,
    read_stall_from_paired,
    read_stall_from_timers,
)
from gpulens.stalls.refine import MAX_REPEATS, refine

_RUNNERS = {
    "run_stalls": "gpulens.stalls.workload",
    "choose_fetch_design": "gpulens.stalls.workload",
    "StallRunner": "gpulens.stalls.runner",
    "warm_page_cache": "gpulens.stalls.runner",
    "run_stalls_command": "gpulens.stalls.command",
}

__all__ = [
    "COMPONENTS",
    "FETCH_DESIGNS",
    "LOADER_BOUND_DATA_WAIT",
    "MAX_REPEATS",
    "PAIRED_KIND",
    "RUN_KINDS",
    "STORAGE_PROFILES",
    "Z95",
    "Measured",
    "StallAnalysis",
    "StallResult",
    "StallsConfig",
    "breakdown",
    "breakdown_of",
    "is_loader_bound",
    "measure_run",
    "pooled",
    "pooled_paired",
    "preflight",
    "read_stall_from_paired",
    "read_stall_from_timers",
    "recommend",
    "refine",
    "what_if",
    *_RUNNERS,
]


def __getattr__(name: str) -> Any:
    # The runners make runs (torch); the analysis above imports without it.
    if name in _RUNNERS:
        import importlib

        return getattr(importlib.import_module(_RUNNERS[name]), name)
    raise AttributeError(f"module 'gpulens.stalls' has no attribute {name!r}")

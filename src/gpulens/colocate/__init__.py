"""Sharing one GPU between jobs (``gpulens colocate``): time-slice, streams, MPS and MIG.

The facade: configuration (:mod:`.config`), the figures (:mod:`.metrics`: slowdown, aggregate
throughput, fairness, energy, memory fit), the recommendation (:mod:`.recommend`) and the
planner over stored results (:mod:`.plan`) are pure and import without torch;
:func:`run_colocate` runs the experiment (:mod:`.experiment`, which starts processes).
"""

from __future__ import annotations

from typing import Any

from gpulens.colocate.config import DEFAULT_MECHANISMS, MECHANISMS, ColocateConfig, ProgressFn
from gpulens.colocate.metrics import (
    CONTEXT_BYTES,
    MEM_USABLE_FRACTION,
    energy_per_sample,
    energy_unit,
    jain_index,
    job_energy,
    mechanism_energy,
    memory_fit,
    normalized_throughputs,
    quadrature,
    slowdown,
    summarize_result,
)
from gpulens.colocate.plan import load_docs, plan
from gpulens.colocate.recommend import best_result, experiment_status, recommend

__all__ = [
    "CONTEXT_BYTES",
    "DEFAULT_MECHANISMS",
    "MECHANISMS",
    "MEM_USABLE_FRACTION",
    "ColocateConfig",
    "ProgressFn",
    "best_result",
    "energy_per_sample",
    "energy_unit",
    "experiment_status",
    "jain_index",
    "job_energy",
    "load_docs",
    "mechanism_energy",
    "memory_fit",
    "normalized_throughputs",
    "plan",
    "probe_device",
    "quadrature",
    "recommend",
    "run_colocate",
    "slowdown",
    "summarize_result",
]


def __getattr__(name: str) -> Any:
    # The runner starts processes and probes the device: loaded only when asked for.
    if name == "run_colocate":
        from gpulens.colocate.experiment import run_colocate

        return run_colocate
    if name == "probe_device":
        from gpulens.colocate.device import probe_device

        return probe_device
    raise AttributeError(f"module 'gpulens.colocate' has no attribute {name!r}")

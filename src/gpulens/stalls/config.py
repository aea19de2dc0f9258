"""What a stall breakdown asks for (``StallsConfig``) and what it gives (``StallResult``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpulens.data.affinity import WORKER_AFFINITIES
from gpulens.errors import UsageError
from gpulens.launch.multinode import NodeTopology
from gpulens.stats import bounded_interval, rate_ci95

if TYPE_CHECKING:
    from gpulens.workloads.config import EffectiveTrainConfig

log = logging.getLogger(__name__)

ProgressFn = Callable[[str], None]

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
    # The interconnect run over several nodes (``gpus`` processes each); the other runs stay
    # on this node. Every node runs the whole breakdown.
    nodes: NodeTopology | None = None

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


def preflight(config: StallsConfig) -> EffectiveTrainConfig:
    """Check everything the runs need before the first one starts, so that a bad option fails
    in a second, not after minutes of runs: the workload, the device, precision and batch size
    on it, the GPUs for ``gpus`` > 1, the dataset (readable, holds one batch, fits the model)
    and the fetch design. Returns the effective config a cached run would get."""
    import os

    import torch

    from gpulens.data.datasets import build_dataset
    from gpulens.workloads.config import TrainConfig, resolve_config
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
    if len(dataset) < eff.batch_size:
        raise UsageError(
            f"dataset {config.data} has {len(dataset)} samples, fewer than one batch of "
            f"{eff.batch_size}: make more data or lower --batch-size"
        )
    if config.fetch_design == "paired":
        from gpulens.data.tokens import TokenFileDataset

        if isinstance(dataset, TokenFileDataset):
            raise UsageError(
                "--fetch-design paired needs an image folder (one file per sample): use "
                "--fetch-design separate (or auto) for a token file"
            )
        if eff.workers < 1:
            raise UsageError("--fetch-design paired needs loader workers: give --workers 1 or more")
    return eff

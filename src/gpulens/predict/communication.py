"""Gradient all-reduce time per step for N GPUs on M nodes: the ring model of ``allreduce``
with link figures from the catalog, and its exposed share calibrated on measured DDP runs."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

from gpulens.errors import UsageError
from gpulens.predict.allreduce import RingModel, calibrate_scaling, ddp_buckets
from gpulens.predict.catalog import GpuSpec
from gpulens.predict.features import RunFacts, run_facts

log = logging.getLogger(__name__)

# NCCL reaches about this share of a link's rated one-way bandwidth (bus bandwidth).
LINK_EFFICIENCY = 0.8
NETWORK_EFFICIENCY = 0.9
# Per ring step: NVLink/PCIe inside a host, and through the network between hosts.
ALPHA_INTRA_S = 10e-6
ALPHA_INTER_S = 30e-6
GRADIENT_BYTES_PER_PARAM = 4.0  # DDP reduces fp32 gradients (autocast keeps fp32 weights)
DEFAULT_BUCKET_MB = 25.0
# Without a measured pair of runs, all of the modelled all-reduce shows in the step (none of it
# hidden behind the backward pass): a pessimistic bound, named as such in the prediction.
UNCALIBRATED_EXPOSED = 1.0


def ring_model(spec: GpuSpec, nodes: int, network_gbps: float | None) -> RingModel:
    """The ring over ``nodes`` hosts of ``spec`` GPUs: the slowest link sets its bandwidth."""
    nvlink = (spec.nvlink_gb_s or 0.0) / 2  # the catalog quotes both directions together
    intra = (nvlink or spec.pcie_gb_s or 16.0) * 1e9 * LINK_EFFICIENCY
    if nodes <= 1:
        return RingModel(ALPHA_INTRA_S, intra)
    inter = (network_gbps or 0.0) * 1e9 / 8 * NETWORK_EFFICIENCY
    return RingModel(ALPHA_INTER_S, min(intra, inter))


@dataclass(frozen=True)
class Communication:
    """Exposed all-reduce seconds per step for one model size."""

    gradient_bytes: float
    buckets: int
    exposed_fraction: float
    calibrated_on: tuple[str, ...]  # run ids of the 1-GPU and N-GPU runs, empty if none

    def exposed_s(self, spec: GpuSpec, gpus: int, nodes: int = 1, gbps: float | None = None):
        n = gpus * nodes
        if n <= 1 or self.gradient_bytes <= 0:
            return 0.0
        model = ring_model(spec, nodes, gbps)
        return self.exposed_fraction * model.allreduce_s(self.gradient_bytes, n, self.buckets)


def communication(
    params: int | None, bucket_mb: float | None, pairs: list[tuple[str, float, str, float, int]],
    spec: GpuSpec,
) -> Communication:  # fmt: skip
    """The model for ``params`` parameters; ``pairs`` are measured (1-GPU run id, its step
    less data, N-GPU run id, its step less data, N) of the same workload on ``spec``: the
    exposed share is their median (``allreduce.calibrate_scaling``, clipped to [0, 1])."""
    grad = (params or 0) * GRADIENT_BYTES_PER_PARAM
    bucket = bucket_mb or DEFAULT_BUCKET_MB
    buckets = ddp_buckets(grad, bucket) if grad else 1
    fractions, used = [], []
    for id1, t1, idn, tn, n in pairs:
        if grad <= 0 or n != 2:  # calibrate_scaling compares with a 2-GPU ring
            continue
        scaled = calibrate_scaling(t1, tn, grad, ring_model(spec, 1, None), bucket)
        fractions.append(scaled.exposed_fraction)
        used += [id1, idn]
    if not fractions:
        return Communication(grad, buckets, UNCALIBRATED_EXPOSED, ())
    fractions.sort()
    mid = fractions[len(fractions) // 2]
    log.info("all-reduce exposed share %.2f from %d measured pairs", mid, len(fractions))
    return Communication(grad, buckets, mid, tuple(used))


def measured_pairs(facts: RunFacts) -> list[tuple[str, float, str, float, int]]:
    """Measured (1-GPU, N-GPU) runs of the same workload, batch, precision and GPU model in the
    store: what calibrates the exposed all-reduce share."""
    from gpulens.paths import runs_dir

    root = runs_dir()
    try:
        stamp = root.stat().st_mtime_ns  # a new run changes it: the cache is then missed
    except OSError:
        return []
    key = (facts.workload, facts.batch_size, facts.precision, facts.gpu_name)
    return list(_pairs_in(str(root), stamp, key))


@functools.lru_cache(maxsize=16)
def _pairs_in(root: str, stamp: int, key: tuple) -> tuple[tuple[str, float, str, float, int], ...]:
    # One scan of the store per run and store state: `advise` predicts dozens of targets.
    from gpulens.record.reader import list_records

    by_gpus: dict[int, list[RunFacts]] = {}
    for rec in list_records(Path(root)):
        if rec.status != "finished":
            continue
        try:
            f = run_facts(rec)
        except UsageError:
            continue
        if (f.workload, f.batch_size, f.precision, f.gpu_name) == key:
            by_gpus.setdefault(f.gpus, []).append(f)
    pairs = []
    for one in by_gpus.get(1, []):
        for n, many in by_gpus.items():
            pairs += [
                (one.run_id, one.non_data_s, m.run_id, m.non_data_s, n) for m in many if n > 1
            ]
    return tuple(pairs)

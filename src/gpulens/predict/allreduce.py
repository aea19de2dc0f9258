"""A ring all-reduce cost model (latency and bandwidth terms) and what it predicts for DDP.

For ``N`` GPUs in a ring, an all-reduce of ``S`` bytes takes ``2 (N - 1)`` steps, each paying a
latency ``alpha`` and moving ``S / N`` bytes at bus bandwidth ``beta``:

    T(S, N) = 2 (N - 1) alpha + 2 (N - 1) / N * S / beta

(Patarasuk and Yuan 2009; NCCL's "bus bandwidth" is defined so that ``beta`` is what one link
carries). DDP all-reduces the gradients in buckets while the backward pass runs; only part of
the communication shows in the step time. The exposed fraction is calibrated on a 2-GPU run and
assumed to hold at larger N.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RingModel:
    alpha_s: float  # latency per ring step
    beta_bytes_per_s: float  # bus bandwidth

    def allreduce_s(self, size_bytes: float, n: int, buckets: int = 1) -> float:
        """Time of all-reducing ``size_bytes`` over ``n`` GPUs, sent as ``buckets`` messages."""
        if n <= 1:
            return 0.0
        steps = 2 * (n - 1)
        return buckets * steps * self.alpha_s + steps / n * size_bytes / self.beta_bytes_per_s

    def as_dict(self) -> dict[str, float]:
        return {"alpha_s": self.alpha_s, "beta_bytes_per_s": self.beta_bytes_per_s}


def fit_ring_model(sizes_bytes: list[float], times_s: list[float], n: int) -> RingModel:
    """Least-squares fit of ``alpha`` and ``beta`` to all-reduce times measured on ``n`` GPUs.

    Relative errors are minimised (each point weighted by 1/time), so small messages, where
    the latency term lives, count as much as large ones."""
    if n < 2:
        raise ValueError("an all-reduce model needs measurements on 2 or more GPUs")
    if len(sizes_bytes) < 2 or len(sizes_bytes) != len(times_s):
        raise ValueError("need at least two (size, time) points of the same length")
    s = np.asarray(sizes_bytes, dtype=float)
    t = np.asarray(times_s, dtype=float)
    steps = 2 * (n - 1)
    design = np.column_stack([np.full_like(s, steps), steps / n * s]) / t[:, None]
    (alpha, inv_beta), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    alpha = max(float(alpha), 0.0)
    inv_beta = float(inv_beta)
    if inv_beta <= 0:
        raise ValueError("all-reduce times do not grow with message size: cannot fit bandwidth")
    return RingModel(alpha, 1.0 / inv_beta)


def ddp_buckets(gradient_bytes: float, bucket_mb: float = 25.0) -> int:
    return max(1, math.ceil(gradient_bytes / (bucket_mb * 1024 * 1024)))


@dataclass(frozen=True)
class ScalingPrediction:
    """Time per step of an N-GPU DDP run from a 1-GPU step, the model and the exposed share."""

    step_time_1_s: float
    exposed_fraction: float  # of the modelled all-reduce time that showed in the 2-GPU step
    gradient_bytes: float
    buckets: int
    model: RingModel

    def step_time_s(self, n: int) -> float:
        comm = self.model.allreduce_s(self.gradient_bytes, n, self.buckets)
        return self.step_time_1_s + self.exposed_fraction * comm


def calibrate_scaling(
    step_time_1_s: float, step_time_2_s: float, gradient_bytes: float, model: RingModel,
    bucket_mb: float = 25.0,
) -> ScalingPrediction:  # fmt: skip
    """The exposed fraction from the measured 1- and 2-GPU step times (clipped to [0, 1])."""
    buckets = ddp_buckets(gradient_bytes, bucket_mb)
    comm_2 = model.allreduce_s(gradient_bytes, 2, buckets)
    exposed = (step_time_2_s - step_time_1_s) / comm_2 if comm_2 > 0 else 0.0
    return ScalingPrediction(
        step_time_1_s, min(max(exposed, 0.0), 1.0), gradient_bytes, buckets, model
    )

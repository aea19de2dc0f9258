"""Scaling a measured GPU time to another GPU by what bounds it: peak FLOP/s or memory bandwidth.

Two methods, both pure (numbers in, numbers out):

- ``kernel``: every CUDA kernel of a profiler window (``predict.trace``) is scaled on its own.
  Its arithmetic intensity (FLOPs / bytes of the launching op, from its input shapes) against
  the source GPU's ridge point says what bounds it. Only the kernel's ideal time (its FLOPs at
  peak or its bytes at full bandwidth) scales with the peaks; the rest of its measured time
  (occupancy, latency, tails: what the peaks do not move) is kept. A kernel whose op recorded
  no shapes is classed by name (GEMM/convolution/attention: compute; the rest: memory) and
  scaled as the kernels of its class with known bytes scaled on average. Kernels shorter than
  ``LATENCY_BOUND_S`` are launch/latency bound and kept. On H100 and H200 profiles of five
  workloads (benchmarks/results, 2026-11-25), scaling whole kernel times by the bandwidth
  ratio predicted the other GPU's kernel time with 15.7% mean error; keeping the non-ideal
  part, 7.3%: most memory-class kernels there reach well under the peak bandwidth. Both GPUs
  have the same SMs and clocks; to a GPU with fewer or slower SMs the kept part would grow, which
  this model does not know (unvalidated: it then predicts too fast).
- ``whole_step``: the step's FLOPs (the workload's count) and bytes (the DRAM bandwidth counter
  of GPM where measured) give the ideal compute and memory times on the source; each part of
  the measured GPU time is scaled by its own ratio, and the rest (latency-bound time, which
  neither peak moves) is kept.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass

from gpulens.errors import UsageError
from gpulens.predict.catalog import GpuSpec

log = logging.getLogger(__name__)

# Kernels this short are bound by launch latency and the GPU's clock, not by a peak.
LATENCY_BOUND_S = 5e-6
# Without a DRAM counter, bytes per step are assumed at this intensity: the one GPM measured for
# resnet50 bf16 b128 on an H100 (61 GB and 3.1 TFLOP per step, tests/fixtures).
DEFAULT_FLOP_PER_BYTE = 50.0
_COMPUTE_NAME = re.compile(
    r"gemm|xmma|wgmma|cutlass|conv|fprop|dgrad|wgrad|flash|fmha|attention|sdpa|matmul|"
    r"\bmm\b|addmm|bmm|linear|cudnn|implicit",
    re.IGNORECASE,
)


def peak_column(precision: str, workload: str | None) -> str:
    """The catalog column of the peak a run's matmuls use: fp32 convnets run on TF32 (cuDNN
    allows it by default); fp32 matmuls (ViT, GPT) do not, as torch's default forbids it."""
    precision = (precision or "fp32").lower()
    if precision == "fp32":
        conv = workload is not None and not workload.startswith(("vit", "gpt"))
        return "tf32_tflops" if conv else "fp32_tflops"
    return f"{precision}_tflops"


def peak_flops_per_s(spec: GpuSpec, column: str) -> float:
    """The peak of ``column``; a GPU without TF32 (no tf32 peak: V100, T4) runs the fp32
    math that would use it at its fp32 peak."""
    value = getattr(spec, column, None)
    if not value and column == "tf32_tflops":
        value = spec.fp32_tflops
    if not value:
        raise UsageError(
            f"the catalog has no {column.removesuffix('_tflops')} peak for {spec.gpu} (left "
            f"empty where the GPU lacks that precision): predict from a run in a precision it "
            f"has, fill column {column} with --gpu-catalog FILE, or pick another GPU"
        )
    return float(value) * 1e12


def bandwidth_bytes_per_s(spec: GpuSpec) -> float:
    if not spec.mem_bw_gb_s:
        raise UsageError(f"the catalog has no memory bandwidth for {spec.gpu}: fill mem_bw_gb_s")
    return float(spec.mem_bw_gb_s) * 1e9


@dataclass(frozen=True)
class Hardware:
    """The two roofline numbers of one GPU at one precision, and its L2 cache (None: unknown)."""

    peak_flops_per_s: float
    bandwidth_bytes_per_s: float
    l2_bytes: float | None = None

    @property
    def ridge_flop_per_byte(self) -> float:
        return self.peak_flops_per_s / self.bandwidth_bytes_per_s

    def ideal_s(self, flops: float, nbytes: float) -> float:
        return max(flops / self.peak_flops_per_s, nbytes / self.bandwidth_bytes_per_s)


def hardware(spec: GpuSpec, column: str) -> Hardware:
    l2 = spec.l2_mb * 1e6 if spec.l2_mb else None
    return Hardware(peak_flops_per_s(spec, column), bandwidth_bytes_per_s(spec), l2)


def fits_both_l2(nbytes: float, source: Hardware, target: Hardware) -> bool:
    """Whether ``nbytes`` fit in the L2 cache of both GPUs: such a kernel's traffic stays in
    L2 on either, so the GPUs' DRAM bandwidths do not set its time."""
    if source.l2_bytes is None or target.l2_bytes is None:
        return False
    return nbytes < min(source.l2_bytes, target.l2_bytes)


# ------------------------------------------------------------------------------ whole step
@dataclass(frozen=True)
class StepScaling:
    """A measured GPU time split into compute-, memory- and latency-bound parts (fractions)."""

    compute_frac: float
    memory_frac: float
    bytes_measured: bool

    @property
    def latency_frac(self) -> float:
        return max(0.0, 1.0 - self.compute_frac - self.memory_frac)

    def ratio(self, source: Hardware, target: Hardware) -> float:
        """Target GPU time / source GPU time."""
        return (
            self.compute_frac * source.peak_flops_per_s / target.peak_flops_per_s
            + self.memory_frac * source.bandwidth_bytes_per_s / target.bandwidth_bytes_per_s
            + self.latency_frac
        )


def split_step(
    gpu_time_s: float, flops: float, nbytes: float | None, source: Hardware
) -> StepScaling:
    """The parts of ``gpu_time_s`` bound by FLOPs and by bytes (ideal times on ``source``,
    clipped so that they sum to at most the measured time)."""
    if gpu_time_s <= 0:
        raise ValueError("gpu_time_s must be positive")
    measured = nbytes is not None
    if nbytes is None:
        nbytes = flops / DEFAULT_FLOP_PER_BYTE
    compute = min(1.0, flops / source.peak_flops_per_s / gpu_time_s)
    memory = min(1.0 - compute, nbytes / source.bandwidth_bytes_per_s / gpu_time_s)
    return StepScaling(compute, max(memory, 0.0), measured)


# ------------------------------------------------------------------------------ kernels
@dataclass(frozen=True)
class Kernel:
    """One kernel of a profiler window; ``flops``/``nbytes`` are its launching op's share."""

    name: str
    duration_s: float
    op: str | None = None
    flops: float | None = None
    nbytes: float | None = None

    @property
    def measured(self) -> bool:
        """Whether the launching op's bytes are known (its FLOPs then are too, 0 or more)."""
        return bool(self.nbytes)

    def bound(self, source: Hardware) -> str:
        """``compute``, ``memory`` or ``latency``: what limits this kernel on ``source``."""
        if self.duration_s < LATENCY_BOUND_S:
            return "latency"
        if self.measured:
            ai = (self.flops or 0.0) / self.nbytes
            return "compute" if ai >= source.ridge_flop_per_byte else "memory"
        text = f"{self.name} {self.op or ''}"
        return "compute" if _COMPUTE_NAME.search(text) else "memory"

    def scaled_s(self, source: Hardware, target: Hardware) -> float:
        """This kernel's time on ``target``: its ideal time on ``source`` (at most its measured
        time) rescaled to ``target``'s peaks, plus the rest of its measured time unchanged. A
        memory-bound kernel whose bytes fit both GPUs' L2 caches keeps its time.
        Kernels with unknown bytes scale by the ratio of the peak their name points to."""
        bound = self.bound(source)
        if bound == "latency":
            return self.duration_s
        if bound == "memory" and self.measured and fits_both_l2(self.nbytes, source, target):
            return self.duration_s
        if self.measured:
            flops = self.flops or 0.0
            ideal_src = source.ideal_s(flops, self.nbytes)
            kept_ideal = min(ideal_src, self.duration_s)
            return self.duration_s - kept_ideal * (
                1.0 - target.ideal_s(flops, self.nbytes) / ideal_src
            )
        if bound == "compute":
            return self.duration_s * source.peak_flops_per_s / target.peak_flops_per_s
        return self.duration_s * source.bandwidth_bytes_per_s / target.bandwidth_bytes_per_s


@dataclass(frozen=True)
class KernelScaling:
    """What a profiler window says about the GPU time of one step on another GPU."""

    kernels: int
    busy_s_per_step: float
    scaled_s_per_step: float
    seconds_by_bound: dict[str, float]

    @property
    def ratio(self) -> float:
        return self.scaled_s_per_step / self.busy_s_per_step if self.busy_s_per_step else 1.0


def scale_kernels(
    kernels: Iterable[Kernel], steps: int, source: Hardware, target: Hardware
) -> KernelScaling:
    ks = list(kernels)
    if not ks or steps < 1:
        raise UsageError("the profiler window holds no CUDA kernels: rerun with a GPU")
    by_bound = {"compute": 0.0, "memory": 0.0, "latency": 0.0}
    # measured and scaled seconds of the kernels with known bytes, per class: the ratio that
    # kernels of the same class whose op recorded no shapes get
    known = {"compute": [0.0, 0.0], "memory": [0.0, 0.0]}
    for k in ks:
        bound = k.bound(source)
        by_bound[bound] += k.duration_s / steps
        if k.measured and bound in known:
            known[bound][0] += k.duration_s
            known[bound][1] += k.scaled_s(source, target)
    scaled = 0.0
    for k in ks:
        bound = k.bound(source)
        measured_s, scaled_s = known.get(bound, (0.0, 0.0))
        if k.measured or bound == "latency" or not measured_s:
            scaled += k.scaled_s(source, target)
        else:
            scaled += k.duration_s * scaled_s / measured_s
    busy = sum(k.duration_s for k in ks) / steps
    return KernelScaling(len(ks), busy, scaled / steps, by_bound)

"""A step's GPU time at another batch size on the same GPU, from one profiler window.

Each kernel's launching op recorded its input shapes. The tensors that carry the batch are
found by their sizes: a dimension equal to the batch, or to the batch times the second
dimension of a 3-D tensor that leads with it (tokens, patches: ``[B * T, C]``). Those
dimensions are rescaled, the op's FLOPs and bytes recomputed, and the kernel's time above a
fixed launch floor scales by the op's roofline-ideal time at the new batch over the old one,
an ideal time under a few microseconds counting as that bound (such small ops are bound by
latency and keep their time). Weights keep their size (a convolution's weight, a matrix whose
dimensions match no batch size, tensor lists such as the optimizer's), so a weight-gradient
product that reads a large weight grows by less than the batch, and the optimizer not at all.
Kernels whose op recorded no shapes keep their time.

Between two kernels queued back to back the GPU idles about a microsecond; those gaps, one per
kernel, do not change with the batch either (``launch_gaps_s``). Kernels plus gaps are what a
step takes when the GPU sets its pace; a step longer than that was paced by the host.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass
from pathlib import Path

from gpulens.errors import UsageError
from gpulens.predict.features import run_facts
from gpulens.predict.roofline import Hardware
from gpulens.predict.trace import CONV_ARGS, load_trace, op_flops_bytes

log = logging.getLogger(__name__)

# A run whose kernels and the gaps between them (launch_gaps_s) fill at least this share of its
# step had its pace set by the GPU; on the ladders, such runs fill 0.94-1.02 of it and
# host-paced ones 0.2-0.9 (2026-11-26).
GPU_BOUND_FILL = 0.95
# Without a profiler window, NVML's utilization (the share of time some kernel ran) at least
# this says the GPU set the pace: on the 282 profiled runs of the committed ladders and records,
# none of the 196 host-paced runs reached it and 79 of the 86 GPU-paced ones did.
GPU_BOUND_UTIL_PCT = 95.0

# The part of a kernel's time that no batch size changes (launch and tail); chosen on the
# 20 committed cases (predict-records-7919c1d-*), where 2-4 us did best, before the ladder
# of other batch sizes (predict-ladder-*) was scored.
LAUNCH_FLOOR_S = 3e-6
# An op whose roofline-ideal time is under this is bound by latency (too little work to fill the
# GPU), not by its work: its time follows max(ideal, this), so it keeps its time while under it.
# Chosen from 1-8 us by the kernel-time error on the ladders 838a8f6, 8311ffd and 54700aa;
# 2479648, fdd21ca and 640a86a were scored beside it, not used to choose. On those three
# (benchmarks/batch_kernel_errors.py, the 3-D rule above in place): growing the batch 9.7 -> 5.6%
# off, shrinking it 4.7 -> 4.7%.
LATENCY_BOUND_IDEAL_S = 3e-6
# Gaps between consecutive kernels of one stream this short are the GPU moving to the next
# queued kernel; longer ones are waits for the host. The median of the short ones was 1.0-1.5 us
# on every ladder run (H100 and H200, 2026-11-26).
QUEUED_GAP_MAX_S = 4e-6


@dataclass(frozen=True)
class BatchScaling:
    """What a profiler window says about one step's GPU time at ``new_batch``."""

    batch_size: int
    new_batch: int
    kernels: int
    busy_s_per_step: float
    scaled_s_per_step: float
    unknown_share: float  # of the busy time: kernels whose op recorded no shapes (kept)
    gap_s_per_step: float = 0.0  # the GPU's idle time between back-to-back kernels (kept)

    @property
    def ratio(self) -> float:
        return self.scaled_s_per_step / self.busy_s_per_step if self.busy_s_per_step else 1.0


def _is_shape(dims) -> bool:
    return isinstance(dims, list) and bool(dims) and all(isinstance(d, int) for d in dims)


def batch_sizes(ops, batch_size: int) -> set[int]:
    """The sizes a batch dimension takes in this window: the batch, and the batch times the
    second dimension of every 3-D tensor that leads with it (``[B, T, C]`` -> ``B * T`` rows).
    Only 3-D: a convolution's ``[B, C, H, W]`` is never flattened to ``B * C`` rows, and taking
    it as such made weights whose size happened to equal ``B * C`` (vit_b_16's ``[3072, 768]``
    MLP at batch 4, vgg16's ``[4096, 25088]`` at 16) scale with the batch."""
    sizes = {batch_size}
    for op in ops:
        for dims in (op.get("args") or {}).get("Input Dims") or []:
            if _is_shape(dims) and len(dims) == 3 and dims[0] == batch_size and dims[1] > 1:
                sizes.add(batch_size * dims[1])
    return sizes


def rescale_dims(op_name: str, dims: list, sizes: set[int], factor: float) -> list:
    """``dims`` (an op's ``Input Dims``) with the first batch-carrying dimension of each tensor
    multiplied by ``factor``; weights, vectors and tensor lists unchanged."""
    out = []
    for i, d in enumerate(dims):
        weight = (op_name in CONV_ARGS and i != 0) or (
            op_name == "aten::convolution_backward" and i == 2
        )
        if not _is_shape(d) or len(d) < 2 or weight:
            out.append(d)
            continue
        j = next((j for j, x in enumerate(d) if x in sizes), None)
        out.append(d if j is None else d[:j] + [max(1, round(d[j] * factor))] + d[j + 1 :])
    return out


def scale_batch(
    trace_path: Path, steps: int, batch_size: int, new_batch: int, hardware: Hardware
) -> BatchScaling:
    """One step's kernel time at ``batch_size`` (measured) and at ``new_batch`` (modelled)."""
    if batch_size < 1 or new_batch < 1 or steps < 1:
        raise UsageError("batch sizes and profiled steps must be whole numbers >= 1")
    ops, device = load_trace(trace_path)
    if not device:
        raise UsageError("the profiler window holds no CUDA kernels: rerun with a GPU")
    sizes = batch_sizes(ops.values(), batch_size)
    factor = new_batch / batch_size
    ratios: dict[object, float | None] = {}
    busy = scaled = unknown = 0.0
    for e in device:
        t = float(e["dur"]) * 1e-6
        ext = (e.get("args") or {}).get("External id")
        if ext not in ratios:
            ratios[ext] = op_ratio(ops.get(ext), sizes, factor, hardware)
        r = ratios[ext]
        busy += t
        if r is None:
            unknown += t
            r = 1.0
        scaled += scaled_kernel_s(t, r)
    log.debug("batch %d -> %d: %d kernels, ratio %.3f", batch_size, new_batch, len(device),
              scaled / busy if busy else 1.0)  # fmt: skip
    return BatchScaling(
        batch_size, new_batch, len(device), busy / steps, scaled / steps,
        unknown / busy if busy else 0.0, launch_gaps_s(device) / steps,
    )  # fmt: skip


def gpu_fill(trace: Path, trace_steps: int, step_s: float) -> float:
    """The share of a step that the profiler window's kernels and the gaps queued between them
    filled: at least GPU_BOUND_FILL, the GPU set the step's pace."""
    _, device = load_trace(trace)
    busy_s = sum(float(e["dur"]) for e in device) * 1e-6 + launch_gaps_s(device)
    return busy_s / trace_steps / step_s


def gpu_set_the_pace(fill: float | None, util_pct: float | None) -> bool:
    """Whether a run's GPU set its pace: by its profiler window's ``fill`` where it has one,
    else by NVML's utilization (a run with neither counts as host-paced)."""
    if fill is not None:
        return fill >= GPU_BOUND_FILL
    return util_pct is not None and util_pct >= GPU_BOUND_UTIL_PCT


def run_gpu_paced(record) -> bool:
    """Whether the GPU set the pace of ``record`` (a RunRecord): ``gpu_set_the_pace``."""
    facts = run_facts(record)
    fill = None
    if facts.trace is not None and facts.trace_steps > 0:
        fill = gpu_fill(facts.trace, facts.trace_steps, facts.step_s)
    return gpu_set_the_pace(fill, facts.gpu_util_pct)


def launch_gaps_s(device: list[dict]) -> float:
    """The GPU's idle time between kernels it had queued, over the window: one median short
    gap (under QUEUED_GAP_MAX_S) per kernel, so that the host's slowness under the profiler,
    which widens the other gaps, does not count. Events without a start time add none."""
    by_stream: dict[object, list[tuple[float, float]]] = {}
    for e in device:
        if "ts" not in e:  # a trace slimmed to durations (older gpulens): no gaps to read
            continue
        stream = (e.get("args") or {}).get("stream")
        by_stream.setdefault(stream, []).append((float(e["ts"]), float(e["dur"])))
    short = []
    for events in by_stream.values():
        events.sort()
        for (ts0, dur0), (ts1, _) in zip(events, events[1:], strict=False):
            gap_us = ts1 - ts0 - dur0
            if 0.0 <= gap_us < QUEUED_GAP_MAX_S * 1e6:
                short.append(gap_us)
    return statistics.median(short) * 1e-6 * len(device) if short else 0.0


def scaled_kernel_s(kernel_s: float, ratio: float) -> float:
    """A kernel's time at the new batch: its launch floor kept, the rest scaled by ``ratio``."""
    floor = min(LAUNCH_FLOOR_S, kernel_s)
    return floor + (kernel_s - floor) * ratio


def _at_most_linear(before: float, after: float, factor: float) -> float:
    """``after`` kept within the linear change ``before * factor`` (from ``before``'s side)."""
    return min(after, before * factor) if factor >= 1 else max(after, before * factor)


def op_ratio(op: dict | None, sizes: set[int], factor: float, hw: Hardware) -> float | None:
    """An op's ideal time at the new batch over the measured one; None without shapes."""
    if op is None:
        return None
    name, args = op.get("name", ""), op.get("args") or {}
    flops0, bytes0 = op_flops_bytes(name, args)
    if flops0 is None or not bytes0:
        return None
    dims = rescale_dims(name, args.get("Input Dims") or [], sizes, factor)
    flops1, bytes1 = op_flops_bytes(name, {**args, "Input Dims": dims})
    ideal0 = hw.ideal_s(flops0, bytes0)
    if ideal0 <= 0:
        return 1.0
    # A training op's work per sample does not depend on the batch, so it grows at most as the
    # batch does. Where a weight's dimension equals a batch size (gpt2 at batch 3: 3 x 1024
    # tokens = its MLP's 3072), both operands of a product are rescaled and the FLOPs grow as
    # the factor squared; this keeps them to the factor.
    flops1 = _at_most_linear(flops0, flops1 or 0.0, factor)
    bytes1 = _at_most_linear(bytes0, bytes1 or 0.0, factor)
    ideal1 = hw.ideal_s(flops1, bytes1)
    return max(ideal1, LATENCY_BOUND_IDEAL_S) / max(ideal0, LATENCY_BOUND_IDEAL_S)

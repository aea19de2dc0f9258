"""GPM (GPU performance monitoring, Hopper and newer): probing at open and the sampling windows.

A GPM metric describes the window between two GPM samples, so each GPU keeps two sample buffers
and the start of the open window. GPM needs windows of about 100 ms or more: a window in which
the GPU's counters did not refresh comes back as zeros and NaN, is reported as null, and the
next window then starts where the last good one ended. Probing at open takes two GPM samples
about 0.12 s apart; their per-metric return codes say which metrics exist.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from gpulens.probes.nvml.errors import error_text
from gpulens.probes.nvml.state import FAILED, GpuState

log = logging.getLogger(__name__)

# GPM metric per column; PCIe comes from GPM too where the GPU has it (MiB/s there).
GPM_COLUMNS: dict[str, str] = {
    "sm_activity_pct": "NVML_GPM_METRIC_SM_UTIL",
    "sm_occupancy_pct": "NVML_GPM_METRIC_SM_OCCUPANCY",
    "tensor_activity_pct": "NVML_GPM_METRIC_ANY_TENSOR_UTIL",
    "dram_bw_util_pct": "NVML_GPM_METRIC_DRAM_BW_UTIL",
}
GPM_PCIE_COLUMNS: dict[str, str] = {
    "pcie_tx_bytes_per_s": "NVML_GPM_METRIC_PCIE_TX_PER_SEC",
    "pcie_rx_bytes_per_s": "NVML_GPM_METRIC_PCIE_RX_PER_SEC",
}
MIB = 1 << 20


def start_gpm_probe(nvml: Any, gpu: GpuState) -> None:
    """Check GPM support and take the first of the two probing samples."""
    h = gpu.handle
    support = gpu.try_open(
        nvml, GPM_COLUMNS, "nvmlGpmQueryDeviceSupport", lambda: nvml.nvmlGpmQueryDeviceSupport(h)
    )
    if support is FAILED:
        mark_gpm_unsupported(nvml, gpu, "nvmlGpmQueryDeviceSupport failed at open")
        return
    if not support.isSupportedDevice:
        mark_gpm_unsupported(
            nvml, gpu, "GPM (GPU performance monitoring) needs a Hopper or newer GPU"
        )
        return
    try:
        mig_current = nvml.nvmlDeviceGetMigMode(h)[0]
    except (nvml.NVMLError, AttributeError):
        mig_current = 0
    if mig_current:
        mark_gpm_unsupported(
            nvml, gpu, "MIG is enabled on this GPU; GPM per MIG instance is not measured"
        )
        return
    buffers = gpu.try_open(
        nvml,
        GPM_COLUMNS,
        "nvmlGpmSampleAlloc",
        lambda: [nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()],
    )
    if buffers is FAILED:
        mark_gpm_unsupported(nvml, gpu, "nvmlGpmSampleAlloc failed at open")
        return
    gpu.gpm_buffers = buffers
    got = gpu.try_open(
        nvml, GPM_COLUMNS, "nvmlGpmSampleGet", lambda: nvml.nvmlGpmSampleGet(h, buffers[0])
    )
    if got is FAILED:
        mark_gpm_unsupported(nvml, gpu, "nvmlGpmSampleGet failed at open")
        return
    gpu.gpm_prev = buffers[0]


def mark_gpm_unsupported(nvml: Any, gpu: GpuState, reason: str) -> None:
    """Mark the GPM columns (keeping a more precise reason already there); free buffers."""
    for metric in GPM_COLUMNS:
        gpu.unsupported.setdefault(metric, reason)
    gpu.gpm_ids.clear()
    free_gpm(nvml, gpu)


def finish_gpm_probe(nvml: Any, gpu: GpuState) -> None:
    """Second probing sample: the per-metric return codes say which GPM metrics exist."""
    if gpu.gpm_prev is None:
        return
    for col, const in {**GPM_COLUMNS, **GPM_PCIE_COLUMNS}.items():
        metric_id = getattr(nvml, const, None)
        if metric_id is not None:
            gpu.gpm_ids[col] = int(metric_id)
        elif col in GPM_COLUMNS:
            gpu.unsupported[col] = f"pynvml lacks {const}; pip install -U nvidia-ml-py"
    gpu.gpm_request = nvml.c_nvmlGpmMetricsGet_t()
    spare = gpu.gpm_buffers[1]
    got = gpu.try_open(
        nvml, GPM_COLUMNS, "nvmlGpmSampleGet", lambda: nvml.nvmlGpmSampleGet(gpu.handle, spare)
    )
    if got is FAILED:
        mark_gpm_unsupported(nvml, gpu, "nvmlGpmSampleGet failed at open")
        return
    cols = list(gpu.gpm_ids)
    result = gpu.try_open(
        nvml,
        GPM_COLUMNS,
        "nvmlGpmMetricsGet",
        lambda: gpm_metrics(nvml, gpu, gpu.gpm_prev, spare, [gpu.gpm_ids[c] for c in cols]),
    )
    if result is FAILED:
        mark_gpm_unsupported(nvml, gpu, "nvmlGpmMetricsGet failed at open")
        return
    for col, (ret, _value) in zip(cols, result, strict=True):
        if ret != nvml.NVML_SUCCESS:
            del gpu.gpm_ids[col]
            if col in GPM_COLUMNS:
                gpu.unsupported[col] = f"GPM metric {GPM_COLUMNS[col]}: " + error_text(nvml, ret)
    gpu.enable([c for c in gpu.gpm_ids if c in GPM_COLUMNS], "gpm")
    gpu.gpm_prev = None  # the first row has no window
    if not gpu.gpm_ids:
        free_gpm(nvml, gpu)


def sample_gpm(
    nvml: Any,
    gpu: GpuState,
    row: dict[str, Any],
    now_s: float,
    min_interval_s: float,
    zero_window_s: float,
) -> None:
    """Close the open GPM window at ``now_s`` and fill ``row``'s GPM columns from it.

    The first call only opens a window. A window shorter than ``min_interval_s`` stays open; a
    stale one (NaN, or all zeros in less than ``zero_window_s``) leaves the row null and the
    window open, so the next one spans both.
    """
    if gpu.gpm_prev is None:
        first = gpu.gpm_buffers[0]
        if gpu.call(nvml, "nvmlGpmSampleGet", gpu.handle, first) is not FAILED:
            gpu.gpm_prev, gpu.gpm_prev_s = first, now_s
        return
    window_s = now_s - gpu.gpm_prev_s
    if window_s < min_interval_s:
        return  # too short for GPM: the window stays open
    a, b = gpu.gpm_buffers
    spare = b if gpu.gpm_prev is a else a
    if gpu.call(nvml, "nvmlGpmSampleGet", gpu.handle, spare) is FAILED:
        return
    cols = list(gpu.gpm_ids)
    try:
        result = gpm_metrics(nvml, gpu, gpu.gpm_prev, spare, [gpu.gpm_ids[c] for c in cols])
    except nvml.NVMLError as exc:
        log.debug("GPU %d: nvmlGpmMetricsGet failed: %s", gpu.index, exc)
        gpu.gpm_prev, gpu.gpm_prev_s = spare, now_s
        return
    good = [value for ret, value in result if ret == nvml.NVML_SUCCESS]
    stale = any(not math.isfinite(v) for v in good) or (
        all(v == 0.0 for v in good) and window_s < zero_window_s
    )
    if stale:  # the counters did not refresh: keep the old start, the next window spans both
        log.debug("GPU %d: GPM counters did not refresh in %.3f s", gpu.index, window_s)
        return
    gpu.gpm_prev, gpu.gpm_prev_s = spare, now_s
    for col, (ret, value) in zip(cols, result, strict=True):
        if ret == nvml.NVML_SUCCESS:
            row[col] = value * MIB if col in GPM_PCIE_COLUMNS else value


def gpm_metrics(
    nvml: Any, gpu: GpuState, first: Any, second: Any, metric_ids: list[int]
) -> list[tuple[int, float]]:
    """nvmlGpmMetricsGet between two samples: (nvmlReturn, value) per metric id."""
    request = gpu.gpm_request
    request.version = nvml.NVML_GPM_METRICS_GET_VERSION
    request.numMetrics = len(metric_ids)
    request.sample1 = first
    request.sample2 = second
    for slot, metric_id in enumerate(metric_ids):
        request.metrics[slot].metricId = metric_id
    nvml.nvmlGpmMetricsGet(request)
    return [
        (int(request.metrics[slot].nvmlReturn), float(request.metrics[slot].value))
        for slot in range(len(metric_ids))
    ]


def free_gpm(nvml: Any, gpu: GpuState) -> None:
    """Free the GPU's GPM sample buffers; safe to call twice."""
    for buffer in gpu.gpm_buffers:
        try:
            nvml.nvmlGpmSampleFree(buffer)
        except nvml.NVMLError as exc:
            log.debug("GPU %d: nvmlGpmSampleFree failed: %s", gpu.index, exc)
    gpu.gpm_buffers = []
    gpu.gpm_prev = None

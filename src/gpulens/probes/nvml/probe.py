"""The GPU probe: NVML (and, on Hopper and newer, GPM) sampled in-process, one row per GPU.

``open_gpu_probe()`` returns an :class:`NvmlGpuProbe`, or a :class:`NullGpuProbe` whose ``reason``
says why nothing is measured (no pynvml, no driver, no GPU). Errors at open:

- NVML cannot start (library or driver missing, no permission to the device files, no GPU):
  a ``NullGpuProbe`` with the reason; everything else keeps running.
- a requested GPU index that does not exist: ``UsageError``.
- a GPU that NVML sees but cannot open (no permission, GPU lost): a ``DeviceError`` naming the
  fix (``NvmlPermissionError``, ``GpuLostError``; see :mod:`gpulens.probes.nvml.errors`).

Each metric is probed once at open. One that NVML refuses for good (not supported, function not
found in this driver, no permission, unknown field) is listed in ``unsupported`` with the reason,
never called again and stays null. Any other NVML error during ``sample()`` makes that one value
null for that row (logged at debug level).

Windowed values (PCIe rates and the GPM metrics) describe the interval since the previous row of
the same GPU, so the first row has them null. GPM needs windows of about 100 ms or more: a window
in which the GPU's counters did not refresh comes back as zeros and NaN, and is reported as null
(the next row's window then starts where the last good one ended).

Sources (``probe.sources`` says which per GPU): ``power_w`` is the instantaneous power field where
the driver has it (``nvmlDeviceGetPowerUsage`` is a one-second average on recent drivers); PCIe
rates come from GPM, else from the cumulative PCIe byte counters (32-bit on H100; a window in
which a full-speed link could wrap them gives null), else from ``nvmlDeviceGetPcieThroughput``
(about 20 ms per call). Opening a GPM-capable GPU takes about 0.12 s (two GPM samples tell which
metrics exist). On an H100 (driver 580) a sample costs about 4 ms, most of it the energy read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa

from gpulens.errors import UsageError
from gpulens.probes.nvml.errors import device_error, error_text
from gpulens.probes.nvml.fields import PcieCounters, field_number, pcie_max_bytes_per_s
from gpulens.probes.nvml.gpm import (
    GPM_COLUMNS,
    finish_gpm_probe,
    free_gpm,
    mark_gpm_unsupported,
    sample_gpm,
    start_gpm_probe,
)
from gpulens.probes.nvml.session import init_nvml, shutdown_nvml
from gpulens.probes.nvml.state import FAILED, GpuState

log = logging.getLogger(__name__)

PROBE_NAME = "gpu"

GPU_SAMPLE_SCHEMA = pa.schema(
    [
        pa.field("time_unix_s", pa.float64()),
        pa.field("gpu_index", pa.int32()),
        pa.field("gpu_util_pct", pa.float64()),
        pa.field("mem_util_pct", pa.float64()),
        pa.field("mem_used_bytes", pa.int64()),
        pa.field("mem_total_bytes", pa.int64()),
        pa.field("power_w", pa.float64()),
        pa.field("energy_j", pa.float64()),
        pa.field("temperature_c", pa.float64()),
        pa.field("sm_clock_mhz", pa.int32()),
        pa.field("mem_clock_mhz", pa.int32()),
        pa.field("throttle_reasons", pa.uint64()),
        pa.field("pcie_tx_bytes_per_s", pa.float64()),
        pa.field("pcie_rx_bytes_per_s", pa.float64()),
        pa.field("sm_activity_pct", pa.float64()),
        pa.field("sm_occupancy_pct", pa.float64()),
        pa.field("tensor_activity_pct", pa.float64()),
        pa.field("dram_bw_util_pct", pa.float64()),
    ]
)
COLUMNS: tuple[str, ...] = tuple(GPU_SAMPLE_SCHEMA.names)
METRICS: tuple[str, ...] = COLUMNS[2:]

PCIE_COLUMNS = ("pcie_tx_bytes_per_s", "pcie_rx_bytes_per_s")


class NullGpuProbe:
    """A GPU probe that measures nothing; ``reason`` says why and how to fix it."""

    name = PROBE_NAME
    schema = GPU_SAMPLE_SCHEMA

    def __init__(self, reason: str):
        self.reason = reason
        self.unsupported: dict[str, str] = dict.fromkeys(METRICS, reason)
        self.gpu_indices: list[int] = []
        self.sources: dict[int, dict[str, str]] = {}
        self.last_sample_cost_s = 0.0

    def sample(self) -> list[dict[str, Any]]:
        """No GPU, no rows."""
        return []

    def close(self) -> None:
        """Nothing to release."""

    def __enter__(self) -> NullGpuProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# GPM is read at most once a second, not at every 10 Hz sample: on an H100, sampler-only blocks
# of a launch-bound loop (resnet18 bf16 batch 1) ran at 0.960 [0.934, 0.997] and 0.980 [0.944,
# 0.996] of the plain loop with GPM read at 10 Hz, and at 0.987 and 0.998 without GPM
# (benchmarks/results/launch_overhead-gpm-*, 2026-11-26). Its metrics are window averages, so
# a longer window loses no activity, only time resolution.
GPM_INTERVAL_S = 1.0


class NvmlGpuProbe:
    """Samples NVML (and GPM where present) for the selected GPUs; one row per GPU per sample.

    Attributes besides the ``Probe`` protocol: ``gpu_indices``; ``sources`` (GPU index -> metric
    -> the NVML call or field behind it); ``last_sample_cost_s`` (wall time of the last
    ``sample()``); ``sample_count``.
    """

    name = PROBE_NAME
    schema = GPU_SAMPLE_SCHEMA

    def __init__(
        self,
        nvml: Any,
        indices: Sequence[int],
        *,
        monotonic: Callable[[], float] = time.monotonic,
        wall_time: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        gpm_min_interval_s: float = GPM_INTERVAL_S,
        gpm_probe_window_s: float = 0.12,
        gpm_zero_window_s: float = 0.5,
        pcie_throughput_fallback: bool = True,
        energy_every_n: int = 1,
        gpm: bool = True,
    ):
        """Open handles and probe each metric once; ``nvml`` is an initialised pynvml module.

        The probe takes over the caller's ``nvmlInit`` reference and releases it in ``close()``.
        ``gpm_min_interval_s``: shorter GPM windows are not computed (NVML asks for at least
        about 100 ms; the default reads GPM once a second, see GPM_INTERVAL_S);
        ``gpm_zero_window_s``: all-zero GPM windows shorter than this count as stale.
        ``pcie_throughput_fallback``: use nvmlDeviceGetPcieThroughput (about 20 ms per call)
        where neither GPM nor PCIe byte counters exist. ``energy_every_n``: read the energy
        counter (a slow call) only every n-th sample; the rows between hold null for it.
        ``gpm``: False leaves GPM off (SM, tensor and DRAM activity unmeasured, with the
        reason), e.g. to measure what GPM sampling costs the workload.
        """
        self._nvml = nvml
        self._monotonic = monotonic
        self._wall_time = wall_time
        self._gpm_min_interval_s = gpm_min_interval_s
        self._gpm_zero_window_s = gpm_zero_window_s
        self._pcie_throughput_fallback = pcie_throughput_fallback
        self._energy_every_n = max(1, int(energy_every_n))
        self._lock = threading.Lock()
        self._closed = False
        self._gpus: list[GpuState] = []
        self.last_sample_cost_s = 0.0
        self.sample_count = 0
        try:
            for index in indices:
                self._gpus.append(GpuState(index=index, handle=self._open_handle(index)))
            for gpu in self._gpus:
                self._probe_basic(gpu)
                self._probe_fields(gpu)
                if gpm:
                    start_gpm_probe(self._nvml, gpu)
                else:
                    mark_gpm_unsupported(self._nvml, gpu, "GPM sampling was turned off")
            if any(gpu.gpm_prev is not None for gpu in self._gpus):
                sleep(gpm_probe_window_s)
            for gpu in self._gpus:
                finish_gpm_probe(self._nvml, gpu)
                self._choose_pcie(gpu)
        except BaseException:
            for gpu in self._gpus:
                free_gpm(self._nvml, gpu)
            raise
        self.gpu_indices = [gpu.index for gpu in self._gpus]
        self.sources = {gpu.index: dict(gpu.sources) for gpu in self._gpus}
        self.unsupported = self._merge_unsupported()

    # ----------------------------------------------------------------------------------- open
    def _open_handle(self, index: int) -> Any:
        nvml = self._nvml
        try:
            return nvml.nvmlDeviceGetHandleByIndex(index)
        except nvml.NVMLError as exc:
            raise device_error(nvml, exc, index) from exc

    def _probe_basic(self, gpu: GpuState) -> None:
        nvml, h = self._nvml, gpu.handle
        checks: list[tuple[tuple[str, ...], str, Callable[[], Any]]] = [
            (
                ("gpu_util_pct", "mem_util_pct"),
                "nvmlDeviceGetUtilizationRates",
                lambda: nvml.nvmlDeviceGetUtilizationRates(h),
            ),
            (
                ("mem_used_bytes", "mem_total_bytes"),
                "nvmlDeviceGetMemoryInfo",
                lambda: nvml.nvmlDeviceGetMemoryInfo(h),
            ),
            (
                ("temperature_c",),
                "nvmlDeviceGetTemperature",
                lambda: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU),
            ),
            (
                ("sm_clock_mhz",),
                "nvmlDeviceGetClockInfo",
                lambda: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM),
            ),
            (
                ("mem_clock_mhz",),
                "nvmlDeviceGetClockInfo",
                lambda: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_MEM),
            ),
        ]
        for metrics, what, call in checks:
            gpu.try_open(nvml, metrics, what, call)
            gpu.enable(metrics, what)

        what = "nvmlDeviceGetTotalEnergyConsumption"
        energy_mj = gpu.try_open(
            nvml, ("energy_j",), what, lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(h)
        )
        gpu.energy_base_mj = None if energy_mj is FAILED else int(energy_mj)
        gpu.enable(("energy_j",), what)

        # The newer name first; drivers before 535 only have the older one.
        for what in (
            "nvmlDeviceGetCurrentClocksEventReasons",
            "nvmlDeviceGetCurrentClocksThrottleReasons",
        ):
            gpu.unsupported.pop("throttle_reasons", None)
            gpu.try_open(
                nvml, ("throttle_reasons",), what, lambda what=what: getattr(nvml, what)(h)
            )
            reason = gpu.unsupported.get("throttle_reasons")
            if reason is None:
                gpu.throttle_fn = what
                gpu.enable(("throttle_reasons",), what)
                return
            if "pynvml lacks" not in reason and "not in this NVIDIA driver" not in reason:
                return

    def _probe_field(self, gpu: GpuState, names: Sequence[str]) -> tuple[list[Any], str | None]:
        """Probe NVML fields given by pynvml constant names: (values, None) or ([], reason)."""
        nvml = self._nvml
        ids = [getattr(nvml, name, None) for name in names]
        if any(i is None for i in ids):
            return [], f"pynvml lacks {names[0]}; pip install -U nvidia-ml-py"
        scratch = GpuState(index=gpu.index, handle=gpu.handle)
        values = scratch.try_open(
            nvml,
            ("field",),
            f"nvmlDeviceGetFieldValues({', '.join(names)})",
            lambda: nvml.nvmlDeviceGetFieldValues(gpu.handle, ids),
        )
        if values is FAILED:
            return [], scratch.unsupported.get("field", f"{names[0]}: failed at open")
        bad = [v for v in values if v.nvmlReturn != nvml.NVML_SUCCESS]
        if bad:
            return [], f"{names[0]}: {error_text(nvml, bad[0].nvmlReturn)}"
        return list(values), None

    def _probe_fields(self, gpu: GpuState) -> None:
        """Instant power and the PCIe byte counters come from one nvmlDeviceGetFieldValues call.

        ``nvmlDeviceGetPowerUsage`` is a one-second average on recent drivers, so the
        instantaneous power field is preferred where the driver has it.
        """
        nvml, h = self._nvml, gpu.handle
        values, _reason = self._probe_field(gpu, ("NVML_FI_DEV_POWER_INSTANT",))
        if values:
            gpu.power_field = int(values[0].fieldId)
            gpu.field_ids.append(gpu.power_field)
            gpu.enable(("power_w",), "NVML_FI_DEV_POWER_INSTANT")
        else:
            what = "nvmlDeviceGetPowerUsage"
            gpu.try_open(nvml, ("power_w",), what, lambda: nvml.nvmlDeviceGetPowerUsage(h))
            gpu.enable(("power_w",), what)
        values, gpu.pcie_field_reason = self._probe_field(
            gpu, ("NVML_FI_DEV_PCIE_COUNT_TX_BYTES", "NVML_FI_DEV_PCIE_COUNT_RX_BYTES")
        )
        if values:
            gpu.pcie_counters = PcieCounters(
                (int(values[0].fieldId), int(values[1].fieldId)), pcie_max_bytes_per_s(nvml, h)
            )

    def _choose_pcie(self, gpu: GpuState) -> None:
        """PCIe rates from GPM where present, else the byte counters, else PcieThroughput."""
        nvml = self._nvml
        if all(col in gpu.gpm_ids for col in PCIE_COLUMNS):
            gpu.pcie_mode = "gpm"
            gpu.enable(PCIE_COLUMNS, "gpm")
            return
        for col in PCIE_COLUMNS:
            gpu.gpm_ids.pop(col, None)
        if not any(col in GPM_COLUMNS for col in gpu.gpm_ids):
            free_gpm(self._nvml, gpu)
            gpu.gpm_ids.clear()
        if gpu.pcie_counters is not None:
            gpu.pcie_mode = "counters"
            gpu.field_ids.extend(gpu.pcie_counters.field_ids)
            gpu.enable(PCIE_COLUMNS, "NVML_FI_DEV_PCIE_COUNT_TX_BYTES/RX_BYTES")
            return
        if not self._pcie_throughput_fallback:
            for col in PCIE_COLUMNS:
                gpu.unsupported[col] = (
                    f"no PCIe byte counters ({gpu.pcie_field_reason}) and no GPM; "
                    "the slow nvmlDeviceGetPcieThroughput fallback is off"
                )
            return
        what = "nvmlDeviceGetPcieThroughput"
        gpu.try_open(
            nvml,
            PCIE_COLUMNS,
            what,
            lambda: nvml.nvmlDeviceGetPcieThroughput(gpu.handle, nvml.NVML_PCIE_UTIL_TX_BYTES),
        )
        if PCIE_COLUMNS[0] not in gpu.unsupported:
            gpu.pcie_mode = "throughput"
            gpu.enable(PCIE_COLUMNS, what)

    def _merge_unsupported(self) -> dict[str, str]:
        """One reason per metric; prefixed with GPU indices where the GPUs differ."""
        merged: dict[str, str] = {}
        for metric in METRICS:
            lacking = [
                (gpu.index, gpu.unsupported.get(metric, "not measured"))
                for gpu in self._gpus
                if metric not in gpu.enabled
            ]
            if not lacking:
                continue
            reasons = {reason for _index, reason in lacking}
            if len(lacking) == len(self._gpus) and len(reasons) == 1:
                merged[metric] = reasons.pop()
            else:
                merged[metric] = "; ".join(f"GPU {i}: {reason}" for i, reason in lacking)
        return merged

    # --------------------------------------------------------------------------------- sample
    def sample(self) -> list[dict[str, Any]]:
        """One row per GPU; values not measured are None, never 0."""
        start_s = time.perf_counter()
        with self._lock:
            if self._closed:
                return []
            now_unix_s = self._wall_time()
            rows = [self._sample_gpu(gpu, now_unix_s) for gpu in self._gpus]
            self.sample_count += 1
        self.last_sample_cost_s = time.perf_counter() - start_s
        return rows

    def _sample_gpu(self, gpu: GpuState, now_unix_s: float) -> dict[str, Any]:
        nvml, h, on = self._nvml, gpu.handle, gpu.enabled
        row: dict[str, Any] = dict.fromkeys(COLUMNS)
        row["time_unix_s"] = now_unix_s
        row["gpu_index"] = gpu.index
        if "gpu_util_pct" in on:
            util = gpu.call(nvml, "nvmlDeviceGetUtilizationRates", h)
            if util is not FAILED:
                row["gpu_util_pct"] = float(util.gpu)
                row["mem_util_pct"] = float(util.memory)
        if "mem_used_bytes" in on:
            mem = gpu.call(nvml, "nvmlDeviceGetMemoryInfo", h)
            if mem is not FAILED:
                row["mem_used_bytes"] = int(mem.used)
                row["mem_total_bytes"] = int(mem.total)
        if "temperature_c" in on:
            temp = gpu.call(nvml, "nvmlDeviceGetTemperature", h, nvml.NVML_TEMPERATURE_GPU)
            row["temperature_c"] = None if temp is FAILED else float(temp)
        for col, clock in (("sm_clock_mhz", "NVML_CLOCK_SM"), ("mem_clock_mhz", "NVML_CLOCK_MEM")):
            if col in on:
                mhz = gpu.call(nvml, "nvmlDeviceGetClockInfo", h, getattr(nvml, clock))
                row[col] = None if mhz is FAILED else int(mhz)
        if "throttle_reasons" in on and gpu.throttle_fn:
            reasons = gpu.call(nvml, gpu.throttle_fn, h)
            row["throttle_reasons"] = None if reasons is FAILED else int(reasons)
        if "energy_j" in on and self.sample_count % self._energy_every_n == 0:
            self._sample_energy(gpu, row)
        if "power_w" in on and gpu.power_field is None:
            power_mw = gpu.call(nvml, "nvmlDeviceGetPowerUsage", h)
            row["power_w"] = None if power_mw is FAILED else power_mw / 1000.0
        if gpu.field_ids:
            self._sample_fields(gpu, row)
        if gpu.pcie_mode == "throughput":
            counters = (nvml.NVML_PCIE_UTIL_TX_BYTES, nvml.NVML_PCIE_UTIL_RX_BYTES)
            for col, counter in zip(PCIE_COLUMNS, counters, strict=True):
                kb_per_s = gpu.call(nvml, "nvmlDeviceGetPcieThroughput", h, counter)
                row[col] = None if kb_per_s is FAILED else kb_per_s * 1000.0
        if gpu.gpm_ids:
            sample_gpm(
                nvml, gpu, row, self._monotonic(), self._gpm_min_interval_s, self._gpm_zero_window_s
            )
        return row

    def _sample_energy(self, gpu: GpuState, row: dict[str, Any]) -> None:
        energy_mj = gpu.call(self._nvml, "nvmlDeviceGetTotalEnergyConsumption", gpu.handle)
        if energy_mj is FAILED:
            return
        if gpu.energy_base_mj is None:  # the read at open failed: count from the first read
            gpu.energy_base_mj = int(energy_mj)
        row["energy_j"] = (int(energy_mj) - gpu.energy_base_mj) / 1000.0

    def _sample_fields(self, gpu: GpuState, row: dict[str, Any]) -> None:
        nvml = self._nvml
        values = gpu.call(nvml, "nvmlDeviceGetFieldValues", gpu.handle, gpu.field_ids)
        if values is FAILED:
            if gpu.pcie_counters is not None:
                gpu.pcie_counters.restart()
            return
        by_id = {}
        for value in values:
            if value.nvmlReturn == nvml.NVML_SUCCESS:
                by_id[value.fieldId] = value
            else:
                text = error_text(nvml, value.nvmlReturn)
                log.debug("GPU %d: field %d failed: %s", gpu.index, value.fieldId, text)
        if gpu.power_field in by_id:
            row["power_w"] = field_number(nvml, by_id[gpu.power_field]) / 1000.0
        if gpu.pcie_mode == "counters" and gpu.pcie_counters is not None:
            counters = gpu.pcie_counters
            tx, rx = (by_id.get(field_id) for field_id in counters.field_ids)
            rates = counters.rates(nvml, tx, rx, self._monotonic, gpu.index)
            if rates is not None:
                row["pcie_tx_bytes_per_s"], row["pcie_rx_bytes_per_s"] = rates

    # ---------------------------------------------------------------------------------- close
    def close(self) -> None:
        """Free the GPM buffers and release NVML; safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for gpu in self._gpus:
                free_gpm(self._nvml, gpu)
                gpu.gpm_ids.clear()
            shutdown_nvml(self._nvml)

    def __enter__(self) -> NvmlGpuProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_gpu_probe(
    indices: Sequence[int] | None = None, **options: Any
) -> NvmlGpuProbe | NullGpuProbe:
    """Open the GPU probe for NVML device ``indices`` (None: all GPUs).

    NVML indices follow PCI bus order, not ``CUDA_VISIBLE_DEVICES``; map a CUDA device with
    :func:`gpulens.probes.nvml.inventory.nvml_index_for_cuda_device`. ``options`` go to
    :class:`NvmlGpuProbe`.
    """
    nvml, reason = init_nvml()
    if nvml is None:
        return NullGpuProbe(reason or "NVML not available")
    try:
        count = nvml.nvmlDeviceGetCount()
        selected = list(range(count)) if indices is None else [int(i) for i in indices]
        missing = [i for i in selected if not 0 <= i < count]
        if missing:
            raise UsageError(
                f"GPU index {missing[0]} does not exist: NVML sees {count} GPU(s)"
                + (f" (indices 0..{count - 1})" if count else "")
                + "; pick from those (NVML numbers GPUs by PCI bus, not CUDA_VISIBLE_DEVICES)"
            )
        if not selected:
            shutdown_nvml(nvml)
            why = "NVML found no GPU" if count == 0 else "no GPU was selected"
            return NullGpuProbe(f"{why}; GPU metrics are not measured")
        return NvmlGpuProbe(nvml, selected, **options)
    except BaseException:
        shutdown_nvml(nvml)  # cleanup must not hide the real error
        raise

"""GPU probe: NVML (and, on Hopper and newer, GPM) sampled in-process, one row per GPU.

``open_gpu_probe()`` returns an :class:`NvmlGpuProbe`, or a :class:`NullGpuProbe` whose ``reason``
says why nothing is measured (no pynvml, no driver, no GPU). Errors at open:

- NVML cannot start (library or driver missing, no permission to the device files, no GPU):
  a ``NullGpuProbe`` with the reason; everything else keeps running.
- a requested GPU index that does not exist: ``UsageError``.
- a GPU that NVML sees but cannot open (no permission, GPU lost): ``DeviceError`` naming the fix.

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
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from gpulens.errors import DeviceError, UsageError

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
PCIE_COLUMNS = ("pcie_tx_bytes_per_s", "pcie_rx_bytes_per_s")
_MIB = 1 << 20

# Usable bytes/s per lane for PCIe generations 1..6 (line rate x encoding / 8).
_PCIE_LANE_BYTES_PER_S = {1: 250e6, 2: 500e6, 3: 984.6e6, 4: 1969.2e6, 5: 3938.5e6, 6: 7563e6}

_PERMANENT_ERRORS = (
    "NVML_ERROR_NOT_SUPPORTED",
    "NVML_ERROR_FUNCTION_NOT_FOUND",
    "NVML_ERROR_NO_PERMISSION",
    "NVML_ERROR_INVALID_ARGUMENT",
)

_INIT_FIXES = {
    "NVML_ERROR_LIBRARY_NOT_FOUND": (
        "no NVIDIA driver found (libnvidia-ml.so.1); install the NVIDIA driver to measure GPUs"
    ),
    "NVML_ERROR_DRIVER_NOT_LOADED": (
        "the NVIDIA kernel driver is not loaded; check `nvidia-smi` and load the driver"
    ),
    "NVML_ERROR_NO_PERMISSION": (
        "no permission to open the NVIDIA device files (/dev/nvidia*); "
        "run as a user who can read them"
    ),
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH": (
        "the NVML library and the kernel driver differ in version; reboot or reload the driver"
    ),
}


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


@dataclass
class _Gpu:
    """Per-GPU state: handle, what is enabled, and the previous values of windowed metrics."""

    index: int
    handle: Any
    enabled: set[str] = field(default_factory=set)
    sources: dict[str, str] = field(default_factory=dict)
    unsupported: dict[str, str] = field(default_factory=dict)
    throttle_fn: str | None = None
    energy_base_mj: int | None = None
    field_ids: list[int] = field(default_factory=list)
    power_field: int | None = None
    pcie_mode: str | None = None  # "gpm", "counters", "throughput" or None
    pcie_fields: tuple[int, int] | None = None
    pcie_field_reason: str | None = None
    pcie_prev: tuple[int, int, int] | None = None  # tx bytes, rx bytes, stamp in us
    pcie_max_bytes_per_s: float | None = None
    pcie_warned: bool = False
    gpm_ids: dict[str, int] = field(default_factory=dict)
    gpm_buffers: list[Any] = field(default_factory=list)
    gpm_prev: Any = None
    gpm_prev_s: float = 0.0
    gpm_request: Any = None


_FAILED = object()


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
        gpm_min_interval_s: float = 0.09,
        gpm_probe_window_s: float = 0.12,
        gpm_zero_window_s: float = 0.5,
        pcie_throughput_fallback: bool = True,
        energy_every_n: int = 1,
    ):
        """Open handles and probe each metric once; ``nvml`` is an initialised pynvml module.

        The probe takes over the caller's ``nvmlInit`` reference and releases it in ``close()``.
        ``gpm_min_interval_s``: shorter GPM windows are not computed (NVML asks for about
        100 ms); ``gpm_zero_window_s``: all-zero GPM windows shorter than this count as stale.
        ``pcie_throughput_fallback``: use nvmlDeviceGetPcieThroughput (about 20 ms per call)
        where neither GPM nor PCIe byte counters exist. ``energy_every_n``: read the energy
        counter (a slow call) only every n-th sample; the rows between hold null for it.
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
        self._gpus: list[_Gpu] = []
        self.last_sample_cost_s = 0.0
        self.sample_count = 0
        try:
            for index in indices:
                self._gpus.append(_Gpu(index=index, handle=self._open_handle(index)))
            for gpu in self._gpus:
                self._probe_basic(gpu)
                self._probe_fields(gpu)
                self._probe_gpm_start(gpu)
            if any(gpu.gpm_prev is not None for gpu in self._gpus):
                sleep(gpm_probe_window_s)
            for gpu in self._gpus:
                self._probe_gpm_finish(gpu)
                self._choose_pcie(gpu)
        except BaseException:
            for gpu in self._gpus:
                self._free_gpm(gpu)
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
            raise DeviceError(_device_error_message(nvml, exc, index)) from exc

    def _try_open(
        self, gpu: _Gpu, metrics: Sequence[str], what: str, call: Callable[[], Any]
    ) -> Any:
        """Run one probing call and return its value, or ``_FAILED``.

        A permanent refusal lists ``metrics`` as unsupported on this GPU; a passing error
        leaves them to be tried at each sample; a lost GPU raises ``DeviceError``.
        """
        nvml = self._nvml
        try:
            return call()
        except AttributeError:
            reason = f"{what}: pynvml lacks it; pip install -U nvidia-ml-py"
        except nvml.NVMLError as exc:
            if _is(nvml, exc, "NVML_ERROR_GPU_IS_LOST"):
                raise DeviceError(_device_error_message(nvml, exc, gpu.index)) from exc
            if not _is_permanent(nvml, exc):
                log.debug("GPU %d: %s failed at open (%s); tried again later", gpu.index, what, exc)
                return _FAILED
            reason = _unsupported_reason(nvml, exc, what)
        for metric in metrics:
            gpu.unsupported.setdefault(metric, reason)
        return _FAILED

    def _enable(self, gpu: _Gpu, metrics: Sequence[str], source: str) -> None:
        for metric in metrics:
            if metric not in gpu.unsupported:
                gpu.enabled.add(metric)
                gpu.sources[metric] = source

    def _probe_basic(self, gpu: _Gpu) -> None:
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
            self._try_open(gpu, metrics, what, call)
            self._enable(gpu, metrics, what)

        what = "nvmlDeviceGetTotalEnergyConsumption"
        energy_mj = self._try_open(
            gpu, ("energy_j",), what, lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(h)
        )
        gpu.energy_base_mj = None if energy_mj is _FAILED else int(energy_mj)
        self._enable(gpu, ("energy_j",), what)

        # The newer name first; drivers before 535 only have the older one.
        for what in (
            "nvmlDeviceGetCurrentClocksEventReasons",
            "nvmlDeviceGetCurrentClocksThrottleReasons",
        ):
            gpu.unsupported.pop("throttle_reasons", None)
            self._try_open(
                gpu, ("throttle_reasons",), what, lambda what=what: getattr(nvml, what)(h)
            )
            reason = gpu.unsupported.get("throttle_reasons")
            if reason is None:
                gpu.throttle_fn = what
                self._enable(gpu, ("throttle_reasons",), what)
                return
            if "pynvml lacks" not in reason and "not in this NVIDIA driver" not in reason:
                return

    def _probe_field(self, gpu: _Gpu, names: Sequence[str]) -> tuple[list[Any], str | None]:
        """Probe NVML fields given by pynvml constant names: (values, None) or ([], reason)."""
        nvml = self._nvml
        ids = [getattr(nvml, name, None) for name in names]
        if any(i is None for i in ids):
            return [], f"pynvml lacks {names[0]}; pip install -U nvidia-ml-py"
        scratch = _Gpu(index=gpu.index, handle=gpu.handle)
        values = self._try_open(
            scratch,
            ("field",),
            f"nvmlDeviceGetFieldValues({', '.join(names)})",
            lambda: nvml.nvmlDeviceGetFieldValues(gpu.handle, ids),
        )
        if values is _FAILED:
            return [], scratch.unsupported.get("field", f"{names[0]}: failed at open")
        bad = [v for v in values if v.nvmlReturn != nvml.NVML_SUCCESS]
        if bad:
            return [], f"{names[0]}: {_error_text(nvml, bad[0].nvmlReturn)}"
        return list(values), None

    def _probe_fields(self, gpu: _Gpu) -> None:
        """Instant power and the PCIe byte counters come from one nvmlDeviceGetFieldValues call.

        ``nvmlDeviceGetPowerUsage`` is a one-second average on recent drivers, so the
        instantaneous power field is preferred where the driver has it.
        """
        nvml, h = self._nvml, gpu.handle
        values, _reason = self._probe_field(gpu, ("NVML_FI_DEV_POWER_INSTANT",))
        if values:
            gpu.power_field = int(values[0].fieldId)
            gpu.field_ids.append(gpu.power_field)
            self._enable(gpu, ("power_w",), "NVML_FI_DEV_POWER_INSTANT")
        else:
            what = "nvmlDeviceGetPowerUsage"
            self._try_open(gpu, ("power_w",), what, lambda: nvml.nvmlDeviceGetPowerUsage(h))
            self._enable(gpu, ("power_w",), what)
        values, gpu.pcie_field_reason = self._probe_field(
            gpu, ("NVML_FI_DEV_PCIE_COUNT_TX_BYTES", "NVML_FI_DEV_PCIE_COUNT_RX_BYTES")
        )
        if values:
            gpu.pcie_fields = (int(values[0].fieldId), int(values[1].fieldId))
            gpu.pcie_max_bytes_per_s = self._pcie_max_bytes_per_s(gpu)

    def _pcie_max_bytes_per_s(self, gpu: _Gpu) -> float | None:
        nvml = self._nvml
        try:
            gen = int(nvml.nvmlDeviceGetMaxPcieLinkGeneration(gpu.handle))
            width = int(nvml.nvmlDeviceGetMaxPcieLinkWidth(gpu.handle))
        except (nvml.NVMLError, AttributeError, TypeError, ValueError):
            return None
        lane = _PCIE_LANE_BYTES_PER_S.get(gen)
        return lane * width if lane and width > 0 else None

    def _probe_gpm_start(self, gpu: _Gpu) -> None:
        """Check GPM support and take the first of the two probing samples."""
        nvml, h = self._nvml, gpu.handle
        support = self._try_open(
            gpu,
            GPM_COLUMNS,
            "nvmlGpmQueryDeviceSupport",
            lambda: nvml.nvmlGpmQueryDeviceSupport(h),
        )
        if support is _FAILED:
            self._gpm_unsupported(gpu, "nvmlGpmQueryDeviceSupport failed at open")
            return
        if not support.isSupportedDevice:
            self._gpm_unsupported(
                gpu, "GPM (GPU performance monitoring) needs a Hopper or newer GPU"
            )
            return
        try:
            mig_current = nvml.nvmlDeviceGetMigMode(h)[0]
        except (nvml.NVMLError, AttributeError):
            mig_current = 0
        if mig_current:
            self._gpm_unsupported(
                gpu, "MIG is enabled on this GPU; GPM per MIG instance is not measured"
            )
            return
        buffers = self._try_open(
            gpu,
            GPM_COLUMNS,
            "nvmlGpmSampleAlloc",
            lambda: [nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()],
        )
        if buffers is _FAILED:
            self._gpm_unsupported(gpu, "nvmlGpmSampleAlloc failed at open")
            return
        gpu.gpm_buffers = buffers
        got = self._try_open(
            gpu, GPM_COLUMNS, "nvmlGpmSampleGet", lambda: nvml.nvmlGpmSampleGet(h, buffers[0])
        )
        if got is _FAILED:
            self._gpm_unsupported(gpu, "nvmlGpmSampleGet failed at open")
            return
        gpu.gpm_prev = buffers[0]

    def _gpm_unsupported(self, gpu: _Gpu, reason: str) -> None:
        """Mark the GPM columns (keeping a more precise reason already there); free buffers."""
        for metric in GPM_COLUMNS:
            gpu.unsupported.setdefault(metric, reason)
        gpu.gpm_ids.clear()
        self._free_gpm(gpu)

    def _probe_gpm_finish(self, gpu: _Gpu) -> None:
        """Second probing sample: the per-metric return codes say which GPM metrics exist."""
        if gpu.gpm_prev is None:
            return
        nvml = self._nvml
        for col, const in {**GPM_COLUMNS, **GPM_PCIE_COLUMNS}.items():
            metric_id = getattr(nvml, const, None)
            if metric_id is not None:
                gpu.gpm_ids[col] = int(metric_id)
            elif col in GPM_COLUMNS:
                gpu.unsupported[col] = f"pynvml lacks {const}; pip install -U nvidia-ml-py"
        gpu.gpm_request = nvml.c_nvmlGpmMetricsGet_t()
        spare = gpu.gpm_buffers[1]
        got = self._try_open(
            gpu, GPM_COLUMNS, "nvmlGpmSampleGet", lambda: nvml.nvmlGpmSampleGet(gpu.handle, spare)
        )
        if got is _FAILED:
            self._gpm_unsupported(gpu, "nvmlGpmSampleGet failed at open")
            return
        cols = list(gpu.gpm_ids)
        result = self._try_open(
            gpu,
            GPM_COLUMNS,
            "nvmlGpmMetricsGet",
            lambda: self._gpm_metrics(gpu, gpu.gpm_prev, spare, [gpu.gpm_ids[c] for c in cols]),
        )
        if result is _FAILED:
            self._gpm_unsupported(gpu, "nvmlGpmMetricsGet failed at open")
            return
        for col, (ret, _value) in zip(cols, result, strict=True):
            if ret != nvml.NVML_SUCCESS:
                del gpu.gpm_ids[col]
                if col in GPM_COLUMNS:
                    gpu.unsupported[col] = f"GPM metric {GPM_COLUMNS[col]}: " + _error_text(
                        nvml, ret
                    )
        self._enable(gpu, [c for c in gpu.gpm_ids if c in GPM_COLUMNS], "gpm")
        gpu.gpm_prev = None  # the first row has no window
        if not gpu.gpm_ids:
            self._free_gpm(gpu)

    def _choose_pcie(self, gpu: _Gpu) -> None:
        """PCIe rates from GPM where present, else the byte counters, else PcieThroughput."""
        nvml = self._nvml
        if all(col in gpu.gpm_ids for col in PCIE_COLUMNS):
            gpu.pcie_mode = "gpm"
            self._enable(gpu, PCIE_COLUMNS, "gpm")
            return
        for col in PCIE_COLUMNS:
            gpu.gpm_ids.pop(col, None)
        if not any(col in GPM_COLUMNS for col in gpu.gpm_ids):
            self._free_gpm(gpu)
            gpu.gpm_ids.clear()
        if gpu.pcie_fields is not None:
            gpu.pcie_mode = "counters"
            gpu.field_ids.extend(gpu.pcie_fields)
            self._enable(gpu, PCIE_COLUMNS, "NVML_FI_DEV_PCIE_COUNT_TX_BYTES/RX_BYTES")
            return
        if not self._pcie_throughput_fallback:
            for col in PCIE_COLUMNS:
                gpu.unsupported[col] = (
                    f"no PCIe byte counters ({gpu.pcie_field_reason}) and no GPM; "
                    "the slow nvmlDeviceGetPcieThroughput fallback is off"
                )
            return
        what = "nvmlDeviceGetPcieThroughput"
        self._try_open(
            gpu,
            PCIE_COLUMNS,
            what,
            lambda: nvml.nvmlDeviceGetPcieThroughput(gpu.handle, nvml.NVML_PCIE_UTIL_TX_BYTES),
        )
        if PCIE_COLUMNS[0] not in gpu.unsupported:
            gpu.pcie_mode = "throughput"
            self._enable(gpu, PCIE_COLUMNS, what)

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

    def _call(self, gpu: _Gpu, fn_name: str, *args: Any) -> Any:
        """One NVML call during sampling; ``_FAILED`` (logged at debug) on an NVML error."""
        nvml = self._nvml
        try:
            return getattr(nvml, fn_name)(*args)
        except nvml.NVMLError as exc:
            log.debug("GPU %d: %s failed: %s", gpu.index, fn_name, exc)
            return _FAILED

    def _sample_gpu(self, gpu: _Gpu, now_unix_s: float) -> dict[str, Any]:
        nvml, h, on = self._nvml, gpu.handle, gpu.enabled
        row: dict[str, Any] = dict.fromkeys(COLUMNS)
        row["time_unix_s"] = now_unix_s
        row["gpu_index"] = gpu.index
        if "gpu_util_pct" in on:
            util = self._call(gpu, "nvmlDeviceGetUtilizationRates", h)
            if util is not _FAILED:
                row["gpu_util_pct"] = float(util.gpu)
                row["mem_util_pct"] = float(util.memory)
        if "mem_used_bytes" in on:
            mem = self._call(gpu, "nvmlDeviceGetMemoryInfo", h)
            if mem is not _FAILED:
                row["mem_used_bytes"] = int(mem.used)
                row["mem_total_bytes"] = int(mem.total)
        if "temperature_c" in on:
            temp = self._call(gpu, "nvmlDeviceGetTemperature", h, nvml.NVML_TEMPERATURE_GPU)
            row["temperature_c"] = None if temp is _FAILED else float(temp)
        for col, clock in (("sm_clock_mhz", "NVML_CLOCK_SM"), ("mem_clock_mhz", "NVML_CLOCK_MEM")):
            if col in on:
                mhz = self._call(gpu, "nvmlDeviceGetClockInfo", h, getattr(nvml, clock))
                row[col] = None if mhz is _FAILED else int(mhz)
        if "throttle_reasons" in on and gpu.throttle_fn:
            reasons = self._call(gpu, gpu.throttle_fn, h)
            row["throttle_reasons"] = None if reasons is _FAILED else int(reasons)
        if "energy_j" in on and self.sample_count % self._energy_every_n == 0:
            self._sample_energy(gpu, row)
        if "power_w" in on and gpu.power_field is None:
            power_mw = self._call(gpu, "nvmlDeviceGetPowerUsage", h)
            row["power_w"] = None if power_mw is _FAILED else power_mw / 1000.0
        if gpu.field_ids:
            self._sample_fields(gpu, row)
        if gpu.pcie_mode == "throughput":
            counters = (nvml.NVML_PCIE_UTIL_TX_BYTES, nvml.NVML_PCIE_UTIL_RX_BYTES)
            for col, counter in zip(PCIE_COLUMNS, counters, strict=True):
                kb_per_s = self._call(gpu, "nvmlDeviceGetPcieThroughput", h, counter)
                row[col] = None if kb_per_s is _FAILED else kb_per_s * 1000.0
        if gpu.gpm_ids:
            self._sample_gpm(gpu, row)
        return row

    def _sample_energy(self, gpu: _Gpu, row: dict[str, Any]) -> None:
        energy_mj = self._call(gpu, "nvmlDeviceGetTotalEnergyConsumption", gpu.handle)
        if energy_mj is _FAILED:
            return
        if gpu.energy_base_mj is None:  # the read at open failed: count from the first read
            gpu.energy_base_mj = int(energy_mj)
        row["energy_j"] = (int(energy_mj) - gpu.energy_base_mj) / 1000.0

    def _sample_fields(self, gpu: _Gpu, row: dict[str, Any]) -> None:
        nvml = self._nvml
        values = self._call(gpu, "nvmlDeviceGetFieldValues", gpu.handle, gpu.field_ids)
        if values is _FAILED:
            gpu.pcie_prev = None
            return
        by_id = {}
        for value in values:
            if value.nvmlReturn == nvml.NVML_SUCCESS:
                by_id[value.fieldId] = value
            else:
                text = _error_text(nvml, value.nvmlReturn)
                log.debug("GPU %d: field %d failed: %s", gpu.index, value.fieldId, text)
        if gpu.power_field in by_id:
            row["power_w"] = _field_number(nvml, by_id[gpu.power_field]) / 1000.0
        if gpu.pcie_mode == "counters" and gpu.pcie_fields is not None:
            tx, rx = (by_id.get(field_id) for field_id in gpu.pcie_fields)
            self._pcie_rates(gpu, row, tx, rx)

    def _pcie_rates(self, gpu: _Gpu, row: dict[str, Any], tx: Any, rx: Any) -> None:
        """Rates from the cumulative byte counters, which wrap (at 2**32 on H100)."""
        if tx is None or rx is None:
            gpu.pcie_prev = None
            return
        nvml = self._nvml
        # NVML stamps each field value (microseconds); integers keep the window exact.
        stamp_us = int(tx.timestamp) if tx.timestamp > 0 else round(self._monotonic() * 1e6)
        tx_bytes, rx_bytes = int(_field_number(nvml, tx)), int(_field_number(nvml, rx))
        prev, gpu.pcie_prev = gpu.pcie_prev, (tx_bytes, rx_bytes, stamp_us)
        if prev is None:
            return
        window_s = (stamp_us - prev[2]) / 1e6
        if window_s <= 0:
            return
        modulus = _field_modulus(nvml, tx)
        if gpu.pcie_max_bytes_per_s and gpu.pcie_max_bytes_per_s * window_s >= modulus:
            if not gpu.pcie_warned:  # a full-speed link could have wrapped the counter
                gpu.pcie_warned = True
                log.warning(
                    "GPU %d: the PCIe byte counters can wrap every %.0f ms at full link speed; "
                    "longer windows give no PCIe rate (sample faster to get one)",
                    gpu.index,
                    modulus / gpu.pcie_max_bytes_per_s * 1000,
                )
            return
        row["pcie_tx_bytes_per_s"] = ((tx_bytes - prev[0]) % modulus) / window_s
        row["pcie_rx_bytes_per_s"] = ((rx_bytes - prev[1]) % modulus) / window_s

    def _sample_gpm(self, gpu: _Gpu, row: dict[str, Any]) -> None:
        nvml = self._nvml
        now_s = self._monotonic()
        if gpu.gpm_prev is None:
            first = gpu.gpm_buffers[0]
            if self._call(gpu, "nvmlGpmSampleGet", gpu.handle, first) is not _FAILED:
                gpu.gpm_prev, gpu.gpm_prev_s = first, now_s
            return
        window_s = now_s - gpu.gpm_prev_s
        if window_s < self._gpm_min_interval_s:
            return  # too short for GPM: the window stays open
        a, b = gpu.gpm_buffers
        spare = b if gpu.gpm_prev is a else a
        if self._call(gpu, "nvmlGpmSampleGet", gpu.handle, spare) is _FAILED:
            return
        cols = list(gpu.gpm_ids)
        try:
            result = self._gpm_metrics(gpu, gpu.gpm_prev, spare, [gpu.gpm_ids[c] for c in cols])
        except nvml.NVMLError as exc:
            log.debug("GPU %d: nvmlGpmMetricsGet failed: %s", gpu.index, exc)
            gpu.gpm_prev, gpu.gpm_prev_s = spare, now_s
            return
        good = [value for ret, value in result if ret == nvml.NVML_SUCCESS]
        stale = any(not math.isfinite(v) for v in good) or (
            all(v == 0.0 for v in good) and window_s < self._gpm_zero_window_s
        )
        if stale:  # the counters did not refresh: keep the old start, the next window spans both
            log.debug("GPU %d: GPM counters did not refresh in %.3f s", gpu.index, window_s)
            return
        gpu.gpm_prev, gpu.gpm_prev_s = spare, now_s
        for col, (ret, value) in zip(cols, result, strict=True):
            if ret == nvml.NVML_SUCCESS:
                row[col] = value * _MIB if col in GPM_PCIE_COLUMNS else value

    def _gpm_metrics(
        self, gpu: _Gpu, first: Any, second: Any, metric_ids: list[int]
    ) -> list[tuple[int, float]]:
        """nvmlGpmMetricsGet between two samples: (nvmlReturn, value) per metric id."""
        nvml, request = self._nvml, gpu.gpm_request
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

    # ---------------------------------------------------------------------------------- close
    def _free_gpm(self, gpu: _Gpu) -> None:
        for buffer in gpu.gpm_buffers:
            try:
                self._nvml.nvmlGpmSampleFree(buffer)
            except self._nvml.NVMLError as exc:
                log.debug("GPU %d: nvmlGpmSampleFree failed: %s", gpu.index, exc)
        gpu.gpm_buffers = []
        gpu.gpm_prev = None

    def close(self) -> None:
        """Free the GPM buffers and release NVML; safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for gpu in self._gpus:
                self._free_gpm(gpu)
                gpu.gpm_ids.clear()
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError as exc:
                log.debug("nvmlShutdown failed: %s", exc)

    def __enter__(self) -> NvmlGpuProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------------ opening
def _import_nvml() -> tuple[Any, str | None]:
    try:
        import pynvml
    except ImportError:
        return None, (
            "NVML not available: pynvml is not installed (pip install nvidia-ml-py); "
            "GPU metrics are not measured"
        )
    return pynvml, None


def _init_nvml() -> tuple[Any, str | None]:
    """Import and initialise pynvml; returns (module, None) or (None, reason)."""
    nvml, reason = _import_nvml()
    if nvml is None:
        return None, reason
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        fix = next(
            (text for name, text in _INIT_FIXES.items() if _is(nvml, exc, name)),
            f"nvmlInit failed ({exc})",
        )
        return None, f"NVML not available: {fix}; GPU metrics are not measured"
    except OSError as exc:  # a broken library that loads but does not link
        return None, f"NVML not available: {exc}; GPU metrics are not measured"
    return nvml, None


def open_gpu_probe(
    indices: Sequence[int] | None = None, **options: Any
) -> NvmlGpuProbe | NullGpuProbe:
    """Open the GPU probe for NVML device ``indices`` (None: all GPUs).

    NVML indices follow PCI bus order, not ``CUDA_VISIBLE_DEVICES``; map through
    ``describe_gpus()``'s ``uuid`` where that matters. ``options`` go to :class:`NvmlGpuProbe`.
    """
    nvml, reason = _init_nvml()
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
            nvml.nvmlShutdown()
            why = "NVML found no GPU" if count == 0 else "no GPU was selected"
            return NullGpuProbe(f"{why}; GPU metrics are not measured")
        return NvmlGpuProbe(nvml, selected, **options)
    except BaseException:
        try:
            nvml.nvmlShutdown()
        except Exception as exc:  # cleanup must not hide the real error
            log.debug("nvmlShutdown after a failed open: %s", exc)
        raise


def nvml_status() -> tuple[bool, str]:
    """(True, what NVML sees) or (False, one line naming the fix)."""
    nvml, reason = _init_nvml()
    if nvml is None:
        return False, reason or "NVML not available"
    try:
        count = nvml.nvmlDeviceGetCount()
        driver = _text(nvml.nvmlSystemGetDriverVersion())
    except nvml.NVMLError as exc:
        return False, f"NVML started but could not list GPUs ({exc})"
    finally:
        nvml.nvmlShutdown()
    if count == 0:
        return False, "NVML found no GPU; GPU metrics are not measured"
    return True, f"NVML ok: driver {driver}, {count} GPU(s)"


def describe_gpus() -> list[dict[str, Any]]:
    """Static facts per GPU (name, memory, driver, architecture, MIG, GPM, PCIe link, power limit).

    Returns [] where NVML is not available; a fact NVML cannot give is None.
    """
    nvml, _reason = _init_nvml()
    if nvml is None:
        return []
    try:
        return _describe(nvml)
    finally:
        nvml.nvmlShutdown()


def _describe(nvml: Any) -> list[dict[str, Any]]:
    def get(fn_name: str, *args: Any) -> Any:
        fn = getattr(nvml, fn_name, None)
        if fn is None:
            return None
        try:
            return fn(*args)
        except nvml.NVMLError as exc:
            log.debug("%s failed: %s", fn_name, exc)
            return None

    driver = get("nvmlSystemGetDriverVersion")
    cuda = get("nvmlSystemGetCudaDriverVersion_v2") or get("nvmlSystemGetCudaDriverVersion")
    cuda_text = f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else None
    arch_names = {
        getattr(nvml, name): name.removeprefix("NVML_DEVICE_ARCH_").lower()
        for name in dir(nvml)
        if name.startswith("NVML_DEVICE_ARCH_") and name != "NVML_DEVICE_ARCH_UNKNOWN"
    }
    gpus = []
    for index in range(get("nvmlDeviceGetCount") or 0):
        h = get("nvmlDeviceGetHandleByIndex", index)
        if h is None:
            gpus.append({"index": index, "error": "NVML could not open this GPU"})
            continue
        mem = get("nvmlDeviceGetMemoryInfo", h)
        mig = get("nvmlDeviceGetMigMode", h)
        gpm = get("nvmlGpmQueryDeviceSupport", h)
        pci = get("nvmlDeviceGetPciInfo", h)
        cc = get("nvmlDeviceGetCudaComputeCapability", h)
        power_mw = get("nvmlDeviceGetEnforcedPowerLimit", h) or get(
            "nvmlDeviceGetPowerManagementLimit", h
        )
        arch = get("nvmlDeviceGetArchitecture", h)
        gpus.append(
            {
                "index": index,
                "name": _text(get("nvmlDeviceGetName", h)),
                "uuid": _text(get("nvmlDeviceGetUUID", h)),
                "pci_bus_id": _text(pci.busId) if pci is not None else None,
                "memory_total_bytes": int(mem.total) if mem is not None else None,
                "driver_version": _text(driver),
                "cuda_driver_version": cuda_text,
                "compute_capability": f"{cc[0]}.{cc[1]}" if cc else None,
                "architecture": arch_names.get(arch) if arch is not None else None,
                "mig_mode": bool(mig[0]) if mig is not None else None,
                "gpm_supported": bool(gpm is not None and gpm.isSupportedDevice),
                "pcie_link_gen": get("nvmlDeviceGetCurrPcieLinkGeneration", h),
                "pcie_link_width": get("nvmlDeviceGetCurrPcieLinkWidth", h),
                "pcie_link_gen_max": get("nvmlDeviceGetMaxPcieLinkGeneration", h),
                "pcie_link_width_max": get("nvmlDeviceGetMaxPcieLinkWidth", h),
                "power_limit_w": power_mw / 1000.0 if power_mw else None,
            }
        )
    return gpus


# ------------------------------------------------------------------------------------ helpers
def _is(nvml: Any, exc: BaseException, const_name: str) -> bool:
    code = getattr(nvml, const_name, None)
    return code is not None and getattr(exc, "value", None) == code


def _is_permanent(nvml: Any, exc: BaseException) -> bool:
    return any(_is(nvml, exc, name) for name in _PERMANENT_ERRORS)


def _error_text(nvml: Any, code: int) -> str:
    try:
        return str(nvml.NVMLError(code))
    except Exception:  # only for a message
        return f"NVML error {code}"


def _unsupported_reason(nvml: Any, exc: BaseException, what: str) -> str:
    if _is(nvml, exc, "NVML_ERROR_NO_PERMISSION"):
        return (
            f"{what}: no permission (NVML: {exc}); run as root or let users read GPU counters "
            "(NVIDIA driver option NVreg_RestrictProfilingToAdminUsers=0)"
        )
    if _is(nvml, exc, "NVML_ERROR_FUNCTION_NOT_FOUND"):
        return f"{what}: not in this NVIDIA driver (NVML: {exc}); a newer driver has it"
    return f"{what}: not supported on this GPU or driver (NVML: {exc})"


def _device_error_message(nvml: Any, exc: BaseException, index: int) -> str:
    if _is(nvml, exc, "NVML_ERROR_NO_PERMISSION"):
        return (
            f"no permission to open GPU {index} through NVML ({exc}): run as a user with access "
            "to /dev/nvidia*, or select other GPUs"
        )
    if _is(nvml, exc, "NVML_ERROR_GPU_IS_LOST"):
        return (
            f"GPU {index} is lost ({exc}): check `nvidia-smi` and the kernel log for Xid errors; "
            "an administrator may need to reset the GPU; or select other GPUs"
        )
    return f"NVML could not open GPU {index} ({exc}): check `nvidia-smi`, or select other GPUs"


def _field_number(nvml: Any, value: Any) -> float:
    """The number in an nvmlFieldValue_t's union, read by its valueType."""
    member = {
        getattr(nvml, "NVML_VALUE_TYPE_DOUBLE", 0): "dVal",
        getattr(nvml, "NVML_VALUE_TYPE_UNSIGNED_INT", 1): "uiVal",
        getattr(nvml, "NVML_VALUE_TYPE_UNSIGNED_LONG", 2): "ulVal",
        getattr(nvml, "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG", 3): "ullVal",
        getattr(nvml, "NVML_VALUE_TYPE_SIGNED_LONG_LONG", 4): "sllVal",
        getattr(nvml, "NVML_VALUE_TYPE_SIGNED_INT", 5): "siVal",
        getattr(nvml, "NVML_VALUE_TYPE_UNSIGNED_SHORT", 6): "usVal",
    }.get(value.valueType, "ullVal")
    return getattr(value.value, member)


def _field_modulus(nvml: Any, value: Any) -> int:
    """Where a counter field wraps: 2**32 for 32-bit values (PCIe bytes on H100), else 2**64."""
    if value.valueType in (
        getattr(nvml, "NVML_VALUE_TYPE_UNSIGNED_INT", 1),
        getattr(nvml, "NVML_VALUE_TYPE_SIGNED_INT", 5),
    ):
        return 1 << 32
    return 1 << 64


def _text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value

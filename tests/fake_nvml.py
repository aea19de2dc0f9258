"""A fake ``pynvml`` whose answers come from a per-test spec, for tests of the NVML boundary.

It keeps pynvml's own constants, error classes and the ctypes request structure of
``nvmlGpmMetricsGet``, so the code's use of them is exercised as on a real GPU. Put it in
``sys.modules['pynvml']``.
"""

from __future__ import annotations

import ctypes
import types
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pynvml as real_nvml

MIB = 1 << 20
NOT_SUPPORTED = real_nvml.NVML_ERROR_NOT_SUPPORTED
FUNCTION_NOT_FOUND = real_nvml.NVML_ERROR_FUNCTION_NOT_FOUND
UNKNOWN = real_nvml.NVML_ERROR_UNKNOWN
GPM = {
    "sm_activity_pct": real_nvml.NVML_GPM_METRIC_SM_UTIL,
    "sm_occupancy_pct": real_nvml.NVML_GPM_METRIC_SM_OCCUPANCY,
    "tensor_activity_pct": real_nvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
    "dram_bw_util_pct": real_nvml.NVML_GPM_METRIC_DRAM_BW_UTIL,
    "pcie_tx": real_nvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC,
    "pcie_rx": real_nvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC,
}
FI_POWER = real_nvml.NVML_FI_DEV_POWER_INSTANT
FI_TX = real_nvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES
FI_RX = real_nvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES
UINT = real_nvml.NVML_VALUE_TYPE_UNSIGNED_INT


class Fail:
    """A spec value: the call raises (or a field/GPM metric returns) this NVML error code."""

    def __init__(self, code: int):
        self.code = code


class Seq:
    """A spec value: successive calls get successive items; the last one repeats."""

    def __init__(self, *items: Any):
        self.items = list(items)
        self.position = 0

    def next(self) -> Any:
        item = self.items[min(self.position, len(self.items) - 1)]
        self.position += 1
        return item


class Clock:
    """The probe's monotonic and wall clocks, moved by the test."""

    def __init__(self) -> None:
        self.t = 100.0

    def monotonic(self) -> float:
        return self.t

    def wall(self) -> float:
        return 1_700_000_000.0 + self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


DEFAULTS: dict[Any, Any] = {
    "nvmlDeviceGetUtilizationRates": (97, 35),
    "nvmlDeviceGetMemoryInfo": (30 << 30, 80 << 30),
    "nvmlDeviceGetTemperature": 55,
    ("nvmlDeviceGetClockInfo", real_nvml.NVML_CLOCK_SM): 1980,
    ("nvmlDeviceGetClockInfo", real_nvml.NVML_CLOCK_MEM): 2619,
    "nvmlDeviceGetCurrentClocksEventReasons": 0,
    "nvmlDeviceGetCurrentClocksThrottleReasons": 0,
    "nvmlDeviceGetTotalEnergyConsumption": 5_000_000,
    "nvmlDeviceGetPowerUsage": 300_000,
    ("field", FI_POWER): 650_000,
    ("field", FI_TX): 1_000,
    ("field", FI_RX): 2_000,
    "nvmlDeviceGetMaxPcieLinkGeneration": 5,
    "nvmlDeviceGetMaxPcieLinkWidth": 16,
    ("nvmlDeviceGetPcieThroughput", real_nvml.NVML_PCIE_UTIL_TX_BYTES): 1_500,
    ("nvmlDeviceGetPcieThroughput", real_nvml.NVML_PCIE_UTIL_RX_BYTES): 2_500,
    "nvmlGpmQueryDeviceSupport": 1,
    "nvmlDeviceGetMigMode": 0,
    ("gpm", GPM["sm_activity_pct"]): 70.0,
    ("gpm", GPM["sm_occupancy_pct"]): 15.0,
    ("gpm", GPM["tensor_activity_pct"]): 55.5,
    ("gpm", GPM["dram_bw_util_pct"]): 23.25,
    ("gpm", GPM["pcie_tx"]): 900.0,
    ("gpm", GPM["pcie_rx"]): 14_000.0,
    "nvmlSystemGetDriverVersion": "580.159.04",
    "nvmlSystemGetCudaDriverVersion_v2": 12040,
    "nvmlDeviceGetName": "NVIDIA H100 80GB HBM3",
    "nvmlDeviceGetArchitecture": real_nvml.NVML_DEVICE_ARCH_HOPPER,
    "nvmlDeviceGetCudaComputeCapability": (9, 0),
    "nvmlDeviceGetEnforcedPowerLimit": 700_000,
    "nvmlDeviceGetCurrPcieLinkGeneration": 5,
    "nvmlDeviceGetCurrPcieLinkWidth": 16,
}


class FakeNvml(types.ModuleType):
    """A pynvml stand-in whose answers come from ``spec`` (per GPU, falling back to DEFAULTS)."""

    def __init__(self, clock: Clock, gpus: int = 1):
        super().__init__("pynvml")
        for name in dir(real_nvml):
            if name.startswith("NVML_") and isinstance(getattr(real_nvml, name), int):
                setattr(self, name, getattr(real_nvml, name))
        self.NVMLError = real_nvml.NVMLError
        self.c_nvmlGpmMetricsGet_t = real_nvml.c_nvmlGpmMetricsGet_t
        self.clock = clock
        self.gpu_count = gpus
        self.init_error: int | None = None
        self.live_inits = 0
        self.calls: Counter[str] = Counter()
        self.spec: dict[tuple[int | None, Any], Any] = {}
        self.gpm_buffers: dict[int, Any] = {}  # address -> (gpu, snapshot number) or None
        self.gpm_snapshots = 0
        self.gpm_windows: list[tuple[int, int]] = []
        self.freed: list[int] = []

    def set(self, key: Any, value: Any, gpu: int | None = None) -> None:
        self.spec[(gpu, key)] = value

    def _answer(self, fn: str, key: Any, index: int) -> Any:
        """Count the call and answer from the spec; a ``Fail`` raises unless per item."""
        self.calls[fn] += 1
        for spec_key in ((index, key), (None, key)):
            if spec_key in self.spec:
                value = self.spec[spec_key]
                break
        else:
            value = DEFAULTS[key]
        if isinstance(value, Seq):
            value = value.next()
        per_item = isinstance(key, tuple) and key[0] in ("field", "gpm")
        if isinstance(value, Fail) and not per_item:
            raise real_nvml.NVMLError(value.code)
        return value

    def _whole_call(self, fn: str, index: int) -> None:
        """Count a call whose only possible answer from the spec is a ``Fail``."""
        if (index, fn) in self.spec or (None, fn) in self.spec:
            self._answer(fn, fn, index)
        else:
            self.calls[fn] += 1

    # -------------------------------------------------------------------------- system
    def nvmlInit(self) -> None:
        self.calls["nvmlInit"] += 1
        if self.init_error is not None:
            raise real_nvml.NVMLError(self.init_error)
        self.live_inits += 1

    def nvmlShutdown(self) -> None:
        self.calls["nvmlShutdown"] += 1
        self.live_inits -= 1

    def nvmlDeviceGetCount(self) -> int:
        return self.gpu_count

    def nvmlSystemGetDriverVersion(self) -> str:
        return self._answer("nvmlSystemGetDriverVersion", "nvmlSystemGetDriverVersion", -1)

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        fn = "nvmlSystemGetCudaDriverVersion_v2"
        return self._answer(fn, fn, -1)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self._whole_call("nvmlDeviceGetHandleByIndex", index)
        return SimpleNamespace(index=index)

    # -------------------------------------------------------------------------- device
    def _device(self, fn: str, handle: Any, *extra: Any) -> Any:
        """Answer a device query; the key has the extra arguments where DEFAULTS has them."""
        key = (fn, *extra) if (fn, *extra) in DEFAULTS else fn
        return self._answer(fn, key, handle.index)

    def __getattr__(self, name: str) -> Any:
        known = name in DEFAULTS or any(isinstance(k, tuple) and k[0] == name for k in DEFAULTS)
        if name.startswith("nvmlDeviceGet") and known:
            return lambda handle, *extra: self._device(name, handle, *extra)
        raise AttributeError(name)

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        util, memory = self._device("nvmlDeviceGetUtilizationRates", handle)
        return SimpleNamespace(gpu=util, memory=memory)

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        used, total = self._device("nvmlDeviceGetMemoryInfo", handle)
        return SimpleNamespace(used=used, total=total, free=total - used)

    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:
        mode = self._device("nvmlDeviceGetMigMode", handle)
        return [mode, mode]

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        return SimpleNamespace(busId=b"00000000:18:00.0")

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return f"GPU-fake-{handle.index}"

    def nvmlDeviceGetFieldValues(self, handle: Any, field_ids: list[int]) -> list[Any]:
        self._whole_call("nvmlDeviceGetFieldValues", handle.index)
        values = []
        for field_id in field_ids:
            answer = self._answer(f"field {field_id}", ("field", field_id), handle.index)
            failed = isinstance(answer, Fail)
            values.append(
                SimpleNamespace(
                    fieldId=field_id,
                    scopeId=0,
                    timestamp=0 if failed else round(self.clock.wall() * 1e6),
                    latencyUsec=0,
                    valueType=UINT,
                    nvmlReturn=answer.code if failed else 0,
                    value=SimpleNamespace(uiVal=0 if failed else answer, ullVal=0, dVal=0.0),
                )
            )
        return values

    # ----------------------------------------------------------------------------- GPM
    def nvmlGpmQueryDeviceSupport(self, handle: Any) -> Any:
        supported = self._device("nvmlGpmQueryDeviceSupport", handle)
        return SimpleNamespace(version=1, isSupportedDevice=supported)

    def nvmlGpmSampleAlloc(self) -> Any:
        self.calls["nvmlGpmSampleAlloc"] += 1
        address = 0x1000 + 0x10 * len(self.gpm_buffers)
        self.gpm_buffers[address] = None
        return ctypes.cast(ctypes.c_void_p(address), real_nvml.c_nvmlGpmSample_t)

    def nvmlGpmSampleFree(self, sample: Any) -> None:
        self.freed.append(_address(sample))

    def nvmlGpmSampleGet(self, handle: Any, sample: Any) -> Any:
        self._whole_call("nvmlGpmSampleGet", handle.index)
        self.gpm_snapshots += 1
        self.gpm_buffers[_address(sample)] = (handle.index, self.gpm_snapshots)
        return sample

    def nvmlGpmMetricsGet(self, request: Any) -> Any:
        self.calls["nvmlGpmMetricsGet"] += 1
        assert request.version == real_nvml.NVML_GPM_METRICS_GET_VERSION
        first = self.gpm_buffers[_address(request.sample1)]
        second = self.gpm_buffers[_address(request.sample2)]
        assert first is not None and second is not None, "GPM sample buffer never filled"
        assert first[0] == second[0], "GPM samples of different GPUs"
        assert first[1] < second[1], "GPM samples out of order"
        self.gpm_windows.append((first[1], second[1]))
        for slot in range(request.numMetrics):
            metric = request.metrics[slot]
            answer = self._answer("gpm metric", ("gpm", metric.metricId), first[0])
            if isinstance(answer, Fail):
                metric.nvmlReturn, metric.value = answer.code, 0.0
            else:
                metric.nvmlReturn, metric.value = 0, answer
        return request


def _address(pointer: Any) -> int:
    return ctypes.cast(pointer, ctypes.c_void_p).value

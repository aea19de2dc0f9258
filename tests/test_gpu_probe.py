"""Tests of the GPU probe against a fake ``pynvml`` put in ``sys.modules`` (the module boundary).

The fake keeps pynvml's own constants, error classes and the ctypes request structure of
``nvmlGpmMetricsGet``, so the probe's use of them is exercised as on a real GPU.
"""

from __future__ import annotations

import ctypes
import json
import logging
import math
import sys
import types
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pynvml as real_nvml
import pytest
from nvml_replay import NvmlReplay

from gpulens.errors import DeviceError, UsageError
from gpulens.probes import gpu
from gpulens.probes.base import Probe

FIXTURES_DIR = Path(__file__).parent / "fixtures"
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


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, clock: Clock) -> FakeNvml:
    module = FakeNvml(clock)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


def open_probe(clock: Clock, indices: list[int] | None = None, **options: Any) -> Any:
    return gpu.open_gpu_probe(
        indices, monotonic=clock.monotonic, wall_time=clock.wall, sleep=clock.sleep, **options
    )


def take(probe: Any, clock: Clock, count: int, every_s: float = 0.1) -> list[dict[str, Any]]:
    """``count`` samples, ``every_s`` apart; returns the rows of GPU 0 only."""
    rows = []
    for _ in range(count):
        rows.append(probe.sample()[0])
        clock.t += every_s
    return rows


def assert_is_probe(probe: Probe) -> None:
    """The ``Probe`` protocol, checked by hand (it is not runtime-checkable)."""
    assert probe.name == "gpu"
    assert probe.schema == gpu.GPU_SAMPLE_SCHEMA
    assert isinstance(probe.unsupported, dict)
    assert callable(probe.sample) and callable(probe.close)


# ------------------------------------------------------------------------------ null probe
def test_null_probe_when_pynvml_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    probe = gpu.open_gpu_probe()
    assert isinstance(probe, gpu.NullGpuProbe)
    assert_is_probe(probe)
    assert "pip install nvidia-ml-py" in probe.reason
    assert probe.sample() == []
    assert set(probe.unsupported) == set(gpu.METRICS)
    assert probe.schema == gpu.GPU_SAMPLE_SCHEMA
    assert gpu.describe_gpus() == []
    assert gpu.nvml_status() == (False, probe.reason)
    probe.close()


@pytest.mark.parametrize(
    ("error", "fix"),
    [
        ("NVML_ERROR_LIBRARY_NOT_FOUND", "libnvidia-ml.so"),
        ("NVML_ERROR_DRIVER_NOT_LOADED", "driver is not loaded"),
        ("NVML_ERROR_NO_PERMISSION", "/dev/nvidia"),
        ("NVML_ERROR_UNKNOWN", "nvmlInit failed"),
    ],
)
def test_null_probe_when_nvml_init_fails(fake: FakeNvml, clock: Clock, error: str, fix: str):
    fake.init_error = getattr(real_nvml, error)
    probe = open_probe(clock)
    assert isinstance(probe, gpu.NullGpuProbe)
    assert probe.reason.startswith("NVML not available: ")
    assert fix in probe.reason
    assert "\n" not in probe.reason
    assert probe.sample() == []
    assert all(reason == probe.reason for reason in probe.unsupported.values())
    assert gpu.nvml_status()[0] is False
    assert gpu.describe_gpus() == []


def test_null_probe_when_there_is_no_gpu(fake: FakeNvml, clock: Clock) -> None:
    fake.gpu_count = 0
    probe = open_probe(clock)
    assert isinstance(probe, gpu.NullGpuProbe)
    assert "no GPU" in probe.reason
    assert fake.live_inits == 0
    assert gpu.nvml_status() == (False, "NVML found no GPU; GPU metrics are not measured")


def test_unknown_gpu_index_is_a_usage_error(fake: FakeNvml, clock: Clock) -> None:
    fake.gpu_count = 2
    with pytest.raises(UsageError, match=r"GPU index 5 does not exist: NVML sees 2 GPU\(s\)"):
        open_probe(clock, [0, 5])
    assert fake.live_inits == 0


def test_gpu_without_permission_is_a_device_error(fake: FakeNvml, clock: Clock) -> None:
    fake.set("nvmlDeviceGetHandleByIndex", Fail(real_nvml.NVML_ERROR_NO_PERMISSION), gpu=0)
    with pytest.raises(DeviceError, match="no permission to open GPU 0 .*select other GPUs"):
        open_probe(clock)
    assert fake.live_inits == 0


def test_lost_gpu_at_open_is_a_device_error_and_frees_gpm(fake: FakeNvml, clock: Clock) -> None:
    fake.gpu_count = 2
    fake.set("nvmlDeviceGetTotalEnergyConsumption", Fail(real_nvml.NVML_ERROR_GPU_IS_LOST), gpu=1)
    with pytest.raises(DeviceError, match="GPU 1 is lost.*Xid"):
        open_probe(clock)
    assert fake.live_inits == 0


# ------------------------------------------------------------------------ the full path
def test_hopper_like_gpu_gives_every_column(fake: FakeNvml, clock: Clock) -> None:
    probe = open_probe(clock)
    assert isinstance(probe, gpu.NvmlGpuProbe)
    assert_is_probe(probe)
    assert probe.unsupported == {}
    assert probe.gpu_indices == [0]
    sources = probe.sources[0]
    assert sources["power_w"] == "NVML_FI_DEV_POWER_INSTANT"
    assert sources["pcie_tx_bytes_per_s"] == sources["sm_activity_pct"] == "gpm"

    first, second = take(probe, clock, 2)
    assert first["time_unix_s"] == pytest.approx(1_700_000_100.12)
    assert first["gpu_index"] == 0
    assert first["gpu_util_pct"] == 97.0 and first["mem_util_pct"] == 35.0
    assert first["mem_used_bytes"] == 30 << 30 and first["mem_total_bytes"] == 80 << 30
    assert first["power_w"] == 650.0  # the instant field, not the 1 s average (300 W)
    assert first["temperature_c"] == 55.0
    assert (first["sm_clock_mhz"], first["mem_clock_mhz"]) == (1980, 2619)
    assert first["throttle_reasons"] == 0
    windowed = [*gpu.GPM_COLUMNS, *gpu.PCIE_COLUMNS]
    assert all(first[col] is None for col in windowed)  # no window before the first row

    assert second["sm_activity_pct"] == 70.0
    assert second["sm_occupancy_pct"] == 15.0
    assert second["tensor_activity_pct"] == 55.5
    assert second["dram_bw_util_pct"] == 23.25
    assert second["pcie_tx_bytes_per_s"] == 900.0 * MIB
    assert second["pcie_rx_bytes_per_s"] == 14_000.0 * MIB
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 0  # the slow call is never made

    table = pa.Table.from_pylist([first, second], schema=probe.schema)
    assert table.num_rows == 2
    assert probe.last_sample_cost_s > 0
    assert probe.sample_count == 2


def test_rows_fit_the_schema_with_a_64_bit_throttle_mask(fake: FakeNvml, clock: Clock) -> None:
    mask = (1 << 63) | 0x44  # top bit set: does not fit a signed int64
    fake.set("nvmlDeviceGetCurrentClocksEventReasons", mask)
    probe = open_probe(clock)
    row = probe.sample()[0]
    assert row["throttle_reasons"] == mask
    table = pa.Table.from_pylist([row], schema=gpu.GPU_SAMPLE_SCHEMA)
    assert table.column("throttle_reasons").type == pa.uint64()
    assert table.column("throttle_reasons")[0].as_py() == mask
    assert list(row) == list(gpu.COLUMNS)


def test_throttle_reasons_fall_back_to_the_older_call(fake: FakeNvml, clock: Clock) -> None:
    fake.set("nvmlDeviceGetCurrentClocksEventReasons", Fail(FUNCTION_NOT_FOUND))
    fake.set("nvmlDeviceGetCurrentClocksThrottleReasons", 0x4)
    probe = open_probe(clock)
    assert probe.sources[0]["throttle_reasons"] == "nvmlDeviceGetCurrentClocksThrottleReasons"
    assert "throttle_reasons" not in probe.unsupported
    assert [r["throttle_reasons"] for r in take(probe, clock, 2)] == [4, 4]
    assert fake.calls["nvmlDeviceGetCurrentClocksEventReasons"] == 1


# ----------------------------------------------------------------------- unsupported
def test_not_supported_metrics_are_listed_and_never_called_again(fake: FakeNvml, clock: Clock):
    fake.set("nvmlDeviceGetTemperature", Fail(NOT_SUPPORTED))
    fake.set("nvmlDeviceGetUtilizationRates", Fail(NOT_SUPPORTED))
    fake.set("nvmlDeviceGetTotalEnergyConsumption", Fail(NOT_SUPPORTED))
    probe = open_probe(clock)
    assert set(probe.unsupported) == {
        "temperature_c",
        "gpu_util_pct",
        "mem_util_pct",
        "energy_j",
    }
    assert "Not Supported" in probe.unsupported["temperature_c"]
    assert "nvmlDeviceGetTemperature" in probe.unsupported["temperature_c"]
    rows = take(probe, clock, 3)
    for row in rows:
        for col in probe.unsupported:
            assert row[col] is None  # null, never 0
        assert row["sm_clock_mhz"] == 1980
    assert fake.calls["nvmlDeviceGetTemperature"] == 1  # only the probe at open
    assert fake.calls["nvmlDeviceGetUtilizationRates"] == 1
    assert fake.calls["nvmlDeviceGetTotalEnergyConsumption"] == 1


def test_no_permission_metric_names_the_fix(fake: FakeNvml, clock: Clock) -> None:
    fake.set("nvmlDeviceGetTemperature", Fail(real_nvml.NVML_ERROR_NO_PERMISSION))
    probe = open_probe(clock)
    assert "run as root" in probe.unsupported["temperature_c"]


def test_unsupported_on_some_gpus_names_them(fake: FakeNvml, clock: Clock) -> None:
    fake.gpu_count = 2
    fake.set("nvmlDeviceGetTemperature", Fail(NOT_SUPPORTED), gpu=1)
    probe = open_probe(clock)
    assert probe.unsupported["temperature_c"].startswith("GPU 1: ")
    rows = probe.sample()
    assert [r["gpu_index"] for r in rows] == [0, 1]
    assert rows[0]["temperature_c"] == 55.0 and rows[1]["temperature_c"] is None


def test_a_transient_error_nulls_only_that_value(
    fake: FakeNvml, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    sm_clock = ("nvmlDeviceGetClockInfo", real_nvml.NVML_CLOCK_SM)
    fake.set(sm_clock, Seq(1980, 1980, Fail(UNKNOWN), 1755))  # open, row 0, row 1, row 2
    fake.set(("field", FI_POWER), Seq(650_000, 650_000, 640_000, Fail(UNKNOWN)))
    caplog.set_level(logging.DEBUG, logger="gpulens.probes.gpu")
    probe = open_probe(clock)
    rows = take(probe, clock, 3)
    assert [r["sm_clock_mhz"] for r in rows] == [1980, None, 1755]
    assert [r["power_w"] for r in rows] == [650.0, 640.0, None]
    assert rows[1]["mem_clock_mhz"] == 2619 and rows[2]["temperature_c"] == 55.0
    assert "sm_clock_mhz" not in probe.unsupported and "power_w" not in probe.unsupported
    assert "nvmlDeviceGetClockInfo failed: Unknown Error" in caplog.text


def test_a_transient_error_at_open_is_tried_again(fake: FakeNvml, clock: Clock) -> None:
    fake.set("nvmlDeviceGetTemperature", Seq(Fail(UNKNOWN), 61))
    probe = open_probe(clock)
    assert "temperature_c" not in probe.unsupported
    assert probe.sample()[0]["temperature_c"] == 61.0


# --------------------------------------------------------------------------- energy
def test_energy_is_counted_from_the_open(fake: FakeNvml, clock: Clock) -> None:
    fake.set(
        "nvmlDeviceGetTotalEnergyConsumption",
        Seq(5_000_000, 5_001_500, 5_001_500, 5_066_000),  # mJ: open, then three rows
    )
    probe = open_probe(clock)
    assert [r["energy_j"] for r in take(probe, clock, 3)] == [1.5, 1.5, 66.0]


def test_energy_base_is_the_first_good_read_when_open_failed(fake: FakeNvml, clock: Clock):
    fake.set("nvmlDeviceGetTotalEnergyConsumption", Seq(Fail(UNKNOWN), 7_000_000, 7_000_250))
    probe = open_probe(clock)
    assert [r["energy_j"] for r in take(probe, clock, 2)] == [0.0, 0.25]


def test_power_falls_back_to_power_usage(fake: FakeNvml, clock: Clock) -> None:
    fake.set(("field", FI_POWER), Fail(NOT_SUPPORTED))
    probe = open_probe(clock)
    assert probe.sources[0]["power_w"] == "nvmlDeviceGetPowerUsage"
    assert probe.sample()[0]["power_w"] == 300.0


# ------------------------------------------------------------------------------ GPM
def test_gpm_windows_chain_from_one_sample_to_the_next(fake: FakeNvml, clock: Clock) -> None:
    fake.set(("gpm", GPM["sm_activity_pct"]), Seq(0.5, 10.0, 20.0, 30.0))  # first: open probe
    probe = open_probe(clock)
    rows = take(probe, clock, 4)
    assert [r["sm_activity_pct"] for r in rows] == [None, 10.0, 20.0, 30.0]
    # the probe at open uses snapshots 1-2; rows use 3-4, 4-5, 5-6
    assert fake.gpm_windows == [(1, 2), (3, 4), (4, 5), (5, 6)]


def test_gpm_stale_window_is_null_and_the_next_one_spans_it(fake: FakeNvml, clock: Clock):
    nan = float("nan")
    for col in ("sm_activity_pct", "sm_occupancy_pct", "tensor_activity_pct", "pcie_tx", "pcie_rx"):
        fake.set(("gpm", GPM[col]), Seq(1.0, 5.0, 0.0, 6.0))
    fake.set(("gpm", GPM["dram_bw_util_pct"]), Seq(1.0, 5.0, nan, 6.0))  # NaN: not refreshed
    probe = open_probe(clock)
    rows = take(probe, clock, 4)
    assert [r["dram_bw_util_pct"] for r in rows] == [None, 5.0, None, 6.0]
    assert [r["pcie_rx_bytes_per_s"] for r in rows] == [None, 5.0 * MIB, None, 6.0 * MIB]
    assert fake.gpm_windows[1:] == [(3, 4), (4, 5), (4, 6)]  # the stale window is not closed


def test_gpm_all_zero_short_window_counts_as_stale_but_long_one_is_idle(
    fake: FakeNvml, clock: Clock
) -> None:
    for metric_id in GPM.values():
        fake.set(("gpm", metric_id), Seq(1.0, 0.0))
    probe = open_probe(clock)
    probe.sample()
    clock.t += 0.1
    assert probe.sample()[0]["sm_activity_pct"] is None  # zeros after 0.1 s: no refresh
    clock.t += 0.6
    assert probe.sample()[0]["sm_activity_pct"] == 0.0  # zeros over 0.7 s: an idle GPU


def test_gpm_windows_shorter_than_the_minimum_are_not_computed(fake: FakeNvml, clock: Clock):
    probe = open_probe(clock, gpm_min_interval_s=0.09)
    calls_before = fake.calls["nvmlGpmMetricsGet"]
    rows = take(probe, clock, 4, every_s=0.05)
    assert [r["sm_activity_pct"] for r in rows] == [None, None, 70.0, None]
    assert fake.calls["nvmlGpmMetricsGet"] - calls_before == 1


def test_gpm_metric_not_supported_is_listed(fake: FakeNvml, clock: Clock) -> None:
    fake.set(("gpm", GPM["tensor_activity_pct"]), Fail(NOT_SUPPORTED))
    probe = open_probe(clock)
    assert set(probe.unsupported) == {"tensor_activity_pct"}
    assert "NVML_GPM_METRIC_ANY_TENSOR_UTIL" in probe.unsupported["tensor_activity_pct"]
    row = take(probe, clock, 2)[1]
    assert row["tensor_activity_pct"] is None and row["sm_activity_pct"] == 70.0


def test_gpu_without_gpm_uses_the_pcie_counters(fake: FakeNvml, clock: Clock) -> None:
    fake.set("nvmlGpmQueryDeviceSupport", 0)
    probe = open_probe(clock)
    assert set(probe.unsupported) == set(gpu.GPM_COLUMNS)
    assert all("Hopper" in probe.unsupported[col] for col in gpu.GPM_COLUMNS)
    assert probe.sources[0]["pcie_rx_bytes_per_s"] == "NVML_FI_DEV_PCIE_COUNT_TX_BYTES/RX_BYTES"
    assert fake.calls["nvmlGpmSampleAlloc"] == 0
    assert fake.calls["nvmlGpmSampleGet"] == 0


def test_mig_mode_turns_gpm_off_with_a_reason(fake: FakeNvml, clock: Clock) -> None:
    fake.set("nvmlDeviceGetMigMode", 1)
    probe = open_probe(clock)
    assert "MIG is enabled" in probe.unsupported["sm_activity_pct"]
    assert "pcie_tx_bytes_per_s" not in probe.unsupported  # the counters still work


def test_close_frees_gpm_buffers_and_releases_nvml(fake: FakeNvml, clock: Clock) -> None:
    probe = open_probe(clock)
    take(probe, clock, 2)
    assert fake.live_inits == 1
    probe.close()
    probe.close()
    assert sorted(fake.freed) == sorted(fake.gpm_buffers)
    assert fake.live_inits == 0
    assert probe.sample() == []


# ----------------------------------------------------------------------------- PCIe
def test_pcie_rate_from_wrapping_32_bit_counters(fake: FakeNvml, clock: Clock) -> None:
    fake.set("nvmlGpmQueryDeviceSupport", 0)
    fake.set("nvmlDeviceGetMaxPcieLinkGeneration", 4)  # 31.5 GB/s: no wrap in 0.1 s
    top = 1 << 32
    fake.set(("field", FI_TX), Seq(0, top - 1_000_000, 500_000_000 - 1_000_000, 500_000_000))
    fake.set(("field", FI_RX), Seq(0, 10, 10, 2_000_000_010))
    probe = open_probe(clock)
    rows = take(probe, clock, 3)
    assert rows[0]["pcie_tx_bytes_per_s"] is None and rows[0]["pcie_rx_bytes_per_s"] is None
    assert rows[1]["pcie_tx_bytes_per_s"] == pytest.approx(5e9)  # across the wrap
    assert rows[1]["pcie_rx_bytes_per_s"] == 0.0  # a real zero, not null
    assert rows[2]["pcie_tx_bytes_per_s"] == pytest.approx(1e7)
    assert rows[2]["pcie_rx_bytes_per_s"] == pytest.approx(2e10)


def test_pcie_rate_is_null_where_the_counter_may_have_wrapped(
    fake: FakeNvml, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    fake.set("nvmlGpmQueryDeviceSupport", 0)  # gen 5 x16: 63 GB/s wraps 2**32 in 68 ms
    fake.set(("field", FI_TX), Seq(0, 0, 100, 200))
    probe = open_probe(clock)
    rows = take(probe, clock, 3, every_s=0.1)
    assert all(r["pcie_tx_bytes_per_s"] is None for r in rows)
    assert "wrap" in caplog.text
    fast = take(probe, clock, 2, every_s=0.05)
    assert fast[1]["pcie_tx_bytes_per_s"] == pytest.approx(0.0)


def test_pcie_counter_field_error_restarts_the_window(fake: FakeNvml, clock: Clock) -> None:
    fake.set("nvmlGpmQueryDeviceSupport", 0)
    fake.set("nvmlDeviceGetMaxPcieLinkGeneration", 3)
    fake.set(("field", FI_RX), Seq(0, 0, Fail(UNKNOWN), 100, 200))
    probe = open_probe(clock)
    rows = take(probe, clock, 4)
    assert [r["pcie_rx_bytes_per_s"] for r in rows] == [None, None, None, pytest.approx(1000.0)]


def test_pcie_throughput_fallback(fake: FakeNvml, clock: Clock) -> None:
    fake.set("nvmlGpmQueryDeviceSupport", 0)
    fake.set(("field", FI_TX), Fail(NOT_SUPPORTED))
    probe = open_probe(clock)
    assert probe.sources[0]["pcie_tx_bytes_per_s"] == "nvmlDeviceGetPcieThroughput"
    row = probe.sample()[0]
    assert row["pcie_tx_bytes_per_s"] == 1_500_000.0  # KB/s -> bytes/s
    assert row["pcie_rx_bytes_per_s"] == 2_500_000.0


def test_pcie_without_any_source_is_unsupported(fake: FakeNvml, clock: Clock) -> None:
    fake.set("nvmlGpmQueryDeviceSupport", 0)
    fake.set(("field", FI_TX), Fail(NOT_SUPPORTED))
    probe = open_probe(clock, pcie_throughput_fallback=False)
    assert "fallback is off" in probe.unsupported["pcie_tx_bytes_per_s"]
    assert probe.sample()[0]["pcie_rx_bytes_per_s"] is None
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 0


# ----------------------------------------------------------------------- describe
def test_describe_gpus(fake: FakeNvml, clock: Clock) -> None:
    fake.set("nvmlDeviceGetMigMode", Fail(NOT_SUPPORTED))
    (info,) = gpu.describe_gpus()
    assert info == {
        "index": 0,
        "name": "NVIDIA H100 80GB HBM3",
        "uuid": "GPU-fake-0",
        "pci_bus_id": "00000000:18:00.0",
        "memory_total_bytes": 80 << 30,
        "driver_version": "580.159.04",
        "cuda_driver_version": "12.4",
        "compute_capability": "9.0",
        "architecture": "hopper",
        "mig_mode": None,
        "gpm_supported": True,
        "pcie_link_gen": 5,
        "pcie_link_width": 16,
        "pcie_link_gen_max": 5,
        "pcie_link_width_max": 16,
        "power_limit_w": 700.0,
    }
    assert fake.live_inits == 0
    assert gpu.nvml_status() == (True, "NVML ok: driver 580.159.04, 1 GPU(s)")


# ------------------------------------------------------------------------- replay
def _fixture_dirs() -> list[Path]:
    return sorted(p for p in FIXTURES_DIR.glob("nvml_*") if (p / "raw_calls.json").is_file())


def _same(got: Any, want: Any) -> bool:
    if isinstance(got, float) and isinstance(want, float):
        return got == pytest.approx(want, rel=1e-12) or (math.isnan(got) and math.isnan(want))
    return got == want


@pytest.mark.parametrize("fixture_dir", _fixture_dirs(), ids=lambda p: p.name)
def test_replayed_fixture_gives_the_recorded_rows(
    fixture_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    replay = NvmlReplay.load(fixture_dir)
    monkeypatch.setitem(sys.modules, "pynvml", replay)
    meta_path = fixture_dir / "describe.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}

    if "describe" in replay.phases:
        described = gpu.describe_gpus()
        if "gpus" in meta:
            assert described == meta["gpus"]
    probe = gpu.open_gpu_probe(
        meta.get("gpu_indices"),
        monotonic=replay.monotonic,
        wall_time=replay.wall_time,
        sleep=replay.sleep,
    )
    assert isinstance(probe, gpu.NvmlGpuProbe)
    rows = []
    for _ in range(replay.sample_count()):
        rows.extend(probe.sample())
    probe.close()
    assert replay.unserved() == []  # the probe made exactly the recorded calls

    if (fixture_dir / "gpu_samples.parquet").is_file():
        expected = pq.read_table(fixture_dir / "gpu_samples.parquet").to_pylist()
    else:
        expected = json.loads((fixture_dir / "expected_rows.json").read_text())
    assert len(rows) == len(expected)
    for got, want in zip(rows, expected, strict=True):
        assert list(got) == list(gpu.COLUMNS)
        diffs = {k: (got[k], want[k]) for k in gpu.COLUMNS if not _same(got[k], want[k])}
        assert diffs == {}
    if "unsupported" in meta:
        assert set(probe.unsupported) == set(meta["unsupported"])
    if "sources" in meta:
        for index, sources in meta["sources"].items():
            assert sources.items() <= probe.sources[int(index)].items()

    # What must hold of any GPU's rows.
    pa.Table.from_pylist(rows, schema=gpu.GPU_SAMPLE_SCHEMA)
    by_gpu: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        by_gpu.setdefault(row["gpu_index"], []).append(row)
    for gpu_rows in by_gpu.values():
        first = gpu_rows[0]
        assert all(first[c] is None for c in (*gpu.GPM_COLUMNS, *gpu.PCIE_COLUMNS))
        energies = [r["energy_j"] for r in gpu_rows if r["energy_j"] is not None]
        assert energies == sorted(energies) and all(e >= 0 for e in energies)
        for row in gpu_rows:
            for col in probe.unsupported:
                assert row[col] is None
            for col in ("gpu_util_pct", "mem_util_pct", *gpu.GPM_COLUMNS):
                assert row[col] is None or 0.0 <= row[col] <= 100.5
            if row["mem_used_bytes"] is not None:
                assert 0 <= row["mem_used_bytes"] <= row["mem_total_bytes"]
            for col in gpu.PCIE_COLUMNS:
                assert row[col] is None or row[col] >= 0.0


def _gpm_fixture_dirs() -> list[Path]:
    return [
        p
        for p in _fixture_dirs()
        if '"nvmlGpmMetricsGet"' in (p / "raw_calls.json").read_text()
        and (p / "gpu_samples.parquet").is_file()
    ]


@pytest.mark.parametrize("fixture_dir", _gpm_fixture_dirs(), ids=lambda p: p.name)
def test_recorded_gpm_rows_follow_the_raw_metrics(fixture_dir: Path) -> None:
    """An oracle independent of the probe: each row's GPM columns from the raw NVML results."""
    recording = json.loads((fixture_dir / "raw_calls.json").read_text())
    rows = pq.read_table(fixture_dir / "gpu_samples.parquet").to_pylist()
    constants = recording["constants"]
    column_of = {constants[name]: col for col, name in gpu.GPM_COLUMNS.items()}
    column_of.update({constants[name]: col for col, name in gpu.GPM_PCIE_COLUMNS.items()})
    samples = [calls for name, calls in recording["phases"].items() if name.startswith("sample_")]
    assert len(rows) == len(samples), "one GPU per GPM fixture"
    stale = 0
    for row, calls in zip(rows, samples, strict=True):
        results = [c["ret"]["__gpm_metrics_get__"] for c in calls if c["fn"] == "nvmlGpmMetricsGet"]
        if not results:
            assert all(row[col] is None for col in column_of.values())
            continue
        (result,) = results
        values = {m["metricId"]: m["value"] for m in result["metrics"] if m["nvmlReturn"] == 0}
        if any(math.isnan(v) for v in values.values()) or not any(values.values()):
            stale += 1
            assert all(row[col] is None for col in column_of.values())
            continue
        for metric_id, value in values.items():
            col = column_of[metric_id]
            assert row[col] == (value * MIB if col in gpu.PCIE_COLUMNS else value)
    if fixture_dir.name == "nvml_h100_stale_gpm":
        assert stale == 4  # samples 3, 5, 7 and 10

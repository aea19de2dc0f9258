"""Tests of the GPU probe against a fake ``pynvml`` put in ``sys.modules`` (the module boundary).

The fake (``fake_nvml.py``) keeps pynvml's own constants, error classes and the ctypes request
structure of ``nvmlGpmMetricsGet``, so the probe's use of them is exercised as on a real GPU.
The replays of recorded GPUs are in ``test_nvml_replay.py``.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import pyarrow as pa
import pynvml as real_nvml
import pytest
from fake_nvml import (
    FI_POWER,
    FI_RX,
    FI_TX,
    FUNCTION_NOT_FOUND,
    GPM,
    MIB,
    NOT_SUPPORTED,
    UNKNOWN,
    Clock,
    Fail,
    FakeNvml,
    Seq,
)

from gpulens.errors import DeviceError, UsageError
from gpulens.probes.base import Probe
from gpulens.probes.nvml.gpm import GPM_COLUMNS
from gpulens.probes.nvml.inventory import describe_gpus
from gpulens.probes.nvml.probe import (
    COLUMNS,
    GPU_SAMPLE_SCHEMA,
    METRICS,
    PCIE_COLUMNS,
    NullGpuProbe,
    NvmlGpuProbe,
    open_gpu_probe,
)
from gpulens.probes.nvml.session import nvml_status


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, clock: Clock) -> FakeNvml:
    module = FakeNvml(clock)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


def open_probe(clock: Clock, indices: list[int] | None = None, **options: Any) -> Any:
    # the window semantics are tested row by row: GPM at every 0.1 s sample, not once a second
    options.setdefault("gpm_min_interval_s", 0.09)
    return open_gpu_probe(
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
    assert probe.schema == GPU_SAMPLE_SCHEMA
    assert isinstance(probe.unsupported, dict)
    assert callable(probe.sample) and callable(probe.close)


# ------------------------------------------------------------------------------ null probe
def test_null_probe_when_pynvml_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    probe = open_gpu_probe()
    assert isinstance(probe, NullGpuProbe)
    assert_is_probe(probe)
    assert "pip install nvidia-ml-py" in probe.reason
    assert probe.sample() == []
    assert set(probe.unsupported) == set(METRICS)
    assert probe.schema == GPU_SAMPLE_SCHEMA
    assert describe_gpus() == []
    assert nvml_status() == (False, probe.reason)
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
    assert isinstance(probe, NullGpuProbe)
    assert probe.reason.startswith("NVML not available: ")
    assert fix in probe.reason
    assert "\n" not in probe.reason
    assert probe.sample() == []
    assert all(reason == probe.reason for reason in probe.unsupported.values())
    assert nvml_status()[0] is False
    assert describe_gpus() == []


def test_null_probe_when_there_is_no_gpu(fake: FakeNvml, clock: Clock) -> None:
    fake.gpu_count = 0
    probe = open_probe(clock)
    assert isinstance(probe, NullGpuProbe)
    assert "no GPU" in probe.reason
    assert fake.live_inits == 0
    assert nvml_status() == (False, "NVML found no GPU; GPU metrics are not measured")


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
    assert isinstance(probe, NvmlGpuProbe)
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
    windowed = [*GPM_COLUMNS, *PCIE_COLUMNS]
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


def test_gpm_is_read_once_a_second_by_default(fake: FakeNvml, clock: Clock) -> None:
    """GPM reads cost a launch-bound loop 2-4% at 10 Hz on an H100 (issue 19): by default the
    probe reads GPM once a second while the other columns keep the sampling rate."""
    from gpulens.probes.nvml.probe import GPM_INTERVAL_S

    probe = open_gpu_probe([0], monotonic=clock.monotonic, wall_time=clock.wall, sleep=clock.sleep)
    reads_at_open = fake.calls["nvmlGpmSampleGet"]
    rows = take(probe, clock, 25, every_s=0.125)  # 3 s at 8 Hz (exact in binary)
    gpm_rows = [r for r in rows if r["sm_activity_pct"] is not None]
    assert GPM_INTERVAL_S == 1.0
    assert len(gpm_rows) == 3  # one window a second, each a full second long
    assert all(r["gpu_util_pct"] == 97.0 for r in rows)  # the rest at every sample
    # one GPM read opens the first window, then one per second
    assert fake.calls["nvmlGpmSampleGet"] - reads_at_open == 1 + 3


def test_rows_fit_the_schema_with_a_64_bit_throttle_mask(fake: FakeNvml, clock: Clock) -> None:
    mask = (1 << 63) | 0x44  # top bit set: does not fit a signed int64
    fake.set("nvmlDeviceGetCurrentClocksEventReasons", mask)
    probe = open_probe(clock)
    row = probe.sample()[0]
    assert row["throttle_reasons"] == mask
    table = pa.Table.from_pylist([row], schema=GPU_SAMPLE_SCHEMA)
    assert table.column("throttle_reasons").type == pa.uint64()
    assert table.column("throttle_reasons")[0].as_py() == mask
    assert list(row) == list(COLUMNS)


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
    caplog.set_level(logging.DEBUG, logger="gpulens.probes.nvml")
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
    assert set(probe.unsupported) == set(GPM_COLUMNS)
    assert all("Hopper" in probe.unsupported[col] for col in GPM_COLUMNS)
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
    (info,) = describe_gpus()
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
    assert nvml_status() == (True, "NVML ok: driver 580.159.04, 1 GPU(s)")


def test_gpm_turned_off_is_never_sampled_and_says_why(fake: FakeNvml, clock: Clock) -> None:
    probe = open_probe(clock, gpm=False)
    assert {probe.unsupported[col] for col in GPM_COLUMNS} == {"GPM sampling was turned off"}
    first, second = take(probe, clock, 2)
    assert all(second[col] is None for col in GPM_COLUMNS)
    assert second["gpu_util_pct"] == 97.0 and second["power_w"] == 650.0
    assert not any(name.startswith("nvmlGpm") and n for name, n in fake.calls.items())

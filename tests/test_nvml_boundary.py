"""The NVML boundary: pynvml is imported only in gpulens.probes.nvml, its error codes become
gpulens exceptions, and a CUDA device maps to an NVML index by UUID or not at all."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pynvml as real_nvml
import pytest
from fake_nvml import Clock, Fail, FakeNvml

from gpulens.errors import DeviceError, RuntimeFailure
from gpulens.probes.nvml.errors import (
    GpuLostError,
    NvmlPermissionError,
    NvmlUnsupportedError,
    device_error,
    nvml_error_class,
)
from gpulens.probes.nvml.inventory import NvmlIndex, nvml_index_for_uuid, nvml_uuid
from gpulens.probes.nvml.probe import open_gpu_probe

SRC = Path(__file__).resolve().parents[1] / "src" / "gpulens"
NVML_PACKAGE = SRC / "probes" / "nvml"


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    module = FakeNvml(Clock(), gpus=2)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


def _imports_pynvml(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        else:
            continue
        if any(name == "pynvml" or name.startswith("pynvml.") for name in names):
            return True
    return False


def test_only_probes_nvml_imports_pynvml() -> None:
    importers = [p for p in sorted(SRC.rglob("*.py")) if _imports_pynvml(p)]
    outside = [str(p.relative_to(SRC)) for p in importers if NVML_PACKAGE not in p.parents]
    assert outside == []
    assert importers, "the scan found no pynvml import at all: is SRC right?"


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        ("NVML_ERROR_GPU_IS_LOST", GpuLostError),
        ("NVML_ERROR_NO_PERMISSION", NvmlPermissionError),
        ("NVML_ERROR_NOT_SUPPORTED", NvmlUnsupportedError),
        ("NVML_ERROR_FUNCTION_NOT_FOUND", NvmlUnsupportedError),
        ("NVML_ERROR_UNKNOWN", DeviceError),
        ("NVML_ERROR_TIMEOUT", DeviceError),
    ],
)
def test_nvml_error_codes_map_to_gpulens_exceptions(code: str, cls: type) -> None:
    exc = real_nvml.NVMLError(getattr(real_nvml, code))
    assert nvml_error_class(real_nvml, exc) is cls
    error = device_error(real_nvml, exc, 3)
    assert type(error) is cls
    assert isinstance(error, DeviceError) and isinstance(error, RuntimeFailure)
    assert error.exit_code == 1
    assert "GPU 3" in str(error) and "\n" not in str(error)


def test_open_raises_the_specific_exception(fake: FakeNvml) -> None:
    fake.set("nvmlDeviceGetHandleByIndex", Fail(real_nvml.NVML_ERROR_NO_PERMISSION), gpu=1)
    with pytest.raises(NvmlPermissionError, match="no permission to open GPU 1"):
        open_gpu_probe([1])
    fake.set("nvmlDeviceGetTemperature", Fail(real_nvml.NVML_ERROR_GPU_IS_LOST), gpu=0)
    with pytest.raises(GpuLostError, match="GPU 0 is lost"):
        open_gpu_probe([0], sleep=lambda _s: None)
    assert fake.live_inits == 0


@pytest.mark.parametrize(
    ("given", "spelled"),
    [("fake-1", "GPU-fake-1"), ("GPU-fake-1", "GPU-fake-1"), ("MIG-x", "MIG-x"), (None, "")],
)
def test_uuids_are_spelled_as_nvml_spells_them(given: str | None, spelled: str) -> None:
    assert nvml_uuid(given) == spelled


def test_a_uuid_maps_to_its_nvml_index(fake: FakeNvml) -> None:
    assert nvml_index_for_uuid("GPU-fake-1").index == 1
    assert nvml_index_for_uuid("fake-0").index == 0  # torch's spelling, without GPU-
    assert fake.live_inits == 0


def test_an_unknown_uuid_is_none_with_a_reason_not_a_guess(fake: FakeNvml) -> None:
    found = nvml_index_for_uuid("GPU-elsewhere")
    assert found.index is None and found.nvml_available
    assert "GPU-elsewhere" in found.reason
    mig = nvml_index_for_uuid("MIG-abc")
    assert mig.index is None and "MIG instance" in mig.reason
    missing = nvml_index_for_uuid("")
    assert missing.index is None and "no UUID" in missing.reason
    assert fake.live_inits == 0


def test_without_nvml_the_mapping_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    found = nvml_index_for_uuid("GPU-fake-0")
    assert found.index is None and not found.nvml_available
    assert "pip install nvidia-ml-py" in found.reason


@pytest.mark.parametrize(
    ("found", "expected"),
    [
        (NvmlIndex(2), 2),
        (NvmlIndex(None, "no GPU that NVML sees has UUID GPU-x (not found)"), None),
        (NvmlIndex(None, "NVML not available: ...", nvml_available=False), 1),
    ],
)
def test_a_cuda_device_is_sampled_only_where_nvml_found_it(
    monkeypatch: pytest.MonkeyPatch, found: NvmlIndex, expected: int | None
) -> None:
    torch = pytest.importorskip("torch")
    from gpulens.workloads import devices

    monkeypatch.setattr(devices, "nvml_index_for_cuda_device", lambda _index: found)
    assert devices.nvml_index_for(torch.device("cuda:1")) == expected
    assert devices.nvml_index_for(torch.device("cpu")) is None

"""What GPUs NVML sees, and the one mapping from a CUDA device or UUID to an NVML index.

NVML numbers GPUs by PCI bus; CUDA numbers the GPUs it is allowed to see
(``CUDA_VISIBLE_DEVICES``, and by default fastest first). The two agree only by chance, so a
CUDA device is mapped to NVML by its UUID, never by its number. A device that cannot be mapped
gets ``NvmlIndex(None, reason)``: measuring another GPU would be a silent guess.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from gpulens.probes.nvml.session import NvmlSession, nvml_text

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NvmlIndex:
    """The NVML index of a device, or ``index`` None with ``reason`` saying why there is none.

    ``nvml_available`` is False where NVML itself could not start (``reason`` then names the
    fix), so nothing on this machine can be measured through NVML.
    """

    index: int | None
    reason: str | None = None
    nvml_available: bool = True


def nvml_uuid(uuid: object) -> str:
    """A device UUID as NVML spells it (``GPU-...`` or ``MIG-...``); "" where there is none.

    torch gives a CUDA device's UUID without the ``GPU-`` prefix that NVML and
    ``CUDA_VISIBLE_DEVICES`` use.
    """
    text = str(uuid or "")
    return text and (text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}")


def nvml_index_for_uuid(uuid: str | None) -> NvmlIndex:
    """The NVML index of the GPU whose UUID is ``uuid`` (with or without the ``GPU-`` prefix)."""
    wanted = nvml_uuid(uuid)
    if not wanted:
        return NvmlIndex(None, "the device has no UUID to find it by in NVML")
    with NvmlSession() as session:
        nvml = session.nvml
        if nvml is None:
            return NvmlIndex(None, session.reason, nvml_available=False)
        try:
            count = nvml.nvmlDeviceGetCount()
            uuids = [
                nvml_text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)))
                for i in range(count)
            ]
        except nvml.NVMLError as exc:
            return NvmlIndex(None, f"NVML could not list the GPUs' UUIDs ({exc})")
    for index, seen in enumerate(uuids):
        if nvml_uuid(seen) == wanted:
            return NvmlIndex(index)
    kind = "a MIG instance; NVML samples whole GPUs" if wanted.startswith("MIG-") else "not found"
    return NvmlIndex(None, f"no GPU that NVML sees has UUID {wanted} ({kind})")


def nvml_index_for_cuda_device(cuda_index: int) -> NvmlIndex:
    """The NVML index of CUDA device ``cuda_index`` (as this process numbers it), by UUID."""
    import torch

    try:
        uuid = getattr(torch.cuda.get_device_properties(cuda_index), "uuid", None)
    except (RuntimeError, AssertionError) as exc:  # no CUDA, or no such device
        return NvmlIndex(None, f"torch cannot describe cuda:{cuda_index} ({exc})")
    if not uuid:
        return NvmlIndex(None, f"torch {torch.__version__} gives no UUID for cuda:{cuda_index}")
    return nvml_index_for_uuid(str(uuid))


def describe_gpus() -> list[dict[str, Any]]:
    """Static facts per GPU (name, memory, driver, architecture, MIG, GPM, PCIe link, power limit).

    Returns [] where NVML is not available; a fact NVML cannot give is None.
    """
    with NvmlSession() as session:
        return [] if session.nvml is None else _describe(session.nvml)


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
                "name": nvml_text(get("nvmlDeviceGetName", h)),
                "uuid": nvml_text(get("nvmlDeviceGetUUID", h)),
                "pci_bus_id": nvml_text(pci.busId) if pci is not None else None,
                "memory_total_bytes": int(mem.total) if mem is not None else None,
                "driver_version": nvml_text(driver),
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

"""Existing MIG instances of a GPU, read through NVML. gpulens never changes the MIG layout."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from gpulens.probes.nvml.session import init_nvml, nvml_text, shutdown_nvml

log = logging.getLogger(__name__)

MIG_DISABLED = "unavailable: MIG mode is disabled and gpulens does not change the MIG layout"
MIG_NOT_CREATED = (
    "unavailable: MIG mode is on but no MIG instances exist, and gpulens does "
    "not create them (nvidia-smi mig -cgi ... -C, as an administrator)"
)


@dataclass(frozen=True)
class MigInstance:
    """One MIG device: address it with ``CUDA_VISIBLE_DEVICES=<uuid>``."""

    uuid: str
    memory_total_bytes: int | None
    sm_count: int | None = None


@dataclass(frozen=True)
class MigLayout:
    """``instances`` when MIG is on; otherwise ``reason`` says why MIG cannot be used."""

    instances: tuple[MigInstance, ...]
    reason: str | None = None


def mig_layout(nvml_index: int, nvml: Any = None) -> MigLayout:
    """The MIG devices that exist on GPU ``nvml_index`` (NVML numbering)."""
    owned = nvml is None
    if owned:
        nvml, reason = init_nvml()
        if nvml is None:
            return MigLayout((), f"unavailable: {reason}")
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(nvml_index)
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
        except nvml.NVMLError as exc:
            return MigLayout((), f"unavailable: this GPU has no MIG support ({exc})")
        if not current:
            return MigLayout((), MIG_DISABLED)
        instances = []
        for i in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
            except nvml.NVMLError:  # an empty slot
                continue
            uuid = nvml_text(nvml.nvmlDeviceGetUUID(mig))
            try:
                mem = int(nvml.nvmlDeviceGetMemoryInfo(mig).total)
            except nvml.NVMLError:
                mem = None
            try:
                sms = int(nvml.nvmlDeviceGetAttributes(mig).multiprocessorCount)
            except (nvml.NVMLError, AttributeError):
                sms = None
            instances.append(MigInstance(uuid, mem, sms))
        if not instances:
            return MigLayout((), MIG_NOT_CREATED)
        return MigLayout(tuple(instances))
    except nvml.NVMLError as exc:
        return MigLayout((), f"unavailable: NVML could not read the MIG layout ({exc})")
    finally:
        if owned:
            shutdown_nvml(nvml)

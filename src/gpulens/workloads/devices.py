"""Choosing and validating the torch device, with errors that name the fix."""

from __future__ import annotations

import torch

from gpulens.errors import UsageError


def default_device() -> str:
    return "cuda:0" if torch.cuda.is_available() else "cpu"


def resolve_device(requested: str | None) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N``; a GPU that is not there is a usage error."""
    name = (requested or default_device()).strip().lower()
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda":
        name = "cuda:0"
    if not name.startswith("cuda:") or not name[5:].isdigit():
        raise UsageError(f"unknown device '{requested}': use cpu, cuda or cuda:N")
    index = int(name[5:])
    if not torch.cuda.is_available():
        raise UsageError(
            f"device {name} does not exist: no CUDA GPU is visible here "
            "(see `gpulens doctor`); use --device cpu"
        )
    count = torch.cuda.device_count()
    if index >= count:
        raise UsageError(
            f"device {name} does not exist: this machine has {count} GPU(s) "
            f"(cuda:0..cuda:{count - 1}); use --device cuda:0"
        )
    return torch.device(name)


def nvml_index_for(device: torch.device) -> int | None:
    """The NVML index of a CUDA device (they differ under CUDA_VISIBLE_DEVICES); None on CPU."""
    if device.type != "cuda":
        return None
    index = device.index or 0
    try:
        import pynvml

        uuid = str(torch.cuda.get_device_properties(index).uuid)
        pynvml.nvmlInit()
        try:
            for i in range(pynvml.nvmlDeviceGetCount()):
                nv_uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
                nv_uuid = nv_uuid.decode() if isinstance(nv_uuid, bytes) else nv_uuid
                if nv_uuid.removeprefix("GPU-") == uuid.removeprefix("GPU-"):
                    return i
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML, or an old torch without uuid: assume the same numbering
        pass
    return index

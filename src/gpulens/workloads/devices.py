"""Choosing and validating the torch device, with errors that name the fix."""

from __future__ import annotations

import logging

import torch

from gpulens.errors import UsageError
from gpulens.probes.nvml.inventory import nvml_index_for_cuda_device

log = logging.getLogger(__name__)


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
    """The NVML index of a CUDA device (they differ under CUDA_VISIBLE_DEVICES); None on CPU.

    The mapping is :func:`~gpulens.probes.nvml.inventory.nvml_index_for_cuda_device` (by UUID).
    Where NVML runs but no GPU it sees has this device's UUID: None, with the reason logged as
    a warning (sampling another GPU would be a silent guess). Where NVML itself cannot start,
    the CUDA index: nothing is sampled then either (the GPU probe is the null probe, and the
    run record keeps its reason, which names the fix).
    """
    if device.type != "cuda":
        return None
    index = device.index or 0
    found = nvml_index_for_cuda_device(index)
    if found.index is not None:
        return found.index
    if not found.nvml_available:
        log.debug("cuda:%d: %s", index, found.reason)
        return index
    log.warning("cuda:%d is not sampled through NVML: %s", index, found.reason)
    return None

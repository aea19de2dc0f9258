"""Starting and stopping NVML: the one place that imports pynvml.

``init_nvml()`` gives ``(module, None)`` or ``(None, reason)``; the reason is one line naming the
fix (no pynvml, no driver, no permission, mismatched driver). Each successful ``init_nvml()``
takes one NVML reference that ``shutdown_nvml()`` (or the owner, such as the GPU probe) gives
back. ``NvmlSession`` does both around a block.
"""

from __future__ import annotations

import logging
from typing import Any

from gpulens.probes.nvml.errors import init_failure_reason

log = logging.getLogger(__name__)

PYNVML_MISSING = (
    "NVML not available: pynvml is not installed (pip install nvidia-ml-py); "
    "GPU metrics are not measured"
)


def import_nvml() -> tuple[Any, str | None]:
    """(the pynvml module, None) or (None, why it cannot be imported)."""
    try:
        import pynvml
    except ImportError:
        return None, PYNVML_MISSING
    return pynvml, None


def init_nvml() -> tuple[Any, str | None]:
    """Import and initialise pynvml; returns (module, None) or (None, reason)."""
    nvml, reason = import_nvml()
    if nvml is None:
        return None, reason
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        return None, init_failure_reason(nvml, exc)
    except OSError as exc:  # a broken library that loads but does not link
        return None, f"NVML not available: {exc}; GPU metrics are not measured"
    return nvml, None


def shutdown_nvml(nvml: Any) -> None:
    """Give back one NVML reference; a failure is logged, never raised (it is clean-up)."""
    try:
        nvml.nvmlShutdown()
    except Exception as exc:  # cleanup must not hide the real outcome
        log.debug("nvmlShutdown failed: %s", exc)


class NvmlSession:
    """``with NvmlSession() as session:`` NVML is started for the block and shut down after it.

    ``session.nvml`` is the initialised module, or None with ``session.reason`` saying why.
    """

    def __init__(self) -> None:
        self.nvml: Any = None
        self.reason: str | None = None

    def __enter__(self) -> NvmlSession:
        self.nvml, self.reason = init_nvml()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.nvml is not None:
            shutdown_nvml(self.nvml)
            self.nvml = None


def nvml_text(value: Any) -> Any:
    """A pynvml string (bytes from older pynvml versions, str from newer) as str."""
    return value.decode() if isinstance(value, bytes) else value


def nvml_status() -> tuple[bool, str]:
    """(True, what NVML sees) or (False, one line naming the fix)."""
    with NvmlSession() as session:
        nvml = session.nvml
        if nvml is None:
            return False, session.reason or "NVML not available"
        try:
            count = nvml.nvmlDeviceGetCount()
            driver = nvml_text(nvml.nvmlSystemGetDriverVersion())
        except nvml.NVMLError as exc:
            return False, f"NVML started but could not list GPUs ({exc})"
    if count == 0:
        return False, "NVML found no GPU; GPU metrics are not measured"
    return True, f"NVML ok: driver {driver}, {count} GPU(s)"

"""NVML errors translated at the boundary into gpulens's own exceptions, each naming the fix.

NVML reports an error as ``pynvml.NVMLError`` with a numeric ``value``. The codes are read by
their constant names from the pynvml module in use (a fake one in tests), never hard-coded.
``nvml_error_class`` is the one map from an NVML error to a gpulens exception class (the shape
Zeus uses); ``device_error`` builds the exception for a GPU that NVML could not open or lost.
"""

from __future__ import annotations

from typing import Any

from gpulens.errors import DeviceError


class GpuLostError(DeviceError):
    """NVML lost the GPU (``NVML_ERROR_GPU_IS_LOST``): it fell off the bus or needs a reset."""


class NvmlPermissionError(DeviceError):
    """NVML refused for lack of permission (``NVML_ERROR_NO_PERMISSION``)."""


class NvmlUnsupportedError(DeviceError):
    """This GPU or driver does not have what was asked for (not supported, function missing)."""


# NVML error constant name -> the gpulens exception it becomes; anything else is a DeviceError.
NVML_ERROR_CLASSES: dict[str, type[DeviceError]] = {
    "NVML_ERROR_GPU_IS_LOST": GpuLostError,
    "NVML_ERROR_NO_PERMISSION": NvmlPermissionError,
    "NVML_ERROR_NOT_SUPPORTED": NvmlUnsupportedError,
    "NVML_ERROR_FUNCTION_NOT_FOUND": NvmlUnsupportedError,
}

# Refusals that do not change while the process lives: such a metric is never asked for again.
PERMANENT_ERRORS = (
    "NVML_ERROR_NOT_SUPPORTED",
    "NVML_ERROR_FUNCTION_NOT_FOUND",
    "NVML_ERROR_NO_PERMISSION",
    "NVML_ERROR_INVALID_ARGUMENT",
)

# Why nvmlInit failed, and what to do about it.
INIT_FIXES = {
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


def is_nvml_error(nvml: Any, exc: BaseException, const_name: str) -> bool:
    """Whether ``exc`` carries the NVML error code named ``const_name`` (e.g. NVML_ERROR_...)."""
    code = getattr(nvml, const_name, None)
    return code is not None and getattr(exc, "value", None) == code


def is_permanent(nvml: Any, exc: BaseException) -> bool:
    """Whether the refusal holds for good (see ``PERMANENT_ERRORS``)."""
    return any(is_nvml_error(nvml, exc, name) for name in PERMANENT_ERRORS)


def nvml_error_class(nvml: Any, exc: BaseException) -> type[DeviceError]:
    """The gpulens exception class for an NVML error; ``DeviceError`` for the unmapped codes."""
    for name, cls in NVML_ERROR_CLASSES.items():
        if is_nvml_error(nvml, exc, name):
            return cls
    return DeviceError


def error_text(nvml: Any, code: int) -> str:
    """NVML's own text for an error code (e.g. a field's ``nvmlReturn``)."""
    try:
        return str(nvml.NVMLError(code))
    except Exception:  # only for a message
        return f"NVML error {code}"


def init_failure_reason(nvml: Any, exc: BaseException) -> str:
    """One line saying that NVML could not start and how to fix it."""
    fix = next(
        (text for name, text in INIT_FIXES.items() if is_nvml_error(nvml, exc, name)),
        f"nvmlInit failed ({exc})",
    )
    return f"NVML not available: {fix}; GPU metrics are not measured"


def unsupported_reason(nvml: Any, exc: BaseException, what: str) -> str:
    """Why a metric is not measured, for a permanent refusal of the call ``what``."""
    if is_nvml_error(nvml, exc, "NVML_ERROR_NO_PERMISSION"):
        return (
            f"{what}: no permission (NVML: {exc}); run as root or let users read GPU counters "
            "(NVIDIA driver option NVreg_RestrictProfilingToAdminUsers=0)"
        )
    if is_nvml_error(nvml, exc, "NVML_ERROR_FUNCTION_NOT_FOUND"):
        return f"{what}: not in this NVIDIA driver (NVML: {exc}); a newer driver has it"
    return f"{what}: not supported on this GPU or driver (NVML: {exc})"


def device_error_message(nvml: Any, exc: BaseException, index: int) -> str:
    """What went wrong with GPU ``index`` and how to fix it."""
    if is_nvml_error(nvml, exc, "NVML_ERROR_NO_PERMISSION"):
        return (
            f"no permission to open GPU {index} through NVML ({exc}): run as a user with access "
            "to /dev/nvidia*, or select other GPUs"
        )
    if is_nvml_error(nvml, exc, "NVML_ERROR_GPU_IS_LOST"):
        return (
            f"GPU {index} is lost ({exc}): check `nvidia-smi` and the kernel log for Xid errors; "
            "an administrator may need to reset the GPU; or select other GPUs"
        )
    return f"NVML could not open GPU {index} ({exc}): check `nvidia-smi`, or select other GPUs"


def device_error(nvml: Any, exc: BaseException, index: int) -> DeviceError:
    """The gpulens exception (of the class ``nvml_error_class`` picks) for GPU ``index``."""
    return nvml_error_class(nvml, exc)(device_error_message(nvml, exc, index))

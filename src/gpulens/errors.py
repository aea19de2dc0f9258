"""gpulens's own exceptions. Every message names the fix; the CLI prints it in one line."""

from __future__ import annotations


class GpulensError(Exception):
    """Base class. ``exit_code`` is what the CLI exits with."""

    exit_code = 1


class UsageError(GpulensError):
    """The user asked for something that cannot be (unknown workload, bad batch size, ...)."""

    exit_code = 2


class RuntimeFailure(GpulensError):
    """Something failed while running (out of memory, a command that would not start, ...)."""

    exit_code = 1


class DeviceError(RuntimeFailure):
    """A GPU or NVML call failed; translated at the vendor boundary."""


class MissingExtraError(GpulensError):
    """An optional package is not installed: the user's to fix, like a usage error (exit 2)."""

    exit_code = 2

    def __init__(self, package: str, extra: str):
        super().__init__(
            f"{package} is not installed: pip install 'gpulens[{extra}]' (or pip install {package})"
        )
        self.package = package
        self.extra = extra


class DamagedRecordError(RuntimeFailure):
    """A run record on disk cannot be read (truncated, empty or malformed file).

    ``path`` is the damaged file; the message says what can still be read and how to fix it.
    """

    def __init__(self, message: str, path=None):
        super().__init__(message)
        self.path = path

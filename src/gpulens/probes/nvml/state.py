"""One GPU's state inside the GPU probe, and the two ways the probe calls NVML for it.

``try_open`` is for probing a metric at open: a permanent refusal lists the metrics as
unsupported with the reason, a passing error leaves them to be tried at each sample, and a lost
GPU raises :class:`~gpulens.probes.nvml.errors.GpuLostError`. ``call`` is for sampling: any NVML
error gives ``FAILED`` (logged at debug level), so that one value is null for that row.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpulens.probes.nvml.errors import (
    device_error,
    is_nvml_error,
    is_permanent,
    unsupported_reason,
)
from gpulens.probes.nvml.fields import PcieCounters

log = logging.getLogger(__name__)

FAILED: Any = object()  # what a failed NVML call returns to the probe


@dataclass
class GpuState:
    """Per-GPU state: handle, what is enabled, and the previous values of windowed metrics."""

    index: int
    handle: Any
    enabled: set[str] = field(default_factory=set)
    sources: dict[str, str] = field(default_factory=dict)
    unsupported: dict[str, str] = field(default_factory=dict)
    throttle_fn: str | None = None
    energy_base_mj: int | None = None
    field_ids: list[int] = field(default_factory=list)
    power_field: int | None = None
    pcie_mode: str | None = None  # "gpm", "counters", "throughput" or None
    pcie_counters: PcieCounters | None = None
    pcie_field_reason: str | None = None
    gpm_ids: dict[str, int] = field(default_factory=dict)
    gpm_buffers: list[Any] = field(default_factory=list)
    gpm_prev: Any = None
    gpm_prev_s: float = 0.0
    gpm_request: Any = None

    def try_open(
        self, nvml: Any, metrics: Sequence[str], what: str, call: Callable[[], Any]
    ) -> Any:
        """Run one probing call and return its value, or ``FAILED``.

        A permanent refusal lists ``metrics`` as unsupported on this GPU; a passing error
        leaves them to be tried at each sample; a lost GPU raises ``GpuLostError``.
        """
        try:
            return call()
        except AttributeError:
            reason = f"{what}: pynvml lacks it; pip install -U nvidia-ml-py"
        except nvml.NVMLError as exc:
            if is_nvml_error(nvml, exc, "NVML_ERROR_GPU_IS_LOST"):
                raise device_error(nvml, exc, self.index) from exc
            if not is_permanent(nvml, exc):
                log.debug(
                    "GPU %d: %s failed at open (%s); tried again later", self.index, what, exc
                )
                return FAILED
            reason = unsupported_reason(nvml, exc, what)
        for metric in metrics:
            self.unsupported.setdefault(metric, reason)
        return FAILED

    def enable(self, metrics: Sequence[str], source: str) -> None:
        """Measure ``metrics`` (those not found unsupported) from ``source``."""
        for metric in metrics:
            if metric not in self.unsupported:
                self.enabled.add(metric)
                self.sources[metric] = source

    def call(self, nvml: Any, fn_name: str, *args: Any) -> Any:
        """One NVML call during sampling; ``FAILED`` (logged at debug) on an NVML error."""
        try:
            return getattr(nvml, fn_name)(*args)
        except nvml.NVMLError as exc:
            log.debug("GPU %d: %s failed: %s", self.index, fn_name, exc)
            return FAILED

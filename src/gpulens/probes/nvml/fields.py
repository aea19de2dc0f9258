"""NVML field values (``nvmlDeviceGetFieldValues``): decoding, and rates from wrapping counters.

A field value is an ``nvmlFieldValue_t``: a union read by its ``valueType``, stamped by NVML in
microseconds. The cumulative PCIe byte counters are 32-bit on H100, so they wrap; a window in
which a full-speed link could wrap them gives no rate rather than a wrong one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# Usable bytes/s per lane for PCIe generations 1..6 (line rate x encoding / 8).
PCIE_LANE_BYTES_PER_S = {1: 250e6, 2: 500e6, 3: 984.6e6, 4: 1969.2e6, 5: 3938.5e6, 6: 7563e6}


def field_number(nvml: Any, value: Any) -> float:
    """The number in an nvmlFieldValue_t's union, read by its valueType."""
    member = {
        getattr(nvml, "NVML_VALUE_TYPE_DOUBLE", 0): "dVal",
        getattr(nvml, "NVML_VALUE_TYPE_UNSIGNED_INT", 1): "uiVal",
        getattr(nvml, "NVML_VALUE_TYPE_UNSIGNED_LONG", 2): "ulVal",
        getattr(nvml, "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG", 3): "ullVal",
        getattr(nvml, "NVML_VALUE_TYPE_SIGNED_LONG_LONG", 4): "sllVal",
        getattr(nvml, "NVML_VALUE_TYPE_SIGNED_INT", 5): "siVal",
        getattr(nvml, "NVML_VALUE_TYPE_UNSIGNED_SHORT", 6): "usVal",
    }.get(value.valueType, "ullVal")
    return getattr(value.value, member)


def field_modulus(nvml: Any, value: Any) -> int:
    """Where a counter field wraps: 2**32 for 32-bit values (PCIe bytes on H100), else 2**64."""
    if value.valueType in (
        getattr(nvml, "NVML_VALUE_TYPE_UNSIGNED_INT", 1),
        getattr(nvml, "NVML_VALUE_TYPE_SIGNED_INT", 5),
    ):
        return 1 << 32
    return 1 << 64


def pcie_max_bytes_per_s(nvml: Any, handle: Any) -> float | None:
    """The fastest the GPU's PCIe link can move bytes one way; None where NVML cannot say."""
    try:
        gen = int(nvml.nvmlDeviceGetMaxPcieLinkGeneration(handle))
        width = int(nvml.nvmlDeviceGetMaxPcieLinkWidth(handle))
    except (nvml.NVMLError, AttributeError, TypeError, ValueError):
        return None
    lane = PCIE_LANE_BYTES_PER_S.get(gen)
    return lane * width if lane and width > 0 else None


@dataclass
class PcieCounters:
    """One GPU's cumulative PCIe byte counters (TX and RX fields) and the window they close."""

    field_ids: tuple[int, int]
    max_bytes_per_s: float | None = None
    prev: tuple[int, int, int] | None = None  # tx bytes, rx bytes, stamp in us
    warned: bool = False

    def restart(self) -> None:
        """Forget the window's start (a read failed): the next read starts a new window."""
        self.prev = None

    def rates(
        self, nvml: Any, tx: Any, rx: Any, monotonic: Callable[[], float], gpu_index: int
    ) -> tuple[float, float] | None:
        """(tx, rx) bytes/s since the previous read, or None (first read, or a possible wrap).

        ``tx`` and ``rx`` are this read's field values (None where the field failed).
        """
        if tx is None or rx is None:
            self.prev = None
            return None
        # NVML stamps each field value (microseconds); integers keep the window exact.
        stamp_us = int(tx.timestamp) if tx.timestamp > 0 else round(monotonic() * 1e6)
        tx_bytes, rx_bytes = int(field_number(nvml, tx)), int(field_number(nvml, rx))
        prev, self.prev = self.prev, (tx_bytes, rx_bytes, stamp_us)
        if prev is None:
            return None
        window_s = (stamp_us - prev[2]) / 1e6
        if window_s <= 0:
            return None
        modulus = field_modulus(nvml, tx)
        if self.max_bytes_per_s and self.max_bytes_per_s * window_s >= modulus:
            if not self.warned:  # a full-speed link could have wrapped the counter
                self.warned = True
                log.warning(
                    "GPU %d: the PCIe byte counters can wrap every %.0f ms at full link speed; "
                    "longer windows give no PCIe rate (sample faster to get one)",
                    gpu_index,
                    modulus / self.max_bytes_per_s * 1000,
                )
            return None
        return ((tx_bytes - prev[0]) % modulus) / window_s, (
            (rx_bytes - prev[1]) % modulus
        ) / window_s

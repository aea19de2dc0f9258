"""Slow-storage emulation for the built-in dataset readers.

A :class:`StorageEmulation` makes every file read take at least ``latency_s + nbytes /
bandwidth_bytes_per_s``: the file is read for real, then the reader sleeps for whatever is left
of that budget. Real disk time therefore counts *toward* the emulated time rather than on top of
it, so a read from a disk slower than the emulated one is not slowed further, and the emulated
figure is what the reader sees (as long as the real storage is faster than the emulated one,
which is the point of emulating slow storage).

Scope of the bandwidth cap: it applies **per reading process**. Each DataLoader worker (or the
main process when ``workers=0``) reads one sample at a time, so a worker never reads faster than
the cap, and ``k`` workers together read up to ``k`` times the cap, like ``k`` independent
streams to a disk whose per-stream throughput is the bottleneck (a network file system or a cloud
disk with per-request latency). To emulate one shared cap for the whole job, divide the
aggregate bandwidth by the number of workers.
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from dataclasses import dataclass
from typing import Any

from gpulens.errors import UsageError

logger = logging.getLogger(__name__)

BANDWIDTH_SCOPE = "per_reader"  # one cap per reading process (DataLoader worker)

_DURATION_UNITS_S = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6}
_SIZE_UNITS_BYTES = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}


@dataclass(frozen=True)
class StorageEmulation:
    """Per-file latency and a per-reader bandwidth cap; the defaults emulate nothing."""

    latency_s: float = 0.0
    bandwidth_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        lat = self.latency_s
        if not isinstance(lat, (int, float)) or not math.isfinite(lat) or lat < 0:
            raise UsageError(
                f"storage latency must be a finite number of seconds >= 0, got {lat!r}: "
                "pass e.g. 0.005 for 5 ms, or 0 for none"
            )
        bw = self.bandwidth_bytes_per_s
        bad_bw = not isinstance(bw, (int, float)) or not math.isfinite(bw) or bw <= 0
        if bw is not None and bad_bw:
            raise UsageError(
                f"storage bandwidth must be a positive number of bytes/s, got {bw!r}: "
                "pass e.g. 200e6 for 200 MB/s, or leave it out for no cap"
            )

    @property
    def active(self) -> bool:
        """Whether reads are slowed at all."""
        return self.latency_s > 0 or self.bandwidth_bytes_per_s is not None

    def delay_s(self, nbytes: int) -> float:
        """The time a read of ``nbytes`` takes on the emulated storage."""
        transfer_s = nbytes / self.bandwidth_bytes_per_s if self.bandwidth_bytes_per_s else 0.0
        return self.latency_s + transfer_s

    def as_dict(self) -> dict[str, Any]:
        """Plain data for a run's effective config."""
        return {
            "latency_s": self.latency_s,
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "bandwidth_scope": BANDWIDTH_SCOPE,
        }


def pad_read(emulation: StorageEmulation | None, nbytes: int, started_s: float) -> float:
    """Sleep until a read of ``nbytes`` begun at ``started_s`` (``time.perf_counter``) has
    lasted ``emulation.delay_s(nbytes)``; returns the seconds slept."""
    if emulation is None or not emulation.active:
        return 0.0
    remaining_s = emulation.delay_s(nbytes) - (time.perf_counter() - started_s)
    if remaining_s <= 0:
        return 0.0
    time.sleep(remaining_s)
    return remaining_s


def read_file(path: str | os.PathLike, emulation: StorageEmulation | None = None) -> bytes:
    """The whole file at ``path``; with ``emulation`` the call lasts at least
    ``emulation.delay_s(len(data))``, real read time included."""
    started_s = time.perf_counter()
    with open(path, "rb") as f:
        data = f.read()
    pad_read(emulation, len(data), started_s)
    return data


def parse_duration_s(text: str | float) -> float:
    """``"5ms"``, ``"200us"``, ``"0.01s"`` or a bare number of seconds, in seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-zµ]*)\s*", text.lower())
    if not m or m.group(2) not in _DURATION_UNITS_S:
        raise UsageError(f"cannot read duration {text!r}: write e.g. 5ms, 200us or 0.01s")
    try:
        return float(m.group(1)) * _DURATION_UNITS_S[m.group(2)]
    except ValueError:
        raise UsageError(f"cannot read duration {text!r}: write e.g. 5ms, 200us or 0.01s") from None


def parse_bandwidth_bytes_per_s(text: str | float) -> float:
    """``"200MB/s"``, ``"1GiB/s"``, ``"500kb"`` or a bare number of bytes/s, in bytes/s."""
    if isinstance(text, (int, float)):
        return float(text)
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-z]*)\s*(/s)?\s*", text.lower())
    if not m or m.group(2) not in _SIZE_UNITS_BYTES:
        raise UsageError(f"cannot read bandwidth {text!r}: write e.g. 200MB/s or 1GiB/s")
    try:
        return float(m.group(1)) * _SIZE_UNITS_BYTES[m.group(2)]
    except ValueError:
        raise UsageError(f"cannot read bandwidth {text!r}: write e.g. 200MB/s or 1GiB/s") from None

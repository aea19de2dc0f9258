"""Host sampler: CPU, memory, page cache, disk and network through psutil."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import psutil
import pyarrow as pa

log = logging.getLogger(__name__)

HOST_SCHEMA = pa.schema(
    [
        ("time_unix_s", pa.float64()),
        ("cpu_util_pct", pa.float32()),
        ("cpu_per_core_pct", pa.list_(pa.float32())),
        ("proc_tree_cpu_pct", pa.float32()),
        ("mem_used_bytes", pa.int64()),
        ("mem_available_bytes", pa.int64()),
        ("page_cache_bytes", pa.int64()),
        ("disk_read_bytes_per_s", pa.float64()),
        ("disk_write_bytes_per_s", pa.float64()),
        ("net_rx_bytes_per_s", pa.float64()),
        ("net_tx_bytes_per_s", pa.float64()),
    ]
)


class HostProbe:
    """One row per sample for this host. ``root_pid`` is the process whose tree is watched."""

    name = "host"
    schema = HOST_SCHEMA

    def __init__(self, root_pid: int | None = None):
        self.unsupported: dict[str, str] = {}
        self._root = psutil.Process(root_pid or os.getpid())
        self._last_t = time.monotonic()
        self._last_disk = self._disk()
        self._last_net = self._net()
        self._last_tree_cpu_s = self._tree_cpu_s()
        psutil.cpu_percent(percpu=True)  # primes the per-core counters
        if not hasattr(psutil.virtual_memory(), "cached"):
            self.unsupported["page_cache_bytes"] = "psutil reports no page cache on this OS"

    def _disk(self):
        try:
            return psutil.disk_io_counters()
        except (RuntimeError, OSError):
            self.unsupported["disk_read_bytes_per_s"] = "no disk counters on this host"
            self.unsupported["disk_write_bytes_per_s"] = "no disk counters on this host"
            return None

    def _net(self):
        try:
            return psutil.net_io_counters()
        except (RuntimeError, OSError):
            self.unsupported["net_rx_bytes_per_s"] = "no network counters on this host"
            self.unsupported["net_tx_bytes_per_s"] = "no network counters on this host"
            return None

    def _tree_cpu_s(self) -> float:
        total = 0.0
        try:
            procs = [self._root, *self._root.children(recursive=True)]
        except psutil.Error:
            return 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                continue  # a worker that ended between listing and reading
        return total

    def sample(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        dt = max(now - self._last_t, 1e-6)
        per_core = psutil.cpu_percent(percpu=True)
        vm = psutil.virtual_memory()
        disk, net, tree_cpu_s = self._disk(), self._net(), self._tree_cpu_s()
        row: dict[str, Any] = {
            "time_unix_s": time.time(),
            "cpu_util_pct": sum(per_core) / max(len(per_core), 1),
            "cpu_per_core_pct": per_core,
            # Percent of one core, like top: 800 means eight cores busy.
            "proc_tree_cpu_pct": max(0.0, 100.0 * (tree_cpu_s - self._last_tree_cpu_s) / dt),
            "mem_used_bytes": vm.total - vm.available,
            "mem_available_bytes": vm.available,
            "page_cache_bytes": getattr(vm, "cached", None),
        }
        if disk is not None and self._last_disk is not None:
            row["disk_read_bytes_per_s"] = (disk.read_bytes - self._last_disk.read_bytes) / dt
            row["disk_write_bytes_per_s"] = (disk.write_bytes - self._last_disk.write_bytes) / dt
        if net is not None and self._last_net is not None:
            row["net_rx_bytes_per_s"] = (net.bytes_recv - self._last_net.bytes_recv) / dt
            row["net_tx_bytes_per_s"] = (net.bytes_sent - self._last_net.bytes_sent) / dt
        self._last_t, self._last_disk, self._last_net = now, disk, net
        self._last_tree_cpu_s = tree_cpu_s
        return [row]

    def close(self) -> None:
        pass

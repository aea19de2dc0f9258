"""Energy, SM activity, utilization and memory of a GPU over one measured window, sampled from
this process through the NVML probe."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

log = logging.getLogger(__name__)


SAMPLE_PERIOD_S = 0.2


# ------------------------------------------------------------------------- GPU window
class GpuWindow:
    """Energy and SM activity of the GPU over a measured window (NVML in this process)."""

    def __init__(self, nvml_index: int | None):
        self.reason: str | None = None
        self._probe = None
        if nvml_index is None:
            self.reason = "the jobs ran on the CPU"
            return
        from gpulens.probes.nvml.probe import open_gpu_probe

        try:
            self._probe = open_gpu_probe([nvml_index], energy_every_n=1)
        except Exception as exc:  # the experiment runs without energy numbers
            self.reason = f"GPU probe failed: {exc}"
            return
        self.reason = getattr(self._probe, "reason", None)

    @contextlib.contextmanager
    def measure(self, out: dict[str, Any]):
        rows: list[dict[str, Any]] = []
        stop = threading.Event()

        def loop() -> None:
            while True:
                with contextlib.suppress(Exception):
                    rows.extend(self._probe.sample())
                if stop.wait(SAMPLE_PERIOD_S):
                    break
            with contextlib.suppress(Exception):
                rows.extend(self._probe.sample())

        thread = None
        if self._probe is not None and self.reason is None:
            thread = threading.Thread(target=loop, name="gpulens-colocate-gpu", daemon=True)
            thread.start()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            stop.set()
            if thread is not None:
                thread.join()
            out["window_s"] = time.perf_counter() - t0
            energy = [r["energy_j"] for r in rows if r.get("energy_j") is not None]
            out["energy_j"] = energy[-1] - energy[0] if len(energy) >= 2 else None
            sm = [r["sm_activity_pct"] for r in rows if r.get("sm_activity_pct") is not None]
            out["sm_activity_pct"] = sum(sm) / len(sm) if sm else None
            util = [r["gpu_util_pct"] for r in rows if r.get("gpu_util_pct") is not None]
            out["gpu_util_pct"] = sum(util) / len(util) if util else None
            mem = [r["mem_used_bytes"] for r in rows if r.get("mem_used_bytes") is not None]
            out["gpu_mem_used_max_bytes"] = max(mem) if mem else None

    def close(self) -> None:
        if self._probe is not None:
            with contextlib.suppress(Exception):
                self._probe.close()

"""The local executor: cells in parallel across this machine's GPUs, one cell per GPU at a time
(a cell asking for N GPUs takes N slots); CPU-only machines have one slot."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from gpulens.launch.cli_child import ChildResult, run_gpulens
from gpulens.sweep.cells import Cell

# on_start(cell) -> None, on_done(cell, result) -> True when the cell should run again (retry).
OnStart = Callable[[Cell], None]
OnDone = Callable[[Cell, ChildResult], bool]


def gpu_slots() -> list[str]:
    """GPU ids from CUDA_VISIBLE_DEVICES, else every NVML GPU, else one CPU slot ("")."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip():
        return [g.strip() for g in visible.split(",") if g.strip()]
    from gpulens.probes.nvml.session import init_nvml, shutdown_nvml

    nvml, _reason = init_nvml()
    count = 0
    if nvml is not None:
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except Exception:  # an NVML that cannot count GPUs: treat as a CPU machine
            count = 0
        finally:
            shutdown_nvml(nvml)
    return [str(i) for i in range(count)] or [""]


class LocalExecutor:
    """Runs cells as ``gpulens`` child processes with CUDA_VISIBLE_DEVICES set per cell."""

    def __init__(self, slots: list[str] | None = None):
        self.slots = slots if slots is not None else gpu_slots()
        self._free = list(self.slots)
        self._cond = threading.Condition()
        self._stopping = threading.Event()
        self._running: set = set()  # the cells' child processes now

    def _take(self, n: int) -> list[str]:
        n = min(n, len(self.slots))  # a cell asking for more GPUs than exist gets all of them
        with self._cond:
            while len(self._free) < n:
                self._cond.wait()
            taken, self._free = self._free[:n], self._free[n:]
            return taken

    def _give(self, taken: list[str]) -> None:
        with self._cond:
            self._free.extend(taken)
            self._cond.notify_all()

    def _one(self, cell: Cell, on_start: OnStart, on_done: OnDone) -> None:
        again = not self._stopping.is_set()
        while again:
            taken = self._take(cell.gpus)
            if self._stopping.is_set():  # it waited for GPUs while the sweep was stopped
                self._give(taken)
                return
            try:
                on_start(cell)
                env = {"CUDA_VISIBLE_DEVICES": ",".join(taken)} if any(taken) else {}
                result = run_gpulens(cell.argv(), env, self._running)
            finally:
                self._give(taken)
            # an interrupted sweep retries nothing: the cell stays unfinished for --resume
            again = on_done(cell, result) and not self._stopping.is_set()

    def run(self, cells: list[Cell], on_start: OnStart, on_done: OnDone) -> None:
        """Run every cell (and its retries); returns when all are finished. Interrupted
        (Ctrl-C), it passes the interrupt to the running cells, starts no other, and raises
        once those have ended."""
        if not cells:
            return
        pool = ThreadPoolExecutor(max_workers=len(self.slots))
        try:
            for future in [pool.submit(self._one, c, on_start, on_done) for c in cells]:
                future.result()
        except BaseException:
            self._stopping.set()
            for proc in list(self._running):
                proc.send_signal(signal.SIGINT)  # a terminal's Ctrl-C reached them already
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        pool.shutdown()

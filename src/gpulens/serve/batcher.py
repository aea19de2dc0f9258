"""Dynamic batching for one model: a bounded queue and one worker thread per model instance.

A worker waits for the first request, then keeps taking queued requests until the batch holds
``max_batch`` samples or the oldest request has waited ``max_delay_s``; it runs the batch once
(``execute``) and hands every request its share. With ``max_batch`` <= 1 each request runs
alone. A full queue refuses at once (:class:`QueueFull`): the server answers 503 with
Retry-After and never blocks or grows without bound. Pure threading: no torch, no web framework.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The model's queue holds ``max_queue`` requests already."""


class ShuttingDown(Exception):
    """The server stops: the request was not run."""


@dataclass(eq=False)
class Pending:
    """One queued request: its samples (``payload``, ``n`` of them) and, once run, its result
    or error and its times. ``token`` is the caller's (e.g. a future to resolve)."""

    payload: Any
    n: int
    token: Any = None
    enqueued_ns: int = field(default_factory=time.perf_counter_ns)
    result: Any = None
    error: BaseException | None = None
    queue_ns: int = 0
    batch_size: int = 0
    # the batch's compute split (input copy, forward, output copy), in ns
    compute_ns: tuple[int, int, int] = (0, 0, 0)


# execute(payloads, instance) -> (results in order, (input_ns, infer_ns, output_ns))
Execute = Callable[[Sequence[Any], int], tuple[Sequence[Any], tuple[int, int, int]]]
# done(batch): called on the worker thread once per batch, every item's result or error set
Done = Callable[[list[Pending]], None]


class Batcher:
    """The queue and workers of one model (see the module docstring)."""

    def __init__(self, name: str, execute: Execute, done: Done, *, max_batch: int,
                 max_delay_s: float, max_queue: int, instances: int = 1):  # fmt: skip
        self.name = name
        self.max_batch = max(1, max_batch)
        self.max_delay_s = max_delay_s if self.max_batch > 1 else 0.0
        self.max_queue = max_queue
        self._execute, self._done = execute, done
        self._queue: deque[Pending] = deque()
        self._queued_samples = 0
        self._cond = threading.Condition(threading.Lock())
        self._stopped = False
        self._workers = [
            threading.Thread(
                target=self._work, args=(i,), name=f"gpulens-serve-{name}-{i}", daemon=True
            )  # fmt: skip
            for i in range(instances)
        ]

    def start(self) -> Batcher:
        for w in self._workers:
            w.start()
        return self

    def depth(self) -> int:
        """Requests waiting (not yet taken into a batch)."""
        return len(self._queue)

    def submit(self, item: Pending) -> None:
        """Queue a request; :class:`QueueFull` or :class:`ShuttingDown` refuse it now."""
        with self._cond:
            if self._stopped:
                raise ShuttingDown(f"model {self.name!r} is shutting down")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"model {self.name!r}: queue full ({self.max_queue} requests)")
            self._queue.append(item)
            self._queued_samples += item.n
            self._cond.notify()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Finish the batches running, refuse what still waits (ShuttingDown), end the workers."""
        with self._cond:
            self._stopped = True
            left = list(self._queue)
            self._queue.clear()
            self._queued_samples = 0
            self._cond.notify_all()
        for item in left:
            item.error = ShuttingDown(f"model {self.name!r} is shutting down")
        if left:
            self._done(left)
        for w in self._workers:
            if w.is_alive() and w is not threading.current_thread():
                w.join(timeout_s)

    # ------------------------------------------------------------------------ the workers
    def _take(self) -> list[Pending] | None:
        """The next batch (None once stopped)."""
        with self._cond:
            while not self._queue:
                if self._stopped:
                    return None
                self._cond.wait()
            if self.max_batch > 1 and self.max_delay_s > 0:
                deadline_ns = self._queue[0].enqueued_ns + int(self.max_delay_s * 1e9)
                while self._queued_samples < self.max_batch and not self._stopped:
                    left_s = (deadline_ns - time.perf_counter_ns()) / 1e9
                    if left_s <= 0 or not self._queue:
                        break
                    self._cond.wait(left_s)
                if not self._queue:  # another worker took them meanwhile
                    return []
            batch = [self._queue.popleft()]
            total = batch[0].n
            while self._queue and total + self._queue[0].n <= self.max_batch:
                item = self._queue.popleft()
                batch.append(item)
                total += item.n
            self._queued_samples -= total
            return batch

    def _work(self, instance: int) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            if batch:
                self._run(batch, instance)

    def _run(self, batch: list[Pending], instance: int) -> None:
        start = time.perf_counter_ns()
        size = sum(item.n for item in batch)
        try:
            results, split = self._execute([item.payload for item in batch], instance)
            for item, result in zip(batch, results, strict=True):
                item.result = result
        except Exception as exc:  # one bad batch fails its requests, never the worker
            log.warning("model %s: a batch of %d failed: %s", self.name, size, exc)
            split = (0, time.perf_counter_ns() - start, 0)
            for item in batch:
                item.error = exc
        for item in batch:
            item.queue_ns = start - item.enqueued_ns
            item.batch_size = size
            item.compute_ns = split
        try:
            self._done(batch)
        except Exception:  # the caller's hook: log, keep serving
            log.exception("model %s: completing a batch failed", self.name)

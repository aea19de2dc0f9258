"""Tracking API for one's own training script: two lines in the loop.

    import gpulens
    with gpulens.track(name="my-train") as tracker:
        for x, y in tracker.data(loader, device="cuda"):  # times the wait for each batch
            ...                                            # forward, backward, optimizer
            tracker.step()                                 # optional: marks the end of the step

Under ``gpulens run -- python train.py`` the steps go into the run that gpulens made (it already
monitors the GPU and host); run on its own, the script gets a run record and monitor of its own.

``tracker.data(iterable, device=None)``: with ``device``, each batch (a tensor, or tuples, lists
and dicts of them, nested) is moved there with ``non_blocking=True`` and the time that takes is
the step's host-to-device phase; the loop gets the batch on the device either way, so a
``x.to(device)`` left in the script is a no-op.

Under ``gpulens stalls --data PATH -- python train.py`` the script runs three times, and two
environment variables change what ``data()`` does (the script itself stays the same):

- ``GPULENS_INGESTION_FREE=1`` (the ingestion-free run of DS-Analyzer's method): the first
  :data:`INGESTION_FREE_BATCHES` batches are taken from the loader, moved to ``device`` (when
  given), and then repeated without touching the loader again, so the step time is compute
  alone. Each ``data()`` call still yields ``len(iterable)`` batches when the iterable has a
  length, so ``for epoch ...: for batch in tracker.data(loader)`` ends its epochs as usual, and
  the script's own stop condition (steps or epochs) ends the run. An iterable without a length
  repeats until the script stops by itself (a warning says so). Pass ``device=`` so the repeated
  batches already sit on the GPU; without it the script's own copy stays in the step. A script
  that changes its batches in place sees the changed values again.
- ``GPULENS_FIRST_PASS_ONLY=1`` (the cold-cache run): only the steps of the first complete pass
  over the first ``data()`` loop are timed, the pass that reads every file once after gpulens
  evicted them from the page cache; later epochs run untimed (their reads would be warm).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from gpulens.probes.steps import STEPS_SCHEMA, StepTimer
from gpulens.record import schema
from gpulens.record.writer import SeriesWriter, atomic_write_json
from gpulens.stats import throughput_ci

log = logging.getLogger(__name__)

RUN_DIR_ENV = "GPULENS_RUN_DIR"
INGESTION_FREE_ENV = "GPULENS_INGESTION_FREE"
FIRST_PASS_ENV = "GPULENS_FIRST_PASS_ONLY"
INGESTION_FREE_BATCHES = 4  # batches taken from the loader and then repeated
TRACKER_FILE = "tracker.json"


def _env_on(name: str) -> bool:
    return os.environ.get(name, "").strip() == "1"


def to_device(batch: Any, device: Any) -> Any:
    """``batch`` with every tensor in it (nested tuples, lists, dicts) moved to ``device`` with
    ``non_blocking=True``; anything else is returned as it is."""
    import torch

    if torch.is_tensor(batch):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(to_device(b, device) for b in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        moved = {k: to_device(v, device) for k, v in batch.items()}
        try:
            return type(batch)(moved)
        except TypeError:  # a mapping type that cannot be built from a dict
            return moved
    return batch


def _length(iterable: Any) -> int | None:
    try:
        return len(iterable)
    except (TypeError, NotImplementedError):
        return None


def _describe_loader(iterable: Any) -> dict[str, Any]:
    """What the tracker can tell about a loader without iterating it (torch DataLoader: workers
    and batch size)."""

    def int_attr(name: str) -> int | None:
        value = getattr(iterable, name, None)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    return {
        "type": type(iterable).__name__,
        "num_workers": int_attr("num_workers"),
        "batch_size": int_attr("batch_size"),
        "len": _length(iterable),
    }


def _batch_size(batch: Any) -> int | None:
    """Samples in a batch: the leading dimension of its first tensor-like part."""
    if hasattr(batch, "shape") and len(batch.shape) > 0:
        return int(batch.shape[0])
    if isinstance(batch, (list, tuple)) and batch:
        first = batch[0]
        if isinstance(first, (int, float, str, bytes)):
            return len(batch)  # a plain list of samples
        return _batch_size(first)
    if isinstance(batch, dict) and batch:
        return _batch_size(next(iter(batch.values())))
    return None


class Tracker:
    """Times the steps of a user's loop. Use :func:`track` to make one."""

    def __init__(
        self,
        name: str | None = None,
        samples_per_step: int | None = None,
        warmup_steps: int = 5,
        sample_hz: float = 10.0,
        runs_root: Path | None = None,
    ):
        self.samples_per_step = samples_per_step
        self._owned_writer = None
        self._monitor = None
        parent_dir = os.environ.get(RUN_DIR_ENV)
        if parent_dir:
            self.run_dir = Path(parent_dir)
            series = SeriesWriter(self.run_dir / schema.SERIES_DIR / "steps", STEPS_SCHEMA)
        else:
            self._start_own_run(name, sample_hz, runs_root)
            series = self._owned_writer.series("steps", STEPS_SCHEMA)
        self._series = series
        self._timer = StepTimer(series, cuda=False, warmup_steps=warmup_steps)
        self._in_step = False
        self._step_timed = False
        self._t0 = time.perf_counter()
        self._last_batch_samples: int | None = None
        self._ingestion_free = _env_on(INGESTION_FREE_ENV)
        self._first_pass_only = _env_on(FIRST_PASS_ENV)
        self._timing = True  # False once the first pass is over under GPULENS_FIRST_PASS_ONLY
        self._passes_completed = 0
        self._device: str | None = None
        self._loader: dict[str, Any] | None = None
        self._cached_batches: dict[int, tuple[Any, list]] = {}  # id -> (iterable, batches)
        self._warned_endless = False

    def _start_own_run(self, name, sample_hz, runs_root) -> None:
        import sys

        from gpulens.paths import runs_dir
        from gpulens.probes.environment import capture_environment
        from gpulens.probes.gpu import describe_gpus
        from gpulens.probes.monitor import Monitor, ProbeSpec
        from gpulens.record.writer import RunWriter

        self._owned_writer = RunWriter(
            runs_root or runs_dir(),
            kind="script",
            name=name or Path(sys.argv[0] or "script").stem,
            requested_config={"argv": sys.argv},
            environment=capture_environment(describe_gpus()),
        )
        self.run_dir = self._owned_writer.dir
        self._monitor = Monitor(
            self._owned_writer,
            [ProbeSpec("gpu"), ProbeSpec("host", {"root_pid": os.getpid()})],
            sample_hz,
        )
        self._monitor.start()

    def data(self, iterable: Iterable, device: Any = None) -> Iterator:
        """Yield from ``iterable``, timing how long each batch took to arrive; with ``device``,
        each batch is moved there (``non_blocking=True``). See the module docstring for what
        ``gpulens stalls`` changes here."""
        if self._loader is None:
            self._loader = _describe_loader(iterable)
        if device is not None and self._device is None:
            self._device = str(device)
        if self._ingestion_free:
            batches = self._repeated(iterable, device)
            move = None  # the repeated batches were moved once, when taken
        else:
            batches = iter(iterable)
            move = device
        while True:
            if self._in_step:
                self.step()
            timed = self._timing
            if timed:
                self._timer.begin_step()
            try:
                batch = next(batches)
            except StopIteration:
                if timed:
                    self._timer._prev_begin = None  # the epoch's end is not a step
                self._passes_completed += 1
                if self._first_pass_only:
                    self._timing = False
                return
            if timed:
                self._timer.batch_ready()
            if move is not None:
                batch = to_device(batch, move)
            if timed:
                self._timer.copy_done()
            self._last_batch_samples = _batch_size(batch)
            self._in_step = True
            self._step_timed = timed
            yield batch

    def _repeated(self, iterable: Iterable, device: Any) -> Iterator:
        """Ingestion-free batches: the first few from ``iterable`` (taken once per iterable),
        repeated ``len(iterable)`` times per call, or without end where it has no length."""
        entry = self._cached_batches.get(id(iterable))
        if entry is None or entry[0] is not iterable:
            source = iter(iterable)
            taken = list(itertools.islice(source, INGESTION_FREE_BATCHES))
            del source  # a DataLoader's workers shut down with their iterator
            if device is not None:
                taken = [to_device(b, device) for b in taken]
            entry = (iterable, taken)
            if not isinstance(iterable, Iterator):  # a one-shot iterator is not seen again
                self._cached_batches[id(iterable)] = entry
        taken = entry[1]
        if not taken:
            return
        n = _length(iterable)
        if n is None:
            if not self._warned_endless:
                self._warned_endless = True
                log.warning(
                    "gpulens ingestion-free run: the loader has no len(), so its %d batches "
                    "repeat until the script stops by itself (a step or time limit)",
                    len(taken),
                )
            yield from itertools.cycle(taken)
            return
        for i in range(n):
            yield taken[i % len(taken)]

    def step(self, samples: int | None = None) -> None:
        """Mark the end of a step. ``samples`` defaults to the batch's leading dimension."""
        if not self._in_step:
            return
        if self._step_timed:
            n = samples or self.samples_per_step or self._last_batch_samples or 1
            self._timer.end_step(samples=n)
        self._in_step = False

    def summary(self) -> dict[str, Any]:
        rows = self._timer.measured_rows()
        times = [r["step_time_s"] for r in rows if r["step_time_s"] is not None]
        samples = [r["samples"] for r in rows if r["step_time_s"] is not None]
        ci = throughput_ci(times, samples) if times else None

        def mean(key):
            vals = [r[key] for r in rows if r[key] is not None]
            return sum(vals) / len(vals) if vals else None

        loader = dict(self._loader) if self._loader else None
        if loader is not None:
            loader.update(
                device=self._device,
                ingestion_free=self._ingestion_free,
                cached_batches=INGESTION_FREE_BATCHES if self._ingestion_free else None,
                first_pass_only=self._first_pass_only,
                passes_completed=self._passes_completed,
            )
        return {
            "measured_steps": len(rows),
            "steps_total": len(self._timer.rows),
            "samples_total": sum(r["samples"] for r in self._timer.rows),
            "throughput_samples_per_s": ci.samples_per_s if ci else None,
            "throughput_ci95_pct": ci.ci95_pct if ci and math.isfinite(ci.ci95_pct) else None,
            "phases_s": {
                "data_wait": mean("data_wait_s"),
                # without device= the copy is inside the user's compute: not separable
                "h2d": mean("h2d_s") if self._device is not None else None,
                "compute": mean("compute_s"),
                "step": mean("step_time_s"),
            },
            "loader": loader,
        }

    def close(self, error: BaseException | None = None) -> None:
        if self._in_step:
            self.step()
        self._timer.finish()
        summary = self.summary()
        if self._owned_writer is None:
            self._series.close(compact=True)
            atomic_write_json(self.run_dir / TRACKER_FILE, summary)
            return
        overhead = self._monitor.stop()
        summary.update(overhead.as_dict())
        self._owned_writer.update(summary=summary)
        if error is None:
            self._owned_writer.finish("finished")
        elif isinstance(error, KeyboardInterrupt):
            self._owned_writer.finish("killed", error="interrupted (Ctrl-C)")
        else:
            self._owned_writer.finish("failed", error=str(error) or type(error).__name__)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(exc)


def track(name: str | None = None, samples_per_step: int | None = None, **kwargs) -> Tracker:
    """Start tracking this script's training loop (see the module docstring)."""
    return Tracker(name=name, samples_per_step=samples_per_step, **kwargs)


def read_tracker_summary(run_dir: Path) -> dict[str, Any] | None:
    path = Path(run_dir) / TRACKER_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None

"""Tracking API for one's own training script: two lines in the loop.

    import gpulens
    with gpulens.track(name="my-train") as tracker:
        for x, y in tracker.data(loader, device="cuda"):  # times the wait for each batch
            ...                                            # forward, backward, optimizer
            tracker.step()                                 # optional: marks the end of the step

Under ``gpulens run -- python train.py`` the steps go into the run that gpulens made; run on its
own, the script gets a run record and monitor of its own, logged to MLflow in the background
when the tracker closes (into the script's active MLflow run, if any; at exit the process waits
at most ``GPULENS_STORE_WAIT_S``, 30 s; ``track(store=False)`` or ``GPULENS_STORE=0``: off).

Under torchrun (``WORLD_SIZE`` > 1) every rank tracks its own steps into one run: per-rank
steps and summaries, combined at the end (throughput summed over ranks, step time of the slowest
rank, stragglers named); see :mod:`gpulens.workloads.tracking_ranks`.

Nothing the tracker does may stop the user's loop: a failure inside gpulens is logged (logger
``gpulens.workloads.tracking``) and the loop goes on untimed.

``tracker.data(iterable, device=None)``: with ``device``, each batch (a tensor, or tuples, lists
and dicts of them, nested) is moved there with ``non_blocking=True`` and the time that takes is
the step's host-to-device phase; the loop gets the batch on the device either way, so a
``x.to(device)`` left in the script is a no-op.

Under ``gpulens stalls --data PATH -- python train.py`` the script runs three times, and two
environment variables change what ``data()`` does (the script stays the same):
``GPULENS_INGESTION_FREE=1`` takes the first :data:`INGESTION_FREE_BATCHES` batches (moved to
``device`` when given) and repeats them, ``len(iterable)`` per call where there is a length
(epochs end as usual), without end otherwise, so the step time is compute alone;
``GPULENS_FIRST_PASS_ONLY=1`` times only the first complete pass over the first ``data()`` loop
(the pass that reads every file cold), later epochs untimed. Injection makes a tracker itself.

"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from gpulens.paths import runs_dir
from gpulens.probes.steps import StepTimer
from gpulens.record import schema
from gpulens.record.schema import STEPS_SCHEMA
from gpulens.record.tracker import (
    RANK_STEPS_SCHEMA,
    RUN_DIR_ENV,
    RUNNING,
    STRAGGLER_PCT,
    TRACKER_FILE,
    finalize_ranks,
    rank_series_name,
    run_status,
    write_rank_file,
)
from gpulens.record.writer import SeriesWriter, atomic_write_json
from gpulens.stats import throughput_ci
from gpulens.store.sink import ACTIVE_URI, active_mlflow_run
from gpulens.workloads import tracking_warmup as warm
from gpulens.workloads.tracking_batches import (
    batch_size,
    describe_loader,
    repeated_batches,
    to_device,
)
from gpulens.workloads.tracking_ranks import (
    GROUPS_DIR,
    RankInfo,
    group_key,
    join_group,
    leave_group,
    rank_doc,
    rank_info,
    rank_wait_s,
    status_of,
    wait_for_ranks,
)

log = logging.getLogger(__name__)

INGESTION_FREE_ENV = "GPULENS_INGESTION_FREE"
FIRST_PASS_ENV = "GPULENS_FIRST_PASS_ONLY"
INGESTION_FREE_BATCHES = 4  # batches taken from the loader and then repeated


def _env_on(name: str) -> bool:
    return os.environ.get(name, "").strip() == "1"


class _WithRank:
    """A series writer that adds ``rank`` to every row (the timer knows nothing of ranks)."""

    def __init__(self, series: SeriesWriter, rank: int):
        self.series, self.rank = series, rank

    def append(self, row: dict[str, Any]) -> None:
        self.series.append({**row, "rank": self.rank})


class Tracker:
    """Times the steps of a user's loop (make one with :func:`track`). A failure inside it is
    logged and the loop goes on untimed; the loop's own errors reach the script unchanged."""

    def __init__(
        self,
        name: str | None = None,
        samples_per_step: int | None = None,
        warmup_steps: int | None = None,
        sample_hz: float = 10.0,
        runs_root: Path | None = None,
        straggler_pct: float = STRAGGLER_PCT,
        store: bool = True,
        injected: bool = False,
    ):
        self.samples_per_step = samples_per_step
        self.injected = injected  # made by gpulens.workloads.inject, not by the script
        self.straggler_pct = straggler_pct
        self.run_dir: Path | None = None
        self.ranks = RankInfo()
        self._store = store
        self._owned_writer = None
        self._monitor = None
        self._series = None
        self._rank_series: SeriesWriter | None = None
        self._group: tuple[Path, str] | None = None  # (groups folder, key) of the run's creator
        self._member = False  # a rank that writes into a run another rank created
        self._held: warm.HeldWarmup | None = None  # warmup_steps None: fewer for a short script
        self._adaptive = warmup_steps is None
        warmup_steps = warm.WARMUP_STEPS if warmup_steps is None else warmup_steps
        self._timer = StepTimer(None, cuda=False, warmup_steps=warmup_steps)
        self._broken = False  # hooks stopped after a failure inside gpulens
        self._failure: str | None = None  # what failed, kept in the summary
        self._mlflow_run = active_mlflow_run()  # the script's, if one is active (or at close)
        self._closed = False
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
        if not injected:
            _explicit.append(self)
        try:
            self._start(name, warmup_steps, sample_hz, runs_root)
        except Exception as exc:
            self._fail("start", exc)
        if injected:  # nobody else will close it: its steps reach the run at exit
            atexit.register(lambda: self.close(getattr(sys, "last_value", None)))

    # --- start ------------------------------------------------------------------------------
    def _start(self, name, warmup_steps, sample_hz, runs_root) -> None:
        self.ranks = rank_info()
        parent_dir = os.environ.get(RUN_DIR_ENV)
        if parent_dir:
            self.run_dir = Path(parent_dir)
            self._member = True
        elif self.ranks.distributed:
            self._join_group(name, runs_root)
        else:
            self._start_own_run(name, runs_root)
        series_dir = self.run_dir / schema.SERIES_DIR
        if self.ranks.distributed:
            series = SeriesWriter(
                series_dir / rank_series_name(self.ranks.rank), RANK_STEPS_SCHEMA, background=True
            )
            self._rank_series = series
            self._series = _WithRank(series, self.ranks.rank)
            write_rank_file(self.run_dir, self.ranks.rank, self._rank_doc(RUNNING))
        elif self._owned_writer is None:
            self._series = SeriesWriter(series_dir / "steps", STEPS_SCHEMA, background=True)
        else:
            self._series = self._owned_writer.series("steps", STEPS_SCHEMA, background=True)
        if self._adaptive:
            self._series = self._held = warm.HeldWarmup(self._series)
        self._timer = StepTimer(self._series, cuda=False, warmup_steps=warmup_steps)
        if self._owned_writer is not None:
            self._start_monitor(sample_hz)

    def _join_group(self, name, runs_root) -> None:
        root = Path(runs_root) if runs_root else runs_dir()
        groups, key = root.parent / GROUPS_DIR, group_key()
        self.run_dir, created = join_group(groups, key, lambda: self._new_writer(name, root, key))
        if created:
            self._group = (groups, key)
        else:
            self._member = True
        log.debug("rank %d tracks into %s", self.ranks.rank, self.run_dir)

    def _new_writer(self, name, runs_root: Path, group: str | None = None) -> Path:
        import sys

        from gpulens.run.lifecycle import measured_run

        config: dict[str, Any] = {"argv": sys.argv}
        if group:
            config.update(world_size=self.ranks.world_size, group=group)
        stack = contextlib.ExitStack()
        self._session = stack.enter_context(
            measured_run(
                runs_root,
                kind="script",
                name=name or Path(sys.argv[0] or "script").stem,
                requested_config=config,
            )
        )
        self._run_stack = stack
        self._owned_writer = self._session.writer
        # An unclosed tracker ends its run at exit: finished, or failed with what ended it.
        atexit.register(lambda: self.close(getattr(sys, "last_value", None)))
        return self._owned_writer.dir

    def _start_own_run(self, name, runs_root) -> None:
        self.run_dir = self._new_writer(name, Path(runs_root) if runs_root else runs_dir())

    def _start_monitor(self, sample_hz) -> None:
        from gpulens.probes.monitor import Monitor, ProbeSpec

        # Under torchrun the launcher's process tree holds every rank of this node.
        root_pid = os.getppid() if self._group and "TORCHELASTIC_RUN_ID" in os.environ else None
        probes = [ProbeSpec("gpu"), ProbeSpec("host", {"root_pid": root_pid or os.getpid()})]
        self._monitor = Monitor(self._owned_writer, probes, sample_hz)
        self._monitor.start()

    def _rank_doc(self, status: str, error: str | None = None, **summary: Any) -> dict[str, Any]:
        return rank_doc(self.ranks, self.straggler_pct, status, error, **summary)

    # --- failures inside gpulens ------------------------------------------------------------
    def _fail(self, where: str, exc: BaseException) -> None:
        """Log a failure inside gpulens once and stop timing; the loop goes on."""
        if not self._broken:
            self._failure = f"{where}: {type(exc).__name__}: {exc}"
            log.warning(
                "gpulens tracking stopped (%s failed: %s: %s); the training goes on untracked",
                where,
                type(exc).__name__,
                exc,
                exc_info=log.isEnabledFor(logging.DEBUG),
            )
        self._broken = True

    def _safely(self, where: str, fn, *args) -> Any:
        if self._broken:
            return None
        try:
            return fn(*args)
        except Exception as exc:
            self._fail(where, exc)
            return None

    # --- the loop -----------------------------------------------------------------------------
    def data(self, iterable: Iterable, device: Any = None, loader: Any = None) -> Iterator:
        """Yield from ``iterable``, timing how long each batch took to arrive; with ``device``,
        each batch is moved there (``non_blocking=True``). ``loader``: the DataLoader behind
        ``iterable`` where that is an iterator of it (for its worker count). See the module
        docstring for what ``gpulens stalls`` changes here."""
        if self._broken:
            yield from self._untimed(iter(iterable), device)
            return
        try:
            if self._loader is None:
                self._loader = describe_loader(loader if loader is not None else iterable)
            if device is not None and self._device is None:
                self._device = str(device)
        except Exception as exc:
            self._fail("data", exc)
        if self._ingestion_free and not self._broken:
            batches = self._repeated(iterable, device)
            move = None  # the repeated batches were moved once, when taken
        else:
            batches = iter(iterable)
            move = device
        while True:
            if self._broken:
                yield from self._untimed(batches, move)
                return
            timed = self._safely("data", self._before_batch)
            try:
                batch = next(batches)
            except StopIteration:
                self._safely("data", self._end_of_pass, timed)
                return
            if timed:
                self._safely("data", self._timer.batch_ready)
            if move is not None:
                batch = to_device(batch, move)
            if timed:
                self._safely("data", self._timer.copy_done)
            self._last_batch_samples = self._safely("data", batch_size, batch)
            self._in_step = True
            self._step_timed = bool(timed) and not self._broken
            yield batch

    def _untimed(self, batches: Iterator, device: Any) -> Iterator:
        for batch in batches:
            yield to_device(batch, device) if device is not None else batch

    def _before_batch(self) -> bool:
        if self._in_step:
            self.step()
        if self._timing:
            self._timer.begin_step()
        return self._timing

    def _end_of_pass(self, timed: bool) -> None:
        if timed:
            self._timer._prev_begin = None  # the epoch's end is not a step
        self._passes_completed += 1
        if self._first_pass_only:
            self._timing = False

    def _repeated(self, iterable: Iterable, device: Any) -> Iterator:
        """Ingestion-free batches (see :func:`repeated_batches`)."""

        def warn_endless(n: int) -> None:
            if not self._warned_endless:
                self._warned_endless = True
                log.warning(
                    "gpulens ingestion-free run: the loader has no len(), so its %d batches "
                    "repeat until the script stops by itself (a step or time limit)", n
                )  # fmt: skip

        return repeated_batches(
            iterable, device, self._cached_batches, INGESTION_FREE_BATCHES, warn_endless
        )

    def step(self, samples: int | None = None, skip: bool = False) -> None:
        """End a step of ``samples`` (default: the batch's size); ``skip``: no training step."""
        if not self._in_step:
            return
        self._in_step = False
        if skip:
            self._timer._prev_begin = None  # and the next step's start is its own
        elif self._step_timed and not self._broken:
            n = samples or self.samples_per_step or self._last_batch_samples or 1
            self._safely("step", self._timer.end_step, n)

    # --- the end ------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """This process's steps (under torchrun: this rank's; the run's ``tracker.json`` and
        summary combine the ranks)."""
        try:
            return self._summary()
        except Exception as exc:
            self._fail("summary", exc)
            return {}

    def _summary(self) -> dict[str, Any]:
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
                injected=self.injected,
            )
        return {
            **warm.step_counts(len(self._timer.rows), len(rows), self._adaptive),
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
            "tracking_us_per_step": self._timer.tracking_us_per_step(),  # gpulens's own time
        }

    def close(self, error: BaseException | None = None) -> None:
        """End the tracking: write the steps and the summary, end the run gpulens made for
        this script (``failed``/``killed`` with ``error``) and log it to the store in the
        background. Never raises."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(ValueError):
            _explicit.remove(self)
        try:
            self._close(error)
        except Exception as exc:
            self._fail("close", exc)

    def _close(self, error: BaseException | None) -> None:
        summary: dict[str, Any] = {}
        if self._series is not None and not self._broken:
            try:
                # An injected step ends at optimizer.step(): a batch fetched and never trained
                # on (the script broke out of its loop) is no step.
                if self._in_step and not self.injected:
                    self.step()
                if self._held is not None:  # the script's length is known: settle its warm-up
                    self._held.settle(self._timer)
                self._timer.finish()
                summary = self._summary()
            except Exception as exc:
                self._fail("close", exc)
        if self._failure:
            summary["tracking_error"] = self._failure
        summary.update(active_mlflow_run() or self._mlflow_run)  # the record goes into it
        status, message = status_of(error)
        if self.ranks.distributed and self._rank_series is not None:
            self._close_rank(summary, status, message)
            if self._member:
                return
        elif self._owned_writer is None:  # inside a run made by `gpulens run`/`stalls`
            if self._series is not None:
                self._series.close(compact=True)
                atomic_write_json(self.run_dir / TRACKER_FILE, summary)
            return
        if self._owned_writer is not None:
            self._end_own_run(summary, status, message, error)

    def _close_rank(self, summary: dict[str, Any], status: str, message: str | None) -> None:
        try:
            self._rank_series.close(compact=True)
        except Exception as exc:  # the stream stays readable
            log.warning("gpulens: could not compact rank %d's steps: %s", self.ranks.rank, exc)
        write_rank_file(self.run_dir, self.ranks.rank, self._rank_doc(status, message, **summary))

    def _end_own_run(self, summary, status, message, error) -> None:
        writer = self._owned_writer
        try:
            if self._group is not None:
                wait_s = rank_wait_s() if not isinstance(error, KeyboardInterrupt) else 5.0
                docs = wait_for_ranks(self.run_dir, self.ranks.local_world_size, wait_s)
                finished = [r for r, d in docs.items() if d.get("status") != RUNNING]
                late = sorted(set(docs) - set(finished))
                if late:
                    log.warning(
                        "gpulens: rank(s) %s still running after %.0f s; the run ends without "
                        "their summary, and their steps stay in series/steps-rank<R>",
                        ", ".join(map(str, late)),
                        wait_s,
                    )
                summary = finalize_ranks(self.run_dir, docs, ranks_to_merge=finished)
                docs.setdefault(self.ranks.rank, {"status": status, "error": message})
                status, message = run_status(docs)
            if self._monitor is not None:
                summary.update(self._monitor.stop().as_dict())
            writer.update(summary=summary)
        finally:
            if status != schema.STATUS_FINISHED or message:
                self._session.end_as(status, message)
            self._run_stack.close()  # measured_run ends the record with that status
            if self._group is not None:
                leave_group(*self._group)
        if self._store:
            from gpulens.store.background import log_finished

            log_finished(writer.dir, block=False, tracking_uri=summary.get(ACTIVE_URI))

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(exc)


_explicit: list[Tracker] = []  # open trackers the script made itself


def explicit_tracker_active() -> bool:
    """Whether the script tracks itself (injection then stays out of its way)."""
    return bool(_explicit)


def track(name: str | None = None, samples_per_step: int | None = None, **kwargs) -> Tracker:
    """Start tracking this script's training loop (see the module docstring)."""
    return Tracker(name=name, samples_per_step=samples_per_step, **kwargs)

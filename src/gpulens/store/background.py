"""Every ended run reaches the store on its own, without ever holding the run.

:func:`log_finished` is the one best-effort entry point, for the tracking API's ``close()``
(standalone scripts), the CLI (built-in runs, commands, colocate jobs, failed runs) and anything
else that ends a record. It never raises. It looks at the store first (at most 2 s), then logs in
a background thread: the caller waits for it at most ``budget_s`` (``block=True``), or not at
all (``block=False``), in which case the process waits at exit for what is left of the budget.
Whatever has not finished by then is left to ``gpulens runs sync``, and a warning says so; the
record on disk is complete either way. MLflow is imported inside the thread, only when it is
installed: importing this module costs nothing.

``GPULENS_STORE=0`` (or ``off``/``false``/``no``) turns automatic logging off;
``GPULENS_STORE_WAIT_S`` sets the default budget (30 s).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gpulens.errors import MissingExtraError, UsageError
from gpulens.paths import default_tracking_uri
from gpulens.store.availability import StoreUnavailableError
from gpulens.store.sink import RecordSink, default_sink

log = logging.getLogger(__name__)

WAIT_ENV = "GPULENS_STORE_WAIT_S"
DEFAULT_BUDGET_S = 30.0
SYNC_HINT = "the record is kept locally; `gpulens runs sync` logs it later"

LOGGED = "logged"
PENDING = "pending"
SKIPPED = "skipped"
UNAVAILABLE = "unavailable"
FAILED = "failed"


@dataclass
class StoreOutcome:
    """What became of one record: ``status`` is ``logged`` (``mlflow_run_id`` set), ``pending``
    (still logging in the background), ``skipped`` (MLflow not installed, or turned off),
    ``unavailable`` (the store did not answer, refused, or was busy) or ``failed``;
    ``message`` is one line for a person."""

    status: str
    message: str
    record_dir: str
    tracking_uri: str | None = None
    mlflow_run_id: str | None = None
    elapsed_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_budget_s() -> float:
    raw = os.environ.get(WAIT_ENV, "").strip()
    if not raw:
        return DEFAULT_BUDGET_S
    try:
        value = float(raw)
    except ValueError:
        log.warning("%s=%r is not a number of seconds; using %g s", WAIT_ENV, raw, DEFAULT_BUDGET_S)
        return DEFAULT_BUDGET_S
    return max(0.0, value)


class _Job:
    def __init__(self, record_dir: Path, sink: RecordSink, uri: str | None, budget_s: float):
        self.record_dir = record_dir
        self.sink = sink
        self.uri = uri
        self.t0 = time.monotonic()
        self.deadline = self.t0 + budget_s
        self.outcome: StoreOutcome | None = None
        self.thread = threading.Thread(
            target=self._run, name=f"gpulens-store-{record_dir.name}", daemon=True
        )

    def _done(self, status: str, message: str, **fields: Any) -> None:
        self.outcome = StoreOutcome(
            status,
            message,
            str(self.record_dir),
            elapsed_s=time.monotonic() - self.t0,
            **fields,
        )

    def _run(self) -> None:
        try:
            uri = self.uri or default_tracking_uri()
            try:
                run_id = self.sink.log_record(self.record_dir)
            except MissingExtraError as exc:
                self._done(SKIPPED, str(exc), tracking_uri=uri)
            except StoreUnavailableError as exc:
                self._done(UNAVAILABLE, str(exc), tracking_uri=uri)
            except UsageError as exc:  # e.g. a record still running: says what to do itself
                self._done(FAILED, f"not stored in MLflow: {exc}", tracking_uri=uri)
            else:
                message = f"logged to MLflow ({uri}) as {run_id}"
                self._done(LOGGED, message, tracking_uri=uri, mlflow_run_id=run_id)
        except Exception as exc:  # the store must never lose a run or break its caller
            log.debug("logging %s to MLflow failed", self.record_dir, exc_info=True)
            self._done(FAILED, f"not stored in MLflow: {exc}; {SYNC_HINT}")

    def wait(self, until: float) -> StoreOutcome:
        self.thread.join(max(0.0, until - time.monotonic()))
        if self.outcome is not None:
            return self.outcome
        waited = time.monotonic() - self.t0
        return StoreOutcome(
            PENDING,
            f"MLflow logging still going after {waited:.0f} s; {SYNC_HINT}",
            str(self.record_dir),
            tracking_uri=self.uri,
            elapsed_s=waited,
        )


_pending: list[_Job] = []
_pending_lock = threading.Lock()
_atexit_registered = False


def _report(outcome: StoreOutcome) -> None:
    if outcome.status == LOGGED:
        log.info("run %s %s", Path(outcome.record_dir).name, outcome.message)
    elif outcome.status == SKIPPED:
        log.debug("run %s not stored: %s", Path(outcome.record_dir).name, outcome.message)
    else:
        log.warning("gpulens: run %s: %s", Path(outcome.record_dir).name, outcome.message)


def _wait_at_exit() -> None:
    """At interpreter exit: wait for background logging until each job's deadline, then say
    what is left to ``gpulens runs sync``."""
    with _pending_lock:
        jobs = list(_pending)
        _pending.clear()
    for job in jobs:
        try:
            _report(job.wait(job.deadline))
        except Exception:  # never fail an exit
            log.debug("waiting for the store failed", exc_info=True)


def log_finished(
    record_dir: Path | str,
    *,
    block: bool = True,
    budget_s: float | None = None,
    tracking_uri: str | None = None,
    experiment: str | None = None,
    sink: RecordSink | None = None,
) -> StoreOutcome:
    """Log an ended record to the store, best effort: never raises, never holds the caller
    longer than ``budget_s`` (default ``GPULENS_STORE_WAIT_S`` or 30 s; the reachability check
    inside takes at most 2 s of it).

    ``block=True`` waits here for the outcome (at most ``budget_s``); ``block=False`` returns
    a ``pending`` outcome at once and the process waits at exit for what is left of the
    budget. Does nothing (``skipped``, a debug log) when MLflow is not installed or
    ``GPULENS_STORE=0``. ``sink`` defaults to :func:`~gpulens.store.sink.default_sink`
    (MLflow at ``tracking_uri``). A failed or killed record is logged with MLflow status
    FAILED/KILLED.
    """
    global _atexit_registered
    path = Path(record_dir)
    try:
        uri = tracking_uri or default_tracking_uri()
        sink = default_sink(uri, experiment) if sink is None else sink
        reason = sink.unavailable_reason()
        if reason:
            outcome = StoreOutcome(SKIPPED, reason, str(path))
            _report(outcome)
            return outcome
        budget = default_budget_s() if budget_s is None else max(0.0, float(budget_s))
        job = _Job(path, sink, uri, budget)
        job.thread.start()
        if block:
            outcome = job.wait(job.deadline)
            _report(outcome)
            return outcome
        with _pending_lock:
            _pending.append(job)
            if not _atexit_registered:
                atexit.register(_wait_at_exit)
                _atexit_registered = True
        return StoreOutcome(
            PENDING, "logging to MLflow in the background", str(path), tracking_uri=tracking_uri
        )
    except Exception as exc:  # best effort, whatever happened
        log.debug("could not start logging %s", path, exc_info=True)
        outcome = StoreOutcome(FAILED, f"not stored in MLflow: {exc}; {SYNC_HINT}", str(path))
        _report(outcome)
        return outcome


def wait_pending(timeout_s: float | None = None) -> list[StoreOutcome]:
    """Wait for the background jobs started with ``block=False`` (each until its deadline, or
    at most ``timeout_s`` in all) and return their outcomes; for tests and long-lived callers."""
    with _pending_lock:
        jobs = list(_pending)
    until = None if timeout_s is None else time.monotonic() + timeout_s
    outcomes = []
    for job in jobs:
        outcome = job.wait(job.deadline if until is None else min(job.deadline, until))
        if not job.thread.is_alive():
            with _pending_lock:
                if job in _pending:
                    _pending.remove(job)
        outcomes.append(outcome)
    return outcomes


def run_bounded(what: str, fn: Callable[[], Any], budget_s: float | None = None) -> Any:
    """``fn()`` in a background thread, waited for at most ``budget_s`` (default as
    :func:`log_finished`); its result, or None after one warning naming ``what`` when it failed
    or took too long. For the MLflow logging that follows the records (experiment parents)."""
    budget = default_budget_s() if budget_s is None else max(0.0, float(budget_s))
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except Exception as exc:  # best effort: the records are logged already
            box["error"] = exc

    thread = threading.Thread(target=target, name="gpulens-store-extra", daemon=True)
    thread.start()
    thread.join(budget)
    if thread.is_alive():
        log.warning("gpulens: %s: still logging after %.0f s; left undone", what, budget)
    elif "error" in box:
        log.warning("gpulens: %s: not logged: %s", what, box["error"])
    return box.get("result")

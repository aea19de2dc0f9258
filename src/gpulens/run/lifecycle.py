"""The one run lifecycle: record, environment, monitor, and every way a run can end.

Built-in training, data-parallel ranks, wrapped commands, the tracking API and collocation
experiments all run inside ``measured_run``::

    with measured_run(runs_root, kind="train", name="resnet50", requested_config=asdict(cfg),
                      role=role_name("stalls", "cached")) as run:
        run.set_effective(eff)
        with run.monitor([ProbeSpec("gpu", {...}), ProbeSpec("host", {...})], hz=10):
            ...  # the measured work
        run.set_summary({...})
    result = run.result()

The record exists before the slow start-up (the environment capture imports torch and starts
NVML), so a run stopped in its first seconds still leaves one. It ends ``finished``; ``failed``
with the error (an out-of-memory error becomes the one-line ``oom_hint``); or ``killed`` on
Ctrl-C. The exception raised carries ``gpulens_record_dir`` so a caller can still store the
record it left.

One exception: a run refused for the user's input (a usage error, exit 2: a device or data
that cannot be used, a mechanism this machine cannot run) before it measured anything (no
monitor started, no series, nothing else written into the record) leaves no record: the
record it opened is removed, so ``runs list`` and the store never show a run that never ran.
A usage error once measuring began, and every other failure, still ends the record ``failed``.
A record adopted through ``writer`` stays its opener's to end.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from gpulens.errors import GpulensError, RuntimeFailure, UsageError
from gpulens.probes.monitor import Monitor
from gpulens.record import schema
from gpulens.record.writer import RunWriter
from gpulens.run import interrupts
from gpulens.run.result import RunResult

log = logging.getLogger(__name__)


class RunSession:
    """A live run: its writer, its monitor, and how it should end."""

    def __init__(self, writer: RunWriter, metrics=None):
        self.writer = writer
        self.metrics = metrics  # a web.metrics.MetricsEndpoint the monitor serves, or None
        self.oom_hint: str | None = None
        self._monitor: Monitor | None = None
        self._end: tuple[str, str | None] | None = None

    @property
    def run_id(self) -> str:
        return self.writer.run_id

    @property
    def dir(self) -> Path:
        return self.writer.dir

    def set_effective(self, effective_config: Mapping[str, Any]) -> None:
        """What actually ran (defaults resolved, devices chosen), beside what was asked for."""
        self.writer.update(effective_config=dict(effective_config))

    def set_summary(self, summary: Mapping[str, Any]) -> None:
        self.writer.update(summary=dict(summary))

    def mark_unsupported(self, metric: str, reason: str) -> None:
        """A metric this run cannot measure, and why (recorded as such, never as zero)."""
        self.writer.update(unsupported={metric: reason})

    def end_as(self, status: str, error: str | None = None) -> None:
        """End with ``status`` instead of ``finished`` when the block completes (a wrapped
        command that exited non-zero, an experiment that measured nothing)."""
        if status not in schema.STATUSES or status == schema.STATUS_RUNNING:
            raise ValueError(f"a run cannot end as {status!r}")
        self._end = (status, error)

    def monitor(self, probes: list, hz: float = 10.0) -> Monitor:
        """The GPU and host monitor for the measured part (a context manager); its costs go
        into ``monitor_costs()``. With ``metrics``, it serves Prometheus ``/metrics`` too."""
        self._monitor = Monitor(self.writer, probes, hz=hz, metrics=self.metrics)
        return self._monitor

    def monitor_costs(self) -> dict[str, Any]:
        """The sampler's CPU share of one core and its samples (empty without a monitor)."""
        return self._monitor.overhead().as_dict() if self._monitor is not None else {}

    def result(self) -> RunResult:
        """The run as analyses see it (its status is final once the block has ended)."""
        return RunResult.from_dict(dict(self.writer.meta), self.writer.dir)


def _is_out_of_memory(exc: BaseException) -> bool:
    # torch.cuda.OutOfMemoryError, recognised without importing torch here
    return type(exc).__name__ == "OutOfMemoryError" and type(exc).__module__.startswith("torch")


def _refused_before_measuring(exc: BaseException, session: RunSession) -> bool:
    """A usage error (exit 2, the user's to fix) raised before anything was measured."""
    refused = isinstance(exc, GpulensError) and exc.exit_code == UsageError.exit_code
    return refused and session._monitor is None and session.writer.is_bare()


def _tag(exc: BaseException, record_dir: Path) -> None:
    with contextlib.suppress(AttributeError, TypeError):
        exc.gpulens_record_dir = record_dir  # type: ignore[attr-defined]


@contextlib.contextmanager
def measured_run(
    runs_root: Path,
    *,
    kind: str,
    name: str | None = None,
    role: str | None = None,
    requested_config: Mapping[str, Any] | None = None,
    capture_environment: bool = True,
    gpu_indices: list[int] | None = None,
    writer: RunWriter | None = None,
    metrics=None,
) -> Iterator[RunSession]:
    """Open a run record, capture the environment, yield a ``RunSession``, and end the record
    on every exit path (see the module docstring). ``writer`` adopts a record opened earlier
    (e.g. by a launcher) instead of making one; ``gpu_indices`` limits the environment's GPU
    list (default: all GPUs NVML sees); ``metrics`` (a
    :class:`gpulens.web.metrics.MetricsEndpoint`) serves Prometheus metrics while it samples."""
    owned = writer is None
    if writer is None:
        writer = RunWriter(
            runs_root,
            kind=kind,
            name=name,
            requested_config=dict(requested_config or {}),
            role=role,
        )
    session = RunSession(writer, metrics)
    try:
        if capture_environment:
            from gpulens.probes.environment import capture_environment as capture
            from gpulens.probes.nvml.inventory import describe_gpus

            gpus = describe_gpus()
            if gpu_indices is not None:
                gpus = [g for g in gpus if g.get("index") in set(gpu_indices)]
            writer.update(environment=capture(gpus))
        yield session
    except KeyboardInterrupt as exc:
        writer.finish(schema.STATUS_KILLED, error=interrupts.stop_reason())
        _tag(exc, writer.dir)
        raise
    except BaseException as exc:
        if owned and _refused_before_measuring(exc, session) and writer.discard():
            raise
        if _is_out_of_memory(exc) and session.oom_hint:
            writer.finish(schema.STATUS_FAILED, error=session.oom_hint)
            failure = RuntimeFailure(session.oom_hint)
            _tag(failure, writer.dir)
            raise failure from exc
        writer.finish(schema.STATUS_FAILED, error=str(exc) or type(exc).__name__)
        _tag(exc, writer.dir)
        raise
    status, error = session._end or (schema.STATUS_FINISHED, None)
    writer.finish(status, error=error)

"""What every ``gpulens`` command shares: the consoles, progress, the one JSON document, the store
call, and the rules for "a built-in workload or a command after ``--``".

The command modules use these through the module (``common.err``, ``common.store_record(...)``),
so a test patches one name here and every command sees it.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import sys
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.text import Text

from gpulens.errors import UsageError
from gpulens.report import output
from gpulens.report.progress import ProgressReporter

log = logging.getLogger("gpulens.cli")

out = Console()
err = Console(stderr=True)
# ``args``: the arguments main() was given (not sys.argv: main(argv) is called in-process too).
state: dict[str, Any] = {"debug": False, "args": None, "started_unix_s": None}


def process_start_unix_s() -> float | None:
    """When this process started (None where psutil cannot tell)."""
    import psutil

    try:
        return psutil.Process().create_time()
    except (psutil.Error, OSError):
        return None


DEVICE_HELP = "cuda:N or cpu [default: cuda:0 if there is a GPU, else cpu]."
SKIP_BAD_HELP = (
    "Images that cannot be decoded (corrupt, truncated, empty, not an image): put the next "
    "readable image in their place and count them (skipped_samples) instead of stopping at "
    "the first."
)
JSON_HELP = "Print one JSON document on stdout."
# `predict`, `fit` and `advise` (whose --catalog is the instance catalog) name it the same way
GPU_CATALOG_HELP = "A CSV of GPUs to add or override (columns as the bundled gpus.csv)."


def after_dashes() -> bool:
    """Whether the command line has a `--` (what follows is a command to run)."""
    args = state["args"] if state["args"] is not None else sys.argv[1:]
    return "--" in args


def mb_per_s_to_bytes(mb_per_s: float | None) -> float | None:
    """Megabytes (10^6 bytes) per second to bytes per second; None or 0: no limit."""
    return mb_per_s * 1e6 if mb_per_s else None


def emit_json(doc: Any) -> None:
    output.emit_json(doc)


def progress(label: str, unit: str = "") -> ProgressReporter:
    """Progress on stderr: a spinner on a terminal, a plain line per phase otherwise (also with
    --json: stdout keeps its one document)."""
    return ProgressReporter(err, label, unit=unit)


def warn(label: str, text: str) -> None:
    err.print(Text.assemble((label, "yellow"), text), soft_wrap=True, highlight=False)


def warn_unfinished(record) -> str | None:
    """A run read for a prediction that did not finish: its steps may be a partial picture.
    Warns on stderr and returns the warning, for a --json document to carry too. One still
    running has no summary yet: a usage error, not a warning that it "ended"."""
    if record.status == "running":
        raise UsageError(
            f"run {record.run_id} is still running: predict from it once it has ended "
            "(`gpulens runs list` shows its status), or give a finished run"
        )
    text = unfinished_text(record)
    if text:
        warn("warning: ", text)
    return text


def unfinished_text(record) -> str | None:
    """``warn_unfinished``'s warning, unprinted; None for a finished run."""
    if record.status == "finished":
        return None
    return (f"run {record.run_id} ended {record.status}: its measured steps may not represent "
            "the job (predict from a finished run)")  # fmt: skip


def store_record(record_dir: Path | None, enabled: bool) -> str | None:
    """Log a record (finished, failed or killed) to MLflow when it is installed; bounded wait,
    never raises: a store that is down leaves the record local for `gpulens runs sync`."""
    if not enabled or record_dir is None or not Path(record_dir).is_dir():
        return None
    from gpulens.store.background import log_finished

    outcome = log_finished(record_dir)
    if outcome.status in ("unavailable", "failed", "pending"):
        warn("not stored in MLflow: ", outcome.message)
    if outcome.status == "logged":
        log_report_artifact(Path(record_dir))
    return outcome.mlflow_run_id


def log_report_artifact(record_dir: Path) -> None:
    """The run's figures (``gpulens report``'s page) into its MLflow run, where plotly is
    installed; bounded wait, never raises."""
    import importlib.util

    if importlib.util.find_spec("plotly") is None:
        return
    import tempfile

    from gpulens.record.reader import read_record
    from gpulens.report.document import build_report
    from gpulens.report.html import render_html
    from gpulens.store.background import run_bounded
    from gpulens.store.mlflow_experiment import log_report_page

    def log_page() -> str | None:
        record = read_record(record_dir)
        title = f"gpulens: {record.meta.get('name') or record.run_id}"
        with tempfile.TemporaryDirectory(prefix="gpulens-report-") as tmp:
            page = Path(tmp) / "report.html"
            page.write_text(render_html(build_report([record]), title), encoding="utf-8")
            return log_report_page(record_dir, page)

    run_bounded("the run's report page", log_page)


def store_will_log() -> bool:
    """Whether ``store_record`` will log to MLflow (installed, not turned off)."""
    from gpulens.store import mlflow_sink
    from gpulens.store.sink import store_enabled

    return store_enabled() and mlflow_sink.is_available()


def store_experiment(enabled: bool, *, stalls: tuple[dict, list[Path]] | None = None,
                     colocate_record: Path | None = None) -> None:  # fmt: skip
    """After an experiment's records are stored: a parent MLflow run over a stalls result's
    runs, or a colocate run's trials as its child runs. Bounded wait, never raises."""
    from gpulens.store import mlflow_sink
    from gpulens.store.sink import store_enabled

    if not enabled or not store_enabled() or not mlflow_sink.is_available():
        return
    from gpulens.store import mlflow_experiment
    from gpulens.store.background import run_bounded

    if stalls is not None:
        result, dirs = stalls
        run_bounded(
            "the stalls experiment's MLflow parent run",
            lambda: mlflow_experiment.log_stalls_experiment(result, dirs),
        )
    if colocate_record is not None:
        run_bounded(
            "the colocate trials' MLflow runs",
            lambda: mlflow_experiment.log_colocate_trials(colocate_record),
        )


@contextlib.contextmanager
def live_store(enabled: bool):
    """While the block runs, the runs it makes are logged to MLflow live (a follower process,
    :mod:`gpulens.store.live`); ``store_record`` completes them at the end."""
    follower = None
    if enabled:
        from gpulens.paths import runs_dir
        from gpulens.store.live import start_follower

        follower = start_follower(runs_dir())
    try:
        yield
    finally:
        if follower is not None:
            follower.stop()


# --------------------------------------------------------------- workload or command
@dataclass(frozen=True)
class Target:
    """What ``run`` and ``stalls`` were asked to measure: a built-in workload or a command."""

    workload: str | None = None
    command: tuple[str, ...] = ()

    @property
    def is_command(self) -> bool:
        return bool(self.command)


def _runnable(word: str) -> bool:
    return shutil.which(word) is not None or Path(word).exists()


def resolve_target(args: list[str] | None, example: str = "") -> Target:
    """The one rule for ``gpulens run`` and ``gpulens stalls``.

    - one word that names a built-in workload (and no program of that name): the workload;
    - after ``--``, or several words, or one word that is a program or a path: a command;
    - a workload name followed by more words that is no program: a usage error (both given);
    - one word that is neither a workload nor a program, without ``--``: unknown workload.
    """
    args = list(args or [])
    if not args:
        raise UsageError(
            "give a built-in workload (see `gpulens workloads`) or a command after --"
            + (f": {example}" if example else "")
        )
    if _runnable(args[0]):
        # a program is always a command: say so before the registry imports torch (seconds)
        return Target(command=tuple(args))
    from gpulens.workloads.models import list_workloads

    known = {w.name for w in list_workloads()}
    first = args[0]
    if first in known:
        if len(args) > 1:
            raise UsageError(f"give either the workload '{first}' or a command after --, not both")
        if not after_dashes():
            return Target(workload=first)
        raise UsageError(f"'{first}' is a built-in workload, not a program: give it without --")
    if len(args) == 1 and not after_dashes():
        raise UsageError(
            f"unknown workload '{first}'; choose one of: {', '.join(sorted(known))} "
            "(or give a command after --)"
        )
    return Target(command=tuple(args))


def given_on_command_line(ctx: typer.Context, name: str) -> bool:
    """Whether the option ``name`` (its parameter name) was typed, not left at its default."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def deprecated_alias(ctx: typer.Context, new: str, old: str) -> Any:
    """The value of option ``new`` (a parameter name), or of its hidden deprecated spelling
    ``old`` with a one-line note on stderr; both typed is a usage error. Old spellings are kept
    for one release (see CHANGELOG.md)."""
    flags = {p.name: p.opts[0] for p in ctx.command.params}
    if not given_on_command_line(ctx, old):
        return ctx.params[new]
    if given_on_command_line(ctx, new):
        raise UsageError(f"give {flags[new]} only ({flags[old]} is its deprecated old name)")
    err.print(
        Text(
            f"note: {flags[old]} is deprecated and goes in the next release: use {flags[new]} "
            "(same meaning)",
            style="yellow",
        ),
        soft_wrap=True,
        highlight=False,
    )
    return ctx.params[old]


def reject_workload_only_options(ctx: typer.Context, command_ok: Collection[str]) -> None:
    """A command after ``--`` takes only the options in ``command_ok`` (parameter names); any
    other option typed on the command line applies to built-in workloads only."""
    typed = [
        param.opts[0]
        for param in ctx.command.params
        if param.name not in command_ok
        and param.opts
        and param.opts[0].startswith("-")
        and given_on_command_line(ctx, param.name)
    ]
    if typed:
        raise UsageError(
            f"{', '.join(typed)} {'applies' if len(typed) == 1 else 'apply'} to built-in "
            "workloads only; pass your script's own "
            "options after --"
        )

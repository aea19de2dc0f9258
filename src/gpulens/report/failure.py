"""How a failed command ends: one line on stderr, an exit code, and with ``--json`` one document.

Exit codes: 0 ok; 1 it failed while running (``RuntimeFailure``, a damaged record, a wrapped
command that failed, a store that refused runs); 2 the command line is wrong (unknown option or
command, missing or malformed value, gpulens's ``UsageError``; a bare ``gpulens`` prints the help
on stderr and exits 2, as click 8.2 and later do for a group given no command); 130 Ctrl-C.

typer 0.26 and later vendor click (``typer._click``) and older ones use click itself: the
exception classes are found from typer's own exports, never by importing click.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import typer
from rich.console import Console
from rich.text import Text

from gpulens.errors import GpulensError
from gpulens.report.output import emit_json, emitted, error_doc


def _click_exceptions() -> tuple[type, type | None, type | None]:
    """(ClickException, UsageError, NoArgsIsHelpError) of the click that typer uses."""
    base = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
    module = sys.modules.get(base.__module__)
    return base, getattr(module, "UsageError", None), getattr(module, "NoArgsIsHelpError", None)


CLICK_EXCEPTION, CLICK_USAGE_ERROR, NO_ARGS_IS_HELP = _click_exceptions()
EXIT = typer.Exit
ABORT = typer.Abort


@dataclass
class Failure:
    exit_code: int
    message: str
    exception: str | None = None
    path: Any = None
    internal: bool = False
    help_text: str | None = None


def _usage_message(exc: BaseException, command_path: str) -> str:
    text = exc.format_message() if hasattr(exc, "format_message") else str(exc)
    text = " ".join(str(text).split()).rstrip(".")
    text = text[:1].lower() + text[1:] if text[:2] != text[:2].upper() else text
    ctx = getattr(exc, "ctx", None)
    path = getattr(ctx, "command_path", None) or command_path
    return f"{text}; see `{path} --help`"


def classify(exc: BaseException, command_path: str = "gpulens") -> Failure:
    """What an exception that ended a command means for the user. ``command_path`` names the
    command for a usage error that click raised before it knew (``gpulens run``)."""
    if isinstance(exc, GpulensError):
        path = getattr(exc, "path", None)
        return Failure(exc.exit_code, str(exc) or type(exc).__name__, type(exc).__name__, path)
    if NO_ARGS_IS_HELP is not None and isinstance(exc, NO_ARGS_IS_HELP):
        ctx = getattr(exc, "ctx", None)
        path = getattr(ctx, "command_path", None) or command_path
        help_text = ctx.get_help() if ctx is not None else None
        message = f"give a command; see `{path} --help`"
        return Failure(2, message, type(exc).__name__, help_text=help_text)
    if CLICK_USAGE_ERROR is not None and isinstance(exc, CLICK_USAGE_ERROR):
        message = _usage_message(exc, command_path)
        return Failure(getattr(exc, "exit_code", 2), message, type(exc).__name__)
    if isinstance(exc, CLICK_EXCEPTION):
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        return Failure(getattr(exc, "exit_code", 1), str(message), type(exc).__name__)
    if isinstance(exc, (KeyboardInterrupt, ABORT)):
        from gpulens.run import interrupts  # a SIGTERM takes Ctrl-C's path: say which it was

        return Failure(interrupts.exit_code(), interrupts.stop_reason(), "KeyboardInterrupt")
    if isinstance(exc, EXIT):
        return Failure(int(getattr(exc, "exit_code", 1)), "", type(exc).__name__)
    return Failure(
        1,
        f"{type(exc).__name__}: {exc} (run again with --debug for the traceback, "
        "and please report it)",
        type(exc).__name__,
        internal=True,
    )


def _plain(text: str) -> None:
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except Exception:  # a closed stderr: nothing more can be said
        pass


def report_failure(failure: Failure, err: Console, json_mode: bool) -> int:
    """Print the failure (one line; the help for a bare group) and, in ``--json`` mode, one
    error document on stdout unless the command printed its own. Never raises."""
    try:
        if failure.help_text:
            err.print(Text(failure.help_text.rstrip()), soft_wrap=True, highlight=False)
        if failure.message and not failure.help_text:
            label = "internal error: " if failure.internal else "error: "
            line = Text.assemble((label, "bold red"), failure.message)
            if failure.exit_code == 130:
                line = Text(failure.message)
            err.print(line, soft_wrap=True, highlight=False)
    except Exception:
        _plain(f"error: {failure.message}")
    if json_mode and not emitted():
        try:
            emit_json(
                error_doc(
                    failure.message or f"exit code {failure.exit_code}",
                    failure.exit_code,
                    failure.exception,
                    failure.path,
                    internal=failure.internal,
                )
            )
        except Exception as exc:  # never crash while reporting a failure
            _plain(f"error: could not write the JSON error document: {exc!r}")
    return failure.exit_code


def handle(exc: BaseException, err: Console, json_mode: bool, command_path: str = "gpulens") -> int:
    """``classify`` then ``report_failure``; falls back to a plain line if even that fails."""
    try:
        return report_failure(classify(exc, command_path), err, json_mode)
    except Exception:
        _plain(f"error: {type(exc).__name__}: {exc!r}")
        return 1

"""The ``gpulens`` command. Thin: parses arguments, calls the layers, renders.

``app`` is the typer application; ``main(argv)`` the entry point that maps every exception to one
line on stderr and an exit code (and with ``--json`` one error document on stdout). Each command
lives in its own module (``run``, ``stalls``, ``colocate``, ``data``, ``doctor``, ``runs``); what
they share (consoles, progress, the store call, workload-or-command) is in ``common``.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import typer

from gpulens import __version__
from gpulens.cli import colocate, common, doctor, load, report, run, serve, stalls, sweep, ui
from gpulens.cli.advise import register as register_advise
from gpulens.cli.data import data_app
from gpulens.cli.predict import register as register_predict
from gpulens.cli.runs import runs_app
from gpulens.report import failure, output
from gpulens.run import interrupts

__all__ = ["app", "main"]

# Help and messages are plain text: rich markup would eat anything in [brackets]
# ("pip install 'gpulens[store]'", "[cuda:0 if present]").
app = typer.Typer(
    name="gpulens",
    help="Measure deep-learning workloads on GPUs and turn the numbers into decisions.\n\n"
    "Start with `gpulens doctor` (what this machine can measure) and `gpulens demo`.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _print_version(value: bool) -> None:
    if value:
        common.out.print(f"gpulens {__version__}", markup=False, highlight=False)
        raise typer.Exit()


@app.callback()
def _global(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks and debug logs."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show info logs on stderr."),
    version: bool = typer.Option(
        False,
        "--version",
        help="Print the version and exit.",
        is_eager=True,
        callback=_print_version,
    ),
) -> None:
    common.state["debug"] = debug
    level = logging.DEBUG if debug else logging.INFO if verbose else logging.WARNING
    logging.basicConfig(
        level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )


# The order here is the order of `gpulens --help`.
run.register_run(app)
stalls.register(app)
colocate.register(app)
serve.register(app)
load.register(app)
sweep.register(app)
register_predict(app)  # predict, fit
register_advise(app)  # advise, allocate-workers
run.register_demo(app)
doctor.register(app)  # doctor, workloads
app.add_typer(data_app, name="data")
app.add_typer(runs_app, name="runs", help="List, show, compare, export and sync stored runs.")
report.register(app)
ui.register(app)


# -------------------------------------------------------------------------------------- main
def _own_args(args: list[str]) -> list[str]:
    """gpulens's own arguments: those before a `--` (after it, the wrapped command's)."""
    return args[: args.index("--")] if "--" in args else args


def _command_path(own: list[str]) -> str:
    """``gpulens run`` for ``run resnet18 --steps``: the (sub)commands named in the arguments."""
    try:
        command: Any = typer.main.get_command(app)
        path = ["gpulens"]
        for arg in own:
            sub = (getattr(command, "commands", None) or {}).get(arg)
            if sub is None:
                if arg.startswith("-"):
                    continue
                break
            path.append(arg)
            command = sub
        return " ".join(path)
    except Exception:  # only a hint in a message
        return "gpulens"


def _help_text() -> str:
    command = typer.main.get_command(app)
    with command.make_context("gpulens", [], resilient_parsing=True) as ctx:
        return command.get_help(ctx)


def main(argv: list[str] | None = None) -> int:
    """Entry point: one line and an exit code for every error (0 ok, 1 failed, 2 usage,
    130 Ctrl-C); with --json one JSON document on stdout, an error one included; tracebacks only
    with --debug."""
    # A Ctrl-C that native code (torch's import, its FLOP counter) swallows is still honoured.
    interrupts.install()
    try:
        return _main(argv)
    finally:
        interrupts.uninstall()
        common.state["args"] = None  # a later resolve_target outside main reads sys.argv


def _main(argv: list[str] | None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    own = _own_args(args)
    debug, json_mode = "--debug" in own, "--json" in own
    output.reset()
    common.state["args"] = args
    # when the command started, for a time budget that counts Python's start-up: the process's
    # start where the process is this command (argv from sys.argv), else now
    common.state["started_unix_s"] = common.process_start_unix_s() if argv is None else None
    if not args:  # the help on stderr and exit 2, with every click version (as click >= 8.2)
        return failure.report_failure(
            failure.Failure(2, "give a command", help_text=_help_text()), common.err, json_mode
        )
    try:
        rv = app(args=args, prog_name="gpulens", standalone_mode=False)
    except SystemExit as exc:
        rv = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException as exc:
        if debug and not isinstance(
            exc, (failure.CLICK_EXCEPTION, failure.EXIT, failure.ABORT, KeyboardInterrupt)
        ):
            raise
        return failure.handle(exc, common.err, json_mode, _command_path(own))
    # Not standalone, typer returns the exit code of a typer.Exit (Ctrl-C is Exit(130)).
    code = rv if isinstance(rv, int) and not isinstance(rv, bool) else 0
    if code == 130:
        return failure.handle(KeyboardInterrupt(), common.err, json_mode)
    if code != 0 and json_mode and not output.emitted():
        return failure.report_failure(
            failure.Failure(code, f"gpulens exited with code {code}"), common.err, json_mode
        )
    return code

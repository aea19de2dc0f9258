"""``gpulens doctor`` (what this machine can measure) and ``gpulens workloads``."""

from __future__ import annotations

import typer
from rich.text import Text

from gpulens.cli import common


def register(app: typer.Typer) -> None:
    app.command(
        help="What gpulens can measure on this machine, and how to enable what is missing.",
        short_help="What this machine can measure, and how to enable the rest.",
    )(doctor)
    app.command(help="List the built-in workloads.")(workloads)


def doctor(json_out: bool = typer.Option(False, "--json", help="Print one JSON document.")) -> None:
    from dataclasses import asdict

    from gpulens.probes.capabilities import Check, checks_as_dict, extras_status, run_checks
    from gpulens.report.terminal import render_checks, render_extras
    from gpulens.store.mlflow_sink import store_status

    checks = run_checks()
    st = store_status()  # one request of at most 2 s: says whether the store answers
    store_check = Check("store", st["ok"], f"{st['tracking_uri']}: {st['detail']}", st["hint"])
    checks = [store_check if c.name == "store" else c for c in checks]
    extras = extras_status()
    if json_out:
        common.emit_json(
            {**checks_as_dict(checks), "store": st, "extras": [asdict(e) for e in extras]}
        )
    else:
        render_checks(common.out, checks)
        render_extras(common.out, extras)


def workloads(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    from gpulens.workloads.models import list_workloads

    specs = list_workloads()
    if json_out:
        common.emit_json(
            [
                {
                    "name": w.name,
                    "task": w.task,
                    "default_batch_size": w.default_batch_size,
                    "input_shape": list(w.input_shape),
                }
                for w in specs
            ]
        )
        return
    for w in specs:
        line = f"{w.name:<20} {w.task:<22} batch {w.default_batch_size:<4} {w.input_shape}"
        common.out.print(Text(line), highlight=False)

"""``gpulens sweep SPEC.yaml``: a grid or list of gpulens runs, one child process per cell."""

from __future__ import annotations

from pathlib import Path

import typer
from rich import box
from rich.table import Table
from rich.text import Text

from gpulens.cli import common
from gpulens.errors import UsageError

SWEEP_HELP = """Run a grid or list of gpulens runs from a YAML spec, resumably.

Every cell is a normal `gpulens run|colocate|stalls ... --json` in a child process; its record
lands in the normal store. Spec keys: name, command (run|colocate|stalls), workload (one or a
list), grid (option: [values]), or cells (a list of option mappings) instead of workload/grid,
options (applied to every cell, e.g. steps: 20, device: cuda), gpus (GPUs per cell, default 1).
Example:


  name: cnn-batch
  command: run
  workload: [resnet18, resnet50]
  grid: {batch_size: [32, 64], precision: [bf16]}
  options: {steps: 20}

Cells are named by a hash of their config; the sweep directory (GPULENS_HOME/sweeps/NAME-HASH or
--out) holds one state file per cell. --resume skips finished cells; a failed cell is retried
--retries times, then recorded as failed with the last lines of its stderr."""


def _table(doc: dict) -> Table:
    table = Table(box=box.SIMPLE_HEAD, title=f"sweep {doc['sweep_dir']}")
    for column in ("cell", "status", "tries", "settings", "run id", "throughput/s"):
        table.add_column(column)
    for cell in doc["cells"]:
        settings = " ".join(f"{k}={v}" for k, v in cell["config"].items() if k != "command")
        tput = cell["summary"].get("throughput_samples_per_s")
        table.add_row(
            Text(cell["cell_id"]),
            Text(cell["status"]),
            Text(str(cell["attempts"])),
            Text(settings),
            Text(cell["run_id"] or "-"),
            Text(f"{tput:.1f}" if isinstance(tput, (int, float)) else "-"),
        )
    return table


def _check_options(app: typer.Typer, cells) -> None:
    """Every cell's options are options of its command: a misspelt key is one line now, not
    a failure of every cell after its retries."""
    commands = getattr(typer.main.get_command(app), "commands", {})  # typer's own click group
    for cell in cells:
        command = commands.get(str(cell.config["command"]))
        if command is None:  # not registered in this app (tests of a sub-app): checked by the child
            continue
        flags = {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
        for key in cell.config:
            if key in ("command", "workload", "jobs", "gpus"):
                continue
            flag = "--" + key.replace("_", "-")
            if flag not in flags:
                raise UsageError(
                    f"sweep spec: gpulens {cell.config['command']} has no option {flag} "
                    f"(key {key!r}); see `gpulens {cell.config['command']} --help`"
                )


def register(app: typer.Typer) -> None:
    @app.command("sweep", help=SWEEP_HELP)
    def sweep(
        spec_path: Path = typer.Argument(..., metavar="SPEC.yaml", help="The sweep spec."),
        executor: str = typer.Option("local", "--executor", help="local or ray."),
        ray_address: str | None = typer.Option(
            None,
            "--ray-address",
            help="Ray cluster address (auto, ray://host:10001); default: a local Ray.",
        ),
        resume: bool = typer.Option(False, "--resume", help="Skip cells already done."),
        retries: int = typer.Option(2, "--retries", help="Retries of a failed cell."),
        out: Path | None = typer.Option(None, "--out", help="Sweep directory."),
        json_out: bool = typer.Option(False, "--json", help=common.JSON_HELP),
    ) -> None:
        from gpulens.sweep.cells import expand
        from gpulens.sweep.runner import SweepConfig, run_sweep
        from gpulens.sweep.spec import load_spec

        config = SweepConfig(load_spec(spec_path), retries=retries, resume=resume, out_dir=out)
        _check_options(app, expand(config.spec))
        if executor == "local":
            from gpulens.sweep.local import LocalExecutor

            runner = LocalExecutor()
        elif executor == "ray":
            from gpulens.sweep.ray_executor import RayExecutor

            runner = RayExecutor(address=ray_address)
        else:
            raise UsageError(f"--executor {executor!r}: use local or ray")
        with common.progress("sweep", unit="cells") as bar:
            result = run_sweep(config, runner, on_progress=lambda d, t: bar.count(d, t, "cells"))
        doc = result.to_dict()
        if json_out:
            common.emit_json(doc)
        else:
            common.out.print(_table(doc))
            common.out.print(
                f"done {doc['done']}, failed {doc['failed']}, remaining {doc['remaining']}",
                markup=False,
                highlight=False,
            )
        if doc["failed"] or doc["remaining"]:
            raise typer.Exit(1)

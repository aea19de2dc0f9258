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
--retries times, then recorded as failed with the last lines of its stderr. A cell that fails
with a usage error (exit 2: a bad value in the spec) is recorded as failed at once: it would
fail again."""


def _table(doc: dict) -> Table:
    """One row per cell: the settings that differ between cells (the shared ones in the
    caption), run id and throughput, or the first line of a failed cell's error."""
    configs = [{k: v for k, v in c["config"].items() if k != "command"} for c in doc["cells"]]
    keys = list(dict.fromkeys(k for c in configs for k in c))
    varying = [k for k in keys if len({repr(c.get(k)) for c in configs}) > 1]
    shared = " ".join(f"{k}={configs[0][k]}" for k in keys if k not in varying and configs)
    table = Table(
        box=box.SIMPLE_HEAD,
        title=f"sweep {doc['sweep_dir']}",
        title_justify="left",
        caption=f"every cell: {shared}" if shared else None,
        caption_justify="left",
        padding=(0, 1),
        pad_edge=False,
        collapse_padding=True,
        show_edge=False,
    )
    for column in ("cell", "status", "tries", *varying, "run id", "samples/s"):
        # the settings and ids stay whole; a failed cell's error wraps in the last column
        table.add_column(column, no_wrap=column != "samples/s", min_width=len(column))
    for cell, config in zip(doc["cells"], configs, strict=True):
        tput = cell["summary"].get("throughput_samples_per_s")
        if isinstance(tput, (int, float)):
            result = Text(f"{tput:.1f}")
        elif cell.get("error"):
            result = Text(str(cell["error"]).strip().splitlines()[-1][:60], style="red")
        else:
            result = Text("-")
        table.add_row(
            Text(cell["cell_id"][:8]),  # the full id is in --json and the state file's name
            Text(cell["status"]),
            Text(str(cell["attempts"])),
            *(Text(str(config.get(k, "-"))) for k in varying),
            Text(cell["run_id"] or "-"),
            result,
        )
    return table


def _summary_line(doc: dict) -> str:
    """``done D, failed F, remaining R``; how many failed with a usage error, not retried."""
    usage = doc.get("usage_errors") or 0
    why = f" ({usage} of them a usage error, exit 2: not retried)" if usage else ""
    return f"done {doc['done']}, failed {doc['failed']}{why}, remaining {doc['remaining']}"


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
        retries: int = typer.Option(
            2, "--retries", help="Retries of a failed cell (not of a usage error)."
        ),
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
            common.out.print(_summary_line(doc), markup=False, highlight=False)
        if doc["failed"] or doc["remaining"]:
            raise typer.Exit(1)

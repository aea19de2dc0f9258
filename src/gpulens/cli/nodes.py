"""Runs over several nodes on the command line: the shared options' help, storing the joined
run, and ``gpulens runs join``."""

from __future__ import annotations

from typing import Any

import typer
from rich import box
from rich.table import Table
from rich.text import Text

from gpulens.cli import common
from gpulens.cli.common import JSON_HELP
from gpulens.paths import runs_dir

NNODES_HELP = (
    "Nodes of a data-parallel run (each runs --gpus processes; start gpulens on every node). "
    "Under torchrun --nproc-per-node 1 or srun --ntasks-per-node 1 it comes from their environment."
)
NODE_RANK_HELP = "This node's place, 0..NNODES-1 (node 0 serves the rendezvous)."
MASTER_ADDR_HELP = "Node 0's address, which every node can reach (the rendezvous)."
MASTER_PORT_HELP = "The rendezvous port on node 0, the same on every node [29500]."
JOIN_HELP = (
    "Join the record shards of a multi-node run (one per node, each from that node's "
    "GPULENS_HOME) into one run with per-rank series and the straggler check. Runs on one "
    "GPULENS_HOME (a shared filesystem) are joined when they end.\n\n"
    "\b\nExample:\n"
    "  gpulens runs join ./node0/20261125-101500-ab12cd.node0 ./node1/20261125-101500-ab12cd.node1"
)


def store_joined(result, store: bool) -> None:
    """Log the run that node 0 joined at the end of a multi-node run (never raises)."""
    join = (result.summary or {}).get("join") or {}
    if join.get("joined") and join.get("record_dir"):
        from pathlib import Path

        if Path(join["record_dir"]).is_dir():  # node 0: the others only hear of it
            common.store_record(Path(join["record_dir"]), store)


def render_node_end(summary: dict[str, Any], json_out: bool = False) -> None:
    """After a node's own summary: the joined run (node 0, one GPULENS_HOME), or where the
    joined run lies, or how to join the shards by hand, said once (the run logs it at info
    level only). With ``--json`` (its document has ``join``) only the last, on stderr."""
    join = summary.get("join")
    if not join:
        return
    from pathlib import Path

    if not join.get("joined"):
        console = common.err if json_out else common.out
        console.print(Text(f"this is one node's shard of run {join['run_id']}: "
                           f"{join.get('hint') or join.get('reason')}", style="yellow"),
                      soft_wrap=True)  # fmt: skip
    elif json_out:
        return
    elif join.get("record_dir") and Path(join["record_dir"]).is_dir():
        from gpulens.record.reader import read_record

        common.out.print()
        render_joined(joined_json(read_record(Path(join["record_dir"]))))
    else:
        common.out.print(Text(f"node 0 joined the nodes' shards as run {join['run_id']}"),
                         soft_wrap=True)  # fmt: skip


def joined_json(record) -> dict[str, Any]:
    """The ``--json`` document of ``gpulens runs join``."""
    s = record.meta.get("summary") or {}
    return {
        "run_id": record.run_id,
        "status": record.status,
        "record_dir": str(record.dir),
        "workload": s.get("workload"),
        "device": s.get("device"),
        "nnodes": s.get("nnodes"),
        "world_size": s.get("world_size"),
        "measured_steps": s.get("measured_steps"),
        "throughput_samples_per_s": s.get("throughput_samples_per_s"),
        "throughput_ci95_pct": s.get("throughput_ci95_pct"),
        "phases_s": s.get("phases_s"),
        "slowest_rank": s.get("slowest_rank"),
        "step_time_median_s": s.get("step_time_median_s"),
        "straggler_threshold_pct": s.get("straggler_threshold_pct"),
        "stragglers": s.get("stragglers"),
        "ranks": s.get("ranks"),
        "nodes": s.get("nodes"),
        "shards": (record.meta.get("joined") or {}).get("shards"),
    }


def _num(value: Any, fmt: str = "{:.4g}") -> str:
    return "-" if value is None else fmt.format(value)


def _ms(seconds: Any) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.2f}"


def render_joined(doc: dict[str, Any]) -> None:
    common.out.print(Text(f"joined run {doc['run_id']} ({doc['status']}): {doc['nnodes']} nodes, "
                          f"{doc['world_size']} ranks, {_num(doc['throughput_samples_per_s'])} "
                          f"samples/s; {doc['record_dir']}"), soft_wrap=True)  # fmt: skip
    table = Table(title="ranks", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for header in ("rank", "node", "hostname", "samples/s", "step ms", "data wait ms"):
        table.add_column(header, justify="left" if header == "hostname" else "right")
    for r in doc.get("ranks") or []:
        phases = r.get("phases_s") or {}
        table.add_row(str(r.get("rank")), str(r.get("node_rank")), Text(str(r.get("hostname"))),
                      _num(r.get("throughput_samples_per_s"), "{:.1f}"),
                      _ms(phases.get("step")), _ms(phases.get("data_wait")))  # fmt: skip
    common.out.print(table)
    for s in doc.get("stragglers") or []:
        common.out.print(Text(f"straggler: rank {s['rank']} ({s['phase']}: {s['mean_s']:.3g} s, "
                              f"{s['above_median_pct']:.0f}% of the median step above the "
                              "median rank)", style="yellow"), soft_wrap=True)  # fmt: skip
    if not doc.get("stragglers"):
        pct = doc.get("straggler_threshold_pct")
        common.out.print(Text(f"no straggler (threshold {_num(pct)}% of the median step)",
                              style="dim"))  # fmt: skip


def join(
    shards: list[str] = typer.Argument(
        ..., help="Every node's shard: its record directory (or run id in this GPULENS_HOME)."
    ),
    store: bool = typer.Option(True, "--store/--no-store", help="Log the joined run to MLflow."),
    json_out: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    from gpulens.record.join import join_shards
    from gpulens.record.reader import read_record
    from gpulens.store.queries import find_run

    dirs = [find_run(s).dir for s in shards]
    target = join_shards(dirs, runs_dir())
    common.store_record(target, store)
    doc = joined_json(read_record(target))
    if json_out:
        common.emit_json(doc)
    else:
        render_joined(doc)


def register_join(app: typer.Typer) -> None:
    app.command("join", help=JOIN_HELP, short_help="Join a multi-node run's shards into one run.")(
        join
    )

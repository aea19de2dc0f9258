"""``gpulens stalls``: where a training job's time goes (built-in workload or command)."""

from __future__ import annotations

import typer

from gpulens.cli import common
from gpulens.cli import nodes as common_nodes
from gpulens.cli.common import DEVICE_HELP, JSON_HELP, SKIP_BAD_HELP
from gpulens.paths import runs_dir

STALLS_HELP = (
    "Break a training job's time into compute, prep (CPU) stall and fetch (storage) stall "
    "by differential runs: ingestion-free, page-cache-warm and cold; with --gpus N also the "
    "interconnect stall (N GPUs with DDP vs 1) and the network stall (NCCL on sockets vs "
    "P2P). When the loop waits on its loader, the cold run is a paired one: each worker "
    "alternates batch by batch between an evicted half of the files and a cached half, which "
    "cancels the CPU's drift between runs. Every run is stored.\n\n"
    "Give a built-in WORKLOAD, or after `--` a command whose script uses gpulens.track().\n\n"
    "\b\nExamples:\n"
    "  gpulens stalls resnet50 --data ./images --workers 15 --precision bf16\n"
    "  gpulens stalls --data ./images -- python train.py --epochs 2"
)
# Seconds the storing of a breakdown's runs takes after them (2-core CPU, local SQLite store:
# 4.5 s for MLflow's import and the first run, 0.4-0.5 s for each further one).
STORE_FIRST_S, STORE_PER_RUN_S = 5.0, 0.6
# The options of `gpulens stalls` that a command after `--` takes too (parameter names).
COMMAND_OPTIONS = {"target", "data", "store", "json_out"}


def register(app: typer.Typer) -> None:
    app.command(
        help=STALLS_HELP,
        short_help="Where a training job's time goes: compute, prep, fetch, interconnect.",
    )(stalls)


def stalls(
    ctx: typer.Context,
    target: list[str] = typer.Argument(
        None,
        help="A built-in workload (see `gpulens workloads`) or, after --, a command whose "
        "script wraps its loader in gpulens.track().data(...).",
    ),
    data: str = typer.Option(
        ..., "--data", help="On-disk dataset (gpulens data make ...), or the one the script reads."
    ),
    gpus: int = typer.Option(
        1, "--gpus", help="GPUs for the interconnect and network stalls (2 or more runs DDP)."
    ),
    nnodes: int = typer.Option(None, "--nnodes", help=common_nodes.NNODES_HELP),
    node_rank: int = typer.Option(None, "--node-rank", help=common_nodes.NODE_RANK_HELP),
    master_addr: str = typer.Option(None, "--master-addr", help=common_nodes.MASTER_ADDR_HELP),
    master_port: int = typer.Option(None, "--master-port", help=common_nodes.MASTER_PORT_HELP),
    workers: int = typer.Option(None, "--workers", help="Data-loader processes."),
    batch_size: int = typer.Option(None, "--batch-size", "-b", help="Samples per step."),
    device: str = typer.Option(None, "--device", help=DEVICE_HELP),
    precision: str = typer.Option("fp32", "--precision", help="fp32, bf16 or fp16."),
    until_ci: float = typer.Option(
        3.0,
        "--until-ci",
        help="Target 95% CI half-width of each share, in points: each run stops once its "
        "throughput is known to within PCT/1.4 percent (or at --max-duration).",
    ),
    max_duration: float = typer.Option(60.0, "--max-duration", help="Seconds per run at most."),
    time_budget: float = typer.Option(
        300.0,
        "--time-budget",
        help="Seconds for the whole command, from gpulens's start to its answer (start-up, "
        "every run with its warm-up, the page-cache handling and the storing of the runs "
        "included): the runs the breakdown needs share it (each at most --max-duration); what "
        "is left repeats the cached run, the cold one (evicting again) or the paired one while "
        "a share misses --until-ci, whichever narrows it most per second; repeats are pooled. "
        "A budget too small to measure each run honestly is said at the start, with the least "
        "that works; one that cannot hold the runs at all stops before any run (exit 2). "
        "Not for a command after --: its script decides how long it runs.",
    ),
    worker_affinity: str = typer.Option(
        "os",
        "--worker-affinity",
        help="Loader workers where the OS scheduler puts them ('os') or pinned one per "
        "physical core ('cores').",
    ),
    storage_latency_ms: float = typer.Option(
        0.0,
        "--storage-latency-ms",
        help="Emulate slow storage: per-file latency for the cold files.",
    ),
    storage_bandwidth_mb_s: float = typer.Option(
        None,
        "--storage-bandwidth-mb-s",
        help="Emulate slow storage: megabytes (10^6 bytes) per second per reader.",
    ),
    old_storage_bandwidth: float = typer.Option(
        None, "--storage-bandwidth-mbps", hidden=True
    ),  # deprecated: --storage-bandwidth-mb-s
    fetch_design: str = typer.Option(
        "auto",
        "--fetch-design",
        help="How the fetch stall is measured: 'paired' (one run alternating evicted and cached "
        "files; needs an image folder and loader workers), 'separate' (a cold run beside the "
        "cached one) or 'auto' (paired when the cached run waits on its loader at least 20% "
        "of the time).",
    ),
    skip_bad_samples: bool = typer.Option(False, "--skip-bad-samples", help=SKIP_BAD_HELP),
    store: bool = typer.Option(True, "--store/--no-store", help="Log the runs to MLflow."),
    json_out: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    from gpulens.stalls import StallsConfig, run_stalls
    from gpulens.stalls.command import run_stalls_command

    found = common.resolve_target(
        target, example="gpulens stalls --data PATH -- python train.py ..."
    )
    if found.is_command:
        common.reject_workload_only_options(ctx, COMMAND_OPTIONS)
        with common.progress("stalls") as progress, common.live_store(store):
            result = run_stalls_command(
                list(found.command), data, runs_dir(), progress=progress.phase
            )
    else:
        from gpulens.launch.multinode import resolve_topology
        from gpulens.run import interrupts

        nodes = resolve_topology(nnodes, node_rank, master_addr, master_port)
        with interrupts.held():  # a Ctrl-C during torch's import is lost or aborts the process
            import torch  # noqa: F401
        bandwidth_mb_s = common.deprecated_alias(
            ctx, "storage_bandwidth_mb_s", "old_storage_bandwidth"
        )
        config = StallsConfig(
            workload=found.workload,
            data=data,
            gpus=gpus,
            batch_size=batch_size,
            workers=workers,
            device=device,
            precision=precision,
            until_ci_pct=until_ci,
            max_duration_s=max_duration,
            time_budget_s=time_budget,
            worker_affinity=worker_affinity,
            storage_latency_s=storage_latency_ms / 1000.0,
            storage_bandwidth_bytes_per_s=common.mb_per_s_to_bytes(bandwidth_mb_s),
            fetch_design=fetch_design,
            skip_bad_samples=skip_bad_samples,
            nodes=nodes,
        )
        from gpulens.stalls.budget import TimeBudget

        storing = store and common.store_will_log()
        budget = TimeBudget.from_unix_start(
            time_budget,
            max_duration,
            common.state.get("started_unix_s"),
            # storing the runs: MLflow's import and the parent run, then each run's record
            finish_s=STORE_FIRST_S if storing else 0.5,
            finish_per_run_s=STORE_PER_RUN_S if storing else 0.0,
        )
        with common.progress("stalls", unit="steps") as progress:

            def on_step(step: int, total: int | None, _elapsed_s: float, _info) -> None:
                progress.count(step, total)

            with common.live_store(store):
                result = run_stalls(
                    config, runs_dir(), progress=progress.phase, on_step=on_step, budget=budget
                )
    repeated = (run_id for ids in result.all_runs.values() for run_id in ids)
    run_ids = {*result.runs.values(), *repeated} - {None, ""}
    run_dirs = sorted(runs_dir() / run_id for run_id in run_ids)
    doc = result.as_dict()
    if doc.get("what_if"):  # with the runs, for `gpulens report` and MLflow
        from gpulens.record.writer import amend_summary

        for run_dir in run_dirs:
            amend_summary(run_dir, stalls_what_if=doc["what_if"])
    for run_dir in run_dirs:
        common.store_record(run_dir, store)
    common.store_experiment(store, stalls=(doc, run_dirs))
    if json_out:
        common.emit_json(doc)
    else:
        from gpulens.report.terminal import render_stalls

        render_stalls(common.out, doc)

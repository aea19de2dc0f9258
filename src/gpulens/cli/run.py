"""``gpulens run`` (a built-in workload, or any command after ``--``) and ``gpulens demo``."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import typer
from rich.text import Text

from gpulens.cli import common
from gpulens.cli import nodes as common_nodes
from gpulens.cli.common import DEVICE_HELP, JSON_HELP, SKIP_BAD_HELP
from gpulens.errors import GpulensError, UsageError
from gpulens.paths import gpulens_home, runs_dir, unwritable_home

RUN_HELP = (
    "Run a built-in WORKLOAD under the monitor, or monitor any command given after `--`.\n\n"
    "\b\nExamples:\n"
    "  gpulens run resnet50 --precision bf16 --data ./images --workers 15\n"
    "  gpulens run gpt2_tiny --steps 50 --device cpu --json\n"
    "  gpulens run resnet50 --precision bf16 --gpus 2 --nccl-transport socket\n"
    "  gpulens run resnet50 --gpus 8 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1\n"
    "  gpulens run -- python train.py --epochs 1"
)
DEMO_HELP = (
    "Make a small JPEG dataset, train a small CNN on it under the monitor, "
    "store the run and print what was measured. Works on CPU-only machines."
)
# The options of `gpulens run` that a command after `--` takes too (parameter names).
COMMAND_OPTIONS = {
    "target", "sample_hz", "name", "store", "json_out", "inject", "duration", "prometheus_port",
    "prometheus_host", "steps",
}  # fmt: skip


def register_run(app: typer.Typer) -> None:
    app.command(
        help=RUN_HELP, short_help="Measure a built-in workload, or any command given after --."
    )(run)


def register_demo(app: typer.Typer) -> None:
    app.command(
        help=DEMO_HELP,
        short_help="Train a small CNN on generated JPEGs and show what was measured.",
    )(demo)


# ------------------------------------------------------------------------- the run document
def monitor_cost(s: dict[str, Any]) -> dict[str, Any]:
    """What the monitor costs, under the summary's names (old records: the one old key)."""
    sampler = s.get("sampler_cpu_pct_of_core")
    if sampler is None:
        sampler = s.get("monitor_overhead_pct")
    return {
        "sampler_cpu_pct_of_core": sampler,
        "tracking_us_per_step": s.get("tracking_us_per_step"),
    }


def train_json(result) -> dict[str, Any]:
    """The ``--json`` document of ``gpulens run WORKLOAD`` and ``gpulens demo`` (a RunResult of
    a built-in training run). Its keys are a contract: see DESIGN.md, Output contracts."""
    s = result.as_dict()["summary"]
    doc = {
        "run_id": result.run_id,
        "status": "finished",
        "record_dir": str(result.record_dir),
        "workload": s["workload"],
        "device": s["device"],
        "precision": s["precision"],
        "batch_size": s["batch_size"],
        "measured_steps": s["measured_steps"],
        "throughput_samples_per_s": s["throughput_samples_per_s"],
        "throughput_ci95_pct": s["throughput_ci95_pct"],
        "phases_s": s["phases_s"],
        "gpu": s["gpu"],
        "host": s["host"],
        **monitor_cost(s),
        "mfu": s["mfu"],
        "flops_per_sample": s["flops_per_sample"],
    }
    if "throughput_ci95_samples_per_s" in s:
        doc["throughput_ci95_samples_per_s"] = s.get("throughput_ci95_samples_per_s")
    for key in ("skipped_samples", "skipped_files_total", "skipped_files"):
        if key in s:
            doc[key] = s[key]
    # several processes: each rank's figures and the stragglers; a node's shard of a
    # multi-node run: its node, and the joined run (or how to join)
    for key in ("nnodes", "node_rank", "world_size", "slowest_rank", "step_time_median_s",
                "straggler_threshold_pct", "stragglers", "ranks", "join"):  # fmt: skip
        if key in s:
            doc[key] = s[key]
    return doc


def command_json(result) -> dict[str, Any]:
    """The ``--json`` document of ``gpulens run -- COMMAND``."""
    s = result.summary
    return {
        "run_id": result.run_id,
        "status": result.status,
        "record_dir": str(result.record_dir),
        "workload": "command",
        "device": None,
        "returncode": result.returncode,
        "stop_reason": s.get("stop_reason"),
        "wall_s": s.get("wall_s"),
        "measured_steps": s.get("measured_steps"),
        # every step the script made; the first ones (warm-up) are in the record, not measured
        "steps_total": s.get("steps_total"),
        "warmup_steps": s.get("warmup_steps"),
        "warmup_note": s.get("warmup_note"),
        "throughput_samples_per_s": s.get("throughput_samples_per_s"),
        "throughput_ci95_pct": s.get("throughput_ci95_pct"),
        "throughput_ci95_samples_per_s": s.get("throughput_ci95_samples_per_s"),
        "phases_s": s.get("phases_s"),
        "gpu": s.get("gpu"),
        "gpus": s.get("gpus"),
        "host": s.get("host"),
        **monitor_cost(s),
        "mfu": None,
        # under torchrun with the tracking API: per-rank and combined figures
        **{k: s[k] for k in ("world_size", "ranks", "stragglers") if k in s},
    }


def train_and_store(config, store: bool, kind: str = "train", label: str = "run", metrics=None):
    """Run built-in training with progress on stderr; the record reaches the store on every
    exit path (finished, failed, killed). ``metrics``: serve Prometheus metrics meanwhile."""
    from gpulens.run import interrupts

    with interrupts.held():  # a Ctrl-C during torch's import is lost or aborts the process
        from gpulens.workloads.train import run_training

    what = f"training {config.workload}"
    with common.progress(label, unit="steps") as progress:

        def on_step(step: int, total: int | None, elapsed_s: float, _info) -> None:
            progress.count(step, total, what)

        try:
            with common.live_store(store):
                result = run_training(
                    config, runs_dir(), progress=on_step, kind=kind, metrics=metrics
                )
        except BaseException as exc:  # failed and killed runs reach the store too
            common.store_record(getattr(exc, "gpulens_record_dir", None), store)
            raise
    common.store_record(result.record_dir, store)
    common_nodes.store_joined(result, store)  # a multi-node run node 0 joined
    return result


def show_training(result, json_out: bool, more_tips: tuple[str, ...] = ()) -> None:
    summary = result.as_dict()["summary"]
    if json_out:
        common.emit_json(train_json(result))
        common_nodes.render_node_end(summary, json_out=True)  # a shard: how to join, on stderr
        return
    from gpulens.report.terminal import render_train_summary

    render_train_summary(common.out, result.run_id, result.record_dir, summary, more_tips)
    common_nodes.render_node_end(summary)  # a node of a multi-node run: the joined run


# ---------------------------------------------------------------------------------- run
def run(
    ctx: typer.Context,
    target: list[str] = typer.Argument(
        None, help="A workload (see `gpulens workloads`) or, after --, a command and its args."
    ),
    batch_size: int = typer.Option(None, "--batch-size", "-b", help="Samples per step."),
    steps: int = typer.Option(
        None,
        "--steps",
        help="Measured steps after warm-up [default: 100]; with a Python command, end it after "
        "this many measured (optimizer) steps.",
    ),
    duration: float = typer.Option(
        None,
        "--duration",
        help="Measured seconds instead of steps; with a command, stop it after this long "
        "(as Ctrl-C would) and end the run as finished.",
    ),
    warmup_steps: int = typer.Option(
        None, "--warmup-steps", help="Warm-up steps, excluded from results."
    ),
    old_warmup: int = typer.Option(None, "--warmup", hidden=True),  # deprecated: --warmup-steps
    device: str = typer.Option(None, "--device", help=DEVICE_HELP),
    precision: str = typer.Option("fp32", "--precision", help="fp32, bf16 or fp16."),
    workers: int = typer.Option(
        None, "--workers", help="Data-loader processes [default: cores-1, at most 8]."
    ),
    data: str = typer.Option("synthetic", "--data", help="'synthetic' (on the device) or a path."),
    until_ci: float = typer.Option(
        None, "--until-ci", help="Stop once the 95% CI half-width is below PCT percent."
    ),
    sample_hz: float = typer.Option(10.0, "--sample-hz", help="Monitor sampling rate."),
    storage_latency_ms: float = typer.Option(
        0.0, "--storage-latency-ms", help="Emulate slow storage: added latency per file read."
    ),
    storage_bandwidth_mb_s: float = typer.Option(
        None,
        "--storage-bandwidth-mb-s",
        help="Emulate slow storage: megabytes (10^6 bytes) per second per loader worker.",
    ),
    old_storage_bandwidth: float = typer.Option(
        None, "--storage-bandwidth-mbps", hidden=True
    ),  # deprecated: --storage-bandwidth-mb-s
    prep_timing: bool = typer.Option(
        False,
        "--prep-timing",
        help="Time read/decode/augment/collate in the loader workers; after the measured "
        "window, also time the loader at several process counts (a few seconds), which "
        "`gpulens predict --workers` uses.",
    ),
    gpus: int = typer.Option(
        1, "--gpus", help="Data-parallel (DDP) over N GPUs, one process each, same per-GPU batch."
    ),
    nccl_transport: str = typer.Option(
        "default",
        "--nccl-transport",
        help="With --gpus N: 'default' (P2P/NVLink) or 'socket' (NCCL over TCP, as between hosts).",
    ),
    ddp_bucket_mb: float = typer.Option(None, "--ddp-bucket-mb", help="DDP bucket size [25]."),
    nnodes: int = typer.Option(None, "--nnodes", help=common_nodes.NNODES_HELP),
    node_rank: int = typer.Option(None, "--node-rank", help=common_nodes.NODE_RANK_HELP),
    master_addr: str = typer.Option(None, "--master-addr", help=common_nodes.MASTER_ADDR_HELP),
    master_port: int = typer.Option(None, "--master-port", help=common_nodes.MASTER_PORT_HELP),
    worker_affinity: str = typer.Option(
        "os",
        "--worker-affinity",
        help="Loader workers where the OS scheduler puts them ('os') or pinned one per "
        "physical core ('cores').",
    ),
    skip_bad_samples: bool = typer.Option(False, "--skip-bad-samples", help=SKIP_BAD_HELP),
    torch_profiler: int = typer.Option(
        0,
        "--torch-profiler",
        help="After the measured steps, run N more under torch.profiler and keep its trace in "
        "the record (gpulens export --perfetto merges it).",
    ),
    name: str = typer.Option(None, "--name", help="A name for the run."),
    store: bool = typer.Option(True, "--store/--no-store", help="Log the run to MLflow."),
    inject: bool = typer.Option(
        True,
        "--inject/--no-inject",
        help="With a Python command: time its steps (DataLoader batches, optimizer steps) "
        "with no change to the script.",
    ),
    prometheus_port: int = typer.Option(
        None,
        "--prometheus-port",
        help="Serve Prometheus /metrics on this port while the run lives (dcgm-exporter's "
        "GPU metric names, plus gpulens_* step time, data wait and throughput).",
    ),
    prometheus_host: str = typer.Option(
        "127.0.0.1", "--prometheus-host", help="Address for /metrics (0.0.0.0: every interface)."
    ),
    json_out: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    found = common.resolve_target(target, example="gpulens run -- python train.py ...")
    metrics = None
    if prometheus_port is not None:
        from gpulens.web.metrics import MetricsEndpoint

        metrics = MetricsEndpoint(prometheus_port, prometheus_host)
        metrics.check_free()
    if found.is_command:
        common.reject_workload_only_options(ctx, COMMAND_OPTIONS)
        run_command(
            list(found.command),
            sample_hz,
            name,
            store,
            json_out,
            inject,
            duration,
            metrics,
            steps,
        )
        return

    from gpulens.launch.multinode import resolve_topology
    from gpulens.workloads.config import TrainConfig

    nodes = resolve_topology(nnodes, node_rank, master_addr, master_port)
    warmup_steps = common.deprecated_alias(ctx, "warmup_steps", "old_warmup")
    bandwidth_mb_s = common.deprecated_alias(ctx, "storage_bandwidth_mb_s", "old_storage_bandwidth")
    config = TrainConfig(
        workload=found.workload,
        batch_size=batch_size,
        steps=steps,
        duration_s=duration,
        warmup_steps=warmup_steps,
        device=device,
        precision=precision,
        workers=workers,
        data=data,
        until_ci_pct=until_ci,
        sample_hz=sample_hz,
        name=name,
        prep_timing=prep_timing,
        loader_probe=prep_timing,
        gpus=gpus,
        nccl_transport=nccl_transport,
        ddp_bucket_mb=ddp_bucket_mb,
        worker_affinity=worker_affinity,
        storage_latency_s=storage_latency_ms / 1000.0,
        storage_bandwidth_bytes_per_s=common.mb_per_s_to_bytes(bandwidth_mb_s),
        skip_bad_samples=skip_bad_samples,
        torch_profiler_steps=torch_profiler,
        nodes=nodes,
    )
    show_training(train_and_store(config, store, metrics=metrics), json_out)


class CommandFailed(GpulensError):
    """A wrapped command ended with a non-zero exit code (its record is complete). Stopped by
    SIGTERM (passed on by gpulens, or sent to the command itself), gpulens exits 143 as a
    built-in run does, so a batch system reads the same status either way."""

    def __init__(self, result):
        if result.status == "killed" and result.returncode in (-signal.SIGTERM, 143):
            self.exit_code = 128 + signal.SIGTERM
            super().__init__(f"stopped by SIGTERM; the command's record is {result.record_dir}")
            return
        super().__init__(
            f"the command ended with exit code {result.returncode} (status {result.status}); "
            f"its record is {result.record_dir}"
        )


def run_command(
    argv: list[str],
    sample_hz: float,
    name,
    store: bool,
    json_out: bool,
    inject: bool = True,
    duration_s: float | None = None,
    metrics=None,
    max_steps: int | None = None,
) -> None:
    if duration_s is not None and duration_s <= 0:
        raise UsageError(f"--duration must be positive seconds, got {duration_s}")
    from gpulens.launch.command import run_command as monitor_command
    from gpulens.report.terminal import render_command_summary

    def starting() -> None:  # once the command is checked: a usage error comes alone
        common.err.print(Text(f"monitoring: {' '.join(argv)}", style="dim"), soft_wrap=True)

    with common.live_store(store):
        result = monitor_command(
            argv, runs_dir(), sample_hz=sample_hz, name=name, stdout_to_stderr=json_out,
            inject=inject, duration_s=duration_s, metrics=metrics, max_steps=max_steps,
            on_start=starting,
        )  # fmt: skip
    common.store_record(result.record_dir, store)
    if json_out:
        common.emit_json(command_json(result))
    else:
        render_command_summary(common.out, result)
    if result.status == "killed" and result.returncode in (-signal.SIGINT, 128 + signal.SIGINT):
        raise KeyboardInterrupt  # a Ctrl-C passed on to the command: gpulens's exit 130
    if result.returncode != 0 and result.summary.get("stop_reason") != "duration":
        raise CommandFailed(result)


# --------------------------------------------------------------------------------- demo
def demo(
    steps: int = typer.Option(None, "--steps", help="Measured steps [60 on CPU, 200 on GPU]."),
    device: str = typer.Option(None, "--device", help=DEVICE_HELP),
    store: bool = typer.Option(True, "--store/--no-store", help="Log the run to MLflow."),
    json_out: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    from gpulens.data.datagen import make_images
    from gpulens.run import interrupts
    from gpulens.workloads.config import TrainConfig

    with interrupts.held():  # a Ctrl-C during torch's import is lost or aborts the process
        from gpulens.workloads.devices import resolve_device

    dev = resolve_device(device)
    gpu = dev.type == "cuda"
    data_dir = gpulens_home() / "demo-data" / "images"
    n_images = 2048 if gpu else 384
    if not data_dir.exists():
        try:  # the demo's own folder: no --out to name, GPULENS_HOME is what to change
            data_dir.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise unwritable_home(gpulens_home(), exc) from None
        with common.progress("demo", unit="images") as progress:
            make_images(
                data_dir,
                n_images,
                progress=lambda done, total: progress.count(done, total, "making demo JPEGs"),
            )
    config = TrainConfig(
        workload="resnet18" if gpu else "tiny_cnn",
        batch_size=64 if gpu else 32,
        steps=steps or (200 if gpu else 60),
        device=str(dev),
        precision="bf16" if gpu else "fp32",
        data=str(data_dir),
        name="demo",
    )
    result = train_and_store(config, store, kind="demo", label="demo")
    # the tips name `gpulens run`'s options (--workers, --until-ci, ...), which the demo lacks
    data = str(data_dir).replace(str(Path.home()), "~", 1)
    as_run = (
        f"gpulens run {config.workload} --data {data} --batch-size {config.batch_size} "
        f"--precision {config.precision} --workers {result.summary.get('workers')}"
    )
    show_training(result, json_out, (f"the demo's job as a run, to try the tips on: `{as_run}`",))

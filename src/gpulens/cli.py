"""The ``gpulens`` command. Thin: parses arguments, calls the layers, renders."""

from __future__ import annotations

import logging
import shutil
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.text import Text

from gpulens import __version__
from gpulens.errors import GpulensError, RuntimeFailure, UsageError
from gpulens.paths import gpulens_home, runs_dir
from gpulens.report import failure, output
from gpulens.report.progress import ProgressReporter

log = logging.getLogger("gpulens")

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
data_app = typer.Typer(
    help="Generate datasets for benchmarks.", no_args_is_help=True, rich_markup_mode=None
)
app.add_typer(data_app, name="data")

out = Console()
err = Console(stderr=True)
# ``args``: the arguments main() was given (not sys.argv: main(argv) is called in-process too).
_state: dict[str, Any] = {"debug": False, "args": None}


def _after_dashes() -> bool:
    """Whether the command line has a `--` (what follows is a command to run)."""
    args = _state["args"] if _state["args"] is not None else sys.argv[1:]
    return "--" in args


def _print_version(value: bool) -> None:
    if value:
        out.print(f"gpulens {__version__}", markup=False, highlight=False)
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
    _state["debug"] = debug
    level = logging.DEBUG if debug else logging.INFO if verbose else logging.WARNING
    logging.basicConfig(
        level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )


_DEVICE_HELP = "cuda:N or cpu [default: cuda:0 if there is a GPU, else cpu]."
_SKIP_BAD_HELP = (
    "Images that cannot be decoded (corrupt, truncated, empty, not an image): put the next "
    "readable image in their place and count them (skipped_samples) instead of stopping at "
    "the first."
)


def _mb_per_s_to_bytes(mb_per_s: float | None) -> float | None:
    return mb_per_s * 1e6 if mb_per_s else None


def _emit_json(doc: Any) -> None:
    output.emit_json(doc)


def _progress(label: str, unit: str = "") -> ProgressReporter:
    """Progress on stderr: a spinner on a terminal, a plain line per phase otherwise (also with
    --json: stdout keeps its one document)."""
    return ProgressReporter(err, label, unit=unit)


def _warn(label: str, text: str) -> None:
    err.print(Text.assemble((label, "yellow"), text), soft_wrap=True, highlight=False)


# ---------------------------------------------------------------------------------------- run
def _monitor_cost(s: dict[str, Any]) -> dict[str, Any]:
    """What the monitor costs, under the summary's names (old records: the one old key)."""
    sampler = s.get("sampler_cpu_pct_of_core")
    if sampler is None:
        sampler = s.get("monitor_overhead_pct")
    return {
        "sampler_cpu_pct_of_core": sampler,
        "tracking_us_per_step": s.get("tracking_us_per_step"),
    }


def _train_json(result) -> dict[str, Any]:
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
        **_monitor_cost(s),
        "mfu": s["mfu"],
        "flops_per_sample": s["flops_per_sample"],
    }
    if "throughput_ci95_samples_per_s" in s:
        doc["throughput_ci95_samples_per_s"] = s.get("throughput_ci95_samples_per_s")
    for key in ("skipped_samples", "skipped_files_total", "skipped_files"):
        if key in s:
            doc[key] = s[key]
    return doc


def _store(record_dir: Path | None, enabled: bool) -> str | None:
    """Log a record (finished, failed or killed) to MLflow when it is installed; bounded wait,
    never raises: a store that is down leaves the record local for `gpulens runs sync`."""
    if not enabled or record_dir is None or not Path(record_dir).is_dir():
        return None
    from gpulens.store.background import log_finished

    outcome = log_finished(record_dir)
    if outcome.status in ("unavailable", "failed", "pending"):
        _warn("not stored in MLflow: ", outcome.message)
    return outcome.mlflow_run_id


def _train(config, store: bool, kind: str = "train", label: str = "run"):
    from gpulens.workloads.train import run_training

    what = f"training {config.workload}"
    with _progress(label, unit="steps") as progress:

        def on_step(step: int, total: int | None, elapsed_s: float, _info) -> None:
            progress.count(step, total, what)

        try:
            result = run_training(config, runs_dir(), progress=on_step, kind=kind)
        except BaseException as exc:  # failed and killed runs reach the store too
            _store(getattr(exc, "gpulens_record_dir", None), store)
            raise
    _store(result.record_dir, store)
    return result


@app.command(
    help="Run a built-in WORKLOAD under the monitor, or monitor any command given after `--`.\n\n"
    "\b\nExamples:\n"
    "  gpulens run resnet50 --precision bf16 --data ./images --workers 15\n"
    "  gpulens run gpt2_tiny --steps 50 --device cpu --json\n"
    "  gpulens run resnet50 --precision bf16 --gpus 2 --nccl-transport socket\n"
    "  gpulens run -- python train.py --epochs 1",
    short_help="Measure a built-in workload, or any command given after --.",
)
def run(
    target: list[str] = typer.Argument(
        None, help="A workload (see `gpulens workloads`) or, after --, a command and its args."
    ),
    batch_size: int = typer.Option(None, "--batch-size", "-b", help="Samples per step."),
    steps: int = typer.Option(None, "--steps", help="Measured steps after warm-up [default: 100]."),
    duration: float = typer.Option(None, "--duration", help="Measured seconds instead of steps."),
    warmup: int = typer.Option(None, "--warmup", help="Warm-up steps, excluded from results."),
    device: str = typer.Option(None, "--device", help=_DEVICE_HELP),
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
    storage_bandwidth_mbps: float = typer.Option(
        None, "--storage-bandwidth-mbps", help="Emulate slow storage: MB/s per loader worker."
    ),
    prep_timing: bool = typer.Option(
        False, "--prep-timing", help="Time read/decode/augment/collate in the loader workers."
    ),
    gpus: int = typer.Option(
        1, "--gpus", help="Data-parallel (DDP) over N GPUs, one process each, same per-GPU batch."
    ),
    nccl_transport: str = typer.Option(
        "default",
        "--nccl-transport",
        help="With --gpus N: 'default' (P2P/NVLink) or 'socket' (NCCL over TCP, as between hosts).",
    ),  # fmt: skip
    ddp_bucket_mb: float = typer.Option(None, "--ddp-bucket-mb", help="DDP bucket size [25]."),
    worker_affinity: str = typer.Option(
        "os",
        "--worker-affinity",
        help="Loader workers where the OS scheduler puts them ('os') or pinned one per "
        "physical core ('cores').",
    ),
    skip_bad_samples: bool = typer.Option(False, "--skip-bad-samples", help=_SKIP_BAD_HELP),
    name: str = typer.Option(None, "--name", help="A name for the run."),
    store: bool = typer.Option(True, "--store/--no-store", help="Log the run to MLflow."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
) -> None:
    from gpulens.workloads.models import list_workloads

    target = target or []
    if not target:
        raise UsageError("give a workload (see `gpulens workloads`) or a command after --")
    known = {w.name for w in list_workloads()}
    is_command = _after_dashes() or len(target) > 1 or target[0] not in known
    if (
        is_command
        and len(target) == 1
        and not _after_dashes()
        and shutil.which(target[0]) is None
        and not Path(target[0]).exists()
    ):
        raise UsageError(
            f"unknown workload '{target[0]}'; choose one of: {', '.join(sorted(known))} "
            "(or give a command after --)"
        )
    if is_command:
        given = {
            "--batch-size": batch_size, "--steps": steps, "--duration": duration,
            "--warmup": warmup, "--device": device, "--workers": workers, "--until-ci": until_ci,
            "--storage-bandwidth-mbps": storage_bandwidth_mbps, "--ddp-bucket-mb": ddp_bucket_mb,
        }  # fmt: skip
        extra = [k for k, v in given.items() if v is not None]
        if gpus != 1 or nccl_transport != "default":
            extra.append("--gpus/--nccl-transport")
        if worker_affinity != "os":
            extra.append("--worker-affinity")
        if skip_bad_samples:
            extra.append("--skip-bad-samples")
        if extra or precision != "fp32" or data != "synthetic":
            raise UsageError(
                f"{', '.join(extra) or '--precision/--data'} apply to built-in workloads only; "
                "pass your script's own options after --"
            )
        _run_command(target, sample_hz, name, store, json_out)
        return

    from gpulens.report.terminal import render_train_summary
    from gpulens.workloads.config import TrainConfig

    config = TrainConfig(
        workload=target[0], batch_size=batch_size, steps=steps, duration_s=duration,
        warmup_steps=warmup, device=device, precision=precision, workers=workers, data=data,
        until_ci_pct=until_ci, sample_hz=sample_hz, name=name, prep_timing=prep_timing,
        gpus=gpus, nccl_transport=nccl_transport, ddp_bucket_mb=ddp_bucket_mb,
        worker_affinity=worker_affinity, storage_latency_s=storage_latency_ms / 1000.0,
        storage_bandwidth_bytes_per_s=_mb_per_s_to_bytes(storage_bandwidth_mbps),
        skip_bad_samples=skip_bad_samples,
    )  # fmt: skip
    result = _train(config, store)
    if json_out:
        _emit_json(_train_json(result))
    else:
        render_train_summary(out, result.run_id, result.record_dir, result.as_dict()["summary"])


def _run_command(argv: list[str], sample_hz: float, name, store: bool, json_out: bool) -> None:
    from gpulens.launch.command import run_command
    from gpulens.report.terminal import render_command_summary

    err.print(Text(f"monitoring: {' '.join(argv)}", style="dim"), soft_wrap=True)
    result = run_command(
        argv, runs_dir(), sample_hz=sample_hz, name=name, stdout_to_stderr=json_out
    )
    _store(result.record_dir, store)
    if json_out:
        s = result.summary
        _emit_json(
            {
                "run_id": result.run_id,
                "status": result.status,
                "record_dir": str(result.record_dir),
                "workload": "command",
                "device": None,
                "returncode": result.returncode,
                "wall_s": s.get("wall_s"),
                "measured_steps": s.get("measured_steps"),
                "throughput_samples_per_s": s.get("throughput_samples_per_s"),
                "throughput_ci95_pct": s.get("throughput_ci95_pct"),
                "throughput_ci95_samples_per_s": s.get("throughput_ci95_samples_per_s"),
                "phases_s": s.get("phases_s"),
                "gpu": s.get("gpu"),
                "gpus": s.get("gpus"),
                "host": s.get("host"),
                **_monitor_cost(s),
                "mfu": None,
                # under torchrun with the tracking API: per-rank and combined figures
                **{k: s[k] for k in ("world_size", "ranks", "stragglers") if k in s},
            }
        )
    else:
        render_command_summary(out, result)
    if result.returncode != 0:
        raise _CommandFailed(result)


class _CommandFailed(GpulensError):
    def __init__(self, result):
        super().__init__(
            f"the command ended with exit code {result.returncode} (status {result.status}); "
            f"its record is {result.record_dir}"
        )


# ------------------------------------------------------------------------------------ stalls
@app.command(
    help="Break a training job's time into compute, prep (CPU) stall and fetch (storage) stall "
    "by differential runs: ingestion-free, page-cache-warm and cold; with --gpus N also the "
    "interconnect stall (N GPUs with DDP vs 1) and the network stall (NCCL on sockets vs "
    "P2P). When the loop waits on its loader, the cold run is a paired one: each worker "
    "alternates batch by batch between an evicted half of the files and a cached half, which "
    "cancels the CPU's drift between runs. Every run is stored.\n\n"
    "Give a built-in WORKLOAD, or after `--` a command whose script uses gpulens.track().\n\n"
    "\b\nExamples:\n"
    "  gpulens stalls resnet50 --data ./images --workers 15 --precision bf16\n"
    "  gpulens stalls --data ./images -- python train.py --epochs 2",
    short_help="Where a training job's time goes: compute, prep, fetch, interconnect.",
)
def stalls(
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
    workers: int = typer.Option(None, "--workers", help="Data-loader processes."),
    batch_size: int = typer.Option(None, "--batch-size", "-b", help="Samples per step."),
    device: str = typer.Option(None, "--device", help=_DEVICE_HELP),
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
        help="Seconds for the whole breakdown: while a share misses --until-ci, gpulens "
        "repeats the cached run or the cold one (evicting again), whichever narrows it most "
        "per second, if one more run fits; repeats are pooled.",
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
    storage_bandwidth_mbps: float = typer.Option(
        None, "--storage-bandwidth-mbps", help="Emulate slow storage: MB/s per reader."
    ),
    fetch_design: str = typer.Option(
        "auto",
        "--fetch-design",
        help="How the fetch stall is measured: 'paired' (one run alternating evicted and cached "
        "files; needs an image folder and loader workers), 'separate' (a cold run beside the "
        "cached one) or 'auto' (paired when the cached run waits on its loader at least 20% "
        "of the time).",
    ),
    skip_bad_samples: bool = typer.Option(False, "--skip-bad-samples", help=_SKIP_BAD_HELP),
    store: bool = typer.Option(True, "--store/--no-store", help="Log the runs to MLflow."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
) -> None:
    from gpulens.report.terminal import render_stalls
    from gpulens.stalls import StallsConfig, run_stalls
    from gpulens.workloads.models import list_workloads

    target = target or []
    if not target:
        raise UsageError(
            "give a built-in workload (see `gpulens workloads`) or a command after --: "
            "gpulens stalls --data PATH -- python train.py ..."
        )
    known = {w.name for w in list_workloads()}
    runnable = shutil.which(target[0]) is not None or Path(target[0]).exists()
    if len(target) > 1 and target[0] in known and not runnable:
        raise UsageError(f"give either the workload '{target[0]}' or a command after --, not both")
    if len(target) == 1 and target[0] not in known and not runnable and not _after_dashes():
        raise UsageError(
            f"unknown workload '{target[0]}'; choose one of: {', '.join(sorted(known))} "
            "(or give a command after --)"
        )
    if len(target) > 1 or target[0] not in known:
        given = {
            "--workers": workers, "--batch-size": batch_size, "--device": device,
            "--storage-bandwidth-mbps": storage_bandwidth_mbps,
        }  # fmt: skip
        extra = [k for k, v in given.items() if v is not None]
        extra += [k for k, bad in (
            ("--gpus", gpus != 1), ("--precision", precision != "fp32"),
            ("--until-ci", until_ci != 3.0), ("--max-duration", max_duration != 60.0),
            ("--time-budget", time_budget != 300.0),
            ("--worker-affinity", worker_affinity != "os"),
            ("--storage-latency-ms", storage_latency_ms != 0.0),
            ("--fetch-design", fetch_design != "auto"),
            ("--skip-bad-samples", skip_bad_samples),
        ) if bad]  # fmt: skip
        if extra:
            raise UsageError(
                f"{', '.join(extra)} apply to built-in workloads only; pass your script's own "
                "options after --"
            )
        from gpulens.stalls.command import run_stalls_command

        with _progress("stalls") as progress:
            result = run_stalls_command(target, data, runs_dir(), progress=progress.phase)
    else:
        config = StallsConfig(
            workload=target[0], data=data, gpus=gpus, batch_size=batch_size, workers=workers,
            device=device, precision=precision, until_ci_pct=until_ci,
            max_duration_s=max_duration, time_budget_s=time_budget,
            worker_affinity=worker_affinity, storage_latency_s=storage_latency_ms / 1000.0,
            storage_bandwidth_bytes_per_s=_mb_per_s_to_bytes(storage_bandwidth_mbps),
            fetch_design=fetch_design, skip_bad_samples=skip_bad_samples,
        )  # fmt: skip
        with _progress("stalls", unit="steps") as progress:

            def on_step(step: int, total: int | None, _elapsed_s: float, _info) -> None:
                progress.count(step, total)

            result = run_stalls(config, runs_dir(), progress=progress.phase, on_step=on_step)
    repeated = (run_id for ids in result.all_runs.values() for run_id in ids)
    for run_id in {*result.runs.values(), *repeated}:
        if run_id:
            _store(runs_dir() / run_id, store)
    doc = result.as_dict()
    if json_out:
        _emit_json(doc)
    else:
        render_stalls(out, doc)


# ---------------------------------------------------------------------------------- colocate
def _csv(text: str, what: str, cast=str) -> tuple:
    try:
        return tuple(cast(x.strip()) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"{what}: give comma-separated numbers, e.g. 25,50,100") from None


@app.command(
    help="Run jobs alone and together on one GPU under time-slicing, CUDA streams, MPS and MIG; "
    "report throughput alone and together, slowdown, step-time p50/p99, peak memory, combined "
    "throughput, fairness and energy, and recommend one.\n\n"
    "A JOB is WORKLOAD[:batch=N,precision=bf16,name=X] (training), "
    "infer:WORKLOAD[:batch=1,rate=R] (inference; rate = requests/s, else closed loop) or "
    "'cmd:COMMAND ARGS' (throughput = runs per second).\n\n"
    "\b\nExamples:\n"
    "  gpulens colocate resnet18:batch=64 resnet50:batch=64 --mps-thread-pct 25,50,100\n"
    "  gpulens colocate resnet18:batch=64 infer:resnet50:rate=100 --mechanisms streams,mps\n"
    "  gpulens colocate --plan resnet18:batch=64 resnet18:batch=64 resnet50:batch=64",
    short_help="Run jobs alone and together on one GPU; recommend how to share it.",
)
def colocate(
    jobs: list[str] = typer.Argument(None, help="Two or more jobs (see above)."),
    mechanisms: str = typer.Option(
        "time-slice,streams,mps,mig", "--mechanisms", help="Comma-separated mechanisms."
    ),
    mps_thread_pct: str = typer.Option(
        "25,50,100", "--mps-thread-pct", help="MPS active-thread percentages to sweep."
    ),
    mps_limit: str = typer.Option(
        "auto",
        "--mps-limit",
        help="Whom the MPS thread limit applies to: all, train, or auto "
        "(train when inference is in the mix).",
    ),
    mps_mem_limit: str = typer.Option(
        None, "--mps-mem-limit", help="Pinned device memory limit per MPS client, e.g. 20G."
    ),
    priorities: bool = typer.Option(
        True,
        "--priorities/--no-priorities",
        help="With inference and training mixed, also run streams with inference at high priority.",
    ),
    duration: float = typer.Option(15.0, "--duration", help="Measured seconds per run."),
    warmup: float = typer.Option(3.0, "--warmup", help="Warm-up seconds before each run."),
    device: str = typer.Option(None, "--device", help=_DEVICE_HELP),
    max_slowdown: float = typer.Option(
        None,
        "--max-slowdown",
        help="Cap per job: alone/together throughput (1.5 = keeps 2/3 of its speed).",
    ),
    plan_mode: bool = typer.Option(
        False, "--plan", help="Plan groupings for JOBs from collocations measured before."
    ),
    from_files: list[Path] = typer.Option(
        None, "--from", help="With --plan: also read results from this JSON file (repeatable)."
    ),
    name: str = typer.Option(None, "--name", help="A name for the run."),
    store: bool = typer.Option(True, "--store/--no-store", help="Log the run to MLflow."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
) -> None:
    from gpulens.workloads.colocate_job import parse_job, unique_names

    specs = unique_names([parse_job(j) for j in jobs or []])
    if plan_mode:
        from gpulens.experiments.colocate_plan import load_docs, plan
        from gpulens.report.colocate import render_plan

        if max_slowdown is not None and max_slowdown < 1:
            raise UsageError(f"--max-slowdown is a factor >= 1, got {max_slowdown:g}")
        docs = load_docs(runs_dir(), list(from_files or []))
        if not docs:
            raise UsageError(
                "no collocation results to plan from: run `gpulens colocate JOB JOB` first "
                "(or give --from FILE)"
            )
        doc = plan(specs, docs, max_slowdown)
        if json_out:
            _emit_json(doc)
        else:
            render_plan(out, doc)
        return

    from gpulens.experiments.colocate import ColocateConfig, run_colocate
    from gpulens.report.colocate import render_colocate

    config = ColocateConfig(
        jobs=specs, mechanisms=_csv(mechanisms, "--mechanisms"),
        mps_thread_pcts=_csv(mps_thread_pct, "--mps-thread-pct", float),
        mps_limit_target=mps_limit, mps_mem_limit=mps_mem_limit, stream_priorities=priorities,
        duration_s=duration, warmup_s=warmup, device=device, max_slowdown=max_slowdown, name=name,
    )  # fmt: skip
    with _progress("colocate") as progress:
        doc = run_colocate(config, runs_dir(), progress=progress.phase)
    if doc.get("run_id"):
        _store(runs_dir() / doc["run_id"], store)
    if json_out:
        _emit_json(doc)
    else:
        render_colocate(out, doc)
    if doc.get("status") == "failed":
        raise RuntimeFailure(doc.get("error") or "the collocation experiment failed")


# -------------------------------------------------------------------------------------- demo
@app.command(short_help="Train a small CNN on generated JPEGs and show what was measured.",
             help="Make a small JPEG dataset, train a small CNN on it under the monitor, "
             "store the run and print what was measured. Works on CPU-only machines.")  # fmt: skip
def demo(
    steps: int = typer.Option(None, "--steps", help="Measured steps [60 on CPU, 200 on GPU]."),
    device: str = typer.Option(None, "--device", help=_DEVICE_HELP),
    store: bool = typer.Option(True, "--store/--no-store", help="Log the run to MLflow."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
) -> None:
    from gpulens.data.datagen import make_images
    from gpulens.report.terminal import render_train_summary
    from gpulens.workloads.config import TrainConfig
    from gpulens.workloads.devices import resolve_device

    dev = resolve_device(device)
    gpu = dev.type == "cuda"
    data_dir = gpulens_home() / "demo-data" / "images"
    n_images = 2048 if gpu else 384
    if not data_dir.exists():
        with _progress("demo", unit="images") as progress:
            make_images(
                data_dir, n_images,
                progress=lambda done, total: progress.count(done, total, "making demo JPEGs"),
            )  # fmt: skip
    config = TrainConfig(
        workload="resnet18" if gpu else "tiny_cnn",
        batch_size=64 if gpu else 32,
        steps=steps or (200 if gpu else 60),
        device=str(dev),
        precision="bf16" if gpu else "fp32",
        data=str(data_dir),
        name="demo",
    )
    result = _train(config, store, kind="demo", label="demo")
    if json_out:
        _emit_json(_train_json(result))
    else:
        render_train_summary(out, result.run_id, result.record_dir, result.as_dict()["summary"])


# ------------------------------------------------------------------------------------ doctor
@app.command(
    help="What gpulens can measure on this machine, and how to enable what is missing.",
    short_help="What this machine can measure, and how to enable the rest.",
)
def doctor(json_out: bool = typer.Option(False, "--json", help="Print one JSON document.")) -> None:
    from gpulens.probes.capabilities import Check, checks_as_dict, run_checks
    from gpulens.report.terminal import render_checks
    from gpulens.store.mlflow_sink import store_status

    checks = run_checks()
    st = store_status()  # one request of at most 2 s: says whether the store answers
    store_check = Check("store", st["ok"], f"{st['tracking_uri']}: {st['detail']}", st["hint"])
    checks = [store_check if c.name == "store" else c for c in checks]
    if json_out:
        _emit_json({**checks_as_dict(checks), "store": st})
    else:
        render_checks(out, checks)


# --------------------------------------------------------------------------------- workloads
@app.command(help="List the built-in workloads.")
def workloads(json_out: bool = typer.Option(False, "--json", help="Print one JSON document.")):
    from gpulens.workloads.models import list_workloads

    specs = list_workloads()
    if json_out:
        _emit_json(
            [
                {
                    "name": w.name,
                    "task": w.task,
                    "default_batch_size": w.default_batch_size,
                    "input_shape": list(w.input_shape),
                }  # fmt: skip
                for w in specs
            ]
        )
        return
    for w in specs:
        line = f"{w.name:<20} {w.task:<22} batch {w.default_batch_size:<4} {w.input_shape}"
        out.print(Text(line), highlight=False)


# -------------------------------------------------------------------------------------- data
@data_app.command("make", help="Generate JPEGs (ImageFolder layout, ~100 KB each, "
                  "ImageNet-like size) or a token file for the language model.")  # fmt: skip
def data_make(
    kind: str = typer.Argument(..., help="images or tokens"),
    out_dir: Path = typer.Option(..., "--out", help="Directory to create."),
    n: int = typer.Option(..., "--n", help="Number of images, or of tokens."),
    vocab_size: int = typer.Option(
        50257, "--vocab-size", help="Tokens only: vocabulary size (gpt2_tiny uses 8192)."
    ),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty --out."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    from gpulens.data.datagen import make_images, make_tokens

    if kind not in ("images", "tokens"):
        raise UsageError(f"unknown data kind '{kind}': use images or tokens")
    if n <= 0:
        raise UsageError(f"--n must be a positive integer, got {n}")
    with _progress("data make", unit=kind) as progress:

        def on_progress(done: int, total: int) -> None:
            progress.count(done, total, f"making {kind}")

        if kind == "images":
            info = make_images(out_dir, n, force=force, progress=on_progress)
        else:
            info = make_tokens(out_dir, n, vocab_size=vocab_size, force=force, progress=on_progress)
    if json_out:
        _emit_json(info)
    else:
        count = info["n_tokens"] if kind == "tokens" else info["n"]
        out.print(
            Text(
                f"made {count:,} {kind} in {info['path']} "
                f"({info['total_bytes'] / 2**20:,.1f} MiB, {info['elapsed_s']:.1f} s)"
            ),
            soft_wrap=True,
        )


def _mount_runs() -> None:
    from gpulens.cli_runs import runs_app

    app.add_typer(runs_app, name="runs", help="List, show, compare, export and sync stored runs.")


_mount_runs()


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
    args = list(sys.argv[1:] if argv is None else argv)
    own = _own_args(args)
    debug, json_mode = "--debug" in own, "--json" in own
    output.reset()
    _state["args"] = args
    if not args:  # the help on stderr and exit 2, with every click version (as click >= 8.2)
        return failure.report_failure(
            failure.Failure(2, "give a command", help_text=_help_text()), err, json_mode
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
        return failure.handle(exc, err, json_mode, _command_path(own))
    # Not standalone, typer returns the exit code of a typer.Exit (Ctrl-C is Exit(130)).
    code = rv if isinstance(rv, int) and not isinstance(rv, bool) else 0
    if code == 130:
        return failure.handle(KeyboardInterrupt(), err, json_mode)
    if code != 0 and json_mode and not output.emitted():
        return failure.report_failure(
            failure.Failure(code, f"gpulens exited with code {code}"), err, json_mode
        )
    return code


if __name__ == "__main__":
    sys.exit(main())

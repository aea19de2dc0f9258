"""``gpulens colocate``: jobs alone and together on one GPU, and a plan from past results."""

from __future__ import annotations

from pathlib import Path

import typer

from gpulens.cli import common
from gpulens.cli.common import DEVICE_HELP, JSON_HELP
from gpulens.errors import RuntimeFailure, UsageError
from gpulens.paths import runs_dir

COLOCATE_HELP = (
    "Run jobs alone and together on one GPU under time-slicing, CUDA streams, MPS and MIG; "
    "report throughput alone and together, slowdown, step-time p50/p99, peak memory, combined "
    "throughput, fairness and energy, and recommend one.\n\n"
    "A JOB is WORKLOAD[:batch=N,precision=bf16,name=X] (training), "
    "infer:WORKLOAD[:batch=1,rate=R,arrivals=poisson] (inference; rate = requests/s, evenly "
    "spaced or Poisson arrivals, latency from each arrival; a closed loop without rate), "
    "serve:MODEL:rate=R[,slo_ms=S] (a `gpulens serve` process driven over HTTP at R "
    "requests/s; its own process, so not under streams) or "
    "'cmd:COMMAND ARGS' (throughput = runs per second). slo_ms=S on infer: and serve: jobs "
    "reports the SLO attainment alone and together. ':' between options works as ',' does "
    "(serve:MODEL:rate=R:slo_ms=S, as gpulens load --tenant is written).\n\n"
    "\b\nExamples:\n"
    "  gpulens colocate resnet18:batch=64 resnet50:batch=64 --mps-thread-pct 25,50,100\n"
    "  gpulens colocate resnet18:batch=64 infer:resnet50:rate=100 --mechanisms streams,mps\n"
    "  gpulens colocate resnet50:batch=64 serve:resnet50:rate=100,slo_ms=50 "
    "serve:bert-base:rate=50,slo_ms=50 --mechanisms time-slice,mps\n"
    "  gpulens colocate --plan resnet18:batch=64 resnet18:batch=64 resnet50:batch=64"
)


def register(app: typer.Typer) -> None:
    app.command(
        help=COLOCATE_HELP,
        short_help="Run jobs alone and together on one GPU; recommend how to share it.",
    )(colocate)


def parse_csv(text: str, what: str, cast=str) -> tuple:
    """``"25,50,100"`` -> ``(25.0, 50.0, 100.0)`` with ``cast=float``; a usage error names
    the option ``what``."""
    try:
        return tuple(cast(x.strip()) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"{what}: give comma-separated numbers, e.g. 25,50,100") from None


def colocate(
    ctx: typer.Context,
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
    warmup_s: float = typer.Option(3.0, "--warmup-s", help="Warm-up seconds before each run."),
    old_warmup: float = typer.Option(None, "--warmup", hidden=True),  # deprecated: --warmup-s
    device: str = typer.Option(None, "--device", help=DEVICE_HELP),
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
    json_out: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    from gpulens.colocate import ColocateConfig, run_colocate
    from gpulens.colocate.plan import load_docs, plan
    from gpulens.workloads.jobspec import parse_job, unique_names

    specs = unique_names([parse_job(j) for j in jobs or []])
    if plan_mode:
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
            common.emit_json(doc)
        else:
            render_plan(common.out, doc)
        return

    from gpulens.report.colocate import render_colocate

    warmup_s = common.deprecated_alias(ctx, "warmup_s", "old_warmup")
    config = ColocateConfig(
        jobs=specs,
        mechanisms=parse_csv(mechanisms, "--mechanisms"),
        mps_thread_pcts=parse_csv(mps_thread_pct, "--mps-thread-pct", float),
        mps_limit_target=mps_limit,
        mps_mem_limit=mps_mem_limit,
        stream_priorities=priorities,
        duration_s=duration,
        warmup_s=warmup_s,
        device=device,
        max_slowdown=max_slowdown,
        name=name,
    )
    with common.progress("colocate") as progress, common.live_store(store):
        doc = run_colocate(config, runs_dir(), progress=progress.phase)
    if doc.get("run_id"):
        common.store_record(runs_dir() / doc["run_id"], store)
        common.store_experiment(store, colocate_record=runs_dir() / doc["run_id"])
    if json_out:
        common.emit_json(doc)
    else:
        render_colocate(common.out, doc)
    if doc.get("status") == "failed":
        raise RuntimeFailure(doc.get("error") or "the collocation experiment failed")

"""``gpulens advise`` (what to run a job on: time and cost per cloud configuration, on demand
and on spot) and ``gpulens allocate-workers`` (loader workers for concurrent jobs)."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import typer
from rich.table import Table
from rich.text import Text

from gpulens.cli import common
from gpulens.errors import UsageError
from gpulens.predict import validation
from gpulens.predict.validation import ASSUMED_ERROR, RERUN_GPU_PACED, RERUN_HOST_PACED
from gpulens.report.terminal import COMPACT

log = logging.getLogger("gpulens.cli.advise")

# Restart after a revocation: a new server, the image, start-up and reading the checkpoint.
DEFAULT_RESTART_S = 300.0
# Checkpoint modelled from the model: weights and Adam's two moments in fp32, written at a cloud
# SSD volume's speed (the stall model's cloud_ssd_volume profile).
CHECKPOINT_BYTES_PER_PARAM = 12
CHECKPOINT_BYTES_PER_S = 250e6
ASSUMED_CHECKPOINT_S = 60.0

ADVISE_HELP = (
    "Every cloud configuration of the instance catalog with the job's predicted time and cost, "
    "the Pareto front (time vs cost), and the one to pick: the cheapest that meets --deadline, "
    "the fastest within --budget, else the knee of the front (the least time x cost). Throughput "
    "per configuration comes from `gpulens predict` on the run. With --spot, also spot servers: "
    "revocations (Poisson), "
    "checkpoints at the best interval (Young/Daly, checked by simulation) and restarts, as p50 "
    "and p90 of a Monte Carlo (fixed seed). Every p90 also spreads the predicted time by the "
    "prediction's own error: the one validated for it; for the run's own configuration, how "
    f"far a rerun on another machine with that GPU lands ({RERUN_HOST_PACED.mape_pct}% where the "
    f"host set the run's pace, {RERUN_GPU_PACED.mape_pct}% where the GPU did); else an "
    f"assumed {ASSUMED_ERROR.mape_pct}%, the widest measured across GPUs. Deadlines and "
    "budgets are met at p90. Options on a GPU other than H100 or H200, on a GPU count other "
    "than 1, 2 or 4, or on several nodes, are marked '?': `predict` was never checked there "
    "(their p90 takes the assumed error), and the pick warns if it is one.\n\n"
    "WORKLOAD|RUN: a built-in workload (its newest finished run in the store) or a run id, "
    "prefix, name, 'latest' or directory.\n\n"
    "\b\nExamples:\n"
    "  gpulens advise resnet50 --epochs 90 --dataset-size 1281167 --deadline 24\n"
    "  gpulens advise latest --samples 5e7 --budget 500 --spot --json"
)
ALLOCATE_HELP = (
    "Data-loader workers for jobs that run at the same time and share --cpus CPUs: each job's "
    "throughput curve over its workers, measured from the store's runs of that workload at two "
    "or more --workers counts (else predicted from its newest run), and the split that maximises "
    "the aggregate (exact dynamic programme; greedy marginal gain on concave curves), compared "
    "with an even split. A job given as a run (id, name or directory) takes that run in place "
    "of the newest.\n\n"
    "\b\nExample:\n"
    "  gpulens allocate-workers resnet50 mobilenet_v3_small --cpus 16"
)


def register(app: typer.Typer) -> None:
    app.command(help=ADVISE_HELP, short_help="Time and cost of a job on each cloud configuration.")(
        advise
    )
    app.command(
        "allocate-workers",
        help=ALLOCATE_HELP,
        short_help="Loader workers per concurrent job from their throughput curves.",
    )(allocate_workers)


# ------------------------------------------------------------------------------ advise
def _workload(meta: dict[str, Any]) -> str | None:
    return (meta.get("summary") or {}).get("workload") or (meta.get("effective_config") or {}).get(
        "workload"
    )


def resolve_run(target: str):
    """The newest finished GPU run of a workload, or the run ``target`` names."""
    from gpulens.paths import runs_dir
    from gpulens.record.reader import list_records
    from gpulens.store.queries import find_run

    runs = [r for r in list_records(runs_dir()) if _workload(r.meta) == target]
    if runs:
        done = [
            r for r in runs if r.status == "finished" and r.meta["summary"].get("measured_steps")
        ]
        on_gpu = [r for r in done if (r.meta["summary"].get("gpu") or {}).get("name")]
        if on_gpu:
            return on_gpu[-1]
        raise UsageError(
            f"no finished run of {target} on a GPU in the store: run `gpulens run {target}` "
            "on a GPU first"
        )
    try:
        record = find_run(target)
        common.warn_unfinished(record)  # the running one's error, before the loading's
        return record
    except UsageError:
        from gpulens.workloads.models import list_workloads

        if target in {w.name for w in list_workloads()}:
            raise UsageError(
                f"no finished run of {target} in the store: run `gpulens run {target}` first"
            ) from None
        raise


def throughput_table(record, instances, max_nodes: int, gpu_catalog: Path | None):
    """One row per (instance, nodes) with the predicted throughput; configurations the
    predictor cannot do are returned apart with its reason."""
    import pandas as pd

    from gpulens.predict.advise import NODE_COUNTS
    from gpulens.predict.catalog import find_gpu
    from gpulens.predict.features import memory_shortfall
    from gpulens.predict.predictor import Target, predict_run

    cache: dict[Target | str, Any] = {}
    rows, skipped = [], []
    for inst in instances:
        short = memory_shortfall(record, find_gpu(inst.gpu, gpu_catalog))
        if short:  # the time model knows nothing of memory: priced, it would be picked
            skipped.append({"instance": inst.instance, "nodes": 1, "reason": f"{inst.gpu} {short}"})
            continue
        counts = [1] + [n for n in NODE_COUNTS if n <= max_nodes]
        for nodes in counts if inst.network_gbps else [1]:
            net = inst.network_gbps if nodes > 1 else None
            target = Target(inst.gpu, inst.gpus, nodes, net)
            if target not in cache:
                try:
                    cache[target] = predict_run(record, target, gpu_catalog)
                except UsageError as exc:
                    cache[target] = exc
            found = cache[target]
            if isinstance(found, UsageError):
                skipped.append({"instance": inst.instance, "nodes": nodes, "reason": str(found)})
                continue
            if found.measured_here and "rerun" not in cache:
                cache["rerun"] = _rerun_pct(record)  # one reading of the profiler window
            rerun = cache["rerun"] if found.measured_here else None
            spread, basis = validation.spread_error(found.validated_error_pct, rerun)
            rows.append({**inst.__dict__, "nodes": nodes,
                         "throughput_samples_per_s": found.throughput_samples_per_s,
                         "loader_bound": found.loader_bound,
                         "validated_error_pct": found.validated_error_pct,
                         "beyond_validation": found.beyond_validation,
                         "p90_error_pct": spread, "p90_error_basis": basis})  # fmt: skip
    if not rows:
        raise UsageError(skipped[0]["reason"] if skipped else "the instance catalog is empty")
    return pd.DataFrame(rows), skipped


def _rerun_pct(record) -> float:
    """The error of a rerun of the run's own configuration (``validation.rerun_error``)."""
    from gpulens.predict.batch import run_gpu_paced

    return validation.rerun_error(run_gpu_paced(record))


def checkpoint_seconds(record, given: float | None) -> tuple[float, str]:
    """The checkpoint's cost and where it comes from: given, measured, or modelled."""
    if given is not None:
        return given, "given (--checkpoint-s)"
    measured = (record.meta.get("summary") or {}).get("checkpoint_s")
    if isinstance(measured, (int, float)) and measured >= 0:
        return float(measured), "measured in the run"
    from gpulens.predict.features import model_size

    params, _ = model_size(_workload(record.meta))
    if not params:
        return ASSUMED_CHECKPOINT_S, (
            f"assumed {ASSUMED_CHECKPOINT_S:g} s (model size unknown; give --checkpoint-s)"
        )
    seconds = params * CHECKPOINT_BYTES_PER_PARAM / CHECKPOINT_BYTES_PER_S
    return seconds, (
        f"modelled: {params / 1e6:.1f}M parameters x {CHECKPOINT_BYTES_PER_PARAM} bytes "
        f"(weights + Adam state) at {CHECKPOINT_BYTES_PER_S / 1e6:g} MB/s"
    )


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item"):  # numpy scalars
        return _clean(value.item())
    return value


def _option_docs(options) -> list[dict[str, Any]]:
    docs = []
    for _, row in options.iterrows():
        docs.append({k: _clean(v) for k, v in row.items()})
    return docs


def advise(
    target: str = typer.Argument(..., help="A workload (its newest run) or a run."),
    samples: float = typer.Option(None, "--samples", help="Samples the job processes in all."),
    epochs: float = typer.Option(None, "--epochs", help="Epochs (with --dataset-size)."),
    dataset_size: int = typer.Option(None, "--dataset-size", help="Samples per epoch."),
    deadline: float = typer.Option(None, "--deadline", help="Hours the job may take (p90)."),
    budget: float = typer.Option(None, "--budget", help="US dollars the job may cost (p90)."),
    spot: bool = typer.Option(False, "--spot", help="Also spot servers where priced."),
    revocations_per_h: float = typer.Option(
        None, "--revocations-per-h", help="Spot revocations per hour per node [catalog, or 0.05]."
    ),
    checkpoint_s: float = typer.Option(
        None, "--checkpoint-s", help="Seconds per checkpoint [measured, or from the model size]."
    ),
    restart_s: float = typer.Option(
        None,
        "--restart-s",
        help=f"Seconds to resume after a revocation [default: {DEFAULT_RESTART_S:g}].",
    ),
    max_nodes: int = typer.Option(
        1, "--max-nodes", help="Also 2, 4, ... nodes up to this (at most 64)."
    ),
    catalog: Path = typer.Option(
        None,
        "--catalog",
        help="A CSV of instances to add or override. To change a catalog row, give provider, "
        "instance and only the columns to change; a new instance needs the bundled header's.",
    ),
    gpu_catalog: Path = typer.Option(None, "--gpu-catalog", help=common.GPU_CATALOG_HELP),
    json_out: bool = typer.Option(False, "--json", help=common.JSON_HELP),
) -> None:
    from gpulens.predict import instances as cat
    from gpulens.predict.advise import AdviseConfig
    from gpulens.predict.advise import advise as advise_job
    from gpulens.predict.spot import SpotParams

    config = AdviseConfig(samples, epochs, dataset_size, deadline, budget, max_nodes)
    spot_only = {"--revocations-per-h": revocations_per_h, "--checkpoint-s": checkpoint_s,
                 "--restart-s": restart_s}  # fmt: skip
    given = [flag for flag, value in spot_only.items() if value is not None]
    if given and not spot:
        raise UsageError(f"{', '.join(given)} only applies to spot servers: add --spot")
    restart_s = DEFAULT_RESTART_S if restart_s is None else restart_s
    SpotParams(checkpoint_s or 0.0, restart_s, revocations_per_h)  # checks them before reading
    catalog_warnings: list[str] = []
    instances = cat.load_instances(catalog, gpu_catalog, catalog_warnings)
    record = resolve_run(target)
    unfinished = common.unfinished_text(record)  # warned on stderr; the JSON carries it too
    table, skipped = throughput_table(record, instances, config.max_nodes, gpu_catalog)
    spot_params, ckpt_source = None, None
    if spot:
        ckpt, ckpt_source = checkpoint_seconds(record, checkpoint_s)
        spot_params = SpotParams(ckpt, restart_s, revocations_per_h)
    result = advise_job(table, config.total_samples, deadline, budget, spot_params)
    day = cat.catalog_date(instances)
    warnings = catalog_warnings + [w for w in [cat.stale_warning(day)] if w]
    if table["loader_bound"].any():
        warnings.append(
            f"run {record.run_id} waited for its data loader: a faster GPU finishes no sooner "
            "at that loader pace (`gpulens stalls` shows where it waits)"
        )
    if spot and not table["spot_usd_per_h"].notna().any():
        warnings.append("no instance in the catalog has a spot price: add them with --catalog")
    options = _option_docs(result.options)
    chosen = options[result.recommended] if result.recommended is not None else None
    # the catalog's date is its newest row's; the pick's own price may be older
    if chosen is not None and chosen.get("price_date") and str(chosen["price_date"]) != day:
        old = cat.stale_warning(
            str(chosen["price_date"]),
            subject=f"the recommended {chosen['instance']}'s price",
            newest_day=day,
        )
        warnings += [old] if old else []
    if chosen is not None and chosen.get("beyond_validation"):
        warnings.append(
            f"the recommended {chosen['instance']} is beyond what predict was validated on: "
            f"{chosen['beyond_validation']}; its time and cost may be far off (measure a short "
            "run there before committing)"
        )
    if json_out:
        # whether the pick meets --deadline and --budget (at p90): where none does, the pick is
        # the nearest, and only the reason's words said so
        met = None if chosen is None or (deadline is None and budget is None) else bool(
            (deadline is None or chosen["time_h_p90"] <= deadline)
            and (budget is None or chosen["cost_usd_p90"] <= budget))  # fmt: skip
        common.emit_json({
            "catalog_date": day, "options": options, "recommended": chosen,
            "constraints_met": met, "reason": result.reason, "source_run": record.run_id,
            "workload": _workload(record.meta),
            "samples": config.total_samples, "skipped": skipped,
            "warnings": ([unfinished] if unfinished else []) + warnings,
            "spot": None if spot_params is None else {
                "checkpoint_s": spot_params.checkpoint_s, "checkpoint_source": ckpt_source,
                "restart_s": spot_params.restart_s,
                # a number where given, else null (each option's own rate is in the option)
                "revocations_per_h": revocations_per_h,
                "revocations_source": _revocations_text(revocations_per_h, table),
                "monte_carlo_samples": spot_params.samples, "seed": spot_params.seed},
        })  # fmt: skip
        return
    for w in warnings:
        common.warn("warning: ", w)
    _render(options, chosen, result.reason, record.run_id, config.total_samples, day)
    if spot_params is not None:
        line = f"spot: checkpoint {spot_params.checkpoint_s:.1f} s ({ckpt_source}), restart "
        line += f"{restart_s:g} s, revocations {_revocations_text(revocations_per_h, table)}"
        common.out.print(Text(line), highlight=False)
    by_reason: dict[str, list[str]] = {}
    for s in skipped:
        by_reason.setdefault(s["reason"], []).append(s["instance"])
    for reason, names in by_reason.items():
        names = list(dict.fromkeys(names))  # an instance skipped at each node count: once
        common.out.print(Text(f"not predicted: {', '.join(names)}: {reason}"), highlight=False)


def _revocations_text(given: float | None, table) -> str:
    """The spot revocation rate the options assume, and where it comes from."""
    from gpulens.predict.instances import DEFAULT_REVOCATIONS_PER_H

    if given is not None:
        return f"{given:g} per hour per node (--revocations-per-h)"
    priced = table[table["spot_usd_per_h"].notna()]
    listed = priced["revocations_per_h"].dropna() if "revocations_per_h" in priced else []
    assumed = (f"{DEFAULT_REVOCATIONS_PER_H:g} per hour per node (assumed: no provider "
               "publishes one; set it with --revocations-per-h)")  # fmt: skip
    return f"the catalog's per node where given, else {assumed}" if len(listed) else assumed


def _figure(value: float) -> str:
    """Hours or dollars in at most 6 characters (99,999; 132k; 258.8M; 2.9e11): a large job's
    figures in cents cut the table's columns short in 80 (the JSON keeps every digit)."""
    size = abs(value)
    if size < 1e3:
        return f"{value:,.2f}"
    if size < 1e5:
        return f"{value:,.0f}"
    if size < 1e6:
        return f"{value / 1e3:.0f}k"
    if size < 1e9:
        return f"{value / 1e6:.1f}M"
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _render(options, chosen, reason: str, run_id: str, samples: float, day: str) -> None:
    out = common.out
    size = f"{samples:,.0f}" if samples < 1e12 else f"{samples:.3g}"
    table = Table(title=f"{size} samples, predicted from {run_id} (prices of {day})",
                  title_justify="left", **COMPACT)  # fmt: skip
    # The instance is what the user rents: never cut short. Its provider and the p90s go on
    # each row's second line, so the table reads in 80 columns.
    table.add_column("instance\n(provider)", no_wrap=True)
    table.add_column("GPUs", no_wrap=True)
    table.add_column("pricing", no_wrap=True)
    table.add_column("hours\n(p90)", justify="right", no_wrap=True)
    table.add_column("USD\n(p90)", justify="right", no_wrap=True)
    table.add_column("", no_wrap=True)
    for opt in options:
        gpus = f"{opt['gpus']}x {opt['gpu']}" + (f" x{opt['nodes']}" if opt["nodes"] > 1 else "")
        mark = ("*" if opt["pareto"] else " ") + ("?" if opt.get("beyond_validation") else " ")
        mark += " pick" if opt is chosen else ""  # short: the table must read in 80 columns
        instance = Text.assemble(opt["instance"], "\n", (f"({opt['provider']})", "dim"))
        table.add_row(instance, gpus, opt["pricing"],
                      f"{_figure(opt['time_h'])}\n({_figure(opt['time_h_p90'])})",
                      f"{_figure(opt['cost_usd'])}\n({_figure(opt['cost_usd_p90'])})",
                      mark)  # fmt: skip
    out.print(table)
    out.print(Text("* on the Pareto front (no option both faster and cheaper)"), highlight=False)
    if any(opt.get("beyond_validation") for opt in options):
        assumed = max((o["p90_error_pct"] or 0) for o in options if o.get("beyond_validation"))
        out.print(Text("? a GPU or GPU count beyond what predict was validated on (H100 and "
                       "H200, 1, 2 or 4 GPUs of one machine): its error is unknown, its p90 "
                       f"assumes {assumed:.1f}%"), highlight=False)  # fmt: skip
    out.print(Text("(p90) spreads each time by its prediction's error"
                   + (", and on spot by revocations and restarts" if any(
                       o["pricing"] == "spot" for o in options) else "")),
              highlight=False)  # fmt: skip
    if chosen is not None:
        out.print(Text(f"pick: {chosen['instance']} x{chosen['nodes']} ({chosen['pricing']}), "
                       f"{_figure(chosen['time_h'])} h, ${_figure(chosen['cost_usd'])}: "
                       f"{reason}"),
                  highlight=False)  # fmt: skip
        if chosen["checkpoint_interval_h"]:
            every = chosen["checkpoint_interval_h"] * 60
            out.print(Text(f"  checkpoint every {every:.0f} min of training (Young/Daly, checked "
                           "by simulation)"),
                      highlight=False)  # fmt: skip


# ----------------------------------------------------------------------- allocate-workers
def _job(job: str, known: set, find_run) -> tuple[str, dict | None]:
    """The job's workload and, for a run the user named, that run's document: a workload of
    the store's runs first, then a run, then a built-in workload."""
    if job in known:
        return job, None
    try:
        meta = find_run(job).meta
    except UsageError:
        from gpulens.workloads.models import get_workload

        try:
            get_workload(job)
        except UsageError as exc:  # a misspelt name: not "run it first"
            raise UsageError(f"{exc} (or give a run id, name or directory)") from None
        return job, None
    return _workload(meta) or job, meta


def allocate_workers(
    jobs: list[str] = typer.Argument(..., help="Workloads (or runs) that run concurrently."),
    cpus: int = typer.Option(..., "--cpus", help="CPUs for all their loader workers together."),
    objective: str = typer.Option(
        "normalized", "--objective", help="normalized (each job's share of its best) or samples."
    ),
    json_out: bool = typer.Option(False, "--json", help=common.JSON_HELP),
) -> None:
    from gpulens.paths import runs_dir
    from gpulens.predict.workers import (
        OBJECTIVES,
        allocate,
        allocation_frame,
        check_cpus,
        curve_for_job,
    )
    from gpulens.record.reader import list_records
    from gpulens.store.queries import find_run

    if objective not in OBJECTIVES:  # before the store is read: its errors would hide this one
        raise UsageError(f"--objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    check_cpus(cpus, len(jobs))  # before the store is read, as --objective
    metas = [r.meta for r in list_records(runs_dir())]
    known = {_workload(m) for m in metas}
    named = [_job(j, known, find_run) for j in jobs]
    curves = [curve_for_job(name, metas, cpus, run) for name, run in named]
    alloc = allocate(curves, cpus, objective)
    frame = allocation_frame(alloc, curves)
    if json_out:
        rows = [{k: _clean(v) for k, v in r.items()} for r in frame.to_dict("records")]
        for row, curve in zip(rows, curves, strict=True):
            row["curve_note"] = curve.note
        common.emit_json({
            "cpus": cpus, "objective": objective, "jobs": rows,
            "aggregate": {"value": alloc.value, "even_value": alloc.even_value,
                          "gain_pct": alloc.gain_pct,
                          "samples_per_s": sum(alloc.samples_per_s),
                          "even_samples_per_s": sum(alloc.even_samples_per_s)},
        })  # fmt: skip
        return
    jobs_text = f"{len(jobs)} job" + "s" * (len(jobs) != 1)
    table = Table(title=f"loader workers for {jobs_text} on {cpus} CPUs ({objective})",
                  title_justify="left", **COMPACT)  # fmt: skip
    for col in ("job", "curve", "workers", "samples/s", "even split", "samples/s"):
        table.add_column(col, no_wrap=col == "job")  # a run's id in full: it tells jobs apart
    for r, (name, run) in zip(frame.to_dict("records"), named, strict=True):
        # a named run's job is labelled by its run id, on a second line (80 columns)
        run_id = (run or {}).get("run_id")
        job = Text.assemble(name, "\n", (f"({run_id})", "dim")) if run_id else name
        table.add_row(job, r["curve"], str(r["workers"]), f"{r['samples_per_s']:,.1f}",
                      str(r["even_workers"]), f"{r['even_samples_per_s']:,.1f}")  # fmt: skip
    common.out.print(table)
    line = f"aggregate ({objective}): {alloc.value:.3f} vs {alloc.even_value:.3f} for an even "
    common.out.print(Text(line + f"split ({alloc.gain_pct:+.1f}%)"), highlight=False)
    for curve in curves:
        common.out.print(
            Text(f"  {curve.job}: {curve.source} curve, {curve.note}"), highlight=False
        )

"""``gpulens predict RUN --gpu G`` (a measured run on another GPU, count or network) and
``gpulens fit`` (the regression over the store's runs)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table
from rich.text import Text

from gpulens.cli import common

PREDICT_HELP = (
    "Predict the step time and throughput of a measured training run on another GPU, another "
    "number of GPUs or nodes, another batch size or another number of loader workers. The GPU's "
    "time is scaled by what bounds it (peak FLOP/s or memory bandwidth): per kernel when the run "
    "has a profiler window (`gpulens run --torch-profiler N`), else for the whole step from its "
    "FLOPs and DRAM bytes. Another batch size rescales each kernel's op by its input shapes "
    "(needs the profiler window). The gradient all-reduce comes from a ring model (calibrated on "
    "1- and 2-GPU runs of the same workload in the store); the data pipeline keeps its measured "
    "pace per worker, scaled by how it falls as its loader runs more workers, and shared with "
    "the other ranks' workers where the host's CPUs run short. The output names the method "
    "and its error where it was validated (H100 and H200, 1, 2 or 4 GPUs of one machine; beyond "
    "them it says the error is unknown); where the host or the loader sets the pace, it "
    "also says how much two runs of one configuration differ (compare against the "
    "median of several runs).\n\n"
    "A RUN is a run id (or unique prefix, name, or 'latest') or a run directory.\n\n"
    "\b\nExamples:\n"
    "  gpulens predict latest --gpu H200\n"
    "  gpulens predict latest --batch-size 256\n"
    "  gpulens predict 20261124-0812-ab12 --gpu A100 --gpus 8\n"
    "  gpulens predict latest --gpu H100 --gpus 8 --nodes 4 --network-gbps 400 --json"
)
FIT_HELP = (
    "Fit a regression of step time (CM-DARE style: model FLOPs, parameters, layers, batch size, "
    "GPU peak FLOP/s and bandwidth, GPUs, precision) on the store's finished training runs. The "
    "error is measured on held-out runs only (leave one workload out, or k-fold). The model is "
    "saved under the gpulens home; `gpulens predict` uses it where its held-out error is lower "
    "than the roofline's."
)


def register(app: typer.Typer) -> None:
    app.command(
        help=PREDICT_HELP, short_help="A measured run on another GPU, GPU count or network."
    )(predict)
    app.command(help=FIT_HELP, short_help="Fit a step-time regression on the store's runs.")(fit)


def predict(
    ctx: typer.Context,
    run: str = typer.Argument(..., help="The measured run (id, prefix, name, 'latest', or dir)."),
    gpu: str = typer.Option(
        None, "--gpu", help="Target GPU (a catalog name, e.g. H100, A100) [default: the run's]."
    ),
    gpus: int = typer.Option(
        1,
        "--gpus",
        help="GPUs per node (same per-GPU batch). On the run's GPU, the host's own pace "
        "(between its probe and the run's step, lengthened by the wait for the slowest of the "
        "N processes) plus DDP's host work per step (more for models with more parameter "
        "tensors) is the floor.",
    ),
    batch_size: int = typer.Option(
        None,
        "--batch-size",
        help="Per-GPU batch size [default: the run's]; needs the run's profiler window "
        "(`gpulens run --torch-profiler 5`). Below the run's batch, the host's own pace (probed "
        "after the measured steps) is the floor.",
    ),
    workers: int = typer.Option(
        None,
        "--workers",
        help="Data-loader workers per GPU [default: the run's]. Each worker's pace falls as more "
        "run beside it (by the decline measured on seventeen ladders, hosts of 2-32 CPUs), and "
        "the workers share what the training process leaves of the CPUs where they need more "
        "than the run had; a run whose "
        "loader kept up needs --prep-timing for its loader's own pace.",
    ),
    nodes: int = typer.Option(1, "--nodes", help="Nodes (hosts)."),
    network_gbps: float = typer.Option(
        None, "--network-gbps", help="Network between nodes, Gbit/s (needed with --nodes > 1)."
    ),
    gpu_catalog: Path = typer.Option(None, "--gpu-catalog", help=common.GPU_CATALOG_HELP),
    old_catalog: Path = typer.Option(None, "--catalog", hidden=True),  # deprecated: --gpu-catalog
    json_out: bool = typer.Option(False, "--json", help=common.JSON_HELP),
) -> None:
    from gpulens.errors import UsageError
    from gpulens.predict.features import run_facts
    from gpulens.predict.predictor import Target, predict_run
    from gpulens.store.queries import find_run

    if gpu is None and gpus == 1 and nodes == 1 and batch_size is None and workers is None:
        raise UsageError(
            "say what to predict the run on: --gpu NAME, --gpus N, --nodes M, --batch-size B "
            "or --workers W"
        )
    catalog = common.deprecated_alias(ctx, "gpu_catalog", "old_catalog")
    # checks the arguments before any reading
    target = Target(gpu, gpus, nodes, network_gbps, batch_size, workers)
    record = find_run(run)
    unfinished = common.warn_unfinished(record)
    prediction = predict_run(record, target, catalog)
    facts = run_facts(record)
    if json_out:
        doc = prediction.as_dict()
        doc["notes"] = [unfinished, *doc["notes"]] if unfinished else doc["notes"]
        common.emit_json(doc)
        return
    out = common.out
    out.print(_table(prediction, facts, record.meta.get("summary") or {}))
    err = prediction.validated_error_pct
    where = f"; regime: {', '.join(prediction.regimes)}" if prediction.regimes else ""
    if err is not None:
        validated = f"±{err:.1f}% (mean abs. error where validated{where})"
    elif prediction.measured_here:
        validated = "none: the run's own configuration, measured (nothing is predicted)"
    elif prediction.notes:  # beyond validation, or a loader whose own pace was not measured
        validated = "unknown (the notes below say why)"
    else:
        validated = "not validated on measured runs yet"
    out.print(Text(f"method: {prediction.method}, error {validated}"), highlight=False)
    for note in prediction.notes:
        out.print(Text(f"  {note}"), highlight=False)


def _table(prediction, facts, summary: dict) -> Table:
    """The prediction beside what the run measured, row by row."""
    t = prediction.target
    where = f"{t.gpus}x {prediction.target_gpu}" + (f" x {t.nodes} nodes" if t.nodes > 1 else "")
    tput = summary.get("throughput_samples_per_s")
    ms = lambda s: f"{s * 1e3:.2f} ms"  # noqa: E731
    measured = {
        "on": f"{facts.gpus}x {prediction.source_gpu}",
        "batch per GPU": f"{facts.batch_size}",
        "loader workers": f"{facts.workers}",
        "step time": ms(facts.step_s),
        "throughput": f"{tput:,.1f} samples/s" if tput else "-",
        # split as the prediction splits it, so the parts add up to the step in both columns
        "  compute": ms(facts.compute_s + facts.bookkeeping_s),
        "  communication": "-",  # inside compute in a measured DDP step
        "  data": ms(facts.data_wait_in_step_s + facts.h2d_s),
    }
    predicted = {
        "on": where,
        "batch per GPU": f"{t.batch_size}",
        "loader workers": f"{t.workers}",
        "step time": ms(prediction.step_time_s),
        "throughput": f"{prediction.throughput_samples_per_s:,.1f} samples/s",
        **{f"  {k}": ms(v) for k, v in prediction.components_s.items()},
    }
    table = Table(title=f"{prediction.source_run} ({prediction.source_gpu})")
    for name in ("", "measured", "predicted"):
        table.add_column(name, justify="right" if name else "left")
    for row, value in predicted.items():
        if row == "loader workers" and not (t.workers or facts.workers):
            continue
        table.add_row(row, measured.get(row, "-"), value)
    return table


def fit(
    ctx: typer.Context,
    gpu_catalog: Path = typer.Option(None, "--gpu-catalog", help=common.GPU_CATALOG_HELP),
    old_catalog: Path = typer.Option(None, "--catalog", hidden=True),  # deprecated: --gpu-catalog
    json_out: bool = typer.Option(False, "--json", help=common.JSON_HELP),
) -> None:
    from gpulens.paths import runs_dir
    from gpulens.predict.fit import fit_runs, save_model
    from gpulens.record.reader import list_records

    catalog = common.deprecated_alias(ctx, "gpu_catalog", "old_catalog")
    model = fit_runs(list_records(runs_dir()), catalog)
    path = save_model(model)
    if json_out:
        common.emit_json({**model.as_dict(), "model_path": str(path)})
        return
    common.out.print(
        Text(
            f"fitted on {model.runs} runs ({', '.join(model.workloads)}; GPUs "
            f"{', '.join(model.gpus)}): held-out error {model.heldout_mape_pct:.1f}% "
            f"({model.validation}); saved {path}"
        ),
        highlight=False,
    )
    if not model.across_gpus:
        common.warn(
            "one GPU model only: ",
            "`gpulens predict` uses the regression only between GPUs it was fitted on; "
            "add runs measured on another GPU and fit again",
        )

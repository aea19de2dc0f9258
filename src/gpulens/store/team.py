"""Read the runs a team logged to one shared MLflow store (a tracking server, typically on
PostgreSQL), whatever machine and ``GPULENS_HOME`` each was recorded under.

Local listings (``gpulens runs list``, the dashboard's runs page) show the records of this
machine; :func:`store_runs` asks the tracking store itself, so every run that reached it shows,
from any process or host. MLflow is imported lazily (the ``store`` extra).
"""

from __future__ import annotations

from typing import Any

from gpulens.errors import UsageError
from gpulens.paths import default_tracking_uri
from gpulens.store.availability import (
    READ_HINT,
    mlflow_http_limits,
    open_client,
    require_reachable,
)

MAX_STORE_RUNS = 10_000


def store_runs(
    tracking_uri: str | None = None, experiment: str | None = None, limit: int = 100
) -> list[dict[str, Any]]:
    """The gpulens runs in the store's experiment, newest first: ``run_id`` (gpulens's),
    ``mlflow_run_id``, ``name``, ``status``, ``kind``, ``workload``, ``device``, ``started_ms``
    and the summary metrics MLflow holds (``metrics``). ``limit`` 0 means all (up to 10,000).

    Raises :class:`~gpulens.store.availability.StoreUnavailableError` when the store does not
    answer and :class:`~gpulens.errors.UsageError` when the experiment does not exist."""
    from gpulens.store import mlflow_sink

    mlflow = mlflow_sink.import_mlflow()
    uri = tracking_uri or default_tracking_uri()
    experiment = experiment or mlflow_sink.default_experiment()
    require_reachable(uri, hint=READ_HINT)  # nothing is logged here: no `runs sync` to suggest
    wanted = limit if limit and limit > 0 else MAX_STORE_RUNS
    with mlflow_http_limits():
        client = open_client(mlflow, uri)
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            raise UsageError(
                f"the MLflow store {uri} has no experiment {experiment!r}: log a run to it "
                "first (`gpulens run ...` with MLFLOW_TRACKING_URI set), or set "
                "MLFLOW_EXPERIMENT_NAME"
            )
        rows: list[dict[str, Any]] = []
        token = None
        while len(rows) < wanted:
            page = client.search_runs(
                [exp.experiment_id],
                filter_string="tags.`gpulens.run_id` != ''",
                max_results=min(1000, wanted - len(rows)),
                order_by=["attributes.start_time DESC"],
                page_token=token,
            )
            rows += [_row(run) for run in page]
            token = page.token
            if not token:
                break
    return rows


def _row(run) -> dict[str, Any]:
    tags = run.data.tags
    return {
        "run_id": tags.get("gpulens.run_id"),
        "mlflow_run_id": run.info.run_id,
        "name": tags.get("gpulens.name") or run.info.run_name,
        "status": tags.get("gpulens.status") or run.info.status.lower(),
        "kind": tags.get("gpulens.kind"),
        "workload": tags.get("gpulens.workload"),
        "device": tags.get("gpulens.device"),
        "synced": tags.get("gpulens.synced") == "true",
        "started_ms": run.info.start_time,
        "metrics": dict(sorted(run.data.metrics.items())),
    }

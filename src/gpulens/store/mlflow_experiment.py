"""Experiments in MLflow as a parent run with child runs.

- ``gpulens stalls``: a parent run of its own (named ``stalls <workload>``, tagged
  ``gpulens.experiment=stalls``) holds the result document (artifact ``stalls.json``) and the
  breakdown's numbers as metrics; each run the experiment made (ingestion-free, cached, cold,
  paired...) is logged as usual and nested under it (MLflow's ``mlflow.parentRunId`` tag).
- ``gpulens colocate``: the experiment's own run is the parent; every mechanism and setting
  it tried becomes a child run (params ``mechanism``, ``setting``, ``status``; metrics: combined
  throughput, fairness, energy against the jobs alone (and per sample, request or run when the
  jobs count one thing), and per job its throughput alone and together in its unit
  (``<job>.throughput_together_requests_per_s``) and its slowdown), so MLflow's runs table
  compares the settings side by side.

- The HTML report of a logged run (its figures) as an artifact of its MLflow run:
  ``report.html`` in a run of its own, ``gpulens/<run id>/report.html`` in the user's run.

The experiments are idempotent: a parent or trial already logged (tags ``gpulens.experiment_key``,
``gpulens.trial``) is reused. The children must have been logged first (their MLflow run ids
are read from the records' sidecars).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

from gpulens.colocate.metrics import SAMPLE_UNITS, throughput_units
from gpulens.paths import default_tracking_uri
from gpulens.record.reader import read_record
from gpulens.store import mlflow_sink
from gpulens.store.availability import mlflow_http_limits, open_client, store_lock
from gpulens.store.queries import flatten, is_number

# MLflow metric keys: alphanumerics, underscores, dashes, periods, spaces and slashes.
_BAD_KEY_CHARS = re.compile(r"[^\w\-. /]")
MAX_METRICS = 500


def _metric_key(key: str) -> str:
    return _BAD_KEY_CHARS.sub("_", key)[:250]


def _numbers(doc: dict[str, Any]) -> dict[str, float]:
    flat = flatten(doc)
    out = {_metric_key(k): float(v) for k, v in flat.items() if is_number(v)}
    return dict(list(out.items())[:MAX_METRICS])


def _find(client, experiment_id: str, tag: str, value: str):
    safe = value.replace("'", "")
    runs = client.search_runs([experiment_id], filter_string=f"tags.`{tag}` = '{safe}'")
    return runs[0] if runs else None


def _client(tracking_uri: str | None, experiment: str | None):
    mlflow = mlflow_sink.import_mlflow()
    uri = tracking_uri or default_tracking_uri()
    experiment = experiment or mlflow_sink.default_experiment()
    return open_client(mlflow, uri), uri, experiment


def log_stalls_experiment(
    result: dict[str, Any],
    record_dirs: list[Path],
    tracking_uri: str | None = None,
    experiment: str | None = None,
) -> str:
    """A parent run for one ``gpulens stalls`` result, with its (already logged) runs nested
    under it; returns the parent's MLflow run id."""
    client, uri, experiment = _client(tracking_uri, experiment)
    run_ids = sorted(Path(d).name for d in record_dirs)
    key = "stalls:" + hashlib.sha1(",".join(run_ids).encode()).hexdigest()[:16]
    with mlflow_http_limits(), store_lock(uri):
        experiment_id = mlflow_sink.ensure_experiment(client, uri, experiment)
        parent = _find(client, experiment_id, "gpulens.experiment_key", key)
        if parent is None:
            name = f"stalls {result.get('workload') or ''}".strip()
            parent = client.create_run(
                experiment_id,
                run_name=name,
                tags={"gpulens.experiment": "stalls", "gpulens.experiment_key": key,
                      "gpulens.run_ids": ",".join(run_ids)[:5000]},
            )  # fmt: skip
            parent_id = parent.info.run_id
            for name_value in _numbers(result).items():
                client.log_metric(parent_id, *name_value)
            client.log_dict(parent_id, result, "stalls.json")
            client.set_terminated(parent_id)
        parent_id = parent.info.run_id
        for record_dir in record_dirs:
            child = mlflow_sink.synced_run_id(read_record(Path(record_dir)), uri, experiment)
            if child and child != parent_id:
                client.set_tag(child, "mlflow.parentRunId", parent_id)
    return parent_id


def log_colocate_trials(
    record_dir: Path, tracking_uri: str | None = None, experiment: str | None = None
) -> list[str]:
    """One child run per mechanism and setting under the (already logged) run of a
    ``gpulens colocate`` record; returns their MLflow run ids."""
    client, uri, experiment = _client(tracking_uri, experiment)
    record = read_record(Path(record_dir))
    parent_id = mlflow_sink.synced_run_id(record, uri, experiment)
    if not parent_id:
        return []
    doc = (record.meta.get("summary") or {}).get("colocate") or {}
    units = throughput_units(doc)
    children = []
    with mlflow_http_limits(), store_lock(uri):
        experiment_id = client.get_run(parent_id).info.experiment_id
        for trial in doc.get("results") or []:
            mechanism, setting = trial.get("mechanism"), trial.get("setting")
            tag = f"{record.run_id}:{mechanism}:{setting}"
            found = _find(client, experiment_id, "gpulens.trial", tag)
            if found is not None:
                children.append(found.info.run_id)
                continue
            child = client.create_run(
                experiment_id,
                run_name=f"{mechanism} {setting}",
                tags={"mlflow.parentRunId": parent_id, "gpulens.trial": tag,
                      "gpulens.experiment": "colocate"},
            )  # fmt: skip
            child_id = child.info.run_id
            for param in ("mechanism", "setting", "status"):
                client.log_param(child_id, param, str(trial.get(param)))
            for name, value in trial_metrics(trial, units).items():
                client.log_metric(child_id, _metric_key(name), float(value))
            ok = trial.get("status") in (None, "ok")
            client.set_terminated(child_id, status="FINISHED" if ok else "FAILED")
            children.append(child_id)
    return children


def trial_metrics(trial: dict[str, Any], units: dict[str, str]) -> dict[str, float]:
    """A colocate trial's MLflow metrics, each name with its unit as a run's metrics have it:
    ``<job>.throughput_alone_samples_per_s`` (``requests_per_s``, ``runs_per_s``: what the job
    counts, from ``units``), ``<job>.slowdown`` (a ratio), and the trial's numbers; its energy
    per unit as ``energy_per_sample_j`` / ``energy_per_request_j`` / ``energy_per_run_j``."""
    metrics = {k: v for k, v in trial.items() if is_number(v) and k != "energy_per_unit_j"}
    counted = set(units.values())
    if len(counted) != 1 or counted - set(SAMPLE_UNITS):  # a document from before the fix
        metrics.pop("energy_per_sample_j", None)  # summed samples, requests and runs
    per_unit, unit = trial.get("energy_per_unit_j"), trial.get("energy_unit")
    if is_number(per_unit) and unit:
        metrics["energy_per_" + unit.removeprefix("J/") + "_j"] = per_unit
    for job in trial.get("jobs") or []:
        name = job.get("name")
        suffix = "_" + (job.get("throughput_unit") or units.get(str(name)) or "samples/s").replace(
            "/", "_per_"
        )
        for field, key in (("throughput_alone", "throughput_alone" + suffix),
                           ("throughput_together", "throughput_together" + suffix),
                           ("slowdown", "slowdown")):  # fmt: skip
            if is_number(job.get(field)):
                metrics[f"{name}.{key}"] = job[field]
    return {_metric_key(k): float(v) for k, v in metrics.items()}


def log_report_page(
    record_dir: Path, html_path: Path, tracking_uri: str | None = None,
    experiment: str | None = None,
) -> str | None:  # fmt: skip
    """The report page ``html_path`` of an already logged record as an artifact of its MLflow
    run; returns that run's id (None when the record is not logged there)."""
    client, uri, experiment = _client(tracking_uri, experiment)
    record = read_record(Path(record_dir))
    run_id = mlflow_sink.synced_run_id(record, uri, experiment)
    if not run_id:
        return None
    own = client.get_run(run_id).data.tags.get("gpulens.run_id") == record.run_id
    with mlflow_http_limits(), store_lock(uri):
        client.log_artifact(run_id, str(html_path), None if own else f"gpulens/{record.run_id}")
    return run_id

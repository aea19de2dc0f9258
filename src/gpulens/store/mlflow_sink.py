"""Log run records to MLflow: one MLflow run per record.

params = effective config, metrics = numeric summary (plus a downsampled copy of the time series as
step metrics), tags = environment and gpulens facts, artifacts = the record directory. MLflow is
imported only inside functions, so the measuring side never needs it.

Which records are synced is kept in a sidecar ``<record>/mlflow.json`` (``run.json`` belongs to
its writer), keyed by tracking URI and experiment; an MLflow run also carries the tag
``gpulens.run_id``, so a sync interrupted half-way is found and redone rather than duplicated.

MLflow's own environment variables are honoured: ``MLFLOW_TRACKING_URI`` (the store),
``MLFLOW_EXPERIMENT_NAME`` (the experiment, default ``gpulens``) and ``MLFLOW_RUN_ID`` (a run of
the user's, e.g. when gpulens runs inside ``mlflow run`` or a script that started one): a record
is then logged into that run (its summary and config as ``gpulens.*`` metrics and params, so
they never collide with the user's; the series under ``system/`` and ``steps/``; the record
under the artifact path ``gpulens/<run id>``; the run is left open), or, when that run already
holds a gpulens record or the record is part of an experiment (stalls, colocate), as a child
run of it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from gpulens.errors import MissingExtraError, UsageError
from gpulens.paths import default_tracking_uri, gpulens_home, runs_dir
from gpulens.record import schema
from gpulens.record.reader import RunRecord, list_records, read_record
from gpulens.record.writer import atomic_write_json, now_iso
from gpulens.store.availability import (
    REACHABILITY_TIMEOUT_S,
    StoreUnavailableError,
    check_store,
    is_locked_error,
    mlflow_http_limits,
    require_reachable,
    store_lock,
)
from gpulens.store.mlflow_payload import (
    iso_to_ms,
    record_metrics,
    record_params,
    record_tags,
    series_metrics,
)
from gpulens.store.sink import ACTIVE_RUN, ACTIVE_URI

log = logging.getLogger(__name__)

SIDECAR_FILE = "mlflow.json"
DEFAULT_EXPERIMENT = "gpulens"
ARTIFACT_PATH = "record"
# Conservative limits that every MLflow server version accepts.
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000
SYNCABLE_STATUSES = (schema.STATUS_FINISHED, schema.STATUS_FAILED, schema.STATUS_KILLED)
_MLFLOW_STATUS = {
    schema.STATUS_FINISHED: "FINISHED",
    schema.STATUS_FAILED: "FAILED",
    schema.STATUS_KILLED: "KILLED",
}
LOCKED_RETRIES = 4  # attempts when SQLite says "database is locked" (backoff 0.5, 1, 2 s)
_NOISY_LOGGERS = ("alembic", "mlflow.store.db.utils", "mlflow.store", "mlflow.tracking")


# ----------------------------------------------------------------------------- availability
def is_available() -> bool:
    """Whether MLflow is installed (without importing it)."""
    return importlib.util.find_spec("mlflow") is not None


def _mlflow_version() -> str | None:
    try:
        return importlib.metadata.version("mlflow")
    except importlib.metadata.PackageNotFoundError:
        return None


def store_status(home: Path | str | None = None, check: bool = True) -> dict[str, Any]:
    """What ``gpulens doctor`` shows about the store: URI, MLflow version, whether the store
    answers (one request of at most 2 s, ``check=False`` skips it), synced counts.

    ``ok`` is true when MLflow is installed and the store can be used; ``detail`` says why not
    (``"unreachable: connection refused"``...) and ``hint`` what to do.
    """
    home_path = Path(home) if home else gpulens_home()
    uri = default_tracking_uri(home_path)
    records = [r for r in list_records(runs_dir(home_path)) if r.status in SYNCABLE_STATUSES]
    synced = sum(1 for r in records if synced_run_id(r, uri, DEFAULT_EXPERIMENT))
    available = is_available()
    found = check_store(uri, REACHABILITY_TIMEOUT_S) if check else None
    if not available:
        ok, detail = False, "MLflow is not installed"
        hint = "records stay local until `pip install 'gpulens[store]'`, then `gpulens runs sync`"
    elif found is None:
        ok, detail, hint = True, "not checked", None
    else:
        ok, detail = found.ok, found.detail
        hint = None if ok else "records stay local; `gpulens runs sync` logs them once it is back"
    return {
        "tracking_uri": found.tracking_uri if found else uri,
        "experiment": DEFAULT_EXPERIMENT,
        "mlflow_available": available,
        "mlflow_version": _mlflow_version() if available else None,
        "install_hint": None if available else "pip install 'gpulens[store]'",
        "reachable": found.reachable if found else None,
        "ok": ok,
        "detail": detail,
        "hint": hint,
        "runs_ended": len(records),
        "runs_synced": synced,
        "runs_unsynced": len(records) - synced,
    }


def import_mlflow():
    # MLflow 3.2+ sends usage telemetry from every process that logs a run: seconds at a run's
    # end (4.5 s on a Ctrl-C here) and a call home a cluster may forbid. Off unless set.
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # read at MLflow's import
    try:
        import mlflow
    except ImportError:
        raise MissingExtraError("mlflow", "store") from None
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    return mlflow


# ----------------------------------------------------------------------------- sidecar
def _read_sidecar(record: RunRecord) -> dict[str, Any]:
    try:
        doc = json.loads((record.dir / SIDECAR_FILE).read_text())
    except (OSError, ValueError):
        return {"synced": []}
    if not isinstance(doc.get("synced"), list):
        doc["synced"] = []
    return doc


def sync_entries(record: RunRecord) -> list[dict[str, Any]]:
    """Where this record was logged: ``tracking_uri``, ``experiment``, ``mlflow_run_id``..."""
    return _read_sidecar(record)["synced"]


def synced_run_id(record: RunRecord, tracking_uri: str, experiment: str) -> str | None:
    """The MLflow run id this record was logged as under ``tracking_uri``/``experiment``."""
    for entry in _read_sidecar(record)["synced"]:
        if entry.get("tracking_uri") == tracking_uri and entry.get("experiment") == experiment:
            return entry.get("mlflow_run_id")
    return None


def _write_sidecar(record: RunRecord, entry: dict[str, Any], key: str = "synced") -> None:
    doc = _read_sidecar(record)
    doc[key] = [
        e
        for e in doc.get(key) or []
        if (e.get("tracking_uri"), e.get("experiment"))
        != (entry["tracking_uri"], entry["experiment"])
    ] + [entry]
    atomic_write_json(record.dir / SIDECAR_FILE, doc)


def live_entry(record: RunRecord, tracking_uri: str, experiment: str) -> dict[str, Any] | None:
    """How far live logging got with this record (:mod:`gpulens.store.live`), or None."""
    for entry in _read_sidecar(record).get("live") or []:
        if entry.get("tracking_uri") == tracking_uri and entry.get("experiment") == experiment:
            return entry
    return None


def _chunks(items: list, size: int) -> Iterable[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


# ----------------------------------------------------------------------------- logging
def _artifact_location(uri: str, experiment: str) -> str | None:
    """For a local SQLite store, artifacts next to the database (MLflow would use ./mlruns)."""
    if uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///") :])
        return (db.parent / "mlartifacts" / experiment).resolve().as_uri()
    return None


def ensure_experiment(client, uri: str, experiment: str) -> str:
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        try:
            return client.create_experiment(
                experiment, artifact_location=_artifact_location(uri, experiment)
            )
        except Exception as exc:  # another process created it first (a shared server)
            exp = client.get_experiment_by_name(experiment)
            if exp is None:
                raise
            log.debug("experiment %s was created meanwhile: %s", experiment, exc)
    if exp.lifecycle_stage == "deleted":
        client.restore_experiment(exp.experiment_id)
    return exp.experiment_id


def _existing_run(client, experiment_id: str, run_id: str):
    """The MLflow run already holding this record, deleting one left half-written."""
    safe = run_id.replace("'", "")
    runs = client.search_runs(
        [experiment_id], filter_string=f"tags.`gpulens.run_id` = '{safe}'", max_results=50
    )
    complete = None
    for run in runs:
        if run.data.tags.get("gpulens.synced") == "true" and complete is None:
            complete = run
        elif run.data.tags.get("gpulens.synced") != "true":
            log.info("deleting half-synced MLflow run %s of %s", run.info.run_id, run_id)
            client.delete_run(run.info.run_id)
    return complete


def log_record(
    record: RunRecord | Path | str,
    tracking_uri: str | None = None,
    experiment: str | None = None,
    check: bool = True,
) -> str:
    """Log one ended record as an MLflow run and return its MLflow run id.

    Idempotent: a record already synced to this URI and experiment returns its existing id.
    First a quick look at the store (``check``, at most 2 s): an unreachable one raises
    :class:`~gpulens.store.availability.StoreUnavailableError` at once instead of MLflow
    retrying for minutes. Writes to a local SQLite store hold a lock across processes (the
    first one creates the database) and are retried when SQLite reports it locked.
    """
    if not isinstance(record, RunRecord):
        record = read_record(Path(record))
    if record.status not in SYNCABLE_STATUSES:
        raise UsageError(
            f"run {record.run_id} is still {record.status}: sync it once it has ended "
            "(`gpulens runs sync`)"
        )
    mlflow = import_mlflow()
    uri = tracking_uri or default_tracking_uri()
    experiment = experiment or default_experiment()
    if check:
        require_reachable(uri)
    attempt = 0
    with mlflow_http_limits():
        while True:
            try:
                with store_lock(uri):
                    return _log_record_once(mlflow, record, uri, experiment)
            except Exception as exc:
                attempt += 1
                if not is_locked_error(exc) or attempt >= LOCKED_RETRIES:
                    raise
                log.info("MLflow store %s is locked; retrying %s", uri, record.run_id)
                time.sleep(0.5 * 2 ** (attempt - 1))


def default_experiment() -> str:
    """``$MLFLOW_EXPERIMENT_NAME``, else ``gpulens``."""
    return os.environ.get("MLFLOW_EXPERIMENT_NAME", "").strip() or DEFAULT_EXPERIMENT


def _user_run(client, uri: str, record: RunRecord):
    """The run ``$MLFLOW_RUN_ID`` names, else the run the script had active (the tracker
    notes it in the summary) when it is in this store; None when there is neither."""
    run_id = os.environ.get("MLFLOW_RUN_ID", "").strip()
    if not run_id:
        summary = record.meta.get("summary") or {}
        if summary.get(ACTIVE_RUN) and summary.get(ACTIVE_URI) == uri:
            try:
                return client.get_run(summary[ACTIVE_RUN])
            except Exception as exc:
                if is_locked_error(exc):
                    raise
                log.info("the script's MLflow run %s is not in %s", summary[ACTIVE_RUN], uri)
        return None
    try:
        return client.get_run(run_id)
    except Exception as exc:
        if is_locked_error(exc):
            raise
        raise UsageError(
            f"MLFLOW_RUN_ID={run_id} is not a run in the MLflow store {uri}: unset it, or set "
            "MLFLOW_TRACKING_URI to the store that holds it"
        ) from None


def _log_record_once(mlflow, record: RunRecord, uri: str, experiment: str) -> str:
    from mlflow.entities import Metric, Param, RunTag

    client = mlflow.MlflowClient(tracking_uri=uri)
    user_run = _user_run(client, uri, record)
    if user_run is not None:
        experiment = client.get_experiment(user_run.info.experiment_id).name
    known = synced_run_id(record, uri, experiment)
    if known:
        try:
            run = client.get_run(known)
            if run.info.lifecycle_stage != "deleted":
                return known
        except mlflow.exceptions.MlflowException as exc:
            if is_locked_error(exc):
                raise
            # the store was wiped or the run purged: log it again
    experiment_id = ensure_experiment(client, uri, experiment)
    live = live_entry(record, uri, experiment)
    existing = None
    if live is None or not _alive(client, live["mlflow_run_id"]):
        live, existing = None, _existing_run(client, experiment_id, record.run_id)
    if live is not None:  # live logging began this MLflow run: complete it
        mlflow_run_id, after = live["mlflow_run_id"], live.get("logged_until_unix_s")
        fill = _log_into if live.get("into_user_run") else _fill
        fill(client, mlflow_run_id, record, Metric, Param, RunTag, after)
    elif existing is not None:
        mlflow_run_id = existing.info.run_id
    elif user_run is not None and _may_log_into(user_run, record):
        mlflow_run_id = _log_into(client, user_run.info.run_id, record, Metric, Param, RunTag)
    else:
        parent = user_run.info.run_id if user_run is not None else None
        mlflow_run_id = _log_new(client, experiment_id, record, Metric, Param, RunTag, parent)
    _write_sidecar(
        record,
        {
            "tracking_uri": uri,
            "experiment": experiment,
            "experiment_id": experiment_id,
            "mlflow_run_id": mlflow_run_id,
            "synced_at": now_iso(),
        },
    )
    return mlflow_run_id


def _may_log_into(user_run, record: RunRecord) -> bool:
    """A plain run goes into the user's run unless that run holds a gpulens record already;
    an experiment's runs (stalls, colocate) become its children."""
    return not record.meta.get("role") and "gpulens.run_id" not in user_run.data.tags


def _alive(client, mlflow_run_id: str) -> bool:
    try:
        return client.get_run(mlflow_run_id).info.lifecycle_stage != "deleted"
    except Exception as exc:
        if is_locked_error(exc):
            raise
        return False


def _log_payload(client, mlflow_run_id: str, record: RunRecord, Metric, Param, RunTag,
                 prefix: str = "", end_ms: int | None = None,
                 series_after: float | None = None) -> None:  # fmt: skip
    """Params, tags and metrics of ``record`` to an MLflow run; ``prefix`` before the summary
    metrics and the params (not the series); only series points after ``series_after`` (what
    live logging has not sent)."""
    tags = record_tags(record)
    params = [Param(prefix + k, v) for k, v in record_params(record).items()]
    tag_list = [RunTag(k, v) for k, v in tags.items()]
    for batch in _chunks(params, MAX_PARAMS_TAGS_PER_BATCH):
        client.log_batch(mlflow_run_id, params=batch, synchronous=True)
    for batch in _chunks(tag_list, MAX_PARAMS_TAGS_PER_BATCH):
        client.log_batch(mlflow_run_id, tags=batch, synchronous=True)
    ts_ms = end_ms or 0
    metrics = [Metric(prefix + k, v, ts_ms, 0) for k, v in record_metrics(record).items()]
    points = series_metrics(record, after_unix_s=series_after)
    metrics += [Metric(k, v, t, s) for k, v, t, s in points]
    for batch in _chunks(metrics, MAX_METRICS_PER_BATCH):
        client.log_batch(mlflow_run_id, metrics=batch, synchronous=True)


def _log_into(client, mlflow_run_id: str, record: RunRecord, Metric, Param, RunTag,
              series_after: float | None = None) -> str:  # fmt: skip
    """The record into the user's run (left open: it is theirs to end)."""
    end_ms = iso_to_ms(record.meta.get("ended_at")) or iso_to_ms(record.meta.get("created_at"))
    _log_payload(client, mlflow_run_id, record, Metric, Param, RunTag, "gpulens.", end_ms,
                 series_after)  # fmt: skip
    client.log_artifacts(mlflow_run_id, str(record.dir), artifact_path=f"gpulens/{record.run_id}")
    client.set_tag(mlflow_run_id, "gpulens.synced", "true")
    return mlflow_run_id


def _log_new(
    client, experiment_id: str, record: RunRecord, Metric, Param, RunTag,
    parent_run_id: str | None = None,
) -> str:  # fmt: skip
    meta = record.meta
    start_ms = iso_to_ms(meta.get("created_at"))
    first_tags = {"gpulens.run_id": record.run_id}
    if parent_run_id:
        first_tags["mlflow.parentRunId"] = parent_run_id  # shown nested under it in the UI
    run = client.create_run(
        experiment_id, start_time=start_ms, tags=first_tags, run_name=meta.get("name")
    )
    return _fill(client, run.info.run_id, record, Metric, Param, RunTag)


def _fill(client, mlflow_run_id: str, record: RunRecord, Metric, Param, RunTag,
          series_after: float | None = None) -> str:  # fmt: skip
    """Everything of an ended record into a run of its own, which then ends."""
    meta = record.meta
    start_ms = iso_to_ms(meta.get("created_at"))
    end_ms = iso_to_ms(meta.get("ended_at")) or iso_to_ms(meta.get("heartbeat_at")) or start_ms
    _log_payload(client, mlflow_run_id, record, Metric, Param, RunTag, end_ms=end_ms,
                 series_after=series_after)  # fmt: skip
    client.log_artifacts(mlflow_run_id, str(record.dir), artifact_path=ARTIFACT_PATH)
    client.set_tag(mlflow_run_id, "gpulens.synced", "true")
    client.set_terminated(mlflow_run_id, status=_MLFLOW_STATUS[record.status], end_time=end_ms)
    return mlflow_run_id


def log_live(
    record: RunRecord, tracking_uri: str, experiment: str, until_unix_s: float | None,
    max_points: int,
) -> str:  # fmt: skip
    """Log a running record's series points up to ``until_unix_s`` (all, when None) that
    earlier calls have not, to its live MLflow run, made at the first call (see
    :mod:`gpulens.store.live`); returns that run's id."""
    mlflow = import_mlflow()
    from mlflow.entities import Metric

    with mlflow_http_limits(), store_lock(tracking_uri):
        client = mlflow.MlflowClient(tracking_uri=tracking_uri)  # see open_client
        user_run = _user_run(client, tracking_uri, record)
        if user_run is not None:
            experiment = client.get_experiment(user_run.info.experiment_id).name
        entry = live_entry(record, tracking_uri, experiment)
        if entry is None:
            entry = {"tracking_uri": tracking_uri, "experiment": experiment,
                     "logged_until_unix_s": None}  # fmt: skip
            if user_run is not None and _may_log_into(user_run, record):
                entry.update(mlflow_run_id=user_run.info.run_id, into_user_run=True)
            else:
                tags = {"gpulens.run_id": record.run_id, "gpulens.live": "true"}
                if user_run is not None:
                    tags["mlflow.parentRunId"] = user_run.info.run_id
                run = client.create_run(
                    ensure_experiment(client, tracking_uri, experiment),
                    start_time=iso_to_ms(record.meta.get("created_at")),
                    tags=tags, run_name=record.meta.get("name"),
                )  # fmt: skip
                entry.update(mlflow_run_id=run.info.run_id, into_user_run=False)
        after = entry["logged_until_unix_s"]
        points = series_metrics(record, max_points, after_unix_s=after, until_unix_s=until_unix_s)
        metrics = [Metric(k, v, t, s) for k, v, t, s in points]
        for batch in _chunks(metrics, MAX_METRICS_PER_BATCH):
            client.log_batch(entry["mlflow_run_id"], metrics=batch, synchronous=True)
        entry["logged_until_unix_s"] = time.time() if until_unix_s is None else until_unix_s
        _write_sidecar(record, entry, key="live")
    return entry["mlflow_run_id"]


def sync_all(
    home: Path | str | None = None,
    tracking_uri: str | None = None,
    experiment: str | None = None,
    on_record: Callable[[int, int, str], None] | None = None,
) -> list[tuple[str, str | Exception]]:
    """Log every ended record not yet synced to this URI and experiment.

    Returns ``(run_id, mlflow_run_id)`` per record logged, or ``(run_id, exception)`` where it
    failed; the others still get logged. ``on_record(i, total, run_id)`` reports progress.
    """
    home_path = Path(home) if home else None
    uri = tracking_uri or default_tracking_uri(home_path)
    experiment = experiment or default_experiment()
    todo = [
        r
        for r in list_records(runs_dir(home_path))
        if r.status in SYNCABLE_STATUSES and not synced_run_id(r, uri, experiment)
    ]
    if todo:
        import_mlflow()
        found = check_store(uri, REACHABILITY_TIMEOUT_S)  # once, quickly: not minutes per record
        if not found.ok:
            raise StoreUnavailableError(
                f"MLflow store {found.tracking_uri}: {found.detail}; nothing was synced: run "
                "`gpulens runs sync` again once it answers"
            )
    results: list[tuple[str, str | Exception]] = []
    for i, record in enumerate(todo):
        if on_record:
            on_record(i, len(todo), record.run_id)
        try:
            results.append((record.run_id, log_record(record, uri, experiment, check=False)))
        except MissingExtraError:
            raise
        except Exception as exc:  # one bad record must not stop the others
            log.warning("could not sync %s: %s", record.run_id, exc)
            results.append((record.run_id, exc))
    if on_record and todo:
        on_record(len(todo), len(todo), "")
    return results

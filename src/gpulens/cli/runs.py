"""``gpulens runs ...``: list, show, compare, export and sync stored runs.

Humans get rich tables on stdout; ``--json`` prints exactly one JSON document on stdout; progress
and logs go to stderr. Errors are gpulens exceptions, rendered by the main entry point. Names,
errors and every other value from a record are plain text in a table, never rich markup.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import typer
from rich import box
from rich.table import Table
from rich.text import Text

from gpulens.cli import common
from gpulens.cli.fitted_table import Column, fitted_table
from gpulens.errors import UsageError
from gpulens.paths import default_tracking_uri, runs_dir
from gpulens.record import schema
from gpulens.record.labels import shown_workload
from gpulens.record.reader import DamagedRecord, RunRecord, scan_records
from gpulens.store.queries import (
    EXPORT_FORMATS,
    REL_DIFF_COLUMN,
    compare_runs,
    damaged_facts,
    export_run,
    find_run,
    flatten,
    json_safe,
    run_facts,
    series_info,
)

runs_app = typer.Typer(
    help="List, inspect, compare, export and sync stored runs.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
)

_STATUS_STYLE = {
    "finished": "green",
    "running": "cyan",
    "failed": "red",
    "killed": "yellow",
    "damaged": "bold red",
}
_LIST_METRICS = ("throughput_samples_per_s", "wall_s")


def _emit_json(doc: Any) -> None:
    common.emit_json(json_safe(doc))


def _cell(value: Any, max_chars: int = 200) -> Text:
    """``_fmt`` cut to ``max_chars`` (a table is no place for an 800-character string), as
    plain text: a run name like ``[bold]x[/]`` shows as typed."""
    text = _fmt(value)
    return Text(text if len(text) <= max_chars else text[: max_chars - 1] + "…")


def _fmt(value: Any) -> str:
    """A value for a table cell: numbers with 4 significant digits, structures as JSON."""
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e15 else f"{value:.3e}"
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) for v in value):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"  # an interval: 4 digits each
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, default=str)
    return str(value)


def _rate(value: Any) -> Text:
    """Samples/s: whole numbers with separators from 100 up, never an exponent."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 100:
        return Text(f"{value:,.0f}")
    return _cell(value)


def _when(iso: str | None, seconds: bool = True) -> str:
    if not iso:
        return "-"
    try:
        fmt = "%Y-%m-%d %H:%M:%S" if seconds else "%m-%d %H:%M"
        return datetime.fromisoformat(iso).astimezone().strftime(fmt)
    except ValueError:
        return iso


def _workload(row: dict[str, Any]) -> Text:
    """A wrapped command's script (train.py), not its interpreter's path (--json: whole); a
    label folds in the table, so a few lines of it at most."""
    return _cell(shown_workload(row.get("kind"), row.get("workload")), 60)


def _status(status: str | None) -> Text:
    return Text(str(status), style=_STATUS_STYLE.get(status or "", "white"))


def _synced(record: RunRecord, uri: str) -> str | None:
    from gpulens.store.mlflow_sink import default_experiment, synced_run_id

    return synced_run_id(record, uri, default_experiment())


def _list_row(record: RunRecord | DamagedRecord, uri: str) -> dict[str, Any]:
    if isinstance(record, DamagedRecord):
        row = damaged_facts(record)
        row.update(dict.fromkeys(_LIST_METRICS), mlflow_run_id=None)
        return row
    row = run_facts(record)
    summary = record.meta.get("summary") or {}
    for key in _LIST_METRICS:
        row[key] = summary.get(key)
    row["mlflow_run_id"] = _synced(record, uri)
    return row


# ----------------------------------------------------------------------------- list
# In the order shown; the flexible ones share the width the others leave, workload first (see
# gpulens.cli.fitted_table); narrow terminals drop those in _LIST_DROP_ORDER first. A label
# folds rather than lose its end (`train_tracked.…` at 80 columns read as nothing).
_LIST_COLUMNS = [
    Column("run id", lambda r: Text(str(r["run_id"])), 22, {"style": "bold"}),
    Column("status", lambda r: _status(r["status"]), 8),
    Column("created", lambda r: Text(_when(r["created_at"], seconds=False)), 11),
    Column("dur s", lambda r: _cell(r["duration_s"]), 5, {"justify": "right"}),
    Column("samples/s", lambda r: _rate(r["throughput_samples_per_s"]), 9, {"justify": "right"}),
    Column("workload", _workload, 12, {"overflow": "fold"}, flexible=True, rank=0),
    Column("device", lambda r: _cell(r["device"]), 6, {"overflow": "ellipsis"}, flexible=True),
    Column(
        "name",
        lambda r: Text("" if r["name"] == r["run_id"] else _fmt(r["name"])),
        6,
        {"overflow": "ellipsis"},
        flexible=True,
    ),
    Column("mlflow", lambda r: "synced" if r["mlflow_run_id"] else "", 6),
]
_LIST_DROP_ORDER = ("mlflow", "name", "dur s", "device", "created")
# `runs list --store`: at 80 columns the run id was cut to "202…" and status fell off the table
_STORE_COLUMNS = [
    Column("run id", lambda r: _cell(r.get("run_id")), 22, {"style": "bold"}),
    Column("status", lambda r: _status(r.get("status")), 8),
    Column("name", lambda r: _cell(r.get("name")), 6, {"overflow": "ellipsis"}, flexible=True),
    Column("workload", _workload, 12, {"overflow": "fold"}, flexible=True, rank=0),
    Column("device", lambda r: _cell(r.get("device")), 6, {"overflow": "ellipsis"}, flexible=True),
    Column("mlflow run id", lambda r: _cell(r.get("mlflow_run_id")), 32),
]
_STORE_DROP_ORDER = ("mlflow run id", "device", "name")


@runs_app.command("list", help="Stored runs, newest first.")
def list_runs(
    limit: int = typer.Option(20, "--limit", "-n", help="Show at most N runs (0: all)."),
    status: str = typer.Option(None, "--status", help="Only runs with this status."),
    kind: str = typer.Option(None, "--kind", help="Only runs of this kind (train, command...)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
    from_store: bool = typer.Option(
        False,
        "--store",
        help="List the runs in the MLflow store (MLFLOW_TRACKING_URI: a team's tracking "
        "server) instead of this machine's records.",
    ),
) -> None:
    statuses = (*schema.STATUSES, "damaged")
    if status and status not in statuses:
        raise UsageError(f"--status {status!r}: choose one of {', '.join(statuses)}")
    if from_store:
        _list_store_runs(limit, status, kind, json_out)
        return
    readable, damaged = scan_records(runs_dir())
    records: list[RunRecord | DamagedRecord] = [*reversed(readable), *reversed(damaged)]
    stored = len(records)
    if status:
        records = [r for r in records if r.status == status]
    if kind:
        records = [r for r in records if isinstance(r, RunRecord) and r.meta.get("kind") == kind]
    total = len(records)
    if limit and limit > 0:
        records = records[:limit]
    uri = default_tracking_uri()
    rows = [_list_row(r, uri) for r in records]
    if json_out:
        _emit_json(
            {"runs": rows, "total": total, "damaged": len(damaged), "runs_dir": str(runs_dir())}
        )
        return
    if not rows:
        text = f"no runs in {runs_dir()}: start one with `gpulens run`"
        if stored:  # the filters left none: not an empty store
            asked = " and ".join(f"{k} {v}" for k, v in (("status", status), ("kind", kind)) if v)
            text = f"none of the {stored} runs in {runs_dir()} has {asked}"
        common.out.print(Text(text, style="dim"), soft_wrap=True)
        return
    title = f"runs ({len(rows)} of {total}, newest first)"
    common.out.print(fitted_table(title, rows, _LIST_COLUMNS, common.out.width, _LIST_DROP_ORDER))
    for bad in damaged:
        common.err.print(Text(bad.message(), style="red"), soft_wrap=True)


def _list_store_runs(limit: int, status: str | None, kind: str | None, json_out: bool) -> None:
    from gpulens.store.team import MAX_STORE_RUNS, store_runs

    uri = default_tracking_uri()
    # MLflow counts nothing: with a filter every run is read and filtered here; without, one
    # run more than shown tells whether the store holds more than the page
    fetch = 0 if status or kind or not limit or limit <= 0 else limit + 1
    rows = store_runs(uri, limit=fetch)
    complete = len(rows) < (fetch or MAX_STORE_RUNS)
    if status:
        rows = [r for r in rows if r["status"] == status]
    if kind:
        rows = [r for r in rows if r["kind"] == kind]
    total = len(rows) if complete else None  # null: more runs than were read, count unknown
    rows = rows[:limit] if limit and limit > 0 else rows
    if json_out:
        _emit_json({"runs": rows, "total": total, "tracking_uri": uri})
        return
    shown = (
        f"{len(rows)} of {total}, newest first"
        if total is not None
        else f"the newest {len(rows)}; more in the store"
    )
    title = f"runs in {uri} ({shown})"
    common.out.print(fitted_table(title, rows, _STORE_COLUMNS, common.out.width, _STORE_DROP_ORDER))


# ----------------------------------------------------------------------------- show
def _kv_table(title: str, items: dict[str, Any], *extra: tuple[str, dict[str, Any]]) -> Table:
    table = Table(title=title, title_justify="left", show_header=bool(extra))
    table.add_column("field", style="bold")
    table.add_column(extra[0][0] if extra else "value", overflow="fold")
    for name, _ in extra[1:]:
        table.add_column(name, overflow="fold")
    keys = list(dict.fromkeys([*items, *(k for _, d in extra[1:] for k in d)]))
    for key in keys:
        row = [_cell(items.get(key)), *(_cell(d.get(key)) for _, d in extra[1:])]
        table.add_row(Text(str(key)), *row)
    return table


@runs_app.command("show", help="Everything about one run (id, unique prefix or 'latest').")
def show(
    run: str = typer.Argument(..., help="Run id, unique prefix, name or 'latest'."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
) -> None:
    from gpulens.store.mlflow_sink import sync_entries

    record = find_run(run)
    meta = record.meta
    facts = run_facts(record)
    series = series_info(record)
    mlflow = sync_entries(record)
    if json_out:
        _emit_json(
            {
                **meta,
                "duration_s": facts["duration_s"],
                "workload": facts["workload"],
                "device": facts["device"],
                "record_dir": str(record.dir),
                "series": series,
                "mlflow": mlflow,
            }
        )
        return
    head = {k: facts[k] for k in ("run_id", "name", "kind", "workload", "device", "record_dir")}
    head.update(
        status=_status(record.status),
        created=_when(meta.get("created_at")),
        ended=_when(meta.get("ended_at")),
        duration_s=facts["duration_s"],
    )
    if meta.get("error"):
        head["error"] = meta["error"]
    table = Table(show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for key, value in head.items():
        table.add_row(key, value if key == "status" else _cell(value, 10_000))
    common.out.print(table)
    eff = flatten(meta.get("effective_config") or {}, keep_none=True)
    req = flatten(meta.get("requested_config") or {}, keep_none=True)
    if eff or req:
        common.out.print(_kv_table("config", eff, ("effective", eff), ("requested", req)))
    env = flatten(meta.get("environment") or {})
    if env:
        common.out.print(_kv_table("environment", env))
    summary = flatten(meta.get("summary") or {})
    if summary:
        common.out.print(_kv_table("summary", summary))
    unsupported = flatten(meta.get("unsupported") or {})
    if unsupported:
        common.out.print(_kv_table("not measured (and why)", unsupported))
    st = Table(title="series", title_justify="left")
    for col in ("name", "rows", "format", "columns"):
        st.add_column(col, overflow="fold")
    for s in series:
        columns = Text(", ".join(s["columns"]))
        if s.get("damaged"):
            columns = Text("damaged: see below", style="red")
        st.add_row(Text(s["name"]), _cell(s["rows"]), s["format"], columns)
    common.out.print(st if series else Text("no series recorded", style="dim"))
    for s in series:
        if s.get("damaged"):
            common.err.print(Text.assemble(("warning: ", "yellow"), s["damaged"]), soft_wrap=True)
    for entry in mlflow:
        common.out.print(
            Text(
                f"mlflow: run {entry.get('mlflow_run_id')} in experiment "
                f"'{entry.get('experiment')}' at {entry.get('tracking_uri')}",
                style="dim",
            ),
            soft_wrap=True,
        )


# ----------------------------------------------------------------------------- compare
def _pct(value: Any) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return ""
    return f"{value:+.1f}%"


def _middle_cut(text: str, width: int) -> str:
    """``text`` in ``width`` characters, its middle replaced by an ellipsis: the start and the
    end of a field name (``paired_fetch.…_cached``) both tell."""
    if len(text) <= width:
        return text
    head = (width - 1) // 2
    return text[:head] + "…" + text[len(text) - (width - 1 - head) :]


@runs_app.command("compare", help="Runs side by side; with two runs, the relative difference.")
def compare(
    runs: list[str] = typer.Argument(..., help="Two or more run ids (or prefixes, or 'latest')."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
) -> None:
    if len(runs) < 2:
        raise UsageError("give at least two runs to compare: see `gpulens runs list`")
    records = [find_run(r) for r in runs]
    df = compare_runs(records)
    run_cols = [c for c in df.columns if c != REL_DIFF_COLUMN]
    if len(kinds := {str(r.meta.get("kind")): 0 for r in records}) > 1:  # train vs colocate
        common.warn("note: ", f"runs of different kinds ({', '.join(kinds)}): shared fields only")
    if json_out:
        rows = []
        for field, row in df.iterrows():
            item: dict[str, Any] = {"field": field, "values": {c: row[c] for c in run_cols}}
            if REL_DIFF_COLUMN in df.columns:
                item[REL_DIFF_COLUMN] = row[REL_DIFF_COLUMN]
            rows.append(item)
        _emit_json({"run_ids": run_cols, "rows": rows})
        return
    # compact, so that two or three runs read in 80 columns: a field name stays on one line
    # (as wide as the longest while each run keeps 10 columns; a longer one loses its middle),
    # the values fold, each run's column wide enough for a number or a date
    table = Table(title="compare", title_justify="left", box=box.SIMPLE_HEAD,
                  collapse_padding=True, pad_edge=False)  # fmt: skip
    rel = REL_DIFF_COLUMN in df.columns
    room = common.out.width - 2 * (len(run_cols) + 2 + rel) - 10 * len(run_cols) - 8 * rel
    key_width = max(12, min(max((len(str(f)) for f in df.index), default=5), room))
    table.add_column("field", style="bold", no_wrap=True, min_width=key_width)
    names = [r.meta.get("name") for r in records]
    for col, name in zip(run_cols, names, strict=True):
        header = col if not name or name == col or names.count(name) > 1 else f"{name}\n{col}"
        table.add_column(Text(header), justify="right", overflow="fold", min_width=10, max_width=16)
    if rel:
        table.add_column("vs first", justify="right", no_wrap=True)
    for field, row in df.iterrows():
        if field == "created_at":
            cells = [Text(_when(row[c])) for c in run_cols]
        else:
            cells = [_cell(row[c], 40) for c in run_cols]
        if REL_DIFF_COLUMN in df.columns:
            cells.append(_pct(row[REL_DIFF_COLUMN]))
        table.add_row(Text(_middle_cut(str(field), key_width)), *cells)
    common.out.print(table)


# ----------------------------------------------------------------------------- export
@runs_app.command("export", help="Write a run elsewhere: a copy, CSV or Parquet files, or JSON.")
def export(
    run: str = typer.Argument(..., help="Run id, unique prefix, name or 'latest'."),
    out_path: Path = typer.Option(..., "--out", "-o", help="Where to write (must not exist)."),
    fmt: str = typer.Option("dir", "--format", "-f", help=f"One of: {', '.join(EXPORT_FORMATS)}."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
) -> None:
    record = find_run(run)
    path = export_run(record, out_path, fmt)
    if json_out:
        _emit_json({"run_id": record.run_id, "format": fmt, "path": str(path)})
    else:
        common.out.print(Text(f"exported {record.run_id} ({fmt}) to {path}"), soft_wrap=True)


# ----------------------------------------------------------------------------- sync
@runs_app.command("sync", help="Log ended runs not yet in MLflow (idempotent).")
def sync(
    uri: str = typer.Option(
        None, "--uri", help="MLflow tracking URI [$MLFLOW_TRACKING_URI or sqlite in GPULENS_HOME]."
    ),
    experiment: str = typer.Option(
        None, "--experiment", help="MLflow experiment [$MLFLOW_EXPERIMENT_NAME or gpulens]."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
) -> None:
    from gpulens.store.mlflow_sink import sync_all

    tracking_uri = uri or default_tracking_uri()
    quiet = json_out and not common.err.is_terminal

    def progress(i: int, total: int, run_id: str) -> None:
        if run_id and not quiet:
            common.err.print(Text(f"syncing {i + 1}/{total}: {run_id}", style="dim"))

    from gpulens.store.mlflow_sink import default_experiment

    experiment = experiment or default_experiment()
    results = sync_all(tracking_uri=tracking_uri, experiment=experiment, on_record=progress)
    synced = [{"run_id": rid, "mlflow_run_id": res} for rid, res in results if isinstance(res, str)]
    failed = [
        {"run_id": rid, "error": str(res).strip() or type(res).__name__}
        for rid, res in results
        if not isinstance(res, str)
    ]
    if json_out:
        _emit_json(
            {
                "tracking_uri": tracking_uri,
                "experiment": experiment,
                "synced": synced,
                "failed": failed,
            }
        )
    elif not results:
        common.out.print(
            Text(f"nothing to sync: every ended run is already in {tracking_uri}"), soft_wrap=True
        )
    else:
        for item in synced:
            common.out.print(Text(f"{item['run_id']} -> mlflow run {item['mlflow_run_id']}"))
        for item in failed:
            line = Text.assemble((f"{item['run_id']} failed: ", "red"), item["error"])
            common.out.print(line, soft_wrap=True)
        common.out.print(
            Text(f"{len(synced)} synced, {len(failed)} failed, store: {tracking_uri}", style="dim"),
            soft_wrap=True,
        )
    if failed:
        # exit 1: a script must notice that some runs are not in the store
        common.err.print(
            Text(
                f"error: {len(failed)} of {len(results)} runs could not be synced to "
                f"{tracking_uri}; fix the store and run `gpulens runs sync` again"
            ),
            soft_wrap=True,
        )
        raise typer.Exit(1)


# ----------------------------------------------------------------------------- join
from gpulens.cli.nodes import register_join  # noqa: E402  (its own module: multi-node runs)

register_join(runs_app)

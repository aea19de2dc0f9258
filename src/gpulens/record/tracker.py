"""The tracking API's files in a run record, as the command wrapper and the tracker share them.

A script that uses :func:`gpulens.track` under ``gpulens run -- ...`` finds the run directory in
``$GPULENS_RUN_DIR`` and leaves its summary in ``tracker.json`` there. Under torchrun each rank
keeps ``tracker-rank<R>.json`` and appends its steps to ``series/steps-rank<R>.arrows``; once the
command has ended, :func:`read_tracker_summary` combines them (see
:mod:`gpulens.workloads.tracking_ranks` for the layout): throughput is the sum of the ranks'
samples/s, step time and phases are the slowest rank's, and ``stragglers`` names every rank that
spends more than ``straggler_threshold_pct`` of the median rank's step time longer per step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import statistics
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gpulens.record import schema
from gpulens.record.reader import read_series_table
from gpulens.record.schema import STEPS_SCHEMA
from gpulens.record.writer import atomic_write_json

log = logging.getLogger(__name__)

RUN_DIR_ENV = "GPULENS_RUN_DIR"  # where a command run under `gpulens run` finds its record
TRACKER_FILE = "tracker.json"  # the tracker's summary (combined over ranks under torchrun)
RANK_STEPS_SCHEMA = STEPS_SCHEMA.append(pa.field("rank", pa.int32()))
STEPS_SERIES = "steps"
RANK_SERIES_PREFIX = "steps-rank"
RANK_FILE_PREFIX = "tracker-rank"
COMBINED_FILE = TRACKER_FILE
STRAGGLER_PCT = 10.0

RUNNING, FINISHED, FAILED, KILLED = "running", "finished", "failed", "killed"


def rank_series_name(rank: int) -> str:
    return f"{RANK_SERIES_PREFIX}{rank}"


def rank_file(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / f"{RANK_FILE_PREFIX}{rank}.json"


def write_rank_file(run_dir: Path, rank: int, doc: dict[str, Any]) -> None:
    atomic_write_json(rank_file(run_dir, rank), doc)


def read_rank_files(run_dir: Path) -> dict[int, dict[str, Any]]:
    """Each rank's ``tracker-rank<R>.json`` by rank; unreadable files are skipped."""
    docs: dict[int, dict[str, Any]] = {}
    for path in Path(run_dir).glob(f"{RANK_FILE_PREFIX}*.json"):
        suffix = path.stem[len(RANK_FILE_PREFIX) :]
        if not suffix.isdigit():
            continue
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict):
            docs[int(suffix)] = doc
    return docs


def run_status(docs: Mapping[int, dict[str, Any]]) -> tuple[str, str | None]:
    """The run's status: ``finished``, or that of the first rank that failed or was killed,
    with its error as ``rank R: ...``."""
    for rank in sorted(docs):
        doc = docs[rank]
        if doc.get("status") in (FAILED, KILLED):
            return doc["status"], f"rank {rank}: {doc.get('error') or doc['status']}"
    return FINISHED, None


# ----------------------------------------------------------------------------- combining
def _num(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if ok else None


def find_stragglers(docs: Mapping[int, dict[str, Any]], pct: float) -> tuple[float | None, list]:
    """``(median step time, stragglers)``. A straggler spends more than ``pct`` % of the
    median rank's step time longer per step than the median rank, in its whole step
    (``phase: step``) or waiting for data (``phase: data_wait``; under synchronous data
    parallelism every rank's step time is the slowest one's, and the wait shows who it is)."""
    step = {r: _num((d.get("phases_s") or {}).get("step")) for r, d in docs.items()}
    step = {r: v for r, v in step.items() if v is not None and v > 0}
    if len(step) < 2:
        return (next(iter(step.values())) if step else None), []
    median_step = statistics.median(step.values())
    found = []
    for phase, values in (
        ("step", step),
        ("data_wait", {r: _num((docs[r].get("phases_s") or {}).get("data_wait")) for r in step}),
    ):
        values = {r: v for r, v in values.items() if v is not None}
        if len(values) < 2:
            continue
        median = statistics.median(values.values())
        for r, v in values.items():
            above_pct = 100.0 * (v - median) / median_step
            if above_pct > pct:
                found.append(
                    {
                        "rank": r,
                        "phase": phase,
                        "mean_s": v,
                        "median_s": median,
                        "above_median_pct": above_pct,
                    }
                )
    found.sort(key=lambda s: -s["above_median_pct"])
    return median_step, found


# What :func:`combine` says of the ranks, copied into a run's summary as it is.
RANK_FIELDS = (
    "world_size",
    "ranks_reported",
    "slowest_rank",
    "step_time_median_s",
    "straggler_threshold_pct",
    "stragglers",
    "ranks",
)


def combine(docs: Mapping[int, dict[str, Any]], world_size: int, pct: float) -> dict[str, Any]:
    """One summary for all ranks (see the module docstring); ``ranks`` keeps each rank's."""
    ranks = sorted(docs)
    step = {r: _num((docs[r].get("phases_s") or {}).get("step")) for r in ranks}
    timed = {r: v for r, v in step.items() if v is not None}
    slowest = max(timed, key=lambda r: timed[r]) if timed else ranks[0]
    base = docs[slowest]
    rates = {r: _num(docs[r].get("throughput_samples_per_s")) for r in ranks}
    rates = {r: v for r, v in rates.items() if v}
    total = sum(rates.values()) if rates else None
    ci_pct = None
    pcts = {r: _num(docs[r].get("throughput_ci95_pct")) for r in rates}
    if total and all(v is not None for v in pcts.values()):
        # independent ranks: half-widths add in quadrature
        half = sum((rates[r] * pcts[r] / 100.0) ** 2 for r in rates) ** 0.5
        ci_pct = 100.0 * half / total
    median_step, stragglers = find_stragglers(docs, pct)
    per_rank = []
    for r in ranks:
        d = docs[r]
        per_rank.append(
            {
                "rank": r,
                "local_rank": d.get("local_rank"),
                "node_rank": d.get("node_rank"),  # multi-node built-in runs (record.join)
                "hostname": d.get("hostname"),
                "status": d.get("status"),
                "error": d.get("error"),
                "measured_steps": d.get("measured_steps"),
                "steps_total": d.get("steps_total"),
                "samples_total": d.get("samples_total"),
                "throughput_samples_per_s": d.get("throughput_samples_per_s"),
                "throughput_ci95_pct": d.get("throughput_ci95_pct"),
                "phases_s": d.get("phases_s"),
            }
        )
    return {
        "measured_steps": base.get("measured_steps"),
        "steps_total": base.get("steps_total"),
        "samples_total": sum(int(docs[r].get("samples_total") or 0) for r in ranks),
        "throughput_samples_per_s": total,
        "throughput_ci95_pct": ci_pct,
        "phases_s": base.get("phases_s"),
        "loader": (docs.get(0) or base).get("loader"),
        "world_size": world_size,
        "ranks_reported": len(ranks),
        "ranks_unfinished": [r for r in ranks if docs[r].get("status") == RUNNING],
        "slowest_rank": slowest,
        "step_time_median_s": median_step,
        "straggler_threshold_pct": pct,
        "stragglers": stragglers,
        "ranks": per_rank,
    }


def _rank_bases(series_dir: Path) -> dict[int, Path]:
    bases: dict[int, Path] = {}
    if not series_dir.is_dir():
        return bases
    for path in series_dir.iterdir():
        if path.suffix not in (schema.PARQUET_SUFFIX, schema.STREAM_SUFFIX):
            continue
        suffix = path.stem[len(RANK_SERIES_PREFIX) :]
        if path.stem.startswith(RANK_SERIES_PREFIX) and suffix.isdigit():
            bases[int(suffix)] = series_dir / path.stem
    return bases


def _remove(base: Path) -> None:
    for suffix in (schema.PARQUET_SUFFIX, schema.STREAM_SUFFIX):
        with contextlib.suppress(FileNotFoundError):
            base.with_suffix(suffix).unlink()


def merge_rank_series(run_dir: Path, ranks: Iterable[int] | None = None) -> Path | None:
    """Merge the ranks' ``steps-rank<R>`` files (all, or only ``ranks``) into
    ``series/steps.parquet`` with a ``rank`` column, adding to one merged before; the merged
    per-rank files are removed. Returns the merged file, or None when there was nothing."""
    series_dir = Path(run_dir) / schema.SERIES_DIR
    bases = _rank_bases(series_dir)
    if ranks is not None:
        wanted = set(ranks)
        bases = {r: b for r, b in bases.items() if r in wanted}
    if not bases:
        return None
    target = series_dir / f"{STEPS_SERIES}{schema.PARQUET_SUFFIX}"
    tables, done = [], set()
    if target.exists():
        existing = pq.read_table(target)
        if "rank" not in existing.column_names:
            log.warning("gpulens: %s has no rank column; the ranks' steps stay apart", target)
            return None
        tables.append(existing.cast(RANK_STEPS_SCHEMA))
        done = {r for r in existing.column("rank").to_pylist() if r is not None}
    merged = []
    for r, base in sorted(bases.items()):
        if r in done:
            merged.append(base)  # merged before; the file was left behind
            continue
        try:
            table = read_series_table(base)
        except Exception as exc:  # one damaged rank file must not lose the others
            log.warning("gpulens: rank %d's steps cannot be read (%s); left as they are", r, exc)
            continue
        if table.num_columns:
            tables.append(table.select(RANK_STEPS_SCHEMA.names).cast(RANK_STEPS_SCHEMA))
        merged.append(base)
    if not tables:
        tables.append(RANK_STEPS_SCHEMA.empty_table())
    table = pa.concat_tables(tables)
    if table.num_rows:
        order = pc.sort_indices(table, sort_keys=[("rank", "ascending"), ("step", "ascending")])
        table = table.take(order)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, target)
    for base in merged:
        _remove(base)
    return target


def finalize_ranks(
    run_dir: Path, docs: Mapping[int, dict[str, Any]], ranks_to_merge: Iterable[int] | None = None
) -> dict[str, Any]:
    """Combine the ranks' summaries into ``tracker.json`` and merge their steps (all, or only
    ``ranks_to_merge``); returns the combined summary."""
    first = docs[min(docs)]
    world = max(int(d.get("world_size") or 0) for d in docs.values()) or len(docs)
    pct = _num(first.get("straggler_threshold_pct"))
    combined = combine(docs, world, STRAGGLER_PCT if pct is None else pct)
    try:
        merge_rank_series(run_dir, ranks_to_merge)
    except Exception as exc:  # the per-rank files stay readable on their own
        log.warning("gpulens: could not merge the ranks' steps in %s: %s", run_dir, exc)
    atomic_write_json(Path(run_dir) / COMBINED_FILE, combined)
    for s in combined["stragglers"]:
        log.warning(
            "gpulens: rank %d is a straggler: its mean %s is %.3g s, %.0f%% of the median "
            "step time above the median rank",
            s["rank"],
            "step time" if s["phase"] == "step" else "wait for data",
            s["mean_s"],
            s["above_median_pct"],
        )
    return combined


def read_tracker_summary(run_dir: Path) -> dict[str, Any] | None:
    """The tracker's summary of a run, or None where the script did not use the tracker.

    Under torchrun (``tracker-rank<R>.json`` files) the ranks are combined first: call it once
    the command has ended (as ``gpulens run`` does); it merges the ranks' steps into
    ``series/steps.parquet`` and writes the combined ``tracker.json``. Never raises.
    """
    run_dir = Path(run_dir)
    try:
        docs = read_rank_files(run_dir)
        if docs:
            return finalize_ranks(run_dir, docs)
    except Exception as exc:
        log.warning("gpulens: could not combine the ranks' summaries in %s: %s", run_dir, exc)
    path = run_dir / TRACKER_FILE
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None

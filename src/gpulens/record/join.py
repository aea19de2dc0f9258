"""One run from the record shards of a multi-node run.

Each node of a run over several nodes writes its own record, ``<run_id>.node<R>`` under its own
``GPULENS_HOME/runs``, with a ``shard`` marker in run.json (``run_id``: the run it belongs to,
``node_rank``, ``nnodes``, ``hostname``, ``ranks``: its global ranks) and one step series per
rank, ``series/steps-rank<R>``. :func:`join_shards` makes ``<run_id>`` from all of them: the
ranks' steps merged into ``series/steps.parquet`` with a ``rank`` column (as the tracking API
does under torchrun), node 0's GPU and host series as ``gpu``/``host`` and the other nodes' as
``gpu-node<R>``/``host-node<R>``, and a summary over every rank: throughput summed over the
nodes, each rank's figures with its node and hostname, and the stragglers of
:func:`gpulens.record.tracker.find_stragglers`.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import statistics
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import psutil

from gpulens.errors import UsageError
from gpulens.record import schema
from gpulens.record.reader import RunRecord, read_record
from gpulens.record.tracker import (
    RANK_FIELDS,
    RANK_STEPS_SCHEMA,
    STRAGGLER_PCT,
    combine,
    merge_rank_series,
    rank_series_name,
)
from gpulens.record.writer import atomic_write_json, now_iso
from gpulens.stats import rate_ci95

log = logging.getLogger(__name__)

SHARD_KEY = schema.SHARD_KEY  # run.json of a node's shard
JOINED_KEY = schema.JOINED_KEY  # run.json of the joined run
NODE_SUFFIX = ".node"
MONITOR_SERIES = ("gpu", "host")


def shard_run_id(run_id: str, node_rank: int) -> str:
    return f"{run_id}{NODE_SUFFIX}{node_rank}"


def _mean(values: Iterable[Any]) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return statistics.fmean(vals) if vals else None


def rank_doc(
    rank: int,
    local_rank: int,
    node_rank: int,
    hostname: str,
    rows: list[dict[str, Any]],
    batch_size: int,
    wall_s: float | None,
) -> dict[str, Any]:
    """One rank's figures over its measured steps, as the tracker's per-rank files hold them
    (the input of :func:`gpulens.record.tracker.combine`)."""
    measured = [r for r in rows if not r.get("warmup")]
    rate = batch_size * len(measured) / wall_s if wall_s and measured else None
    return {
        "rank": rank,
        "local_rank": local_rank,
        "node_rank": node_rank,
        "hostname": hostname,
        "status": schema.STATUS_FINISHED,
        "measured_steps": len(measured),
        "steps_total": len(rows),
        "samples_total": batch_size * len(measured),
        "throughput_samples_per_s": rate,
        "throughput_ci95_pct": None,
        "phases_s": {
            "data_wait": _mean(r.get("data_wait_s") for r in measured),
            "h2d": _mean(r.get("h2d_s") for r in measured),
            "compute": _mean(r.get("compute_s") for r in measured),
            "step": _mean(r.get("step_time_s") for r in measured),
        },
    }


def write_rank_steps(writer, rank: int, rows: list[dict[str, Any]]) -> None:
    """A rank's steps as ``series/steps-rank<R>`` of a shard (with its global rank)."""
    series = writer.series(rank_series_name(rank), RANK_STEPS_SCHEMA)
    for row in rows:
        series.append({**row, "rank": rank})
    series.close()


# ----------------------------------------------------------------------------- joining
def _shards(records: list[RunRecord]) -> tuple[str, int, dict[int, RunRecord]]:
    by_node: dict[int, RunRecord] = {}
    run_ids = set()
    nnodes = 0
    for rec in records:
        marker = rec.meta.get(SHARD_KEY)
        if not isinstance(marker, Mapping):
            raise UsageError(
                f"{rec.dir} is not a node's shard of a multi-node run (no '{SHARD_KEY}' in its "
                "run.json): give the record directories that each node's gpulens run printed"
            )
        node = int(marker["node_rank"])
        if node in by_node:
            raise UsageError(f"node {node}'s shard is given twice ({by_node[node].dir}, {rec.dir})")
        by_node[node] = rec
        run_ids.add(str(marker["run_id"]))
        nnodes = max(nnodes, int(marker["nnodes"]))
    if len(run_ids) != 1:
        raise UsageError(
            f"the shards belong to different runs ({', '.join(sorted(run_ids))}): join the "
            "shards of one run at a time"
        )
    missing = [n for n in range(nnodes) if n not in by_node]
    if missing:
        raise UsageError(
            f"node {', '.join(map(str, missing))}'s shard is missing ({len(by_node)} of {nnodes} "
            "given): copy it from that node's GPULENS_HOME/runs and give it too"
        )
    for node, rec in sorted(by_node.items()):
        if rec.status == schema.STATUS_RUNNING:
            raise UsageError(f"node {node}'s shard {rec.dir} is still running: join it once ended")
    return run_ids.pop(), nnodes, by_node


def _copy_series(shard: RunRecord, node: int, series_dir: Path) -> None:
    src = shard.dir / schema.SERIES_DIR
    if not src.is_dir():
        return
    for path in src.iterdir():
        stem, suffix = path.stem, path.suffix
        if suffix not in (schema.PARQUET_SUFFIX, schema.STREAM_SUFFIX):
            continue
        if stem.startswith(rank_series_name(0)[:-1]):
            shutil.copy2(path, series_dir / path.name)  # global rank in the name: no clash
        elif stem in MONITOR_SERIES:
            name = stem if node == 0 else f"{stem}{NODE_SUFFIX.replace('.', '-')}{node}"
            shutil.copy2(path, series_dir / f"{name}{suffix}")


def _ci_pct(rates: list[float], pcts: list[float | None]) -> float | None:
    total = sum(rates)
    if not total or any(p is None for p in pcts):
        return None
    half = sum((r * p / 100.0) ** 2 for r, p in zip(rates, pcts, strict=True)) ** 0.5
    return 100.0 * half / total


def joined_summary(by_node: Mapping[int, RunRecord]) -> dict[str, Any]:
    """The joined run's summary: node 0's, with every figure that spans nodes recomputed."""
    first = by_node[0].meta.get("summary") or {}
    docs: dict[int, dict[str, Any]] = {}
    for rec in by_node.values():
        for doc in (rec.meta.get("summary") or {}).get("ranks") or []:
            docs[int(doc["rank"])] = doc
    world = sum(len(rec.meta[SHARD_KEY].get("ranks") or []) for rec in by_node.values())
    combined = combine(docs, world or len(docs), STRAGGLER_PCT) if docs else {}
    shard_sums = [(rec.meta.get("summary") or {}) for _, rec in sorted(by_node.items())]
    rates = [s.get("throughput_samples_per_s") for s in shard_sums]
    total = sum(rates) if rates and all(rates) else combined.get("throughput_samples_per_s")
    ci_pct = _ci_pct(rates, [s.get("throughput_ci95_pct") for s in shard_sums]) if total else None
    backend = (by_node[0].meta.get("effective_config") or {}).get("backend")
    batch = first.get("batch_size") or 0
    nodes = []
    for node, rec in sorted(by_node.items()):
        s = rec.meta.get("summary") or {}
        nodes.append({
            "node_rank": node, "hostname": rec.meta[SHARD_KEY].get("hostname"),
            "shard_run_id": rec.run_id, "status": rec.status, "ranks": rec.meta[SHARD_KEY]["ranks"],
            "throughput_samples_per_s": s.get("throughput_samples_per_s"),
            "gpu": s.get("gpu"), "host": s.get("host"),
        })  # fmt: skip
    return {
        **first,
        "device": f"{world}x {'cuda' if backend == 'nccl' else 'cpu'}",
        "gpus": sum(int(s.get("gpus") or 0) for s in shard_sums),
        "processes": world,
        "global_batch_size": batch * world,
        "measured_steps": min((s.get("measured_steps") or 0) for s in shard_sums),
        "throughput_samples_per_s": total,
        "throughput_ci95_pct": ci_pct,
        "throughput_ci95_samples_per_s": rate_ci95(total, ci_pct),  # [low, high] as every run
        "phases_s": combined.get("phases_s") or first.get("phases_s"),
        "nnodes": len(by_node),
        "nodes": nodes,
        **{k: combined.get(k) for k in RANK_FIELDS},
    }


def _status(by_node: Mapping[int, RunRecord]) -> tuple[str, str | None]:
    for node, rec in sorted(by_node.items()):
        if rec.status != schema.STATUS_FINISHED:
            return rec.status, f"node {node}: {rec.meta.get('error') or rec.status}"
    return schema.STATUS_FINISHED, None


def join_shards(shard_dirs: Iterable[Path | str], runs_root: Path) -> Path:
    """Write the joined run ``<run_id>`` under ``runs_root`` from every node's shard; returns its
    directory. A UsageError names a missing, repeated, foreign or still running shard."""
    records = [read_record(Path(d)) for d in shard_dirs]
    run_id, nnodes, by_node = _shards(records)
    runs_root = Path(runs_root)
    target = runs_root / run_id
    if target.exists():
        raise UsageError(
            f"run {run_id} is already joined in {runs_root}: see `gpulens runs show {run_id}` "
            f"(delete {target} to join it again)"
        )
    tmp = runs_root / f".{run_id}.joining-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    series_dir = tmp / schema.SERIES_DIR
    series_dir.mkdir(parents=True)
    try:
        for node, rec in sorted(by_node.items()):
            _copy_series(rec, node, series_dir)
        merge_rank_series(tmp)
        first = by_node[0].meta
        status, error = _status(by_node)
        proc = psutil.Process()
        unsupported: dict[str, Any] = {}
        for rec in by_node.values():
            unsupported.update(rec.meta.get("unsupported") or {})
        meta = {
            **{
                k: first.get(k)
                for k in (
                    "schema_version",
                    "kind",
                    "role",
                    "requested_config",
                    "effective_config",
                    "environment",
                )
            },  # fmt: skip
            "run_id": run_id,
            "name": str(first.get("name") or run_id).removesuffix(f"{NODE_SUFFIX}0"),
            "status": status,
            "pid": proc.pid,
            "pid_create_time": proc.create_time(),
            "hostname": socket.gethostname(),
            "created_at": min(str(r.meta.get("created_at") or "") for r in by_node.values()),
            "ended_at": max(str(r.meta.get("ended_at") or "") for r in by_node.values()),
            "heartbeat_at": now_iso(),
            "summary": joined_summary(by_node),
            "unsupported": unsupported,
            "error": error,
            JOINED_KEY: {
                "joined_at": now_iso(),
                "nnodes": nnodes,
                "shards": [
                    {
                        "node_rank": n,
                        "run_id": r.run_id,
                        "hostname": r.meta[SHARD_KEY].get("hostname"),
                        "record_dir": str(r.dir),
                        "status": r.status,
                    }
                    for n, r in sorted(by_node.items())
                ],  # fmt: skip
            },
        }
        atomic_write_json(tmp / schema.RUN_FILE, meta)
        os.rename(tmp, target)  # readers see no half-joined run
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for s in meta["summary"].get("stragglers") or []:
        log.warning("gpulens: rank %d (%s) is a straggler: its mean %s is %.0f%% of the median "
                    "step time above the median rank", s["rank"], _host_of(meta, s["rank"]),
                    "step time" if s["phase"] == "step" else "wait for data",
                    s["above_median_pct"])  # fmt: skip
    return target


def _host_of(meta: Mapping[str, Any], rank: int) -> str:
    for doc in meta["summary"].get("ranks") or []:
        if doc.get("rank") == rank:
            return f"node {doc.get('node_rank')}, {doc.get('hostname')}"
    return "?"


def join_if_local(shards: Mapping[int, Mapping[str, Any]], runs_root: Path) -> dict[str, Any]:
    """Join automatically where every node's shard lies in ``runs_root`` (one GPULENS_HOME on a
    shared filesystem); else say how to join by hand. Never raises: the shards stay."""
    run_id = str(shards[0]["of_run"])
    dirs = [Path(runs_root) / str(shards[n]["run_id"]) for n in sorted(shards)]
    reported = [str(shards[n]["record_dir"]) for n in sorted(shards)]
    if all((d / schema.RUN_FILE).is_file() for d in dirs):
        try:
            target = join_shards(dirs, runs_root)
            return {"joined": True, "run_id": run_id, "record_dir": str(target)}
        except Exception as exc:  # the shards are complete on their own
            log.warning("gpulens: could not join the shards of %s: %s", run_id, exc)
            return {"joined": False, "run_id": run_id, "shards": reported, "reason": str(exc)}
    return {
        "joined": False,
        "run_id": run_id,
        "shards": reported,
        "reason": "the nodes' shards are not in one GPULENS_HOME",
        "hint": "copy every node's shard to one machine, then: gpulens runs join "
        + " ".join(reported),
    }

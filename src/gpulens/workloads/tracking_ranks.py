"""The tracking API under torchrun: which rank this is, one run for all ranks, their summary.

Layout of a run tracked by N > 1 ranks (``WORLD_SIZE`` > 1):

- while it runs, each rank appends its own steps to ``series/steps-rank<R>.arrows`` (no two
  processes ever write one file) and keeps ``tracker-rank<R>.json`` (``status`` ``running``,
  then its summary once it closed);
- when the run ends, the ranks' steps are merged into one ``series/steps.parquet`` with a
  ``rank`` column (the per-rank files are removed), and ``tracker.json`` holds the combined
  summary: throughput is the sum of the ranks' samples/s, step time and phases are the slowest
  rank's, and ``stragglers`` names every rank that spends more than ``straggler_threshold_pct``
  of the median rank's step time longer per step (in its step time, or waiting for data).

Under ``gpulens run -- torchrun ...`` the ranks write into the run gpulens made and the command
wrapper combines them once the command has ended (:func:`finalize_ranks`). Run on their own, the
ranks of one node agree on one run through a small file under ``$GPULENS_HOME/groups`` named
after their launcher (torchrun's per-launch error-file folder, else the parent process and its
start time): the first rank to arrive creates the run, the others find it there, and the
creator ends the run once every rank has closed (waiting at most ``GPULENS_RANK_WAIT_S``, 30 s).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gpulens.probes.steps import STEPS_SCHEMA
from gpulens.record import schema
from gpulens.record.reader import read_series_table
from gpulens.record.writer import atomic_write_json

log = logging.getLogger(__name__)

RANK_STEPS_SCHEMA = STEPS_SCHEMA.append(pa.field("rank", pa.int32()))
STEPS_SERIES = "steps"
RANK_SERIES_PREFIX = "steps-rank"
RANK_FILE_PREFIX = "tracker-rank"
COMBINED_FILE = "tracker.json"
STRAGGLER_PCT = 10.0
RANK_WAIT_ENV = "GPULENS_RANK_WAIT_S"
DEFAULT_RANK_WAIT_S = 30.0
UNJOINED_GRACE_S = 5.0  # how long the creator waits for ranks that never started tracking
JOIN_TIMEOUT_S = 60.0
GROUPS_DIR = "groups"
STALE_GROUP_S = 7 * 24 * 3600.0

RUNNING, FINISHED, FAILED, KILLED = "running", "finished", "failed", "killed"


@dataclass(frozen=True)
class RankInfo:
    """This process's place in a distributed job (``rank`` 0 of 1 when there is none)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        return int(raw)
    except ValueError:
        log.warning("gpulens: %s=%r is not an integer; ignored", name, raw)
        return None


def rank_info(env: Mapping[str, str] | None = None) -> RankInfo:
    """The rank from ``RANK`` (else ``LOCAL_RANK``) and ``WORLD_SIZE`` as torchrun sets them;
    values that make no sense count as a single process (with a warning)."""
    env = os.environ if env is None else env
    world = _env_int(env, "WORLD_SIZE") or 1
    if world <= 1:
        return RankInfo()
    local_rank = _env_int(env, "LOCAL_RANK")
    rank = _env_int(env, "RANK")
    rank = rank if rank is not None else local_rank
    if rank is None or not 0 <= rank < world:
        log.warning(
            "gpulens: WORLD_SIZE=%s but RANK=%s: tracking this process as a single one",
            world,
            env.get("RANK"),
        )
        return RankInfo()
    local_world = _env_int(env, "LOCAL_WORLD_SIZE") or world
    return RankInfo(rank, world, local_rank if local_rank is not None else rank, local_world)


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


# ----------------------------------------------------------------------------- one run
def group_key(env: Mapping[str, str] | None = None) -> str:
    """A name that every rank on this node started by the same launcher computes alike, and
    a later launch does not: torchrun's per-launch (and per-restart) error-file folder where it
    sets one, else the parent process (the launcher) and when it started."""
    env = os.environ if env is None else env
    error_file = env.get("TORCHELASTIC_ERROR_FILE")
    if error_file and len(Path(error_file).parents) >= 2:
        launch = str(Path(error_file).parents[1])  # .../<run>/attempt_<N>
    else:
        ppid = os.getppid()
        try:
            started = f"{psutil.Process(ppid).create_time():.2f}"
        except psutil.Error:
            started = "?"
        launch = f"{ppid}@{started}"
    parts = [
        socket.gethostname(),
        launch,
        env.get("TORCHELASTIC_RUN_ID", ""),
        env.get("TORCHELASTIC_RESTART_COUNT", ""),
        env.get("MASTER_ADDR", ""),
        env.get("MASTER_PORT", ""),
        env.get("WORLD_SIZE", ""),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


def _run_is_live(run_dir: Path) -> bool:
    try:
        meta = json.loads((Path(run_dir) / schema.RUN_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("status") == schema.STATUS_RUNNING


def _clean_stale_groups(groups: Path) -> None:
    cutoff = time.time() - STALE_GROUP_S
    for path in groups.glob("*.json"):
        try:
            if path.stat().st_mtime < cutoff:
                path.unlink()
        except OSError:
            pass


def join_group(
    groups: Path, key: str, create: Callable[[], Path], timeout_s: float = JOIN_TIMEOUT_S
) -> tuple[Path, bool]:
    """The run of this group: ``(run_dir, True)`` for the rank that created it with
    ``create()``, ``(run_dir, False)`` for the ranks that found it. The group file is read and
    written under an exclusive lock, so exactly one rank creates the run."""
    import fcntl

    groups.mkdir(parents=True, exist_ok=True)
    path = groups / f"{key}.json"
    with open(path, "a+") as handle:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{path} stayed locked for {timeout_s:g} s") from None
                time.sleep(0.05)
        found = None
        try:
            handle.seek(0)
            text = handle.read()
            try:
                found = json.loads(text) if text.strip() else None
            except ValueError:
                found = None
            if isinstance(found, dict) and found.get("run_dir"):
                run_dir = Path(found["run_dir"])
                if _run_is_live(run_dir):
                    return run_dir, False
            run_dir = create()
            handle.seek(0)
            handle.truncate()
            json.dump({"run_dir": str(run_dir), "pid": os.getpid()}, handle)
            handle.flush()
            return run_dir, True
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
            if found is None:
                _clean_stale_groups(groups)


def leave_group(groups: Path, key: str) -> None:
    with contextlib.suppress(OSError):
        (groups / f"{key}.json").unlink()


def rank_wait_s() -> float:
    raw = os.environ.get(RANK_WAIT_ENV, "").strip()
    try:
        return max(0.0, float(raw)) if raw else DEFAULT_RANK_WAIT_S
    except ValueError:
        log.warning("gpulens: %s=%r is not a number of seconds", RANK_WAIT_ENV, raw)
        return DEFAULT_RANK_WAIT_S


def wait_for_ranks(
    run_dir: Path, expected: int, timeout_s: float, grace_s: float = UNJOINED_GRACE_S
) -> dict[int, dict[str, Any]]:
    """The ranks' files once every rank that started tracking has closed and ``expected``
    ranks have started (ranks that never start are waited for ``grace_s`` once the others are
    done), or whatever is there after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    all_done_since = None
    while True:
        docs = read_rank_files(run_dir)
        done = all(d.get("status") != RUNNING for d in docs.values())
        now = time.monotonic()
        if done and len(docs) >= expected:
            return docs
        if done:
            all_done_since = all_done_since or now
            if now - all_done_since >= grace_s:
                return docs
        else:
            all_done_since = None
        if now >= deadline:
            return docs
        time.sleep(0.05)


def status_of(error: BaseException | None) -> tuple[str, str | None]:
    if error is None:
        return FINISHED, None
    if isinstance(error, KeyboardInterrupt):
        return KILLED, "interrupted (Ctrl-C)"
    return FAILED, str(error) or type(error).__name__


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

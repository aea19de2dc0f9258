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
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from gpulens.record import schema
from gpulens.record.tracker import FAILED, FINISHED, KILLED, RUNNING, read_rank_files

log = logging.getLogger(__name__)

RANK_WAIT_ENV = "GPULENS_RANK_WAIT_S"
DEFAULT_RANK_WAIT_S = 30.0
UNJOINED_GRACE_S = 5.0  # how long the creator waits for ranks that never started tracking
JOIN_TIMEOUT_S = 60.0
GROUPS_DIR = "groups"
STALE_GROUP_S = 7 * 24 * 3600.0


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
    from gpulens.filelock import exclusive_lock

    groups.mkdir(parents=True, exist_ok=True)
    path = groups / f"{key}.json"
    with open(path, "a+") as handle, exclusive_lock(handle, timeout_s):
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


def rank_doc(
    ranks: RankInfo, straggler_pct: float, status: str, error: str | None = None, **summary: Any
) -> dict[str, Any]:
    """What one rank writes of itself (its rank file): where it ran, how it ended, its steps."""
    return {
        "rank": ranks.rank,
        "local_rank": ranks.local_rank,
        "world_size": ranks.world_size,
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "status": status,
        "error": error,
        "straggler_threshold_pct": straggler_pct,
        **summary,
    }

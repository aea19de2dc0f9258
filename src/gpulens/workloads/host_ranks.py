"""Every rank's steps of a built-in data-parallel run on one host (``--gpus N``), and its
straggler check.

Each training process times its steps anyway; it sends them to the parent once, when the run
has ended (never per step), as the ranks of a multi-node run do. The record keeps them as one
``series/steps.parquet`` with a ``rank`` column, the layout of a torchrun job tracked by gpulens
and of a joined multi-node run; each row's ``samples`` is that rank's own batch, so that the
series' samples add up to the run's. The summary's throughput and phases stay rank 0's (every
sample counted once, as before); it gains the figures over all ranks that those runs have:
``world_size``, ``ranks_reported``, ``slowest_rank``, ``step_time_median_s``,
``straggler_threshold_pct``, ``stragglers`` and ``ranks`` (see
:func:`gpulens.record.tracker.combine`).

``GPULENS_TEST_SLOW_RANK=R:SECONDS`` delays every batch of rank R by SECONDS (a slow loader on
one GPU): a hook for the tests of the straggler check, read by the training processes only.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from collections.abc import Iterator, Mapping
from typing import Any

from gpulens.record.join import rank_doc
from gpulens.record.tracker import (
    RANK_FIELDS,
    RANK_STEPS_SCHEMA,
    STEPS_SERIES,
    STRAGGLER_PCT,
    combine,
)

log = logging.getLogger(__name__)

SLOW_RANK_ENV = "GPULENS_TEST_SLOW_RANK"

# rank -> (its step rows, its measured wall time in seconds)
RankSteps = Mapping[int, tuple[list[dict[str, Any]], float]]


def own_samples(rows: list[dict[str, Any]], rank: int, batch_size: int) -> list[dict[str, Any]]:
    """A rank's rows for a series with a ``rank`` column: its own batch as ``samples`` (its
    timer counted the whole step's, every rank's batch)."""
    return [{**row, "rank": rank, "samples": batch_size} for row in rows]


def write_steps(writer, rank_steps: RankSteps, batch_size: int) -> None:
    """Every rank's steps as the run's ``steps`` series, by rank then step."""
    series = writer.series(STEPS_SERIES, RANK_STEPS_SCHEMA)
    for rank, (rows, _wall_s) in sorted(rank_steps.items()):
        for row in own_samples(rows, rank, batch_size):
            series.append(row)
    series.close()


def rank_summary(rank_steps: RankSteps, world: int, batch_size: int) -> dict[str, Any]:
    """The summary's figures over the ranks (one host: node 0); logs each straggler."""
    host = socket.gethostname()
    docs = {
        rank: rank_doc(rank, rank, 0, host, rows, batch_size, wall_s)
        for rank, (rows, wall_s) in rank_steps.items()
    }
    if not docs:
        return {}
    combined = combine(docs, world, STRAGGLER_PCT)
    if len(docs) < world:
        missing = sorted(set(range(world)) - set(docs))
        log.warning("gpulens: ranks %s sent no steps; the straggler check has %d of %d ranks",
                    ", ".join(map(str, missing)), len(docs), world)  # fmt: skip
    for s in combined["stragglers"]:
        log.warning("gpulens: rank %d is a straggler: its mean %s is %.3g s, %.0f%% of the "
                    "median step time above the median rank", s["rank"],
                    "step time" if s["phase"] == "step" else "wait for data", s["mean_s"],
                    s["above_median_pct"])  # fmt: skip
    return {k: combined[k] for k in RANK_FIELDS}


def slow_rank_delay_s(rank: int, env: Mapping[str, str] | None = None) -> float:
    """The delay per batch that ``GPULENS_TEST_SLOW_RANK`` gives ``rank`` (0.0: none)."""
    raw = (os.environ if env is None else env).get(SLOW_RANK_ENV, "").strip()
    if not raw:
        return 0.0
    try:
        which, seconds = raw.split(":", 1)
        delay_s = float(seconds)
        which_rank = int(which)
    except ValueError:
        log.warning("gpulens: %s=%r is not RANK:SECONDS; ignored", SLOW_RANK_ENV, raw)
        return 0.0
    return max(0.0, delay_s) if which_rank == rank else 0.0


def _delayed(batches: Iterator, delay_s: float) -> Iterator:
    for batch in batches:
        time.sleep(delay_s)
        yield batch


def slowed(prepared, rank: int):
    """``prepared`` whose batches arrive late on the rank ``GPULENS_TEST_SLOW_RANK`` names."""
    delay_s = slow_rank_delay_s(rank)
    if not delay_s:
        return prepared
    log.warning("gpulens: %s: rank %d waits %.3g s for each batch", SLOW_RANK_ENV, rank, delay_s)
    return dataclasses.replace(prepared, batches=_delayed(prepared.batches, delay_s))

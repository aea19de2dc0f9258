"""Per-stage data-prep timing from a single normal run: read, decode, augment, collate.

Recording happens where the work happens, in each DataLoader worker process (or in the main
process when ``workers=0``): every sample appends one row ``(read_s, decode_s, augment_s,
nbytes)`` and every batch one row ``(collate_s, batch_samples)`` to a :class:`SeriesWriter` of its
own process, ``TIMING_DIR/prep_w<worker id>_p<pid>.arrows`` (``prep_wmain_...`` for the main
process), opened lazily on the first row. Each row also has ``cpu_s``, the thread's CPU time over
the same span: wall minus CPU is waiting (storage, emulated delay, a CPU shared with others).
Rows are kept in memory and flushed at least once a second (also by a small daemon thread while a
worker waits on a full queue), and the stream is closed best-effort when the process exits;
readers read unclosed streams.

:func:`read_prep` reads them back; :func:`gpulens.stalls.prep_summary.summarize_prep` turns them
into stage totals, shares and per-worker busy fractions, and judges whether the loader keeps up.

Timing costs a few clock reads and one dict append per sample (about 3-5 us).
"""

from __future__ import annotations

import logging
import multiprocessing.util
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset, default_collate, get_worker_info

from gpulens.data.bad_samples import (
    BadSampleError,
    decode_rgb,
    note_skipped,
    replacement_candidates,
    too_many_bad,
    unreadable,
)
from gpulens.data.storage import StorageEmulation, read_file
from gpulens.record import schema
from gpulens.record.writer import SeriesWriter

logger = logging.getLogger(__name__)

MAIN_PROCESS_WORKER_ID = -1
FLUSH_INTERVAL_S = 1.0


# ---------------------------------------------------------------------------------------------
# Recording, one writer per process
# ---------------------------------------------------------------------------------------------


class _Recorder:
    """The current process's writer for one timing directory."""

    def __init__(self, timing_dir: Path):
        info = get_worker_info()
        self.worker_id = info.id if info is not None else MAIN_PROCESS_WORKER_ID
        self.pid = os.getpid()
        self.rank = int(os.environ.get("RANK", "0") or 0)
        tag = f"w{self.worker_id}" if self.worker_id >= 0 else "wmain"
        if "RANK" in os.environ:
            tag = f"r{self.rank}_{tag}"
        stem = f"{schema.PREP_SERIES_PREFIX}{tag}_p{self.pid}"
        timing_dir.mkdir(parents=True, exist_ok=True)
        base, n = timing_dir / stem, 0
        while any(base.with_suffix(s).exists() for s in (schema.STREAM_SUFFIX, ".parquet")):
            n += 1  # a second loader in the same process: never truncate the first one's rows
            base = timing_dir / f"{stem}_{n}"
        self.writer = SeriesWriter(base, schema.PREP_SCHEMA, flush_interval_s=FLUSH_INTERVAL_S)

    def append(self, row: dict[str, Any]) -> None:
        row["rank"], row["pid"], row["worker_id"] = self.rank, self.pid, self.worker_id
        self.writer.append(row)


_RECORDERS: dict[tuple[str, int], _Recorder | None] = {}
_LOCK = threading.Lock()
_FLUSHER_PID: int | None = None


def _recorder(timing_dir: Path) -> _Recorder | None:
    key = (str(timing_dir), os.getpid())
    try:
        return _RECORDERS[key]
    except KeyError:
        pass
    with _LOCK:
        if key not in _RECORDERS:
            try:
                _RECORDERS[key] = _Recorder(Path(timing_dir))
            except OSError as exc:  # timing must never stop the workload
                logger.warning("prep timing off in pid %d: %s", key[1], exc)
                _RECORDERS[key] = None
            _ensure_flusher()
        return _RECORDERS[key]


def _own_recorders() -> list[_Recorder]:
    pid = os.getpid()
    return [r for (_, p), r in list(_RECORDERS.items()) if p == pid and r is not None]


def _ensure_flusher() -> None:
    """Start this process's flush thread and exit hook once (called with ``_LOCK`` held)."""
    global _FLUSHER_PID
    if os.getpid() == _FLUSHER_PID:
        return
    _FLUSHER_PID = os.getpid()
    threading.Thread(target=_flush_loop, name="gpulens-prep-flush", daemon=True).start()
    # Runs at a DataLoader worker's normal exit (multiprocessing's exit function) and, through
    # multiprocessing's atexit hook, at the main process's exit.
    multiprocessing.util.Finalize(None, close_timing, exitpriority=10)


def _flush_loop() -> None:
    pid = os.getpid()
    while pid == _FLUSHER_PID:
        time.sleep(FLUSH_INTERVAL_S)
        for rec in _own_recorders():
            try:
                rec.writer.flush()
            except Exception as exc:  # noqa: BLE001 - a full disk must not kill the workload
                logger.debug("prep timing flush failed: %s", exc)


def close_timing(timing_dir: str | os.PathLike | None = None) -> None:
    """Flush and close this process's prep-timing writers (for ``timing_dir``, or all).

    Optional: they close at process exit anyway. Call it in the main process after a
    ``workers=0`` loop to have every row on disk before :func:`summarize_prep`.
    """
    pid = os.getpid()
    with _LOCK:
        for key in list(_RECORDERS):
            if key[1] != pid or (timing_dir is not None and key[0] != str(timing_dir)):
                continue
            rec = _RECORDERS.pop(key)
            if rec is None:
                continue
            try:
                rec.writer.close(compact=False)
            except Exception as exc:  # noqa: BLE001 - best effort at exit
                logger.debug("closing %s failed: %s", rec.writer.path, exc)


def record_sample(
    timing_dir: Path,
    read_s: float,
    decode_s: float,
    augment_s: float,
    nbytes: int,
    cpu_s: float | None = None,
    index: int | None = None,
) -> None:
    """Append one sample's stage times (wall) and CPU time to this process's prep series."""
    rec = _recorder(timing_dir)
    if rec is not None:
        rec.append(
            {
                "time_unix_s": time.time(),
                "read_s": read_s,
                "decode_s": decode_s,
                "augment_s": augment_s,
                "nbytes": nbytes,
                "cpu_s": cpu_s,
                "index": index,
            }
        )


def record_batch(
    timing_dir: Path, collate_s: float, batch_samples: int, cpu_s: float | None = None
) -> None:
    """Append one batch's collate time (wall) and CPU time to this process's prep series."""
    rec = _recorder(timing_dir)
    if rec is not None:
        rec.append(
            {
                "time_unix_s": time.time(),
                "collate_s": collate_s,
                "batch_samples": batch_samples,
                "cpu_s": cpu_s,
            }
        )


class TimedCollate:
    """A DataLoader ``collate_fn`` that records each batch's collate time (picklable)."""

    def __init__(self, timing_dir: str | os.PathLike, collate_fn: Callable | None = None):
        self.timing_dir = Path(timing_dir)
        self.collate_fn = collate_fn

    def __call__(self, batch: list) -> Any:
        c0, t0 = time.thread_time(), time.perf_counter()
        out = (self.collate_fn or default_collate)(batch)
        t1 = time.perf_counter()
        record_batch(self.timing_dir, t1 - t0, len(batch), time.thread_time() - c0)
        return out


class InstrumentedImageFolder(Dataset):
    """An ImageFolder read through :func:`read_file` (storage emulation), optionally timed.

    Wraps a torchvision ``ImageFolder`` (whose attributes, e.g. ``classes``, it forwards): read =
    the file's bytes, emulated delay included; decode = PIL open + ``convert("RGB")``; augment =
    the folder's ``transform``. Same items as the folder itself.

    A file that cannot be read or decoded raises a
    :class:`~gpulens.workloads.bad_samples.BadSampleError` naming it; with
    ``skip_bad_samples`` the next readable sample (of the same half in a paired cold run) takes
    its place, the bad index is not read again in this process, and the skip is logged to
    ``skip_log``. Only the sample returned is timed.
    """

    def __init__(
        self,
        folder: Dataset,
        storage: StorageEmulation | None = None,
        timing_dir: str | os.PathLike | None = None,
        *,
        skip_bad_samples: bool = False,
        skip_log: str | os.PathLike | None = None,
    ):
        self.folder = folder
        self.storage = storage if storage is not None and storage.active else None
        self.timing_dir = Path(timing_dir) if timing_dir is not None else None
        self.emulated: np.ndarray | None = None  # which indices the emulation slows (all: None)
        self.skip_bad_samples = skip_bad_samples
        self.skip_log = Path(skip_log) if skip_log is not None else None
        self._bad: set[int] = set()  # indices found bad, in this process

    def emulate_only(self, mask: np.ndarray) -> None:
        """Slow down only the samples where ``mask`` is true (a paired cold run's cold half)."""
        self.emulated = np.asarray(mask, dtype=bool)

    def __len__(self) -> int:
        return len(self.folder)

    def __getattr__(self, name: str) -> Any:
        if name == "folder" or name.startswith("__"):  # unpickling: no recursion
            raise AttributeError(name)
        return getattr(self.folder, name)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        if not self.skip_bad_samples:
            return self._item(index)
        for candidate in replacement_candidates(index, len(self), self.emulated):
            if candidate in self._bad:
                continue
            try:
                return self._item(candidate)
            except BadSampleError as exc:
                self._bad.add(candidate)
                note_skipped(self.skip_log, exc)
        raise too_many_bad(self.folder.samples[index][0])

    def _item(self, index: int) -> tuple[Any, Any]:
        path, target = self.folder.samples[index]
        c0 = time.thread_time() if self.timing_dir is not None else 0.0
        t0 = time.perf_counter()
        slow = self.storage is not None and (self.emulated is None or self.emulated[index])
        try:
            data = read_file(path, self.storage if slow else None)
        except OSError as exc:
            raise unreadable(path, exc) from None
        t1 = time.perf_counter()
        sample = decode_rgb(data, path)
        t2 = time.perf_counter()
        if self.folder.transform is not None:
            sample = self.folder.transform(sample)
        t3 = time.perf_counter()
        if self.folder.target_transform is not None:
            target = self.folder.target_transform(target)
        if self.timing_dir is not None:
            cpu_s = time.thread_time() - c0
            record_sample(self.timing_dir, t1 - t0, t2 - t1, t3 - t2, len(data), cpu_s, index)
        return sample, target

"""Samples that cannot be read or decoded: a one-line error naming the file, or skipped.

Real image datasets hold a few corrupt, truncated, empty or mislabelled files. By default the
first one a loader worker meets stops the run with a :class:`BadSampleError` (a usage error,
exit 2) naming the file and the fix. With ``skip_bad_samples`` the dataset puts the next
readable sample in its place (the batch keeps its size, so throughput still counts samples that
were trained on), remembers the bad index in that worker, and appends one line per skip to a
log in the run record, which :func:`read_skipped` summarizes.

A :class:`BadSampleError` raised in a DataLoader worker reaches the main process as itself:
torch re-raises it as ``BadSampleError(<worker traceback>)``, and the constructor keeps only the
original one-line message.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from gpulens.errors import UsageError

logger = logging.getLogger(__name__)

SKIPPED_SAMPLES_FILE = "skipped_samples.tsv"  # in the run record: "path<TAB>reason" per skip
SKIP_OPTION = "--skip-bad-samples"
MAX_REPLACEMENT_TRIES = 64  # bad samples in a row before the dataset is called unusable
SKIPPED_FILES_SHOWN = 5


class BadSampleError(UsageError):
    """A sample that cannot be read or decoded. ``path`` and ``reason`` are set where it was
    raised (a worker); in the main process only the message is left."""

    def __init__(self, message: str = "", *, path: str | None = None, reason: str | None = None):
        super().__init__(_original_message(message))
        self.path = path
        self.reason = reason


def _original_message(message: str) -> str:
    """The message a worker raised, from torch's ``"Caught BadSampleError in DataLoader worker
    process N.\\nOriginal Traceback ...\\n<module>.BadSampleError: <message>"``."""
    if not message.startswith("Caught ") or "Traceback" not in message:
        return message
    marker = f"{BadSampleError.__name__}: "
    for line in reversed(message.strip().splitlines()):
        if marker in line:
            return line.partition(marker)[2].strip()
    return message.strip().splitlines()[0]


def bad_image(path: str | os.PathLike, exc: BaseException, nbytes: int | None) -> BadSampleError:
    """The error for an image file that PIL cannot decode."""
    from PIL import UnidentifiedImageError

    if nbytes == 0:
        reason = "empty file"
    elif isinstance(exc, UnidentifiedImageError):
        reason = "not an image PIL can read"
    else:
        reason = str(exc).strip() or type(exc).__name__
    return BadSampleError(
        f"cannot decode image {path} ({reason}): remove the file, or pass {SKIP_OPTION} to put "
        "the next readable image in its place",
        path=str(path),
        reason=reason,
    )


def unreadable(path: str | os.PathLike, exc: OSError) -> BadSampleError:
    """The error for a file that cannot be read at all (vanished, no permission, I/O error)."""
    reason = exc.strerror or str(exc)
    return BadSampleError(
        f"cannot read {path} ({reason}): fix or remove the file, or pass {SKIP_OPTION}",
        path=str(path),
        reason=reason,
    )


def decode_rgb(data: bytes, path: str | os.PathLike):
    """``data`` (the bytes of ``path``) as an RGB PIL image, or a :class:`BadSampleError`."""
    import io

    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.convert("RGB")
    except Exception as exc:  # noqa: BLE001 - any decoder failure means a bad file
        raise bad_image(path, exc, len(data)) from None


def load_rgb(path: str) -> object:
    """An ImageFolder ``loader``: the file as an RGB PIL image, or a :class:`BadSampleError`."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise unreadable(path, exc) from None
    return decode_rgb(data, path)


def replacement_candidates(index: int, n: int, same_as: np.ndarray | None = None) -> Iterator[int]:
    """``index`` and then the indices after it (wrapping), at most ``MAX_REPLACEMENT_TRIES`` in
    all; with a mask ``same_as``, only those on the same side of it as ``index`` (a paired cold
    run's cached or cold half)."""
    tried = 0
    for step in range(n):
        j = (index + step) % n
        if same_as is not None and same_as[j] != same_as[index]:
            continue
        yield j
        tried += 1
        if tried >= MAX_REPLACEMENT_TRIES:
            return


def too_many_bad(path: str | os.PathLike) -> BadSampleError:
    return BadSampleError(
        f"{MAX_REPLACEMENT_TRIES} images in a row from {path} on cannot be decoded: the dataset "
        "looks damaged; check it (e.g. remake it with `gpulens data make images`)"
    )


_WARNED_PIDS: set[int] = set()


def note_skipped(log: Path | None, error: BadSampleError) -> None:
    """Record one skipped sample: a line in ``log`` (appends of one short line are atomic
    between processes) and a warning the first time in this process."""
    if os.getpid() not in _WARNED_PIDS:
        _WARNED_PIDS.add(os.getpid())
        logger.warning(
            "skipping bad samples (first in pid %d: %s, %s)", os.getpid(), error.path, error.reason
        )
    if log is None:
        return
    line = f"{error.path}\t{(error.reason or '').replace(chr(9), ' ').replace(chr(10), ' ')}\n"
    try:
        with open(log, "a", encoding="utf-8") as f:
            f.write(line)
    except OSError as exc:  # counting must never stop the workload
        logger.debug("cannot log a skipped sample to %s: %s", log, exc)


def read_skipped(log: Path | None) -> dict[str, object]:
    """``skipped_samples`` (samples replaced, warm-up included), ``skipped_files_total``
    (distinct files) and ``skipped_files`` (the first few, in the order met)."""
    lines: list[str] = []
    if log is not None:
        try:
            lines = Path(log).read_text(encoding="utf-8", errors="replace").splitlines()
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("cannot read the skipped-sample log %s: %s", log, exc)
    files = list(dict.fromkeys(line.split("\t", 1)[0] for line in lines if line.strip()))
    return {
        "skipped_samples": sum(1 for line in lines if line.strip()),
        "skipped_files_total": len(files),
        "skipped_files": files[:SKIPPED_FILES_SHOWN],
    }

"""Page-cache control for cold and warm reads of a dataset (Linux).

- :func:`resident_fraction`: how much of some files sits in the page cache, from ``mincore(2)``.
- :func:`warm`: read every file once so that the next epoch reads from memory.
- :func:`evict`: make the files cold, with the least invasive method that works, and say which
  one worked, or that none did. A read is only reported as cold when at most
  :data:`COLD_MAX_RESIDENT_FRACTION` of the pages are still cached afterwards.

"Cold" means not in *this* kernel's page cache: a hypervisor's cache under a VM disk or a file
server's cache can still serve the read faster than the storage itself would.

Each function takes an iterable of file paths, or one path: a file, or a folder whose files
(all of them, recursively, hidden ones excluded) are meant. Files that vanish or cannot be opened
are skipped. Costs about 10-30 us per file, so 100k files take a few seconds.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

COLD_MAX_RESIDENT_FRACTION = 0.05  # above this a read is not called cold
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
_WINDOW_BYTES = 1 << 30  # mincore a large file 1 GiB at a time (256 KiB of vector per window)
_READ_CHUNK_BYTES = 1 << 20
_NO_COLD = "no cold read possible here: "

PathsLike = Iterable[str | os.PathLike] | str | os.PathLike


@dataclass(frozen=True)
class EvictResult:
    """What :func:`evict` did: ``method`` is None when the files could not be made cold."""

    method: str | None  # "posix_fadvise", "drop_caches" or None
    resident_before: float | None
    resident_after: float | None
    note: str

    @property
    def cold(self) -> bool:
        return self.method is not None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# Paths
# ---------------------------------------------------------------------------------------------


def _walk_files(root: str) -> list[str]:
    files: list[str] = []
    stack = [root]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    if entry.name.startswith("."):
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    elif entry.is_file():
                        files.append(entry.path)
        except OSError as exc:
            logger.debug("cannot list %s: %s", exc.filename, exc)
    files.sort()
    return files


def _expand(paths: PathsLike) -> list[str]:
    """A list of file paths from one path (file or folder) or an iterable of file paths."""
    if isinstance(paths, (str, os.PathLike)):
        p = os.fspath(paths)
        return _walk_files(p) if os.path.isdir(p) else [p]
    return [os.fspath(p) for p in paths]


# ---------------------------------------------------------------------------------------------
# mincore
# ---------------------------------------------------------------------------------------------


class _Libc:
    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.mmap = libc.mmap
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,  # off_t on 64-bit Linux
        ]
        self.munmap = libc.munmap
        self.munmap.restype = ctypes.c_int
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.mincore = libc.mincore
        self.mincore.restype = ctypes.c_int
        self.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        self.map_failed = ctypes.c_void_p(-1).value


_LIBC: _Libc | None = None
_LIBC_TRIED = False


def _libc() -> _Libc | None:
    global _LIBC, _LIBC_TRIED
    if not _LIBC_TRIED:
        _LIBC_TRIED = True
        if sys.platform.startswith("linux") and ctypes.sizeof(ctypes.c_long) == 8:
            try:
                _LIBC = _Libc()
            except (OSError, AttributeError) as exc:
                logger.debug("mincore unavailable: %s", exc)
    return _LIBC


def _file_pages(libc: _Libc, path: str) -> tuple[int, int] | None:
    """``(resident pages, pages)`` of one file, or None if it cannot be examined."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        logger.debug("cannot open %s: %s", path, exc)
        return None
    try:
        size = os.fstat(fd).st_size
        page = mmap.PAGESIZE
        resident = total = 0
        for offset in range(0, size, _WINDOW_BYTES):
            length = min(_WINDOW_BYTES, size - offset)
            n_pages = (length + page - 1) // page
            addr = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
            if addr is None or addr == libc.map_failed:
                logger.debug("mmap %s failed: %s", path, os.strerror(ctypes.get_errno()))
                return None
            try:
                vec = (ctypes.c_ubyte * n_pages)()
                if libc.mincore(addr, length, vec) != 0:
                    logger.debug("mincore %s failed: %s", path, os.strerror(ctypes.get_errno()))
                    return None
                resident += int(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8) & 1))
                total += n_pages
            finally:
                libc.munmap(addr, length)
        return resident, total
    finally:
        os.close(fd)


def _residency(files: list[str]) -> tuple[float | None, list[str]]:
    """(fraction of all pages resident, files with any page resident); None where unmeasurable."""
    libc = _libc()
    if libc is None:
        return None, []
    resident = total = 0
    warm_files = []
    for path in files:
        pages = _file_pages(libc, path)
        if pages is None:
            continue
        resident += pages[0]
        total += pages[1]
        if pages[0]:
            warm_files.append(path)
    return (resident / total if total else None), warm_files


def resident_fraction(paths: PathsLike) -> float | None:
    """Fraction of the files' pages in the page cache (0..1), weighted by size.

    None where it cannot be known: not Linux, or no non-empty readable file.
    """
    return _residency(_expand(paths))[0]


# ---------------------------------------------------------------------------------------------
# Warm and evict
# ---------------------------------------------------------------------------------------------


def warm(paths: PathsLike) -> int:
    """Read every file once (into the page cache); returns the bytes read."""
    buf = bytearray(_READ_CHUNK_BYTES)
    view = memoryview(buf)
    total_bytes = 0
    for path in _expand(paths):
        try:
            with open(path, "rb", buffering=0) as f:
                while n := f.readinto(view):
                    total_bytes += n
        except OSError as exc:
            logger.debug("cannot read %s: %s", path, exc)
    return total_bytes


def _fadvise_dontneed(files: list[str], sync_first: bool = False) -> None:
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            continue
        try:
            if sync_first:  # dirty pages are not dropped: write them back first
                os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError as exc:
            logger.debug("posix_fadvise %s: %s", path, exc)
        finally:
            os.close(fd)


def _is_cold(fraction: float | None) -> bool:
    return fraction is not None and fraction <= COLD_MAX_RESIDENT_FRACTION


def _fmt(fraction: float | None) -> str:
    return "unknown" if fraction is None else f"{fraction:.1%}"


def evict(paths: PathsLike) -> EvictResult:
    """Make the files cold: ``posix_fadvise(DONTNEED)`` per file (no privilege needed), then,
    only if more than 5% stays resident and we are root, ``drop_caches`` after ``sync``.

    Residency is measured before and after; ``method`` is None (and ``note`` says why) when no
    method brought it to 5% or below, or when it cannot be measured.
    """
    files = _expand(paths)
    before, _ = _residency(files)
    if before is None:
        why = (
            "page-cache residency cannot be measured on this platform (needs Linux mincore)"
            if _libc() is None
            else "no non-empty readable file among the paths"
        )
        return EvictResult(None, None, None, _NO_COLD + why)

    tried: list[str] = []
    after = before
    if hasattr(os, "posix_fadvise"):
        _fadvise_dontneed(files)
        after, still_warm = _residency(files)
        if not _is_cold(after) and still_warm:
            _fadvise_dontneed(still_warm, sync_first=True)  # written recently: dirty pages
            after, still_warm = _residency(files)
        if _is_cold(after):
            note = f"posix_fadvise DONTNEED per file: resident {_fmt(before)} -> {_fmt(after)}"
            logger.info("evicted %d files: %s", len(files), note)
            return EvictResult("posix_fadvise", before, after, note)
        tried.append(
            f"posix_fadvise DONTNEED left {_fmt(after)} resident (pages mapped or locked by a "
            "running process stay)"
        )
    else:
        tried.append("posix_fadvise is not available")

    if hasattr(os, "geteuid") and os.geteuid() == 0:
        try:
            os.sync()
            DROP_CACHES.write_text("1")
        except OSError as exc:  # PermissionError included: containers often forbid it
            tried.append(f"writing {DROP_CACHES} failed ({exc.strerror or exc})")
        else:
            after, _ = _residency(files)
            if _is_cold(after):
                note = f"sync + drop_caches: resident {_fmt(before)} -> {_fmt(after)}"
                logger.info("evicted %d files: %s", len(files), note)
                return EvictResult("drop_caches", before, after, note)
            tried.append(f"drop_caches left {_fmt(after)} resident")
    else:
        tried.append(f"not root, so {DROP_CACHES} cannot be written")
    note = _NO_COLD + "; ".join(tried)
    logger.warning("%s", note)
    return EvictResult(None, before, after, note)

"""One bounded exclusive file lock (``flock``), for the few places where processes must take
turns: the ranks of a torchrun job agreeing on one run, and writers of a local SQLite store."""

from __future__ import annotations

import contextlib
import fcntl
import time
from collections.abc import Iterator
from typing import IO

POLL_S = 0.05


@contextlib.contextmanager
def exclusive_lock(handle: IO, timeout_s: float, poll_s: float = POLL_S) -> Iterator[None]:
    """Hold an exclusive lock on the open file ``handle``, waiting at most ``timeout_s``.
    Raises ``TimeoutError`` (naming the file) when another process holds it that long."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{handle.name} stayed locked for {timeout_s:g} s") from None
            time.sleep(poll_s)
    try:
        yield
    finally:
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

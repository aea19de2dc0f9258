"""Helpers for tests that send Ctrl-C (SIGINT) to a process they start.

A shell starts background jobs (``.ci/run &``, nohup) with SIGINT ignored, and children inherit
that; Python then never installs its KeyboardInterrupt handler. Tests of what Ctrl-C does start
their child with SIGINT at its default, as a terminal would.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


def default_sigint() -> None:
    """``preexec_fn`` for a child that must react to SIGINT as under a terminal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def python_sigint_handler() -> Iterator[None]:
    """This process with Python's own SIGINT handler for the duration (restored after)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)

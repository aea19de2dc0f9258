"""A Ctrl-C that is never lost.

Python raises ``KeyboardInterrupt`` wherever the main thread happens to be. Inside native code
that calls back into Python (``import torch``, a dispatch mode such as torch's FLOP counter)
the exception can be swallowed, or turned into a C++ exception that aborts the process: seen
here, 2 of 40 SIGINTs during ``import torch`` were lost and 1 aborted with SIGABRT. gpulens
therefore notes every SIGINT it receives, holds it inside such regions (:func:`held`), and its
loops re-raise a noted interrupt that something swallowed (:func:`raise_if_interrupted`).

SIGTERM (what Slurm, Kubernetes and `kill` send to stop a job) takes the same path where it
would otherwise end the process on the spot: the run's record ends ``killed`` instead of being
left ``running`` with no end, and the CLI exits 143.

Only the CLI installs the handlers (:func:`install`); a library user keeps Python's own.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

_state = {"pending": False, "held": 0, "installed": False, "signal": None}


def _on_stop_signal(signum: int, frame: FrameType | None) -> None:
    """The handler of SIGINT and SIGTERM: note the signal (the first says what stopped the
    run), and raise ``KeyboardInterrupt`` unless inside :func:`held`."""
    _state["pending"] = True
    _state["signal"] = _state["signal"] or signum  # the first one says what stopped the run
    if not _state["held"]:
        raise KeyboardInterrupt


def install() -> bool:
    """Note SIGINTs and SIGTERMs from now on (main thread). Each is taken only where it has
    Python's default handler: a launcher's own forwarding handler, or an ignored signal, is left
    alone. The two are decided apart: a job started in the background by a non-interactive shell
    (a batch script's `cmd &`) starts with SIGINT ignored, and its SIGTERM must still end the
    record `killed`. Returns whether either was taken."""
    if threading.current_thread() is not threading.main_thread():
        return False
    took = False
    if signal.getsignal(signal.SIGINT) in (signal.default_int_handler, _on_stop_signal):
        signal.signal(signal.SIGINT, _on_stop_signal)
        took = True
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, _on_stop_signal):
        signal.signal(signal.SIGTERM, _on_stop_signal)
        took = True
    if took:
        _state.update(pending=False, held=0, installed=True, signal=None)
    return took


def uninstall() -> None:
    """Python's default handlers again (tests, and a CLI run inside another program)."""
    if _state["installed"] and signal.getsignal(signal.SIGINT) is _on_stop_signal:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if _state["installed"] and signal.getsignal(signal.SIGTERM) is _on_stop_signal:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _state.update(pending=False, held=0, installed=False, signal=None)


def stop_reason() -> str:
    """What stopped the run, in the record's and the CLI's words."""
    return "stopped by SIGTERM" if _state["signal"] == signal.SIGTERM else "interrupted (Ctrl-C)"


def exit_code() -> int:
    """The shell's code for the signal that stopped the run: 143 for SIGTERM, else 130."""
    return 128 + signal.SIGTERM if _state["signal"] == signal.SIGTERM else 130


def pending() -> bool:
    """Whether a SIGINT or SIGTERM arrived that has not been raised to the end (it is cleared
    only by :func:`uninstall`: a run interrupted once stays interrupted)."""
    return bool(_state["pending"])


def raise_if_interrupted() -> None:
    """Raise ``KeyboardInterrupt`` if a SIGINT or SIGTERM arrived (one that native code
    swallowed)."""
    if _state["pending"]:
        raise KeyboardInterrupt


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Within: a SIGINT or SIGTERM is noted, not raised (native code cannot lose it or abort
    on it); on leaving, a noted one is raised as ``KeyboardInterrupt``."""
    _state["held"] += 1
    try:
        yield
    finally:
        _state["held"] -= 1
    if not _state["held"]:
        raise_if_interrupted()


def set_from_handler(event: threading.Event) -> None:
    """Set ``event`` from a signal handler. A handler runs on the main thread between two
    bytecodes, possibly inside ``event.wait()`` just after it took the event's lock back (a
    lock that is not reentrant): ``event.set()`` there waits for that lock forever. A served
    run hung so on SIGTERM in CI (2026-11-27). A thread of its own sets the event once the
    handler has returned and the main thread has let the lock go."""
    threading.Thread(target=event.set, name="gpulens-signal-set", daemon=True).start()

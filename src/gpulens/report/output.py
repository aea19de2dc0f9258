"""stdout in ``--json`` mode: exactly one JSON document per command, an error one included.

``emit_json`` writes a document and remembers that it did, so that the entry point prints an
error document only when the command had not printed its own (a wrapped command that exits
non-zero prints its run's document, then fails with exit 1).
"""

from __future__ import annotations

import json
import sys
from typing import Any

_state = {"emitted": False}

# The error document's ``type``: a small, stable vocabulary (the exception class is in
# ``exception``).
ERROR_TYPES = {2: "usage_error", 130: "interrupted"}


def reset() -> None:
    """Start a command: nothing printed yet."""
    _state["emitted"] = False


def emitted() -> bool:
    return _state["emitted"]


def emit_json(doc: Any) -> None:
    """Print ``doc`` as one line of JSON on stdout (NaN is not JSON: callers clean it first)."""
    text = json.dumps(doc, default=str, allow_nan=False)
    _state["emitted"] = True
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def error_doc(
    message: str,
    exit_code: int,
    exception: str | None = None,
    path: str | None = None,
    internal: bool = False,
) -> dict[str, Any]:
    """``{"error": {"type", "message", "exit_code", "exception"[, "path"]}}``.

    ``type`` is ``usage_error`` (exit 2: fix the command line), ``interrupted`` (exit 130,
    Ctrl-C) or ``runtime_error`` (exit 1 or another code: it failed while running), or
    ``internal_error`` for a gpulens bug.
    """
    kind = "internal_error" if internal else ERROR_TYPES.get(exit_code, "runtime_error")
    error: dict[str, Any] = {
        "type": kind,
        "message": message,
        "exit_code": exit_code,
        "exception": exception,
    }
    if path is not None:
        error["path"] = str(path)
    return {"error": error}

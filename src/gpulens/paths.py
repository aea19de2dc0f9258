"""Where gpulens keeps its files."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from gpulens.errors import UsageError


def gpulens_home() -> Path:
    """``$GPULENS_HOME`` or ``~/.gpulens``."""
    return Path(os.environ.get("GPULENS_HOME") or Path.home() / ".gpulens").expanduser()


def unwritable_home(where: Path, exc: OSError) -> UsageError:
    """The one line for a gpulens home it cannot write under (a file, read-only, a missing
    mount, full): GPULENS_HOME is what to change, or the space to free."""
    free = "free space there, or " if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    return UsageError(
        f"cannot write under {where} ({exc.strerror or exc}): {free}set GPULENS_HOME to a "
        "folder you can write (default ~/.gpulens)"
    )


def runs_dir(home: Path | None = None) -> Path:
    return Path(home or gpulens_home()) / "runs"


def default_tracking_uri(home: Path | None = None) -> str:
    """``$MLFLOW_TRACKING_URI`` or an embedded SQLite store in the gpulens home."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    return f"sqlite:///{(Path(home or gpulens_home()) / 'mlflow.db').resolve()}"

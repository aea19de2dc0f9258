"""Where gpulens keeps its files."""

from __future__ import annotations

import os
from pathlib import Path


def gpulens_home() -> Path:
    """``$GPULENS_HOME`` or ``~/.gpulens``."""
    return Path(os.environ.get("GPULENS_HOME") or Path.home() / ".gpulens").expanduser()


def runs_dir(home: Path | None = None) -> Path:
    return Path(home or gpulens_home()) / "runs"


def default_tracking_uri(home: Path | None = None) -> str:
    """``$MLFLOW_TRACKING_URI`` or an embedded SQLite store in the gpulens home."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    return f"sqlite:///{(Path(home or gpulens_home()) / 'mlflow.db').resolve()}"

"""The store: MLflow logging (optional extra) and queries over local records."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # Lazy, so importing gpulens.store never imports MLflow or pandas.
    if name == "log_finished":
        from gpulens.store.background import log_finished

        return log_finished
    raise AttributeError(f"module 'gpulens.store' has no attribute {name!r}")

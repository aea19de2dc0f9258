"""The interface every probe implements, so that hardware sits behind one seam."""

from __future__ import annotations

from typing import Any, Protocol

import pyarrow as pa


class Probe(Protocol):
    """A source of samples. ``sample()`` returns one row per observed device (GPU, host...).

    ``unsupported`` maps a metric name to the reason it cannot be measured here; such a metric is
    null in every row, never zero.
    """

    name: str
    schema: pa.Schema
    unsupported: dict[str, str]

    def sample(self) -> list[dict[str, Any]]: ...

    def close(self) -> None: ...

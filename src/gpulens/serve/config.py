"""What ``gpulens serve`` was asked for: a typed, validated configuration (no torch here)."""

from __future__ import annotations

import logging
import math
import re
from dataclasses import asdict, dataclass
from typing import Any

from gpulens.errors import UsageError

log = logging.getLogger(__name__)

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class ModelEntry:
    """One served model: the name clients use in URLs and the model it runs."""

    name: str
    workload: str

    @classmethod
    def parse(cls, text: str) -> ModelEntry:
        """``resnet50`` (served as resnet50) or ``NAME=MODEL`` (``a=resnet50``: a second
        tenant with the same model)."""
        name, _, workload = text.partition("=")
        name, workload = name.strip(), (workload or name).strip()
        if not name or not workload or not _NAME.match(name):
            raise UsageError(
                f"--model {text!r}: give a model (see `gpulens workloads`) or NAME=MODEL, "
                "NAME of letters, digits, '_', '-', '.'"
            )
        return cls(name, workload)


@dataclass(frozen=True)
class ServeConfig:
    """``max_batch`` <= 1 turns dynamic batching off (each request runs alone);
    ``max_queue_delay_ms`` is how long the oldest request may wait for a fuller batch (0, as
    Triton's default: batch only what has queued meanwhile); ``max_queue`` bounds the requests
    waiting per model (beyond: 503 with Retry-After); ``duration_s`` None serves until Ctrl-C."""

    models: tuple[ModelEntry, ...]
    max_batch: int = 32
    max_queue_delay_ms: float = 0.0
    instances: int = 1
    device: str = "auto"
    precision: str = "auto"
    host: str = "127.0.0.1"
    port: int = 8000
    max_queue: int = 256
    max_body_mb: float = 64.0
    duration_s: float | None = None
    sample_hz: float = 10.0
    warmup: bool = True
    name: str | None = None

    def __post_init__(self) -> None:
        if not self.models:
            raise UsageError("give at least one --model (e.g. --model resnet50)")
        names = [m.name for m in self.models]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:  # the suggestion names the model the second one runs, not its name
            second = [m for m in self.models if m.name == dupes[0]][1].workload
            raise UsageError(
                f"model {dupes[0]!r} is given twice: serve a second copy as NAME=MODEL "
                f"(--model {dupes[0]}2={second})"
            )
        if self.max_batch < 0:
            raise UsageError(
                f"--max-batch must be >= 0 (0 or 1: no batching), got {self.max_batch}"
            )
        if not (self.max_queue_delay_ms >= 0 and math.isfinite(self.max_queue_delay_ms)):
            raise UsageError(f"--max-queue-delay-ms must be >= 0, got {self.max_queue_delay_ms:g}")
        if self.instances < 1:
            raise UsageError(f"--instances must be >= 1, got {self.instances}")
        if self.precision not in PRECISIONS:
            raise UsageError(f"--precision {self.precision!r}: use one of {', '.join(PRECISIONS)}")
        if not 0 <= self.port <= 65535:
            raise UsageError(f"--port must be in 0..65535 (0: any free port), got {self.port}")
        if not self.host:
            raise UsageError("--host must not be empty (default 127.0.0.1)")
        if self.max_queue < 1:
            raise UsageError(f"--max-queue must be >= 1, got {self.max_queue}")
        if not (self.max_body_mb > 0 and math.isfinite(self.max_body_mb)):
            raise UsageError(f"--max-body-mb must be > 0, got {self.max_body_mb:g}")
        # inf and nan are no lengths of time (they once reached the record's JSON: an internal
        # error after the models were built); no --duration serves until Ctrl-C
        if self.duration_s is not None and not (
            self.duration_s > 0 and math.isfinite(self.duration_s)
        ):
            raise UsageError(f"--duration must be > 0 seconds, got {self.duration_s:g}")
        if not (self.sample_hz > 0 and math.isfinite(self.sample_hz)):
            raise UsageError(f"--sample-hz must be > 0, got {self.sample_hz:g}")

    @property
    def batching(self) -> bool:
        return self.max_batch > 1

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 1024 * 1024)

    def as_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["models"] = [asdict(m) for m in self.models]
        return doc

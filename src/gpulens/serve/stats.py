"""What the server counts, and its Prometheus ``/metrics`` text (exposition format 0.0.4).

Triton's metric names and labels (``model``, ``version``), so ``gpulens load`` reads the same
queue/compute split from Triton and from ``gpulens serve``: per request, cumulative
microseconds of request, queue and compute time (compute = input copy + forward + output copy,
each request of a batch charged the batch's compute, as Triton does), and counts of requests,
inferences (samples) and executions (batches). What only gpulens has is ``gpulens_serve_*``:
the batch-size histogram, the queue depth and the 503s. Standard library and numpy only.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
RESERVOIR = 200_000  # per model: latency samples kept for the percentiles (reservoir sampling)
FAILURE_REASONS = ("REJECTED", "BACKEND", "OTHER")  # queue full, the model failed, bad request


class Reservoir:
    """A uniform sample of at most ``size`` values (Vitter's algorithm R)."""

    def __init__(self, size: int = RESERVOIR, seed: int = 0):
        self.size, self.seen, self.values = size, 0, []
        self._rng = random.Random(seed)

    def add(self, value: float) -> None:
        self.seen += 1
        if len(self.values) < self.size:
            self.values.append(value)
        else:
            j = self._rng.randrange(self.seen)
            if j < self.size:
                self.values[j] = value

    def percentiles_ms(self, qs: Iterable[float] = (50, 99)) -> dict[str, float | None]:
        if not self.values:
            return {f"p{q:g}": None for q in qs}
        arr = np.asarray(self.values)
        return {f"p{q:g}": round(float(np.percentile(arr, q)), 4) for q in qs}


@dataclass
class ModelStats:
    """One model's counters (microseconds, counts) and latency samples (ms)."""

    success: int = 0
    failure: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAILURE_REASONS, 0))
    inferences: int = 0
    executions: int = 0
    request_us: int = 0
    queue_us: int = 0
    input_us: int = 0
    infer_us: int = 0
    output_us: int = 0
    batch_buckets: list[int] = field(default_factory=lambda: [0] * len(BATCH_BUCKETS))
    batch_sum: int = 0
    queue_ms: Reservoir = field(default_factory=Reservoir)
    compute_ms: Reservoir = field(default_factory=Reservoir)
    request_ms: Reservoir = field(default_factory=Reservoir)


class ServeStats:
    """Counters for every served model; thread-safe (workers and the event loop both write).
    ``depth(model)`` reads a model's queue depth for the gauge."""

    def __init__(self, models: Iterable[str], depth: Callable[[str], int] | None = None):
        self.models = {m: ModelStats() for m in models}
        self._depth = depth or (lambda _m: 0)
        self._lock = threading.Lock()

    def batch(self, model: str, size: int) -> None:
        """One execution of ``size`` samples."""
        with self._lock:
            s = self.models[model]
            s.executions += 1
            s.inferences += size
            s.batch_sum += size
            for i, bound in enumerate(BATCH_BUCKETS):
                if size <= bound:
                    s.batch_buckets[i] += 1
                    break

    def success(self, model: str, request_ns: int, queue_ns: int,
                compute_ns: tuple[int, int, int]) -> None:  # fmt: skip
        with self._lock:
            s = self.models[model]
            s.success += 1
            s.request_us += request_ns // 1000
            s.queue_us += queue_ns // 1000
            s.input_us += compute_ns[0] // 1000
            s.infer_us += compute_ns[1] // 1000
            s.output_us += compute_ns[2] // 1000
            s.request_ms.add(request_ns / 1e6)
            s.queue_ms.add(queue_ns / 1e6)
            s.compute_ms.add(sum(compute_ns) / 1e6)

    def failure(self, model: str, reason: str, request_ns: int = 0) -> None:
        with self._lock:
            s = self.models[model]
            s.failure[reason] = s.failure.get(reason, 0) + 1
            s.request_us += request_ns // 1000

    # ------------------------------------------------------------------------ reading
    def summary(self) -> dict:
        """Per model and in total: requests, failures, 503s, mean batch size, queue/compute/
        request p50/p99 in ms."""
        with self._lock:
            per_model = {}
            for name, s in self.models.items():
                per_model[name] = {
                    "requests": s.success,
                    "failures": sum(s.failure.values()),
                    "rejected_503": s.failure["REJECTED"],
                    "inferences": s.inferences,
                    "executions": s.executions,
                    "mean_batch_size": round(s.batch_sum / s.executions, 3)
                    if s.executions
                    else None,
                    "queue_ms": s.queue_ms.percentiles_ms(),
                    "compute_ms": s.compute_ms.percentiles_ms(),
                    "request_ms": s.request_ms.percentiles_ms(),
                }
        executions = sum(m["executions"] for m in per_model.values())
        return {
            "requests": sum(m["requests"] for m in per_model.values()),
            "failures": sum(m["failures"] for m in per_model.values()),
            "rejected_503": sum(m["rejected_503"] for m in per_model.values()),
            "mean_batch_size": round(
                sum(m["inferences"] for m in per_model.values()) / executions, 3
            )
            if executions
            else None,  # fmt: skip
            "models": per_model,
        }

    def prometheus(self, version: str = "1") -> str:
        """The ``/metrics`` page."""
        lines: list[str] = []
        with self._lock:
            snap = {m: _copy(s) for m, s in self.models.items()}
        depth = {m: self._depth(m) for m in snap}

        def family(name: str, kind: str, help_text: str, rows: Mapping[str, float],
                   extra: Mapping[str, Mapping[str, str]] | None = None) -> None:  # fmt: skip
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            for key, value in rows.items():
                labels = (extra or {}).get(key) or {"model": key, "version": version}
                lines.append(f"{name}{_labels(labels)} {_num(value)}")

        family("nv_inference_request_success", "counter", "Number of successful inference "
               "requests, all batch sizes", {m: s.success for m, s in snap.items()})  # fmt: skip
        rows, extra = {}, {}
        for m, s in snap.items():
            for reason, n in s.failure.items():
                rows[f"{m}\0{reason}"] = n
                extra[f"{m}\0{reason}"] = {"model": m, "reason": reason, "version": version}
        family("nv_inference_request_failure", "counter", "Number of failed inference requests, "
               "all batch sizes", rows, extra)  # fmt: skip
        family("nv_inference_count", "counter", "Number of inferences performed (does not "
               "include cached requests)", {m: s.inferences for m, s in snap.items()})  # fmt: skip
        executions = {m: s.executions for m, s in snap.items()}
        family("nv_inference_exec_count", "counter", "Number of model executions performed "
               "(does not include cached requests)", executions)  # fmt: skip
        for name, attr, text in (
            ("nv_inference_request_duration_us", "request_us", "Cumulative inference request "
             "duration in microseconds (includes cached requests)"),
            ("nv_inference_queue_duration_us", "queue_us", "Cumulative inference queuing "
             "duration in microseconds (includes cached requests)"),
            ("nv_inference_compute_input_duration_us", "input_us", "Cumulative compute input "
             "duration in microseconds (does not include cached requests)"),
            ("nv_inference_compute_infer_duration_us", "infer_us", "Cumulative compute inference "
             "duration in microseconds (does not include cached requests)"),
            ("nv_inference_compute_output_duration_us", "output_us", "Cumulative inference "
             "compute output duration in microseconds (does not include cached requests)"),
        ):  # fmt: skip
            family(name, "counter", text, {m: getattr(s, attr) for m, s in snap.items()})
        lines.append("# HELP gpulens_serve_batch_size Samples per model execution.")
        lines.append("# TYPE gpulens_serve_batch_size histogram")
        for m, s in snap.items():
            running = 0
            for bound, n in zip(BATCH_BUCKETS, s.batch_buckets, strict=True):
                running += n
                lines.append(f"gpulens_serve_batch_size_bucket{_labels({'model': m, 'le': bound})}"
                             f" {running}")  # fmt: skip
            lines.append(f'gpulens_serve_batch_size_bucket{_labels({"model": m, "le": "+Inf"})}'
                         f" {s.executions}")  # fmt: skip
            lines.append(f"gpulens_serve_batch_size_sum{_labels({'model': m})} {s.batch_sum}")
            lines.append(f"gpulens_serve_batch_size_count{_labels({'model': m})} {s.executions}")
        lines.append("# HELP gpulens_serve_queue_depth Requests waiting in the model's queue.")
        lines.append("# TYPE gpulens_serve_queue_depth gauge")
        lines += [f"gpulens_serve_queue_depth{_labels({'model': m})} {d}" for m, d in depth.items()]
        lines.append("# HELP gpulens_serve_rejected_total Requests refused with 503 (queue full).")
        lines.append("# TYPE gpulens_serve_rejected_total counter")
        lines += [
            f"gpulens_serve_rejected_total{_labels({'model': m})} {s.failure['REJECTED']}"
            for m, s in snap.items()
        ]
        return "\n".join(lines) + "\n"


def _copy(s: ModelStats) -> ModelStats:
    return ModelStats(s.success, dict(s.failure), s.inferences, s.executions, s.request_us,
                      s.queue_us, s.input_us, s.infer_us, s.output_us, list(s.batch_buckets),
                      s.batch_sum, s.queue_ms, s.compute_ms, s.request_ms)  # fmt: skip


def _escape(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Mapping[str, object]) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def prometheus_labels(labels: Mapping[str, object]) -> str:
    """``{k="v",...}`` with the values escaped (for other modules' families)."""
    return _labels(labels)

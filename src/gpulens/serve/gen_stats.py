"""What the server counts for its generative tenants, and their Prometheus families.

Per model: time to first token (from arrival, queueing included) and time per output token
(``(last - first) / (tokens - 1)``) as histograms in seconds, prompt and generated tokens,
requests by finish reason, sequences per iteration (the continuous batch), and two gauges read
live: running sequences and requests waiting. Names follow ``gpulens_serve_*`` (vLLM's
``time_to_first_token_seconds``/``time_per_output_token_seconds`` in spirit). Standard library
and numpy only.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from gpulens.serve.stats import BATCH_BUCKETS, Reservoir, prometheus_labels

log = logging.getLogger(__name__)

TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
FINISH_REASONS = ("length", "context", "cancelled", "error", "shutdown")


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * len(self.bounds)

    def add(self, value: float) -> None:
        self.n += 1
        self.total += value
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                break

    def lines(self, name: str, labels: dict) -> list[str]:
        out, running = [], 0
        for bound, n in zip(self.bounds, self.counts, strict=True):
            running += n
            out.append(f"{name}_bucket{prometheus_labels({**labels, 'le': bound})} {running}")
        out.append(f"{name}_bucket{prometheus_labels({**labels, 'le': '+Inf'})} {self.n}")
        out.append(f"{name}_sum{prometheus_labels(labels)} {self.total!r}")
        out.append(f"{name}_count{prometheus_labels(labels)} {self.n}")
        return out


@dataclass
class GenModelStats:
    ttft_s: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS_S))
    tpot_s: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS_S))
    step_batch: Histogram = field(default_factory=lambda: Histogram(BATCH_BUCKETS))
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft_ms: Reservoir = field(default_factory=Reservoir)
    tpot_ms: Reservoir = field(default_factory=Reservoir)


class GenerationStats:
    """Counters of every generative model; thread-safe. ``running(m)``/``waiting(m)`` read the
    gauges live."""

    def __init__(self, models: Iterable[str], running: Callable[[str], int],
                 waiting: Callable[[str], int]):  # fmt: skip
        self.models = {m: GenModelStats() for m in models}
        self._running, self._waiting = running, waiting
        self._lock = threading.Lock()

    def step(self, model: str, sequences: int) -> None:
        with self._lock:
            self.models[model].step_batch.add(sequences)

    def finish(self, model: str, prompt_tokens: int, tokens: int, reason: str,
               ttft_s: float | None, tpot_s: float | None) -> None:  # fmt: skip
        with self._lock:
            s = self.models[model]
            s.finished[reason] = s.finished.get(reason, 0) + 1
            s.prompt_tokens += prompt_tokens
            s.generated_tokens += tokens
            if ttft_s is not None:
                s.ttft_s.add(ttft_s)
                s.ttft_ms.add(ttft_s * 1e3)
            if tpot_s is not None:
                s.tpot_s.add(tpot_s)
                s.tpot_ms.add(tpot_s * 1e3)

    def summary(self, served_s: float | None = None) -> dict[str, dict]:
        """Per model: requests by finish reason, tokens, tokens/s, mean sequences per
        iteration, TTFT and TPOT p50/p99 in ms."""
        with self._lock:
            out = {}
            for m, s in self.models.items():
                steps = s.step_batch.n
                out[m] = {
                    "completions": dict(s.finished),
                    "prompt_tokens": s.prompt_tokens,
                    "generated_tokens": s.generated_tokens,
                    "tokens_per_s": round(s.generated_tokens / served_s, 3) if served_s else None,
                    "iterations": steps,
                    "mean_sequences_per_iteration": round(s.step_batch.total / steps, 3)
                    if steps
                    else None,
                    "ttft_ms": s.ttft_ms.percentiles_ms(),
                    "tpot_ms": s.tpot_ms.percentiles_ms(),
                }
        return out

    def prometheus(self) -> str:
        """The generation families of ``/metrics`` (appended to the server's)."""
        lines: list[str] = []
        with self._lock:
            snap = {
                m: (list(s.ttft_s.lines("gpulens_serve_time_to_first_token_seconds", {"model": m})),
                    list(s.tpot_s.lines("gpulens_serve_time_per_output_token_seconds",
                                        {"model": m})),
                    list(s.step_batch.lines("gpulens_serve_generation_batch_size", {"model": m})),
                    dict(s.finished), s.prompt_tokens, s.generated_tokens)
                for m, s in self.models.items()
            }  # fmt: skip

        def head(name: str, kind: str, text: str) -> None:
            lines.append(f"# HELP {name} {text}")
            lines.append(f"# TYPE {name} {kind}")

        for i, (name, text) in enumerate((
            ("gpulens_serve_time_to_first_token_seconds",
             "Time from a completion request's arrival to its first token."),
            ("gpulens_serve_time_per_output_token_seconds",
             "Time per output token after the first, per completion request."),
            ("gpulens_serve_generation_batch_size",
             "Sequences in one generation iteration (continuous batching)."),
        )):  # fmt: skip
            head(name, "histogram", text)
            for rows in snap.values():
                lines += rows[i]
        head("gpulens_serve_generation_tokens_total", "counter", "Tokens generated.")
        lines += [f"gpulens_serve_generation_tokens_total{prometheus_labels({'model': m})} {r[5]}"
                  for m, r in snap.items()]  # fmt: skip
        head("gpulens_serve_prompt_tokens_total", "counter", "Prompt tokens prefilled.")
        lines += [f"gpulens_serve_prompt_tokens_total{prometheus_labels({'model': m})} {r[4]}"
                  for m, r in snap.items()]  # fmt: skip
        head("gpulens_serve_completions_total", "counter", "Completions ended, by reason.")
        for m, r in snap.items():
            for reason, n in r[3].items():
                labels = prometheus_labels({"model": m, "finish_reason": reason})
                lines.append(f"gpulens_serve_completions_total{labels} {n}")
        head("gpulens_serve_active_sequences", "gauge", "Sequences being generated now.")
        lines += [f"gpulens_serve_active_sequences{prometheus_labels({'model': m})} "
                  f"{self._running(m)}" for m in snap]  # fmt: skip
        head("gpulens_serve_generation_queue_length", "gauge",
             "Completion requests waiting for a sequence slot.")  # fmt: skip
        lines += [f"gpulens_serve_generation_queue_length{prometheus_labels({'model': m})} "
                  f"{self._waiting(m)}" for m in snap]  # fmt: skip
        return "\n".join(lines) + "\n"

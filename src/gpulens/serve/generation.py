"""Continuous (iteration-level) batching of token generation for one language model.

One worker thread owns the model's KV cache (:class:`~gpulens.serve.kv_decode.CachedGPT`). Each
iteration it drops the sequences whose client went away, admits waiting requests up to
``max_batch`` running sequences and prefills them (their first token), runs one decode step for
every sequence already running (one more token each), and hands the iteration's tokens to
``on_tokens`` in one call (the HTTP side wakes each request's stream from there). A sequence ends
at ``max_tokens`` or at the model's context, and its slot is free for the next iteration. A full
queue refuses at once (:class:`~gpulens.serve.batcher.QueueFull`). No web framework here.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gpulens.serve.batcher import QueueFull, ShuttingDown
from gpulens.serve.kv_decode import CachedGPT

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Generation:
    """One completion request and, as it runs, its tokens and times (``perf_counter_ns``).
    ``stream`` is the caller's (e.g. an asyncio queue); ``finish_reason`` is set once done:
    ``length`` (max_tokens), ``context`` (the model's context is full), ``cancelled``,
    ``error``."""

    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    stream: Any = None
    enqueued_ns: int = field(default_factory=time.perf_counter_ns)
    admitted_ns: int = 0
    first_token_ns: int = 0
    last_token_ns: int = 0
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: BaseException | None = None
    cancelled: bool = False
    length: int = 0  # tokens whose keys/values are in the cache

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


# on_tokens(step): called on the worker once per iteration with (generation, new token or None,
# ended) triples; None when the generation ended without a token (cancelled, error, shutdown).
# ``ended`` is decided on the worker: the caller must not read ``done`` later, it races.
Event = tuple[Generation, "int | None", bool]
OnTokens = Callable[[list[Event]], None]
# on_step(sequences): the decode/prefill batch size of one iteration, for the metrics
OnStep = Callable[[int], None]


class GenerationService:
    """The waiting queue, the running sequences and the worker of one model."""

    def __init__(self, name: str, model: CachedGPT, on_tokens: OnTokens, *,
                 max_batch: int, max_queue: int, vocab_out: int,
                 autocast: torch.dtype | None = None, on_step: OnStep | None = None,
                 on_finish: Callable[[Generation], None] | None = None, seed: int = 0):  # fmt: skip
        self.name = name
        self.model = model
        self.max_batch = max(1, min(max_batch, model.slots))
        self.max_queue = max_queue
        self.vocab_out = min(vocab_out, model.vocab_size)
        self._autocast = autocast
        self._on_tokens, self._on_step = on_tokens, on_step or (lambda _n: None)
        self._on_finish = on_finish or (lambda _g: None)
        self._waiting: deque[Generation] = deque()
        self._running: list[Generation] = []  # running[i] lives in cache slot i
        self._cond = threading.Condition(threading.Lock())
        self._stopped = False
        self._rng = torch.Generator(device=model.device).manual_seed(seed)
        self._thread = threading.Thread(target=self._work, name=f"gpulens-gen-{name}", daemon=True)
        self._stream = torch.cuda.Stream(model.device) if model.device.type == "cuda" else None

    # ------------------------------------------------------------------------ callers
    def start(self) -> GenerationService:
        self._thread.start()
        return self

    def waiting(self) -> int:
        return len(self._waiting)

    def running(self) -> int:
        return len(self._running)

    def submit(self, gen: Generation) -> None:
        """Queue a request; :class:`QueueFull` or :class:`ShuttingDown` refuse it now."""
        with self._cond:
            if self._stopped:
                raise ShuttingDown(f"model {self.name!r} is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"model {self.name!r}: queue full ({self.max_queue} requests)")
            self._waiting.append(gen)
            self._cond.notify()

    def cancel(self, gen: Generation) -> None:
        """The client went away: free its slot at the next iteration (any thread)."""
        gen.cancelled = True

    def stop(self, timeout_s: float = 10.0) -> None:
        """End every request (waiting and running) with ``finish_reason`` shutdown, then the
        worker."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    # ------------------------------------------------------------------------ the worker
    def _work(self) -> None:
        ctx = torch.cuda.stream(self._stream) if self._stream else contextlib.nullcontext()
        autocast = (
            torch.autocast(self.model.device.type, dtype=self._autocast)
            if self._autocast is not None
            else contextlib.nullcontext()
        )
        with ctx, autocast, torch.inference_mode():
            while True:
                admitted = self._next()
                if admitted is None:
                    break
                try:
                    self._iterate(admitted)
                except Exception as exc:  # a failed step fails its sequences, never the worker
                    log.exception("model %s: a generation step failed", self.name)
                    self._fail([*self._running, *admitted], exc, "error")
                    self._running = []
        with self._cond:
            left = [*self._running, *self._waiting]
            self._waiting.clear()
        self._running = []
        self._fail(left, ShuttingDown(f"model {self.name!r} is shutting down"), "shutdown")

    def _next(self) -> list[Generation] | None:
        """Wait for work; the requests admitted this iteration (None once stopped)."""
        with self._cond:
            while not self._waiting and not self._running and not self._stopped:
                self._cond.wait()
            if self._stopped:
                return None
            admitted = []
            while self._waiting and len(self._running) + len(admitted) < self.max_batch:
                gen = self._waiting.popleft()
                if not gen.cancelled:
                    admitted.append(gen)
                else:
                    self._end(gen, "cancelled")
            return admitted

    def _iterate(self, admitted: list[Generation]) -> None:
        step: list[Generation] = []
        for gen in [g for g in self._running if g.cancelled]:
            self._end(gen, "cancelled")
        self._compact()
        old = len(self._running)
        if old:  # one token for every running sequence
            last = torch.tensor([g.tokens[-1] for g in self._running], device=self.model.device)
            lengths = torch.tensor([g.length for g in self._running], device=self.model.device)
            logits = self.model.decode(last, lengths)
            for gen in self._running:
                gen.length += 1
            self._emit(self._running, logits, step)
        if admitted:  # prefill the newcomers into the next free slots: their first token
            now = time.perf_counter_ns()
            for gen in admitted:
                gen.admitted_ns = now
            slots = list(range(old, old + len(admitted)))
            logits = self.model.prefill([g.prompt for g in admitted], slots)
            for gen in admitted:
                gen.length = len(gen.prompt)
            self._running.extend(admitted)
            self._emit(admitted, logits, step)
        self._on_step(len(self._running))
        for gen in self._running:
            if len(gen.tokens) >= gen.max_tokens:
                self._end(gen, "length")
            elif gen.length >= self.model.context:
                self._end(gen, "context")
        self._compact()
        self._on_tokens([(g, g.tokens[-1], g.done) for g in step])

    def _emit(self, gens: list[Generation], logits: torch.Tensor, step: list) -> None:
        """Pick each sequence's next token (greedy at temperature 0, else sampled)."""
        logits = logits[:, : self.vocab_out]
        picked = logits.argmax(dim=-1)
        temps = torch.tensor([g.temperature for g in gens], device=logits.device)
        hot = temps > 0
        if bool(hot.any()):
            probs = torch.softmax(logits[hot] / temps[hot, None], dim=-1)
            picked[hot] = torch.multinomial(probs, 1, generator=self._rng)[:, 0]
        now = time.perf_counter_ns()
        for gen, token in zip(gens, picked.tolist(), strict=True):
            gen.tokens.append(token)
            if not gen.first_token_ns:
                gen.first_token_ns = now
            gen.last_token_ns = now
            step.append(gen)

    def _end(self, gen: Generation, reason: str) -> None:
        gen.finish_reason = reason
        try:
            self._on_finish(gen)
        except Exception:  # the caller's hook: log, keep generating
            log.exception("model %s: finishing a generation failed", self.name)

    def _compact(self) -> None:
        """Drop ended sequences; the last running one moves into each freed slot."""
        i = 0
        while i < len(self._running):
            if self._running[i].done:
                last = len(self._running) - 1
                if i != last:
                    self.model.move(last, i)
                    self._running[i] = self._running[last]
                self._running.pop()
            else:
                i += 1

    def _fail(self, gens: list[Generation], exc: BaseException, reason: str) -> None:
        for gen in gens:
            if not gen.done:
                gen.error = exc
                self._end(gen, reason)
        if gens:
            self._on_tokens([(g, None, True) for g in gens])

"""The generative tenants of a serving run: one :class:`GenerationService` per served language
model over the model's own GPT module (the KServe path and generation share the weights), its
warm-up, its counters and one row per finished completion in the run's ``generations`` series."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import pyarrow as pa
import torch

from gpulens.serve import tokenizer
from gpulens.serve.gen_stats import GenerationStats
from gpulens.serve.generation import Generation, GenerationService, OnTokens
from gpulens.serve.kv_decode import CachedGPT
from gpulens.serve.repository import ServedModel
from gpulens.serve.stats import ServeStats

log = logging.getLogger(__name__)

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
WARMUP_TOKENS = 4

# The ``generations`` series: one row per completion request that ended.
GENERATION_SCHEMA = pa.schema([
    ("time_unix_s", pa.float64()), ("model", pa.string()), ("prompt_tokens", pa.int32()),
    ("completion_tokens", pa.int32()), ("queue_ms", pa.float64()), ("ttft_ms", pa.float64()),
    ("tpot_ms", pa.float64()), ("latency_ms", pa.float64()), ("finish_reason", pa.string()),
])  # fmt: skip


def _cached(model: ServedModel, slots: int) -> CachedGPT:
    gpt = model.instances[0].lm  # LastTokenLogits wraps the GPT module
    dtype = _DTYPES.get(model.precision, next(gpt.parameters()).dtype)
    return CachedGPT(gpt, slots, model.device, dtype)


def _warm_up(cached: CachedGPT, autocast: torch.dtype | None) -> None:
    """Prefill and a few decode steps (kernels chosen, cache allocated) before ready."""
    ctx = torch.autocast(cached.device.type, dtype=autocast) if autocast else nullcontext()
    with ctx, torch.inference_mode():
        logits = cached.prefill([[0] * 8], [0])
        length = torch.tensor([8], device=cached.device)
        for _ in range(WARMUP_TOKENS):
            logits = cached.decode(logits.argmax(-1), length)
            length = length + 1


def _timings(gen: Generation) -> tuple[float | None, float | None]:
    """(TTFT s, TPOT s) of a completion that ran to its end; None where there is none."""
    if gen.finish_reason not in ("length", "context") or not gen.first_token_ns:
        return None, None
    ttft = (gen.first_token_ns - gen.enqueued_ns) / 1e9
    n = len(gen.tokens)
    tpot = (gen.last_token_ns - gen.first_token_ns) / 1e9 / (n - 1) if n > 1 else None
    return ttft, tpot


def build_services(models: dict[str, ServedModel], *, max_batch: int, max_queue: int,
                   warmup: bool, stats: ServeStats, on_tokens: OnTokens,
                   on_row: Callable[[dict], None]) -> tuple[dict[str, GenerationService],
                                                            GenerationStats]:  # fmt: skip
    """A started service per generative model, and the counters they feed."""
    services: dict[str, GenerationService] = {}
    gen_stats = GenerationStats(
        [n for n, m in models.items() if m.spec.generative],
        running=lambda m: services[m].running() if m in services else 0,
        waiting=lambda m: services[m].waiting() if m in services else 0,
    )
    slots = max(1, max_batch)
    for name, model in models.items():
        if not model.spec.generative:
            continue
        cached = _cached(model, slots)
        autocast = _DTYPES.get(model.precision)
        if warmup:
            _warm_up(cached, autocast)

        def finish(gen: Generation, name: str = name) -> None:
            ttft, tpot = _timings(gen)
            gen_stats.finish(name, len(gen.prompt), len(gen.tokens), gen.finish_reason, ttft, tpot)
            end_ns = gen.last_token_ns or time.perf_counter_ns()
            queue_ns = (gen.admitted_ns or end_ns) - gen.enqueued_ns
            if ttft is not None:
                compute = (0, end_ns - gen.admitted_ns, 0)
                stats.success(name, end_ns - gen.enqueued_ns, queue_ns, compute)
            elif gen.finish_reason == "error":
                stats.failure(name, "BACKEND", end_ns - gen.enqueued_ns)
            on_row({
                "time_unix_s": time.time(), "model": name, "prompt_tokens": len(gen.prompt),
                "completion_tokens": len(gen.tokens), "queue_ms": queue_ns / 1e6,
                "ttft_ms": None if ttft is None else ttft * 1e3,
                "tpot_ms": None if tpot is None else tpot * 1e3,
                "latency_ms": (end_ns - gen.enqueued_ns) / 1e6,
                "finish_reason": gen.finish_reason,
            })  # fmt: skip

        services[name] = GenerationService(
            name, cached, on_tokens, max_batch=slots, max_queue=max_queue,
            vocab_out=tokenizer.VOCAB_SIZE, autocast=autocast,
            on_step=lambda n, name=name: gen_stats.step(name, n), on_finish=finish,
        ).start()  # fmt: skip
        log.info("%s: generating with a KV cache of %d slots (context %d)", name, slots,
                 cached.context)  # fmt: skip
    return services, gen_stats


def effective_of(models: dict[str, ServedModel], max_batch: int) -> list[dict[str, Any]]:
    """What the run's effective config says of each generative tenant."""
    out = []
    for name, model in models.items():
        if model.spec.generative:
            gpt = model.instances[0].lm
            out.append({
                "name": name, "endpoint": "/v1/completions", "tokenizer": tokenizer.NAME,
                "context_tokens": gpt.cfg.block_size, "max_sequences": max(1, max_batch),
                "kv_cache_dtype": model.precision if model.precision in _DTYPES else "fp32",
            })  # fmt: skip
    return out

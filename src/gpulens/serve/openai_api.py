"""OpenAI-compatible completions for the generative tenants: ``POST /v1/completions`` (streamed
as server-sent events or one JSON) and ``GET /v1/models``.

A request is checked here (400 bad request, 404 unknown model, 503 queue full, each in OpenAI's
error JSON), queued to the model's :class:`~gpulens.serve.generation.GenerationService` and
answered from an asyncio queue that the worker fills once per iteration (one
``call_soon_threadsafe`` per iteration, not per token). A client that goes away mid-stream
cancels its sequence, which frees its slot at the next iteration. Text is byte-level
(:mod:`~gpulens.serve.tokenizer`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from gpulens.serve import tokenizer
from gpulens.serve.batcher import QueueFull, ShuttingDown
from gpulens.serve.generation import Event, Generation, GenerationService

log = logging.getLogger(__name__)

JSON = "application/json"
DEFAULT_MAX_TOKENS = 16  # OpenAI's default
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; 0 is greedy
WIRE_REASON = {"length": "length", "context": "length"}


class OpenAIError(Exception):
    """A request the server refuses, in OpenAI's error format."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None):  # fmt: skip
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code

    def body(self) -> bytes:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        err = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        return json.dumps({"error": err}).encode()

    def response(self, headers: Mapping[str, str] | None = None) -> Response:
        return Response(self.body(), status_code=self.status, media_type=JSON, headers=headers)


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompt: list[int]
    max_tokens: int
    temperature: float
    stream: bool
    include_usage: bool
    return_token_ids: bool = False  # vLLM's extension: each choice also carries its token ids


def _int(doc: dict, key: str, default: int) -> int:
    value = doc.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise OpenAIError(f"'{key}' must be an integer >= 1, got {value!r}", param=key)
    return value


def _prompt(value, vocab_size: int) -> list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one prompt
    if isinstance(value, str):
        ids = tokenizer.encode(value)
    elif isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        ids = value
        if any(not 0 <= t < vocab_size for t in ids):
            raise OpenAIError(f"token ids of 'prompt' must be in [0, {vocab_size})", param="prompt")
    else:
        raise OpenAIError(
            "'prompt' must be a string or a list of token ids (one prompt per request)",
            param="prompt",
        )
    if not ids:
        raise OpenAIError("'prompt' is empty: give at least one token", param="prompt")
    return ids


def parse_completion(body: bytes, models: Mapping[str, GenerationService],
                     served: Mapping[str, object] = ()) -> CompletionRequest:  # fmt: skip
    """The request in ``body``; :class:`OpenAIError` naming what is wrong else."""
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise OpenAIError(f"the body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise OpenAIError("the body must be a JSON object")
    name = doc.get("model")
    if not isinstance(name, str) or not name:
        raise OpenAIError("'model' is required: the name of a served language model", param="model")
    service = models.get(name)
    if service is None:
        what = "is not a language model" if name in served else "does not exist"
        raise OpenAIError(
            f"the model {name!r} {what}; language models served: {', '.join(models) or 'none'}",
            404, "model", "model_not_found",
        )  # fmt: skip
    if "prompt" not in doc:
        raise OpenAIError("'prompt' is required", param="prompt")
    prompt = _prompt(doc["prompt"], service.model.vocab_size)
    max_tokens = _int(doc, "max_tokens", DEFAULT_MAX_TOKENS)
    temperature = doc.get("temperature", DEFAULT_TEMPERATURE)
    temperature = DEFAULT_TEMPERATURE if temperature is None else temperature
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
        0 <= temperature <= 2
    ):  # fmt: skip
        raise OpenAIError(
            f"'temperature' must be in [0, 2], got {temperature!r}", param="temperature"
        )
    n = doc.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise OpenAIError("'n' must be 1: one completion per request", param="n")
    stream = doc.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise OpenAIError("'stream' must be true or false", param="stream")
    options = doc.get("stream_options")
    options = {} if options is None else options
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise OpenAIError(
            "'stream_options' must be an object like {\"include_usage\": true}",
            param="stream_options",
        )
    context = service.model.context
    if len(prompt) + max_tokens > context:
        raise OpenAIError(
            f"this model's maximum context length is {context} tokens; the prompt has "
            f"{len(prompt)} and max_tokens asks for {max_tokens}: shorten one",
            param="max_tokens", code="context_length_exceeded",
        )  # fmt: skip
    return CompletionRequest(name, prompt, max_tokens, float(temperature), bool(stream),
                             bool(options.get("include_usage")),
                             doc.get("return_token_ids") is True)  # fmt: skip


@dataclass
class OpenAIState:
    """What the completion handlers share: the generation services, the other served model
    names (for a precise 404) and the event loop the workers wake."""

    services: dict[str, GenerationService]
    served: tuple[str, ...] = ()
    max_body_bytes: int = 1 << 20
    loop: asyncio.AbstractEventLoop | None = field(default=None, repr=False)
    on_refused: Callable[[str, int], None] | None = None  # a 503, counted by the caller

    def deliver(self, step: list[Event]) -> None:
        """The services' ``on_tokens`` hook (a worker thread): wake the streams on the loop."""
        if self.loop is not None and step:
            self.loop.call_soon_threadsafe(_put, step)


def _put(step: list[Event]) -> None:
    for gen, token, ended in step:
        if gen.stream is not None:
            gen.stream.put_nowait((token, ended))


async def _read(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise OpenAIError(f"the request body exceeds {limit} bytes (--max-body-mb)", 413)
        chunks.append(chunk)
    return b"".join(chunks)


def _usage(req: CompletionRequest, gen: Generation) -> dict:
    n = len(gen.tokens)
    return {"prompt_tokens": len(req.prompt), "completion_tokens": n,
            "total_tokens": len(req.prompt) + n}  # fmt: skip


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def completion_routes(state: OpenAIState) -> list[Route]:
    """``/v1/completions`` and ``/v1/models`` over ``state``."""

    async def models(_request: Request) -> Response:
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "gpulens",
                 "max_model_len": s.model.context} for m, s in state.services.items()]  # fmt: skip
        return Response(json.dumps({"object": "list", "data": data}), media_type=JSON)

    async def completions(request: Request) -> Response:
        try:
            req = parse_completion(
                await _read(request, state.max_body_bytes), state.services, state.served
            )
        except OpenAIError as exc:
            return exc.response()
        if state.loop is None:
            state.loop = asyncio.get_running_loop()
        service = state.services[req.model]
        gen = Generation(req.prompt, req.max_tokens, req.temperature, stream=asyncio.Queue())
        try:
            service.submit(gen)
        except (QueueFull, ShuttingDown) as exc:
            if state.on_refused is not None:
                state.on_refused(req.model, 503)
            return OpenAIError(f"{exc}: retry later", 503).response({"Retry-After": "1"})
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": req.model}  # fmt: skip
        if req.stream:
            return StreamingResponse(
                _stream(service, gen, req, head), media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )  # fmt: skip
        return await _whole(service, gen, req, head)

    return [
        Route("/v1/models", models),
        Route("/v1/completions", completions, methods=["POST"]),
    ]


def _failure(gen: Generation) -> OpenAIError:
    status = 503 if gen.finish_reason == "shutdown" else 500
    return OpenAIError(f"generation failed ({gen.finish_reason}): {gen.error}", status)


async def _whole(service: GenerationService, gen: Generation, req: CompletionRequest,
                 head: dict) -> Response:  # fmt: skip
    decoder, parts = tokenizer.StreamDecoder(), []
    try:
        while True:
            token, ended = await gen.stream.get()
            if token is not None:
                parts.append(decoder.feed(token))
            if ended:
                break
    finally:
        if not gen.done:
            service.cancel(gen)
    if gen.error is not None:
        return _failure(gen).response()
    parts.append(decoder.flush())
    choice = {"text": "".join(parts), "index": 0, "logprobs": None,
              "finish_reason": WIRE_REASON.get(gen.finish_reason, gen.finish_reason)}  # fmt: skip
    if req.return_token_ids:
        choice["token_ids"] = list(gen.tokens)
    doc = {**head, "choices": [choice], "usage": _usage(req, gen)}
    return Response(json.dumps(doc), media_type=JSON)


async def _stream(service: GenerationService, gen: Generation, req: CompletionRequest,
                  head: dict) -> AsyncIterator[bytes]:  # fmt: skip
    """The SSE events: one per token with text, the last with its finish reason, the usage
    when asked (``stream_options.include_usage``), then ``data: [DONE]``."""
    decoder = tokenizer.StreamDecoder()
    try:
        while True:
            token, ended = await gen.stream.get()
            text = decoder.feed(token) if token is not None else ""
            if ended and gen.error is not None:
                yield _sse(json.loads(_failure(gen).body()))
                break
            if ended:
                text += decoder.flush()
            if text or ended or (req.return_token_ids and token is not None):
                reason = WIRE_REASON.get(gen.finish_reason, gen.finish_reason) if ended else None
                choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": reason}
                if req.return_token_ids:
                    choice["token_ids"] = [] if token is None else [token]
                yield _sse({**head, "choices": [choice]})
            if ended:
                if req.include_usage:
                    yield _sse({**head, "choices": [], "usage": _usage(req, gen)})
                break
        yield b"data: [DONE]\n\n"
    finally:  # the client went away (the stream was cancelled): free the slot
        if not gen.done:
            service.cancel(gen)

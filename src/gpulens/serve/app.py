"""The HTTP side of ``gpulens serve``: a Starlette app speaking KServe v2 REST (and, for language
models, OpenAI-compatible completions from :mod:`~gpulens.serve.openai_api`), served by uvicorn in
a thread. With ``openai_api``, the only modules that import a web framework (the ``serve`` extra).

The request path is lean: the body is read once, decoded with numpy
(:mod:`~gpulens.serve.protocol`), queued to the model's :class:`~gpulens.serve.batcher.Batcher`
and awaited on a future that the worker resolves (one ``call_soon_threadsafe`` per batch). No
thread is created per request and no schema validation walks the tensors.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gpulens import __version__
from gpulens.serve.batcher import Batcher, Pending, QueueFull, ShuttingDown
from gpulens.serve.config import ServeConfig
from gpulens.serve.openai_api import OpenAIState, completion_routes
from gpulens.serve.openapi import openapi_document
from gpulens.serve.protocol import (
    HEADER_LENGTH,
    ProtocolError,
    decode_request,
    encode_response,
    error_body,
    parse_header_length,
)
from gpulens.serve.repository import VERSION, ServedModel
from gpulens.serve.stats import CONTENT_TYPE, ServeStats

log = logging.getLogger(__name__)

JSON = "application/json"
RETRY_AFTER_S = 1


@dataclass
class ServerState:
    """What the handlers share: the models, their batchers and the counters."""

    config: ServeConfig
    models: dict[str, ServedModel]
    batchers: dict[str, Batcher]
    stats: ServeStats
    ready: bool = True
    loop: asyncio.AbstractEventLoop | None = field(default=None, repr=False)
    openai: OpenAIState | None = None  # the generative tenants, when a language model is served
    extra_metrics: list = field(default_factory=list)  # more /metrics text: () -> str each

    def complete(self, batch: list[Pending]) -> None:
        """The batchers' hook (a worker thread): resolve the batch's futures on the loop."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(_resolve, batch)


def _resolve(batch: list[Pending]) -> None:
    for item in batch:
        if not item.token.done():
            item.token.set_result(None)


def _error(message: str, status: int, headers: Mapping[str, str] | None = None) -> Response:
    return Response(error_body(message), status_code=status, media_type=JSON, headers=headers)


async def _body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    too_big = ProtocolError(
        f"the request body exceeds the server's limit of {limit} bytes (--max-body-mb)", 413
    )
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def build_app(state: ServerState) -> Starlette:
    """The Starlette application over ``state``."""
    batching = state.config.batching
    limit = state.config.max_body_bytes
    server_meta = {"name": "gpulens", "version": __version__, "extensions": ["binary_tensor_data"]}
    generative = list(state.openai.services) if state.openai else []
    spec = openapi_document(list(state.models), generative)

    def model_of(request: Request) -> ServedModel:
        name = request.path_params["name"]
        model = state.models.get(name)
        if model is None:
            raise ProtocolError(f"unknown model {name!r}; served: {', '.join(state.models)}", 404)
        version = request.path_params.get("version")
        if version is not None and version != VERSION:
            raise ProtocolError(f"model {name!r} has no version {version!r} (only {VERSION})", 404)
        return model

    async def live(_request: Request) -> Response:
        return JSONResponse({"live": True})

    async def ready(_request: Request) -> Response:
        return JSONResponse({"ready": state.ready}, status_code=200 if state.ready else 400)

    async def server_metadata(_request: Request) -> Response:
        return JSONResponse(server_meta)

    async def model_metadata(request: Request) -> Response:
        return JSONResponse(model_of(request).metadata())

    async def model_config(request: Request) -> Response:
        return JSONResponse(model_of(request).config())

    async def model_ready(request: Request) -> Response:
        model = model_of(request)
        return JSONResponse({"name": model.name, "ready": state.ready},
                            status_code=200 if state.ready else 400)  # fmt: skip

    async def metrics(_request: Request) -> Response:
        text = state.stats.prometheus(VERSION) + "".join(f() for f in state.extra_metrics)
        return Response(text, media_type=CONTENT_TYPE)

    async def openapi(_request: Request) -> Response:
        return JSONResponse(spec)

    async def infer(request: Request) -> Response:
        start = time.perf_counter_ns()
        model = model_of(request)  # a 404 before any counting: no such model label
        name = model.name
        try:
            body = await _body(request, limit)
            header_length = parse_header_length(request.headers.get(HEADER_LENGTH), len(body))
            req = decode_request(body, header_length)
            checked = model.check(req, batching)
        except ProtocolError as exc:
            state.stats.failure(name, "OTHER", time.perf_counter_ns() - start)
            return _error(exc.message, exc.status)
        loop = state.loop
        if loop is None:
            loop = state.loop = asyncio.get_running_loop()
        item = Pending(checked.array, checked.n, token=loop.create_future())
        try:
            state.batchers[name].submit(item)
        except (QueueFull, ShuttingDown) as exc:
            state.stats.failure(name, "REJECTED", time.perf_counter_ns() - start)
            return _error(f"{exc}: retry later", 503, {"Retry-After": str(RETRY_AFTER_S)})
        await item.token
        if item.error is not None:
            if isinstance(item.error, ShuttingDown):
                state.stats.failure(name, "REJECTED", time.perf_counter_ns() - start)
                return _error(str(item.error), 503, {"Retry-After": str(RETRY_AFTER_S)})
            state.stats.failure(name, "BACKEND", time.perf_counter_ns() - start)
            return _error(f"model {name!r} failed: {item.error}", 500)
        out, header_length = encode_response(name, VERSION, item.result, req)
        headers = {HEADER_LENGTH: str(header_length)} if header_length is not None else None
        media = "application/octet-stream" if header_length is not None else JSON
        state.stats.success(name, time.perf_counter_ns() - start, item.queue_ns, item.compute_ns)
        return Response(out, media_type=media, headers=headers)

    async def protocol_error(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ProtocolError)
        return _error(exc.message, exc.status)

    async def http_error(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return _error(str(exc.detail), exc.status_code, exc.headers)  # 405 keeps its Allow

    async def server_error(_request: Request, exc: Exception) -> Response:
        log.exception("unexpected error while serving a request", exc_info=exc)
        return _error(f"internal error: {exc}", 500)

    m = "/v2/models/{name}"
    v = "/v2/models/{name}/versions/{version}"
    routes = [
        Route("/v2/health/live", live),
        Route("/v2/health/ready", ready),
        Route("/v2", server_metadata),
        Route("/metrics", metrics),
        Route("/v2/openapi.json", openapi),
    ]
    for base in (m, v):
        routes += [
            Route(base, model_metadata),
            Route(f"{base}/ready", model_ready),
            Route(f"{base}/config", model_config),
            Route(f"{base}/infer", infer, methods=["POST"]),
        ]
    if state.openai is not None:
        routes += completion_routes(state.openai)
    return Starlette(
        routes=routes,
        exception_handlers={
            ProtocolError: protocol_error,
            HTTPException: http_error,
            Exception: server_error,
        },
    )


def http_implementation() -> dict[str, str]:
    """The event loop and HTTP parser uvicorn will use: uvloop and httptools where installed
    (the serve extra installs both; uvicorn's own ``auto`` picks the same), else asyncio and h11."""
    from importlib.util import find_spec

    return {
        "loop": "uvloop" if find_spec("uvloop") else "asyncio",
        "http": "httptools" if find_spec("httptools") else "h11",
    }


class HttpServer:
    """uvicorn on an already bound socket, in a thread of its own (so the caller's thread
    keeps its signal handling)."""

    def __init__(self, state: ServerState, sock: socket.socket):
        impl = http_implementation()
        config = uvicorn.Config(
            build_app(state),
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_keep_alive=30,
            backlog=4096,
            loop=impl["loop"],
            http=impl["http"],
        )
        self._server = uvicorn.Server(config)
        self._sock = sock
        self._thread = threading.Thread(target=self._run, name="gpulens-serve-http", daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._sock])
        except BaseException as exc:  # reported by the runner
            self.error = exc
            log.error("the HTTP server stopped: %s", exc)

    def start(self, timeout_s: float = 30.0) -> HttpServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started and self._thread.is_alive():
            if time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start in time")
            time.sleep(0.01)
        if not self._server.started:
            raise RuntimeError(f"the HTTP server did not start: {self.error}")
        return self

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)

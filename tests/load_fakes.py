"""Small fake servers for the load generator's tests: a KServe v2 server (aiohttp.web) with a
configurable delay, failures and Triton-style /metrics, and an OpenAI-compatible SSE server.
Each runs on its own event loop in a thread, on a free loopback port."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import deque
from collections.abc import Callable

from aiohttp import web

from gpulens.serve.load_inputs import BINARY_HEADER, decode_binary_request

SMALL = {"name": "small", "platform": "fake", "versions": ["1"],
         "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
         "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 1]}]}  # fmt: skip
LARGE = {"name": "large", "platform": "fake", "versions": ["1"],
         "inputs": [{"name": "image", "datatype": "FP32", "shape": [-1, 3, 32, 32]},
                    {"name": "flag", "datatype": "INT64", "shape": [-1, 1]}],
         "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 10]}]}  # fmt: skip


class FakeKServe:
    """``delay_s(model, recent_rate_rps) -> seconds`` per request; ``fail_every``: every Nth
    infer answers 500; ``drop_every``: every Nth closes the connection unanswered;
    ``metrics``: serve Triton-style counters at /metrics."""

    def __init__(self, delay_s: Callable[[str, float], float] | float = 0.0,
                 fail_every: int = 0, metrics: bool = True, models=(SMALL, LARGE),
                 drop_every: int = 0, chunked: bool = False, close: bool = False):  # fmt: skip
        self.drop_every = drop_every
        self.chunked, self.close = chunked, close
        self.delay_s = delay_s if callable(delay_s) else (lambda _m, _r, d=delay_s: d)
        self.fail_every = fail_every
        self.metrics = metrics
        self.models = {m["name"]: m for m in models}
        self.counts: dict[str, dict[str, float]] = {}
        self.bodies: list[dict] = []
        self.arrivals: deque = deque()
        self.n = 0
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _rate(self, now: float, window_s: float = 0.5) -> float:
        self.arrivals.append(now)
        while self.arrivals and self.arrivals[0] < now - window_s:
            self.arrivals.popleft()
        return len(self.arrivals) / window_s

    async def _meta(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in self.models:
            return web.json_response({"error": f"unknown model {name}"}, status=404)
        return web.json_response(self.models[name])

    async def _infer(self, request: web.Request) -> web.Response:
        t0 = time.perf_counter()
        name = request.match_info["name"]
        body = await request.read()
        hlen = request.headers.get(BINARY_HEADER)
        doc = decode_binary_request(body, int(hlen) if hlen else None)
        if len(self.bodies) < 5:
            self.bodies.append({"doc": doc, "bytes": len(body), "binary_header": hlen})
        self.n += 1
        rate = self._rate(t0)
        if self.drop_every and self.n % self.drop_every == 0:
            request.transport.close()  # no answer: the client sees the connection go
            raise web.HTTPInternalServerError()
        if self.fail_every and self.n % self.fail_every == 0:
            return web.json_response({"error": "injected failure"}, status=500)
        delay = self.delay_s(name, rate)
        if delay > 0:
            await asyncio.sleep(delay)
        c = self.counts.setdefault(name, {"ok": 0, "queue": 0.0, "compute": 0.0})
        c["ok"] += 1
        c["queue"] += 0.25 * delay * 1e6
        c["compute"] += 0.75 * delay * 1e6
        out = {"model_name": name, "outputs": [{"name": "y", "datatype": "FP32",
                                                "shape": [1, 1], "data": [0.5]}]}  # fmt: skip
        headers = {"Connection": "close"} if self.close else None
        if not self.chunked:
            return web.json_response(out, headers=headers)
        resp = web.StreamResponse(headers=headers)
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        text = json.dumps(out).encode()
        await resp.write(text[:10])
        await resp.write(text[10:])
        await resp.write_eof()
        return resp

    async def _metrics(self, _request: web.Request) -> web.Response:
        if not self.metrics:
            return web.Response(status=404, text="no metrics")
        lines = ["# HELP nv_inference_request_success Number of successful requests",
                 "# TYPE nv_inference_request_success counter"]  # fmt: skip
        for name, c in self.counts.items():
            lab = f'{{model="{name}",version="1"}}'
            lines += [
                f"nv_inference_request_success{lab} {c['ok']}",
                f"nv_inference_queue_duration_us{lab} {c['queue']}",
                f"nv_inference_compute_infer_duration_us{lab} {c['compute']}",
                f"nv_inference_exec_count{lab} {c['ok'] / 2}",
                f"nv_inference_count{lab} {c['ok']}",
            ]
        return web.Response(text="\n".join(lines) + "\n")

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/v2/models/{name}", self._meta)
        app.router.add_post("/v2/models/{name}/infer", self._infer)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    def __enter__(self) -> FakeKServe:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


class FakeOpenAI(FakeKServe):
    """``/v1/completions`` streaming ``tokens`` events, the first after ``ttft_s``, then one
    every ``tpot_s``, then a usage event and ``[DONE]``."""

    def __init__(self, ttft_s: float = 0.02, tpot_s: float = 0.005, tokens: int = 8,
                 served: tuple[str, ...] = (), byte_level: bool = False):  # fmt: skip
        super().__init__(metrics=False, models=())
        self.ttft_s, self.tpot_s, self.tokens = ttft_s, tpot_s, tokens
        self.served = served  # empty: any model name
        self.byte_level = byte_level  # prompt tokens: its bytes (as gpulens's gpt), else words
        self.requests: list[dict] = []

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        if self.served and body["model"] not in self.served:
            error = {"message": f"the model {body['model']!r} does not exist", "code": None}
            return web.json_response({"error": error}, status=404)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(self.ttft_s)
        for k in range(self.tokens):
            if k:
                await asyncio.sleep(self.tpot_s)
            event = {"choices": [{"index": 0, "text": f" t{k}"}], "model": body["model"]}
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
        prompt = body["prompt"]
        counted = len(prompt.encode()) if self.byte_level else len(prompt.split())
        usage = {"choices": [], "usage": {"completion_tokens": self.tokens,
                                          "prompt_tokens": counted}}  # fmt: skip
        await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        await resp.write_eof()
        return resp

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

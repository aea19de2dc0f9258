"""The open-loop load generator: one clock for all tenants, requests sent on schedule.

Every tenant's arrival times (Poisson or constant, seeded) are drawn in advance and merged
into one schedule; one sender walks it and starts each request at its time whatever the
server does (an open loop, as MLPerf LoadGen's server scenario). Per request it records the
scheduled time, the send time (when its coroutine starts the HTTP call; lateness = send −
scheduled), the completion time and the status. The HTTP client is aiohttp (imported here,
lazily: ``gpulens[serve]``), one keep-alive connection pool.

Named scenarios, mapped onto LoadGen's:
- ``server``: Poisson arrivals at the tenant's rate, result = whether p99 ≤ SLO (LoadGen's
  server scenario with its latency constraint, at the rate given instead of a searched one:
  ``--find-max`` is the search);
- ``single-stream``: one request at a time, the next as soon as the last completes; result =
  p90 latency (LoadGen's single-stream metric);
- ``offline``: every request scheduled at t=0 (``rate × duration`` of them, or
  ``offline_requests``), sent as fast as the pool allows; result = samples/s (requests ×
  batch), LoadGen's offline throughput.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpulens.errors import MissingExtraError, RuntimeFailure
from gpulens.serve import load_report, openai_load
from gpulens.serve.http_client import RawPool, encode_request
from gpulens.serve.load_config import LoadConfig, TenantSpec
from gpulens.serve.load_inputs import kserve_request, request_from_file
from gpulens.serve.load_report import (
    ERR_CONNECTION,
    ERR_OTHER,
    ERR_TIMEOUT,
    NOT_DONE,
    LoadRecords,
)
from gpulens.serve.wakeup import due_timer

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 0.5
ProgressFn = Callable[[int, int], None]


def require_aiohttp():
    try:
        import aiohttp
    except ImportError:
        raise MissingExtraError("aiohttp", "serve") from None
    return aiohttp


# --------------------------------------------------------------------------- schedule
def arrival_times(spec: TenantSpec, total_s: float, rng: np.random.Generator) -> np.ndarray:
    """Seconds from the start at which ``spec``'s requests arrive, all below ``total_s``.
    Poisson: exponential gaps from t=0 (the first arrival after one gap); constant: k / rate."""
    rate = spec.rate_rps
    if spec.arrival == "constant":
        return np.arange(0.0, total_s, 1.0 / rate)
    expected = rate * total_s
    n = int(expected + 10.0 * math.sqrt(expected) + 16)
    times = np.cumsum(rng.exponential(1.0 / rate, size=n))
    while times[-1] < total_s:  # rare: draw more
        more = times[-1] + np.cumsum(rng.exponential(1.0 / rate, size=n))
        times = np.concatenate([times, more])
    return times[times < total_s]


def merged_schedule(
    tenants: tuple[TenantSpec, ...], total_s: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """All tenants' arrivals on one clock: (times ascending, tenant index per request). Each
    tenant draws from its own seeded stream, so adding a tenant does not move the others."""
    times, owners = [], []
    for i, spec in enumerate(tenants):
        t = arrival_times(spec, total_s, np.random.default_rng([seed, i]))
        times.append(t)
        owners.append(np.full(t.size, i, dtype=np.int32))
    all_t, all_o = np.concatenate(times), np.concatenate(owners)
    order = np.lexsort((all_o, all_t))  # by time, ties by tenant
    return all_t[order], all_o[order]


# --------------------------------------------------------------------------- outcome
@dataclass
class LoadOutcome:
    """What one load run measured: the records, and the two /metrics scrapes (None when the
    server has none, with the reason)."""

    records: LoadRecords
    metrics_before: str | None
    metrics_after: str | None
    metrics_reason: str | None
    requests: dict  # model -> {"path", "input_bytes", "binary"}

    def document(self, config: LoadConfig) -> dict:
        server = None
        if self.metrics_before is not None and self.metrics_after is not None:
            models = [t.model for t in config.tenants]
            server = load_report.server_split(self.metrics_before, self.metrics_after, models)
        doc = load_report.build_document(
            config.url, config.tenants, self.records, server, config.price_per_hour_usd,
            config.scenario, self.metrics_reason, config.concurrency,
        )  # fmt: skip
        doc["requests_sent"] = self.requests
        return doc


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


# --------------------------------------------------------------------------- the driver
class _Driver:
    def __init__(self, config: LoadConfig, session, aiohttp, prepared: list):
        self.config = config
        self.session = session
        self.aiohttp = aiohttp
        self.prepared = prepared  # per tenant: InferRequest or bytes (OpenAI body)
        self.timeout = aiohttp.ClientTimeout(total=config.timeout_s)
        self.t0 = 0.0
        self.tenant: list[int] = []
        self.sched: list[float] = []
        self.sent: list[float] = []
        self.done: list[float] = []
        self.status: list[int] = []
        self.ttft: list[float] = []
        self.tpot: list[float] = []
        self.tasks: set = set()
        self.started = 0
        self.pool: RawPool | None = None  # the raw HTTP client, for KServe tenants
        self.encoded: list[bytes | None] = [None] * len(prepared)
        self.in_flight = 0

    async def use_raw_client(self, warm_connections: int = 8) -> None:
        self.pool = RawPool(self.config.url, self.config.max_connections, self.config.timeout_s)
        self.encoded = [
            None
            if isinstance(r, bytes)
            else encode_request(self.config.url, r.path, r.body, r.headers)
            for r in self.prepared
        ]
        await self.pool.warm(warm_connections)

    def _send_raw(self, i: int, data: bytes, then: Callable[[], Any] | None = None) -> None:
        clock, t0 = time.perf_counter, self.t0
        sent, done_at, status = self.sent, self.done, self.status

        def on_write() -> None:
            sent[i] = clock() - t0

        def done(code: int) -> None:
            done_at[i] = clock() - t0
            status[i] = code
            self.in_flight -= 1
            if then is not None:
                then()

        self.in_flight += 1
        self.pool.send(data, done, on_write)

    def _reserve(self, times: np.ndarray, owners: np.ndarray) -> None:
        n = int(times.size)
        self.sched, self.tenant = times.tolist(), owners.tolist()
        self.sent, self.done = [math.nan] * n, [math.nan] * n
        self.status = [NOT_DONE] * n
        self.ttft, self.tpot = [math.nan] * n, [math.nan] * n

    async def _send(self, i: int) -> None:
        clock, t0 = time.perf_counter, self.t0
        ti = self.tenant[i]
        req = self.prepared[ti]
        aiohttp = self.aiohttp
        self.sent[i] = clock() - t0
        try:
            if isinstance(req, bytes):  # an OpenAI-compatible streamed completion
                timing = await openai_load.stream_completion(
                    self.session, self.config.url, req, self.timeout
                )
                status = timing.status
                self.ttft[i] = timing.first_token_s - t0 - self.sched[i]
                self.tpot[i] = openai_load.time_per_output_token_s(timing)
            else:
                async with self.session.post(
                    self.config.url + req.path, data=req.body, headers=req.headers
                ) as resp:
                    await resp.read()
                    status = resp.status
        except TimeoutError:
            status = ERR_TIMEOUT
        except (aiohttp.ClientConnectionError, OSError):
            status = ERR_CONNECTION
        except aiohttp.ClientError:
            status = ERR_OTHER
        self.done[i] = clock() - t0
        self.status[i] = status

    def _start(self, i: int) -> None:
        data = self.encoded[self.tenant[i]]
        if data is not None:
            self._send_raw(i, data)
            self.started = i + 1
            return
        task = asyncio.get_running_loop().create_task(self._send(i))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        self.started = i + 1

    async def open_loop(self, times: np.ndarray, owners: np.ndarray, on_start=None) -> None:
        """Send each request at its scheduled time: wait (never spin) until the next one is
        due, then send every request whose time has come."""
        self._reserve(times, owners)
        sched, n, clock = self.sched, len(self.sched), time.perf_counter
        timer = due_timer()
        i = 0
        self.t0 = clock()
        if on_start is not None:
            on_start()
        try:
            while i < n:
                now = clock() - self.t0
                if sched[i] > now:
                    await timer.wait_until(self.t0 + sched[i])
                    continue
                while i < n and sched[i] <= now:
                    self._start(i)
                    i += 1
                if i < n and sched[i] <= clock() - self.t0:
                    # behind schedule, the next request is due already: still let the loop
                    # read the responses (and open connections) between bursts, or none
                    # completes until the whole schedule has left and every latency becomes
                    # the generator's backlog
                    await asyncio.sleep(0)
        finally:
            timer.close()

    async def closed_loop(self, total_s: float, on_start=None, concurrency: int = 1) -> None:
        """A closed loop until ``total_s``: ``concurrency`` requests outstanding per tenant,
        each sent when the one before it returned (single-stream: one tenant, one)."""
        clock = time.perf_counter
        loop = asyncio.get_running_loop()
        self.t0 = clock()
        if on_start is not None:
            on_start()

        async def worker(tenant: int) -> None:
            while clock() - self.t0 < total_s:
                i = len(self.sched)
                self.tenant.append(tenant)
                self.sched.append(clock() - self.t0)  # due when sent: no lateness
                for series, value in ((self.sent, math.nan), (self.done, math.nan),
                                      (self.status, NOT_DONE), (self.ttft, math.nan),
                                      (self.tpot, math.nan)):  # fmt: skip
                    series.append(value)
                self.started = len(self.sched)
                data = self.encoded[tenant]
                if data is None:
                    await self._send(i)
                else:
                    returned = loop.create_future()
                    self._send_raw(i, data, functools.partial(_resolve, returned))
                    await returned

        await asyncio.gather(*(worker(t) for t in range(len(self.prepared))
                               for _ in range(concurrency)))  # fmt: skip

    async def drain(self) -> None:
        """Wait for what is in flight, at most the request timeout (then it counts as one)."""
        deadline = time.perf_counter() + self.config.timeout_s + 1.0
        pending = set(self.tasks)
        if pending:
            _, late = await asyncio.wait(pending, timeout=self.config.timeout_s + 1.0)
            for task in late:
                task.cancel()
            if late:
                await asyncio.gather(*late, return_exceptions=True)
        while self.in_flight and time.perf_counter() < deadline:
            await asyncio.sleep(0.005)
        if self.pool is not None:
            self.pool.close()

    def records(self, warmup_s: float, duration_s: float) -> LoadRecords:
        return LoadRecords(
            tenant=np.asarray(self.tenant, dtype=np.int32),
            scheduled_s=np.asarray(self.sched, dtype=float),
            sent_s=np.asarray(self.sent, dtype=float),
            done_s=np.asarray(self.done, dtype=float),
            status=np.asarray(self.status, dtype=np.int32),
            warmup_s=warmup_s,
            duration_s=duration_s,
            ttft_s=np.asarray(self.ttft, dtype=float),
            tpot_s=np.asarray(self.tpot, dtype=float),
        )


# --------------------------------------------------------------------------- I/O helpers
async def fetch_metadata(session, aiohttp, url: str, model: str) -> dict:
    """``GET /v2/models/{model}``, with errors that say what to fix."""
    try:
        async with session.get(f"{url}/v2/models/{model}") as resp:
            if resp.status != 200:
                raise RuntimeFailure(
                    f"GET {url}/v2/models/{model} returned HTTP {resp.status}: the server does "
                    f"not serve {model!r} over KServe v2; check the model name and --url"
                )
            return await resp.json(content_type=None)
    except aiohttp.ClientError as exc:
        raise RuntimeFailure(
            f"cannot reach {url} ({type(exc).__name__}: {exc}); start the server (e.g. "
            "gpulens serve --model ...) or fix --url"
        ) from None


async def scrape_metrics(session, aiohttp, url: str) -> tuple[str | None, str | None]:
    """The server's Prometheus text at ``/metrics``, or (None, why not)."""
    try:
        async with session.get(f"{url}/metrics") as resp:
            if resp.status != 200:
                return None, f"GET {url}/metrics returned HTTP {resp.status}"
            return await resp.text(), None
    except (aiohttp.ClientError, TimeoutError) as exc:
        return None, f"GET {url}/metrics failed: {type(exc).__name__}"


async def prepare_requests(config: LoadConfig, session, aiohttp) -> tuple[list, dict]:
    """Per tenant the request to send (built once), and what it is, for the report."""
    prepared, info = [], {}
    rng = np.random.default_rng(config.seed)
    for spec in config.tenants:
        if spec.openai:
            timeout = aiohttp.ClientTimeout(total=config.timeout_s)
            body, words, counted = await openai_load.fit_prompt(
                session, aiohttp, config.url, spec.model, config.prompt_tokens,
                config.max_tokens, timeout,
            )  # fmt: skip
            prepared.append(body)
            info[spec.model] = {"path": openai_load.PATH, "prompt_tokens": config.prompt_tokens,
                                "prompt_words": words, "prompt_tokens_counted": counted,
                                "max_tokens": config.max_tokens}  # fmt: skip
            continue
        given = dict(config.input_files).get(spec.model)
        if given is not None:
            req = request_from_file(spec.model, given)
        else:
            meta = await fetch_metadata(session, aiohttp, config.url, spec.model)
            req = kserve_request(meta, spec.batch, rng, config.binary_threshold_bytes)
        prepared.append(req)
        info[spec.model] = {"path": req.path, "input_bytes": req.input_bytes,
                            "binary": req.binary}  # fmt: skip
    return prepared, info


def use_raw_client(config: LoadConfig) -> bool:
    """The raw client for KServe tenants on plain http:// (``client``: auto or raw)."""
    return config.client == "raw" or (config.client == "auto" and config.url.startswith("http://"))


async def _progress_task(driver: _Driver, total: int, progress: ProgressFn) -> None:
    while True:
        progress(driver.started, total)
        await asyncio.sleep(PROGRESS_EVERY_S)


async def run_load_async(config: LoadConfig, progress: ProgressFn | None = None) -> LoadOutcome:
    aiohttp = require_aiohttp()
    connector = aiohttp.TCPConnector(
        limit=config.max_connections, limit_per_host=0, keepalive_timeout=60, ttl_dns_cache=300
    )
    timeout = aiohttp.ClientTimeout(total=config.timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        prepared, info = await prepare_requests(config, session, aiohttp)
        before, reason = await scrape_metrics(session, aiohttp, config.url)
        driver = _Driver(config, session, aiohttp, prepared)
        if use_raw_client(config):
            await driver.use_raw_client()
        scenario = config.scenario
        warmup, duration = config.warmup_s, config.duration_s
        if scenario == "offline":
            spec = config.tenants[0]
            n = config.offline_requests or max(1, round(spec.rate_rps * duration))
            times, owners = np.zeros(n), np.zeros(n, dtype=np.int32)
            warmup = 0.0
        elif scenario == "single-stream" or config.concurrency is not None:
            times = owners = None
        else:
            times, owners = merged_schedule(config.tenants, warmup + duration, config.seed)
        total = int(times.size) if times is not None else 0
        ticker = None
        if progress is not None:
            ticker = asyncio.get_running_loop().create_task(_progress_task(driver, total, progress))
        warm_scrape: list[asyncio.Task] = []

        async def scrape_after_warmup() -> tuple[str | None, str | None]:
            await asyncio.sleep(warmup)
            return await scrape_metrics(session, aiohttp, config.url)

        def on_start() -> None:  # the server's counters from the end of the warm-up on
            if before is not None and warmup > 0:
                loop = asyncio.get_running_loop()
                warm_scrape.append(loop.create_task(scrape_after_warmup()))

        try:
            if times is None:
                await driver.closed_loop(warmup + duration, on_start, config.concurrency or 1)
            else:
                await driver.open_loop(times, owners, on_start)
            await driver.drain()
        finally:
            if ticker is not None:
                ticker.cancel()
        after = None
        if before is not None:
            if warm_scrape:
                before = (await warm_scrape[0])[0] or before
            after, reason = await scrape_metrics(session, aiohttp, config.url)
    rec = driver.records(warmup, duration)
    if scenario == "offline":  # the window is the time the work took
        finite = rec.done_s[np.isfinite(rec.done_s)]
        rec.duration_s = float(finite.max()) if finite.size else duration
    log.info("load run: %d requests scheduled, %d sent", len(driver.sched), driver.started)
    return LoadOutcome(rec, before, after, reason, info)


def run_load(config: LoadConfig, progress: ProgressFn | None = None) -> LoadOutcome:
    """One load run (blocking): the records and the server's metrics around it."""
    return asyncio.run(run_load_async(config, progress))

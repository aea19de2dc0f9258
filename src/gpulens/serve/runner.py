"""A serving run: bind the address, build the models, serve under the GPU/host monitor until
Ctrl-C, SIGTERM or ``--duration``, and end as a finished run with a summary.

A serving run is a gpulens run (:func:`gpulens.run.lifecycle.measured_run`, kind ``serve``):
its record holds the requested and effective config, the environment, GPU and host samples
while it served, and the summary (requests per model, mean batch size, queue/compute p50/p99).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from gpulens.errors import MissingExtraError, RuntimeFailure, UsageError
from gpulens.run import interrupts
from gpulens.serve.config import ServeConfig

log = logging.getLogger(__name__)

# The ``batches`` series: one row per model execution (what the dynamic batcher did).
BATCH_SCHEMA = pa.schema([
    ("time_unix_s", pa.float64()), ("model", pa.string()), ("batch_size", pa.int32()),
    ("requests", pa.int32()), ("queue_ms_max", pa.float64()), ("compute_ms", pa.float64()),
    ("infer_ms", pa.float64()), ("ok", pa.bool_()),
])  # fmt: skip


class ServeExtraMissing(MissingExtraError):
    """``gpulens serve`` without its web framework: a usage problem (exit 2)."""

    exit_code = 2


def require_extra() -> None:
    """Starlette and uvicorn are importable, or one line naming ``pip install 'gpulens[serve]'``."""
    for package in ("starlette", "uvicorn"):
        try:
            __import__(package)
        except ImportError:
            raise ServeExtraMissing(package, "serve") from None


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: any free port); a usage error naming
    --port when it is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets that say so; without it a
    # response written in two parts waits for the client's delayed ACK (40 ms a request).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
        sock.listen(4096)
    except OSError as exc:
        sock.close()
        if exc.errno in (errno.EADDRINUSE, errno.EACCES):  # the port: taken, or privileged
            raise UsageError(
                f"cannot serve on {host}:{port} ({exc.strerror or exc}): pick another --port "
                "(0: any free port)"
            ) from None
        raise UsageError(  # the address is none of this machine's, or no address at all
            f"cannot serve on {host}:{port} ({exc.strerror or exc}): --host must be an address "
            "of this machine (127.0.0.1, 0.0.0.0 for every interface, or one of its own)"
        ) from None
    sock.set_inheritable(False)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@dataclass
class ServeOutcome:
    """The finished serving run: its result (RunResult), address and summary."""

    result: Any
    url: str
    effective: dict[str, Any]
    summary: dict[str, Any]

    def document(self) -> dict[str, Any]:
        """``gpulens serve --json``'s document."""
        return {
            "run_id": self.result.run_id,
            "status": self.result.status,
            "record_dir": str(self.result.record_dir),
            "url": self.url,
            **{
                k: self.effective[k]
                for k in ("device", "precision", "max_batch", "max_queue_delay_ms", "instances")
            },  # fmt: skip
            **self.summary,
        }


@contextlib.contextmanager
def _sigterm_sets(stop: threading.Event, why: list[str]) -> Iterator[None]:
    """SIGTERM ends the serving as Ctrl-C does (main thread only; the old handler back after)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigterm(*_args) -> None:
        why.append("sigterm")
        interrupts.set_from_handler(stop)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _wait(stop: threading.Event, duration_s: float | None, server, why: list[str]) -> str:
    """Block until asked to stop; the reason."""
    deadline = time.monotonic() + duration_s if duration_s else None
    try:
        while not stop.wait(0.1):
            if deadline is not None and time.monotonic() >= deadline:
                return "duration"
            if not server.alive():
                raise RuntimeFailure(f"the HTTP server stopped unexpectedly: {server.error}")
            interrupts.raise_if_interrupted()
    except KeyboardInterrupt:
        if interrupts.pending():  # Ctrl-C is how a server is stopped: a clean end, not a kill
            interrupts.uninstall()
            interrupts.install()
        return "interrupt"
    return why[0] if why else "stop"


def run_serve(
    config: ServeConfig,
    runs_root: Path,
    on_ready: Callable[[str, dict[str, Any]], None] | None = None,
    stop: threading.Event | None = None,
) -> ServeOutcome:
    """Serve ``config`` until Ctrl-C, SIGTERM, ``stop`` is set or ``duration_s`` passes.
    ``on_ready(url, effective_config)`` is called once requests are taken."""
    require_extra()
    with interrupts.held():  # torch's import: a Ctrl-C there is noted, not lost
        from gpulens.run import measured_run
        from gpulens.serve import gen_setup
        from gpulens.serve.app import http_implementation
        from gpulens.serve.repository import build_models, resolve_precision
        from gpulens.workloads.devices import nvml_index_for, resolve_device
    device = resolve_device(None if config.device == "auto" else config.device)
    sock = bind(config.host, config.port)
    url = url_of(sock)
    stop = stop or threading.Event()
    names = "+".join(m.name for m in config.models)
    try:
        with measured_run(runs_root, kind="serve", name=config.name or f"serve-{names}",
                          requested_config=config.as_dict()) as run:  # fmt: skip
            run.oom_hint = (
                f"out of GPU memory building or running {names}: serve fewer models, fewer "
                "--instances or a smaller --max-batch"
            )
            models = build_models(config, device)
            effective = {
                "url": url,
                "device": str(device),
                "precision": resolve_precision(config.precision, device),
                "max_batch": max(1, config.max_batch),
                "batching": config.batching,
                "max_queue_delay_ms": config.max_queue_delay_ms if config.batching else 0.0,
                "instances": config.instances,
                "max_queue": config.max_queue,
                "max_body_bytes": config.max_body_bytes,
                "http_server": http_implementation(),
                "models": [
                    {"name": m.name, **m.metadata(), "workload": m.spec.workload}
                    for m in models.values()
                ],  # fmt: skip
                "generative": gen_setup.effective_of(models, config.max_batch),
            }
            run.set_effective(effective)
            nvml_index = nvml_index_for(device)
            probes = _probes(nvml_index)
            if nvml_index is None:
                run.mark_unsupported("gpu", "the server used the CPU")
            batches = run.writer.series("batches", BATCH_SCHEMA)
            gens = (
                run.writer.series("generations", gen_setup.GENERATION_SCHEMA)
                if effective["generative"]
                else None
            )
            try:
                with run.monitor(probes, hz=config.sample_hz):
                    summary, reason = _serve(
                        config, models, sock, url, effective, on_ready, stop,
                        (batches.append, gens.append if gens else None),
                    )  # fmt: skip
            finally:
                batches.close()
                if gens is not None:
                    gens.close()
            summary.update(stop_reason=reason, **run.monitor_costs())
            run.set_summary(summary)
    finally:
        sock.close()
    return ServeOutcome(run.result(), url, effective, summary)


def _probes(nvml_index: int | None) -> list:
    from gpulens.probes.monitor import ProbeSpec

    probes = [ProbeSpec("host", {"root_pid": os.getpid()})]
    if nvml_index is not None:
        probes.insert(0, ProbeSpec("gpu", {"indices": [nvml_index]}))
    return probes


def _batch_row(name: str, batch) -> dict[str, Any]:
    """One row of the ``batches`` series: one model execution."""
    first = batch[0]
    input_ns, infer_ns, output_ns = first.compute_ns
    return {
        "time_unix_s": time.time(),
        "model": name,
        "batch_size": first.batch_size,
        "requests": len(batch),
        "queue_ms_max": max(item.queue_ns for item in batch) / 1e6,
        "compute_ms": (input_ns + infer_ns + output_ns) / 1e6,
        "infer_ms": infer_ns / 1e6,
        "ok": first.error is None,
    }


def _serve(config, models, sock, url, effective, on_ready, stop, on_rows) -> tuple[dict, str]:
    from gpulens.serve.app import HttpServer, ServerState
    from gpulens.serve.batcher import Batcher
    from gpulens.serve.gen_setup import build_services
    from gpulens.serve.openai_api import OpenAIState
    from gpulens.serve.stats import ServeStats

    on_batch, on_generation = on_rows

    batchers: dict[str, Batcher] = {}
    stats = ServeStats(models, depth=lambda m: batchers[m].depth())
    state = ServerState(config, models, batchers, stats)

    def done_for(name: str):
        def done(batch) -> None:
            if batch[0].error is None:
                stats.batch(name, batch[0].batch_size)
            state.complete(batch)
            on_batch(_batch_row(name, batch))

        return done

    for name, model in models.items():
        batchers[name] = Batcher(
            name, model.execute, done_for(name), max_batch=config.max_batch,
            max_delay_s=config.max_queue_delay_ms / 1000.0, max_queue=config.max_queue,
            instances=len(model.instances),
        ).start()  # fmt: skip
    openai = OpenAIState({}, served=tuple(models), max_body_bytes=config.max_body_bytes,
                         on_refused=lambda m, _status: stats.failure(m, "REJECTED"))  # fmt: skip
    services, gen_stats = build_services(
        models, max_batch=config.max_batch, max_queue=config.max_queue, warmup=config.warmup,
        stats=stats, on_tokens=openai.deliver, on_row=on_generation,
    )  # fmt: skip
    if services:
        openai.services.update(services)
        state.openai = openai
        state.extra_metrics.append(gen_stats.prometheus)
    server = HttpServer(state, sock)
    started = time.monotonic()
    reason = "stop"
    try:
        server.start()
        log.info("serving %s on %s", ", ".join(models), url)
        if on_ready is not None:
            on_ready(url, effective)
        why: list[str] = []
        with _sigterm_sets(stop, why):
            reason = _wait(stop, config.duration_s, server, why)
    finally:
        state.ready = False
        server.stop()
        for b in batchers.values():
            b.stop()
        for g in services.values():
            g.stop()
    served_s = time.monotonic() - started
    summary = stats.summary()
    for name, gen in gen_stats.summary(served_s).items():
        summary["models"][name]["generation"] = gen
    summary["served_s"] = round(served_s, 3)
    summary["requests_per_s"] = round(summary["requests"] / served_s, 3) if served_s else None
    return summary, reason

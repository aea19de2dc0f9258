"""A `gpulens serve` in a thread of the test process, on a free loopback port (CPU)."""

from __future__ import annotations

import http.client
import json
import threading
from pathlib import Path
from urllib.parse import urlparse

from gpulens.serve.config import ModelEntry, ServeConfig
from gpulens.serve.runner import run_serve


class ServeThread:
    """``with ServeThread(tmp, models=("identity",)) as srv: srv.get("/v2")``; after the block,
    ``srv.outcome`` is the finished run."""

    def __init__(self, runs_root: Path, models=("identity", "tiny_cnn"), **config):
        config = {"device": "cpu", "port": 0, "sample_hz": 2.0, **config}
        self.config = ServeConfig(models=tuple(ModelEntry.parse(m) for m in models), **config)
        self.runs_root = runs_root
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.url = ""
        self.outcome = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        def on_ready(url: str, _effective: dict) -> None:
            self.url = url
            self.ready.set()

        try:
            self.outcome = run_serve(self.config, self.runs_root, on_ready=on_ready, stop=self.stop)
        except BaseException as exc:
            self.error = exc
            self.ready.set()

    def __enter__(self) -> ServeThread:
        self._thread.start()
        assert self.ready.wait(120), "the server did not start"
        if self.error is not None:
            raise self.error
        parsed = urlparse(self.url)
        self.host, self.port = parsed.hostname, parsed.port
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive(), "the server did not stop"
        if self.error is not None and exc[0] is None:
            raise self.error

    # ------------------------------------------------------------------------ a tiny client
    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict | None = None):  # fmt: skip
        """(status, headers dict with lower-case names, body bytes)."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def get(self, path: str):
        status, headers, body = self.request("GET", path)
        ctype = headers.get("content-type", "")
        return status, json.loads(body) if ctype.startswith("application/json") else body.decode()

    def infer(self, model: str, doc_or_body, headers: dict | None = None):
        body = doc_or_body if isinstance(doc_or_body, bytes) else json.dumps(doc_or_body).encode()
        return self.request("POST", f"/v2/models/{model}/infer", body, headers)

    def metrics(self) -> dict[str, float]:
        """``name{labels}`` -> value from /metrics."""
        _status, text = self.get("/metrics")
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
        return out

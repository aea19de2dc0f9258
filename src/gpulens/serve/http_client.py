"""A small HTTP/1.1 client for the load generator's hot path: pre-encoded requests written
straight onto keep-alive connections from asyncio protocols, no task per request.

aiohttp costs a few hundred microseconds of one core per request, too much for thousands of
requests per second from one process; this client writes a request the moment it is due and
calls back on the response. It speaks just what KServe v2 infer needs: one request in flight
per connection (no pipelining: a slow response never delays the next request), responses with
Content-Length or chunked bodies (or read until close), ``Connection: close`` honoured; plain
``http://`` only (``https`` and streamed OpenAI requests go through aiohttp).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from urllib.parse import urlsplit

from gpulens.serve.load_report import ERR_CONNECTION, ERR_TIMEOUT

log = logging.getLogger(__name__)

Done = Callable[[int], None]  # called with the HTTP status or an ERR_* code


def encode_request(url: str, path: str, body: bytes, headers: dict) -> bytes:
    """The whole request, bytes ready for the socket."""
    parts = urlsplit(url)
    lines = [f"POST {path} HTTP/1.1", f"Host: {parts.netloc}", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in headers.items() if k.lower() != "content-length"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class _Conn(asyncio.Protocol):
    def __init__(self, pool: RawPool):
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.done: Done | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.status = 0
        self.remaining = -1  # body bytes still to come; -1 until the head is read
        self.chunked = False
        self.until_close = False
        self.close_after = False

    # -------------------------------------------------------------- sending
    def send(self, data: bytes, done: Done, timeout_s: float) -> None:
        self.done = done
        self.status, self.remaining, self.chunked, self.until_close = 0, -1, False, False
        self.close_after = False
        loop = self.pool.loop
        self.timer = loop.call_at(loop.time() + timeout_s, self._timed_out)
        self.transport.write(data)

    def _finish(self, code: int, reusable: bool) -> None:
        done, self.done = self.done, None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if not reusable and self.transport is not None:
            self.transport.close()
        self.pool.released(self, reusable)
        if done is not None:
            done(code)

    def _timed_out(self) -> None:
        self.timer = None
        self._finish(ERR_TIMEOUT, reusable=False)

    # -------------------------------------------------------------- protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.transport = None
        if self.done is not None:
            self._finish(self.status if self.until_close else ERR_CONNECTION, reusable=False)
        self.pool.lost(self)

    def data_received(self, data: bytes) -> None:
        if self.done is None:
            return  # nothing asked: stray bytes after a timeout
        self.buf += data
        while self.done is not None:
            head_due = self.remaining < 0 and not self.chunked and not self.until_close
            if head_due and not self._head():
                return
            if self.until_close:
                self.buf.clear()
                return
            if self.chunked:
                if not self._chunks():
                    return
                continue
            if len(self.buf) < self.remaining:
                return
            del self.buf[: self.remaining]
            self._finish(self.status, reusable=not self.close_after)

    def _head(self) -> bool:
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return False
        head = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
        del self.buf[: end + 4]
        try:
            self.status = int(head[0].split(" ", 2)[1])
        except (IndexError, ValueError):
            self._finish(ERR_CONNECTION, reusable=False)
            return False
        length = None
        for line in head[1:]:
            name, _, value = line.partition(":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "transfer-encoding" and "chunked" in value:
                self.chunked = True
            elif name == "connection" and value == "close":
                self.close_after = True
        if not self.chunked:
            if length is None:
                self.until_close = True
            else:
                self.remaining = length
        return True

    def _chunks(self) -> bool:
        """Consume whole chunks; True once the last one (and its trailers) is in."""
        while True:
            eol = self.buf.find(b"\r\n")
            if eol < 0:
                return False
            size = int(bytes(self.buf[:eol]).split(b";")[0] or b"0", 16)
            if size == 0:
                end = self.buf.find(b"\r\n\r\n", eol)
                if end < 0:
                    return False
                del self.buf[: end + 4]
                self.chunked = False
                self._finish(self.status, reusable=not self.close_after)
                return True
            if len(self.buf) < eol + 2 + size + 2:
                return False
            del self.buf[: eol + 2 + size + 2]


class RawPool:
    """Keep-alive connections to one host; ``send`` writes now on an idle connection, or as
    soon as one is free (a new one is opened while fewer than ``limit`` exist)."""

    def __init__(self, url: str, limit: int, timeout_s: float):
        parts = urlsplit(url)
        if parts.scheme != "http":
            raise ValueError("the raw client speaks plain http:// only")
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.limit, self.timeout_s = limit, timeout_s
        self.loop = asyncio.get_running_loop()
        self.idle: list[_Conn] = []
        self.waiting: deque = deque()
        self.opening = 0
        self.open = 0

    async def warm(self, n: int) -> None:
        await asyncio.gather(*(self._open() for _ in range(min(n, self.limit))))

    async def _open(self) -> None:
        self.opening += 1
        try:
            _, conn = await self.loop.create_connection(lambda: _Conn(self), self.host, self.port)
        except OSError as exc:
            self.opening -= 1
            log.debug("connect failed: %s", exc)
            if self.waiting and self.open == 0 and self.opening == 0:
                while self.waiting:  # nothing will ever free up: fail what waits
                    _, done, _ = self.waiting.popleft()
                    done(ERR_CONNECTION)
            return
        self.opening -= 1
        self.open += 1
        self.released(conn, True)

    def send(self, data: bytes, done: Done, on_write: Callable[[], None] | None = None) -> None:
        if self.idle:
            if on_write is not None:
                on_write()
            self.idle.pop().send(data, done, self.timeout_s)
            return
        self.waiting.append((data, done, on_write))
        if self.open + self.opening < self.limit and self.opening < len(self.waiting):
            self.loop.create_task(self._open())

    def released(self, conn: _Conn, reusable: bool) -> None:
        if not reusable or conn.transport is None:
            return
        if self.waiting:
            data, done, on_write = self.waiting.popleft()
            if on_write is not None:
                on_write()
            conn.send(data, done, self.timeout_s)
        else:
            self.idle.append(conn)

    def lost(self, conn: _Conn) -> None:
        self.open -= 1
        if conn in self.idle:
            self.idle.remove(conn)
        if self.waiting and self.open + self.opening < self.limit:
            self.loop.create_task(self._open())

    def close(self) -> None:
        for conn in list(self.idle):
            if conn.transport is not None:
                conn.transport.close()
        self.idle.clear()

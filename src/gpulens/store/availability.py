"""Is the store there, and can several processes create it at once?

MLflow's own client retries an unreachable server for minutes (7 retries with exponential
backoff, a 120 s timeout per request), and two processes creating a new SQLite store at the
same time break each other's schema migration. Here:

- :func:`check_store` looks at the tracking URI with one short request (2 s): an HTTP GET of
  ``<uri>/health`` for a tracking server, a TCP connect for a database server, a writable folder
  for SQLite. It never imports MLflow.
- :func:`mlflow_http_limits` caps MLflow's HTTP retries and timeout while gpulens logs (values
  the user set in the environment are kept).
- :func:`store_lock` serializes gpulens's writes to a local SQLite store across processes with
  an exclusive ``flock`` on ``<database>.lock``, so the first creation and migration of the
  database happens once; :func:`is_locked_error` recognizes SQLite's ``database is locked``.
"""

from __future__ import annotations

import base64
import contextlib
import os
import socket
import ssl
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from gpulens.errors import RuntimeFailure

REACHABILITY_TIMEOUT_S = 2.0
LOCK_TIMEOUT_S = 120.0
LOCK_POLL_S = 0.05
# MLflow's HTTP client while gpulens logs: one retry after 1 s, 30 s per request (MLflow's
# defaults: 7 retries with backoff factor 2 and 120 s, about 4 minutes for a dead server).
MLFLOW_HTTP_ENV = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
    # MLflow prints "View run ... at: URL" on stdout when a run against a tracking server
    # ends: that broke `--json` (one JSON document on stdout) with a team store.
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}
_DB_PORTS = {"postgresql": 5432, "postgres": 5432, "mysql": 3306, "mssql": 1433}
_SYNC_HINT = "`gpulens runs sync` logs it later"
READ_HINT = "start the tracking server, or check MLFLOW_TRACKING_URI, and ask again"


class StoreUnavailableError(RuntimeFailure):
    """The tracking store cannot be used now (unreachable, refused, busy); records stay local."""


@dataclass(frozen=True)
class Reachability:
    """What one quick look at a tracking URI found.

    ``reachable``: True (it answered), False (it did not), None (a kind of store that is not
    checked, e.g. Databricks). ``ok``: gpulens can log there (reachable and not refused).
    """

    tracking_uri: str
    reachable: bool | None
    ok: bool
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def display_uri(uri: str) -> str:
    """``uri`` without a password (``http://user:***@host``), for messages."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return uri
    if parts.password is None:
        return uri
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    netloc = f"{parts.username}:***@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (None for other URIs and in-memory ones)."""
    if not uri.startswith("sqlite:///"):
        return None
    raw = uri[len("sqlite:///") :].split("?", 1)[0]
    if not raw or raw == ":memory:":
        return None
    return Path(raw)


def _writable_place(path: Path) -> tuple[bool, str]:
    """Whether ``path`` (a file that may not exist yet) can be written."""
    if path.exists():
        if os.access(path, os.W_OK):
            return True, f"{path} exists and is writable"
        return False, f"{path} is not writable (check its permissions)"
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if parent.is_dir() and os.access(parent, os.W_OK | os.X_OK):
        return True, f"{path} is created at first use"
    return False, f"{path} cannot be created: {parent} is not writable (check its permissions)"


def _http_reason(exc: BaseException, timeout_s: float) -> str:
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    if isinstance(reason, (TimeoutError, socket.timeout)):
        return f"no answer within {timeout_s:g} s"
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    if isinstance(reason, socket.gaierror):
        return "the host name does not resolve"
    if isinstance(reason, ssl.SSLError):
        return f"TLS error ({reason.reason or reason})"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror.lower()
    return str(reason) or type(reason).__name__


def _http_request(url: str) -> urllib.request.Request:
    request = urllib.request.Request(url, method="GET")
    token = os.environ.get("MLFLOW_TRACKING_TOKEN")
    user = os.environ.get("MLFLOW_TRACKING_USERNAME")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    elif user:
        password = os.environ.get("MLFLOW_TRACKING_PASSWORD", "")
        basic = base64.b64encode(f"{user}:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {basic}")
    return request


def _ssl_context() -> ssl.SSLContext | None:
    if os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() == "true":
        return ssl._create_unverified_context()  # the user asked MLflow for no verification
    cafile = os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH")
    return ssl.create_default_context(cafile=cafile) if cafile else None


def _get(url: str, timeout_s: float) -> tuple[int, bytes]:
    """``(HTTP status, first bytes of the body)`` of a GET; credentials in the URL become a
    basic-auth header (urllib would take them for part of the host name)."""
    parts = urlsplit(url)
    request = _http_request(url)
    if parts.username is not None:
        host = parts.hostname or ""
        netloc = f"{host}:{parts.port}" if parts.port else host
        request = _http_request(urlunsplit((parts.scheme, netloc, parts.path, parts.query, "")))
        basic = f"{parts.username}:{parts.password or ''}".encode()
        request.add_header("Authorization", f"Basic {base64.b64encode(basic).decode()}")
    try:
        with urllib.request.urlopen(  # noqa: S310 - the user's own tracking URI, http(s) only
            request, timeout=timeout_s, context=_ssl_context()
        ) as response:
            return response.status, response.read(2048)
    except urllib.error.HTTPError as exc:
        try:
            body = exc.read(2048)
        except Exception:
            body = b""
        return exc.code, body


def _check_http(uri: str, timeout_s: float) -> Reachability:
    shown = display_uri(uri)
    base = uri.rstrip("/")
    try:
        code, _ = _get(base + "/health", timeout_s)
        if code not in (401, 403) and not 200 <= code < 300:
            # no /health (a proxy that routes only the API?): MLflow's API answers in JSON
            api_code, body = _get(
                base + "/api/2.0/mlflow/experiments/get-by-name?experiment_name=Default",
                timeout_s,
            )
            if api_code == 200 or b"error_code" in body:
                code = 200
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return Reachability(shown, False, False, f"unreachable: {_http_reason(exc, timeout_s)}")
    if code in (401, 403):
        return Reachability(
            shown,
            True,
            False,
            f"the server refused access (HTTP {code}): set MLFLOW_TRACKING_USERNAME and "
            "MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN",
        )
    if 200 <= code < 300:
        return Reachability(shown, True, True, "the tracking server answered")
    return Reachability(
        shown,
        True,
        False,
        f"the server answered HTTP {code} and not as an MLflow tracking server does "
        "(check the URI, and any proxy in between: http_proxy, no_proxy)",
    )


def _check_socket(uri: str, scheme: str, timeout_s: float) -> Reachability:
    shown = display_uri(uri)
    try:
        parts = urlsplit(uri)
        host, port = parts.hostname, parts.port or _DB_PORTS.get(scheme)
    except ValueError as exc:
        return Reachability(shown, False, False, f"not a valid URI ({exc})")
    if not host or not port:
        return Reachability(shown, None, True, "not checked (no host and port in the URI)")
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        return Reachability(shown, False, False, f"unreachable: {_http_reason(exc, timeout_s)}")
    return Reachability(shown, True, True, f"the database server at {host}:{port} answered")


def check_store(uri: str, timeout_s: float = REACHABILITY_TIMEOUT_S) -> Reachability:
    """One quick look at the tracking URI (at most ``timeout_s``); never raises."""
    scheme = uri.split(":", 1)[0].lower() if ":" in uri else ""
    base = scheme.split("+", 1)[0]
    if uri.lower().startswith("databricks"):  # "databricks", "databricks-uc", "databricks://p"
        return Reachability(uri, None, True, "not checked (Databricks)")
    if scheme in ("http", "https"):
        return _check_http(uri, timeout_s)
    if scheme == "sqlite":
        db = sqlite_path(uri)
        if db is None:
            return Reachability(uri, None, True, "not checked (in-memory or unusual SQLite URI)")
        ok, detail = _writable_place(db)
        return Reachability(uri, ok, ok, f"local SQLite database: {detail}")
    if base in _DB_PORTS:
        return _check_socket(uri, base, timeout_s)
    if scheme == "file" or not scheme or (len(scheme) == 1 and os.name == "nt"):
        path = Path(urlsplit(uri).path if scheme == "file" else uri)
        ok, detail = _writable_place(path)
        return Reachability(uri, ok, ok, f"local file store: {detail}")
    return Reachability(display_uri(uri), None, True, f"not checked ({scheme} store)")


def require_reachable(
    uri: str, timeout_s: float = REACHABILITY_TIMEOUT_S, hint: str = _SYNC_HINT
) -> Reachability:
    """:func:`check_store`, raising :class:`StoreUnavailableError` where gpulens cannot log;
    ``hint`` ends its message (by default: `gpulens runs sync` logs the record later)."""
    found = check_store(uri, timeout_s)
    if not found.ok:
        raise StoreUnavailableError(f"MLflow store {found.tracking_uri}: {found.detail}; {hint}")
    return found


# ----------------------------------------------------------------------------- MLflow's HTTP
_env_lock = threading.Lock()
_env_users = 0
_env_saved: dict[str, str | None] = {}


@contextlib.contextmanager
def mlflow_http_limits() -> Iterator[None]:
    """Cap MLflow's HTTP retries and timeout (``MLFLOW_HTTP_ENV``) for the duration; a value
    the user already set is left alone. Re-entrant and safe across threads."""
    global _env_users
    with _env_lock:
        if _env_users == 0:
            _env_saved.clear()
            for key, value in MLFLOW_HTTP_ENV.items():
                if key not in os.environ:
                    _env_saved[key] = None
                    os.environ[key] = value
        _env_users += 1
    try:
        yield
    finally:
        with _env_lock:
            _env_users -= 1
            if _env_users == 0:
                for key in _env_saved:
                    os.environ.pop(key, None)
                _env_saved.clear()


# ----------------------------------------------------------------------------- SQLite lock
def lock_path(uri: str) -> Path | None:
    """The lock file that serializes writes to a local SQLite store (None for other stores)."""
    db = sqlite_path(uri)
    return db.with_name(db.name + ".lock") if db is not None else None


@contextlib.contextmanager
def store_lock(uri: str, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold an exclusive lock on a local SQLite store (no-op for other stores or where
    ``fcntl`` is missing). Raises :class:`StoreUnavailableError` after ``timeout_s``."""
    path = lock_path(uri)
    try:
        from gpulens.filelock import exclusive_lock
    except ImportError:  # Windows: no flock; SQLite's own locking and the retries remain
        exclusive_lock = None
    if path is None or exclusive_lock is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle, contextlib.ExitStack() as held:
        try:
            held.enter_context(exclusive_lock(handle, timeout_s, LOCK_POLL_S))
        except TimeoutError:  # only the wait for the lock: the body's timeouts pass through
            raise StoreUnavailableError(
                f"the MLflow store {uri} is busy: another process has held {path} for "
                f"{timeout_s:g} s; {_SYNC_HINT}"
            ) from None
        yield


def open_client(mlflow, uri: str):
    """An ``MlflowClient`` for ``uri``, made under the store's lock: making one creates or
    migrates a local SQLite store, and two processes doing that at once can leave it unusable
    to both (``table _alembic_tmp_tags already exists``). Not for use under that lock."""
    with store_lock(uri):
        return mlflow.MlflowClient(tracking_uri=uri)


def is_locked_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is SQLite's ``database is locked``."""
    seen = 0
    while exc is not None and seen < 5:
        if "database is locked" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False

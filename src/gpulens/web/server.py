"""``gpulens ui``: a read-only dashboard over the local run store (Python's own HTTP server).

Pages: ``/`` (the runs, filterable by kind, status, GPU and a name or id fragment), ``/run/ID``
(the report of one run; a running run's page reloads itself every few seconds as its record
grows), ``/compare?runs=ID,ID`` (several side by side) and ``/static/plotly.js`` (served once, so
pages stay small). Every figure is the report's own (:mod:`gpulens.report.document`).

Safety: it binds the loopback by default; another address needs a token, which every request
must carry (``?token=``). Run ids are looked up in the store's own listing, never used as paths,
so nothing outside the store can be read; only GET and HEAD are answered.
"""

from __future__ import annotations

import hmac
import html
import ipaddress
import json
import logging
import secrets
from functools import lru_cache
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, urlsplit

from gpulens.errors import UsageError
from gpulens.paths import runs_dir
from gpulens.record.reader import RunRecord, scan_records
from gpulens.store.queries import run_facts

log = logging.getLogger(__name__)

LIVE_REFRESH_S = 5
# "date" is the day a run began (UTC); "role" its part in an experiment (stalls:cached ...)
FILTERS = ("kind", "workload", "gpu_model", "date", "status", "role")
TABLE_COLUMNS = ("run_id", "name", "kind", "status", "created_at", "workload", "gpu_model")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@lru_cache(maxsize=1)
def _plotly_js() -> bytes:
    from plotly.offline import get_plotlyjs

    return get_plotlyjs().encode()


class Dashboard:
    """What the pages show, over the records under ``runs_root``."""

    def __init__(self, runs_root: Path, token: str | None = None) -> None:
        self.runs_root = runs_root
        self.token = token

    def _q(self) -> str:
        return f"token={quote(self.token)}" if self.token else ""

    def link(self, path: str, query: str = "") -> str:
        q = "&".join(p for p in (query, self._q()) if p)
        return html.escape(path + (f"?{q}" if q else ""))

    def records(self) -> dict[str, RunRecord]:
        records, _damaged = scan_records(self.runs_root)
        return {r.run_id: r for r in records}

    def damaged(self) -> dict[str, str]:
        """The records whose run.json cannot be read: run id -> what is wrong and the fix."""
        return {d.run_id: d.message() for d in scan_records(self.runs_root)[1]}

    def runs_page(self, query: dict[str, str]) -> str:
        records, damaged_records = scan_records(self.runs_root)
        rows = [
            {**run_facts(r), "date": str(r.meta.get("created_at") or "")[:10],
             "role": r.meta.get("role")}
            for r in records
        ][::-1]  # newest first  # fmt: skip
        options = {k: sorted({str(r.get(k)) for r in rows if r.get(k)}) for k in FILTERS}
        for key in FILTERS:
            if query.get(key):
                rows = [r for r in rows if str(r.get(key) or "") == query[key]]
        if query.get("q"):
            needle = query["q"].lower()
            rows = [r for r in rows if needle in f"{r['run_id']} {r.get('name') or ''}".lower()]
        selects = "".join(
            f"<label>{k} <select name='{k}'><option value=''>all</option>"
            + "".join(
                f"<option{' selected' if query.get(k) == v else ''}>{html.escape(v)}</option>"
                for v in vals
            )
            + "</select></label> "
            for k, vals in options.items()
        )
        token = f"<input type='hidden' name='token' value='{html.escape(self.token)}'>" if (
            self.token) else ""  # fmt: skip
        form = (
            f"<form method='get' action='/'>{selects}<label>name or id <input name='q' "
            f"value='{html.escape(query.get('q', ''))}'></label>{token} "
            "<button>filter</button></form>"
        )
        head = "".join(f"<th>{c}</th>" for c in ("", *TABLE_COLUMNS))
        body = []
        for r in rows:
            rid = str(r["run_id"])
            cells = [f"<td><input type='checkbox' name='runs' value='{html.escape(rid)}'></td>"]
            for c in TABLE_COLUMNS:
                text = html.escape(str(r.get(c) if r.get(c) is not None else ""))
                if c == "run_id":
                    text = f"<a href='{self.link('/run/' + quote(rid))}'>{text}</a>"
                cells.append(f"<td>{text}</td>")
            body.append(f"<tr class='run'>{''.join(cells)}</tr>")
        compare = (
            f"<form method='get' action='/compare' id='compare'>{token}"
            f"<table><tr>{head}</tr>{''.join(body)}</table>"
            "<button>compare the runs ticked</button></form>"
        )
        store = f"<p><a href='{self.link('/store')}'>runs in the MLflow store</a></p>"
        if damaged_records:  # as `gpulens runs list` does: named, never dropped silently
            items = "".join(f"<li>{html.escape(d.message())}</li>" for d in damaged_records)
            n = len(damaged_records)
            compare += f"<p class='note'>{n} damaged, not listed:</p><ul>{items}</ul>"
        body = f"<h1>gpulens runs ({len(rows)})</h1>{store}{form}{compare}"
        return _page("gpulens runs", body)

    def store_page(self, limit: int) -> str:
        """The runs in the MLflow store (a team's tracking server), newest first."""
        from gpulens.paths import default_tracking_uri
        from gpulens.store.team import store_runs

        uri = default_tracking_uri()
        rows = store_runs(uri, limit=limit)
        columns = ("run_id", "name", "status", "workload", "device", "mlflow_run_id")
        head = "".join(f"<th>{c}</th>" for c in columns)
        body = "".join(
            "<tr class='run'>"
            + "".join(f"<td>{html.escape(str(r.get(c) or ''))}</td>" for c in columns)
            + "</tr>"
            for r in rows
        )
        nav = f"<p><a href='{self.link('/')}'>this machine's runs</a></p>"
        title = f"runs in the store {html.escape(uri)} ({len(rows)}, newest first)"
        return _page("gpulens store", f"<h1>{title}</h1>{nav}<table><tr>{head}</tr>{body}</table>")

    def report_page(self, run_ids: list[str]) -> str | None:
        """The report of these runs, or None if one is not in the store."""
        from gpulens.report.document import build_report
        from gpulens.report.html import render_html

        known = self.records()
        run_ids = list(dict.fromkeys(run_ids))  # a run ticked twice is shown once
        if not run_ids or any(rid not in known for rid in run_ids):
            return None
        records = [known[rid] for rid in run_ids]
        live = any(r.status == "running" for r in records)
        head = f"<meta http-equiv='refresh' content='{LIVE_REFRESH_S}'>" if live else ""
        nav = f"<p><a href='{self.link('/')}'>all runs</a>"
        nav += f" · live: this page reloads every {LIVE_REFRESH_S} s</p>" if live else "</p>"
        title = "gpulens: " + ", ".join(str(r.meta.get("name") or r.run_id) for r in records)
        return render_html(
            build_report(records), title, plotly_src=self.link("/static/plotly.js"),
            head_extra=head, body_top=nav,
        )  # fmt: skip


NO_ICON = "<link rel='icon' href='data:,'>"  # no /favicon.ico request (a 404 in the console)


def _page(title: str, body: str) -> str:
    from gpulens.report.html import STYLE

    return (
        f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>{NO_ICON}"
        f"<title>{title}</title><style>{STYLE}</style></head><body>{body}</body></html>"
    )


def _handler(dashboard: Dashboard) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "gpulens-ui"

        def log_message(self, fmt: str, *args) -> None:
            log.info("%s %s", self.address_string(), fmt % args)

        def _send(self, status: int, body: bytes, ctype: str = "text/html; charset=utf-8"):
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("X-Content-Type-Options", "nosniff")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _error(self, status: HTTPStatus, text: str) -> None:
            self._send(status, _page(str(status.value), f"<p>{html.escape(text)}</p>").encode())

        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            url = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            if dashboard.token and not hmac.compare_digest(query.get("token", ""), dashboard.token):
                return self._error(HTTPStatus.FORBIDDEN, "a token is needed: use the URL printed")
            try:
                if url.path == "/":
                    return self._send(200, dashboard.runs_page(query).encode())
                if url.path in ("/store", "/api/store-runs"):  # the team's MLflow store
                    limit = query.get("limit", "100")
                    if not limit.isdigit():
                        return self._error(HTTPStatus.BAD_REQUEST, "limit must be a number")
                    if url.path == "/store":
                        return self._send(200, dashboard.store_page(int(limit)).encode())
                    from gpulens.store.team import store_runs

                    doc = {"runs": store_runs(limit=int(limit))}
                    return self._send(200, json.dumps(doc).encode(), "application/json")
                if url.path == "/static/plotly.js":
                    return self._send(200, _plotly_js(), "text/javascript; charset=utf-8")
                if url.path.startswith("/run/") or url.path == "/compare":
                    if url.path == "/compare":
                        ids = [i for v in parse_qs(url.query).get("runs", []) for i in v.split(",")]
                    else:
                        ids = [url.path.removeprefix("/run/")]
                    ids = [i.strip() for i in ids if i.strip()]
                    page = dashboard.report_page(ids)
                    if page is None:
                        damaged = dashboard.damaged()
                        bad = [damaged[i] for i in ids if i in damaged]
                        if bad:
                            return self._error(HTTPStatus.UNPROCESSABLE_ENTITY, bad[0])
                        return self._error(HTTPStatus.NOT_FOUND, "no such run in this store")
                    return self._send(200, page.encode())
            except Exception as exc:  # one bad record must not take the dashboard down
                log.warning("page %s failed: %s", url.path, exc)
                return self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}")
            return self._error(HTTPStatus.NOT_FOUND, "no such page")

        do_HEAD = do_GET  # noqa: N815

        def _refuse(self) -> None:
            self._error(HTTPStatus.METHOD_NOT_ALLOWED, "the dashboard is read-only")

        do_POST = do_PUT = do_DELETE = do_PATCH = _refuse  # noqa: N815

    return Handler


def make_server(
    host: str = "127.0.0.1",
    port: int = 8050,
    token: str | None = None,
    home: Path | None = None,
) -> tuple[ThreadingHTTPServer, str]:
    """The dashboard's server (not yet serving) and its URL. A non-loopback ``host`` needs a
    token; ``token="auto"`` makes one."""
    if token == "auto":
        token = secrets.token_urlsafe(16)
    if not is_loopback(host) and not token:
        raise UsageError(
            f"--host {host} exposes your runs beyond this machine: give --token TOKEN (or "
            "--token auto), or keep the default --host 127.0.0.1"
        )
    dashboard = Dashboard(runs_dir(home), token)
    try:
        server = ThreadingHTTPServer((host, port), _handler(dashboard))
    except OSError as exc:
        raise UsageError(f"cannot listen on {host}:{port} ({exc.strerror}): try --port 0") from None
    server.daemon_threads = True
    bound_port = server.server_address[1]
    url = f"http://{host}:{bound_port}/" + (f"?token={quote(token)}" if token else "")
    return server, url

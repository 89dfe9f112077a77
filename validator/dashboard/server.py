"""The dashboard's HTTP server (``sparseloco-validator dashboard``): the standard library's
``http.server`` on a thread, reading the contribution log through a read-only SQLite connection per
request, so a validator keeps writing it meanwhile.

Routes (GET; ``?page=N&per_page=M`` pages the leaderboard or a peer's rows, ``?from=A&to=B`` picks
windows, ``?points=N`` sets how many buckets a series has at most):

    /                    the main page: current window, charts, leaderboard, rejections, windows
    /peer/<id>           one peer: standing, rejections by reason, rows (newest first)
    /api/overview        everything the main page shows, as JSON
    /api/leaderboard     {"page": {...}, "peers": [...]}
    /api/peers/<id>      {"summary": {...}, "reasons": [...], "page": {...}, "history": [...]}
    /api/windows         {"windows", "first", "last", "per_bucket", "buckets": [...]}
    /api/rejections      [{"reason", "rejections", "peers", "last_window"}, ...]
    /api/current         the open window, uploads read in it so far, the last window
    /api/agreement       several validators: per window the leader, view, signers, objections, handovers

    with Dashboard("vstate/contributions.sqlite", port=0) as dash:
        urllib.request.urlopen(dash.url + "api/leaderboard")

Responses forbid scripts and framing (Content-Security-Policy) and are never cached; JSON has no
NaN or Infinity (null instead). A malformed query is answered 400 (:class:`BadQuery`).
"""

from __future__ import annotations

import json
import logging
import math
import socket
import sqlite3
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from protocol.errors import ConfigError, ProtocolError
from validator.dashboard import pages, views
from validator.logview import LogView

__all__ = ["BadQuery", "Dashboard", "check_log"]

logger = logging.getLogger(__name__)

MAX_POINTS = 5000
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'; base-uri 'none'; "
        "form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
HTML, JSON = "text/html; charset=utf-8", "application/json"


class BadQuery(ProtocolError):
    """A dashboard request's query string is not what the route takes (answered 400)."""

    reason = "bad_query"


class _NotFound(Exception):
    """No page or peer at this path (answered 404)."""


def check_log(db: str | Path, *, not_yet: bool = False) -> None:
    """Raise ConfigError unless ``db`` is a contribution log this process can read; with
    ``not_yet`` a log that does not exist yet in a directory that does is fine (the validator
    creates it when it starts: the dashboard may be started first)."""
    if not Path(db).is_file():
        if not_yet and Path(db).parent.is_dir() and not Path(db).exists():
            return
        raise ConfigError(f"no contribution log at {db}")
    try:
        with LogView.open(db) as log:
            log.window_span()
            log.peer_count()
    except sqlite3.Error as exc:
        raise ConfigError(f"{db} is not a readable contribution log: {exc}") from exc


class Dashboard:
    """The dashboard served on ``host:port`` (port 0: a free one) from a thread until :meth:`stop`."""

    def __init__(self, db: str | Path, *, host: str = "127.0.0.1", port: int = 8080) -> None:
        check_log(db, not_yet=True)
        self.server = _Server((host, port), Path(db))
        self._thread = threading.Thread(target=self.server.serve_forever, name="dashboard", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        text = host.decode() if isinstance(host, bytes) else str(host)
        return f"http://[{text}]:{port}/" if ":" in text else f"http://{text}:{port}/"

    def start(self) -> str:
        """Serve from now on; the URL of the main page."""
        self._thread.start()
        return self.url

    def stop(self) -> None:
        """Stop serving and close the socket (requests in flight finish on their own threads)."""
        if self._thread.is_alive():
            self.server.shutdown()
            self._thread.join()
        self.server.server_close()

    def __enter__(self) -> Dashboard:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], db: Path) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.db = db
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    server_version = "sparseloco-dashboard"

    def do_GET(self) -> None:
        assert isinstance(self.server, _Server)
        url = urlsplit(self.path)
        if not self.server.db.is_file():  # opening it would create an empty database
            message = f"no contribution log at {self.server.db} yet: the validator creates it when it starts"
            return self._error(503, message, url.path)
        try:
            query = _Query(url.query)
            with LogView.open(self.server.db) as log:
                ctype, body = _route(url.path, query, log, self.server.db.name)
        except BadQuery as exc:
            return self._error(400, str(exc), url.path)
        except _NotFound as exc:
            return self._error(404, str(exc), url.path)
        except sqlite3.Error as exc:
            logger.warning("dashboard: reading %s failed: %s", self.server.db, exc)
            return self._error(503, f"the contribution log could not be read: {exc}", url.path)
        self._send(200, ctype, body)

    def _error(self, status: int, message: str, path: str) -> None:
        if path.startswith("/api/"):
            self._send(status, JSON, json.dumps({"error": message}).encode())
        else:
            self._send(status, HTML, pages.error_page(status, message).encode())

    def _send(self, status: int, ctype: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in _HEADERS.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("dashboard %s: " + format, self.address_string(), *args)


def _route(path: str, q: _Query, log: LogView, log_name: str) -> tuple[str, bytes]:
    """(content type, body) of the page or API answer at ``path``."""
    for prefix, render in _PEER_ROUTES:
        if path.startswith(prefix) and len(path) > len(prefix):
            return render(log, unquote(path[len(prefix) :]), q, log_name)
    handler = _ROUTES.get(path)
    if handler is None:
        raise _NotFound(f"nothing at {path}")
    return handler(log, q, log_name)


def _overview_html(log: LogView, q: _Query, log_name: str) -> tuple[str, bytes]:
    ov = views.overview(log, page=q.page(), per_page=q.per_page())
    return HTML, pages.overview_page(ov, log_name=log_name).encode()


def _peer_html(log: LogView, peer: str, q: _Query, log_name: str) -> tuple[str, bytes]:
    return HTML, pages.peer_page(_peer_view(log, peer, q), log_name=log_name).encode()


def _peer_json(log: LogView, peer: str, q: _Query, log_name: str) -> tuple[str, bytes]:
    return _json(_peer_view(log, peer, q))


def _peer_view(log: LogView, peer: str, q: _Query) -> views.PeerView:
    pv = views.peer(log, peer, page=q.page(), per_page=q.per_page())
    if pv is None:
        raise _NotFound(f"no decided contribution of peer {peer!r} in the log")
    return pv


def _json(value: object) -> tuple[str, bytes]:
    return JSON, json.dumps(_finite(views.to_json(value)), allow_nan=False).encode()


def _finite(v: Any) -> Any:
    """``v`` with every NaN or infinite float replaced by None (strict JSON has neither)."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_finite(x) for x in v]
    return v


_Route = Callable[[LogView, "_Query", str], tuple[str, bytes]]
_PeerRoute = Callable[[LogView, str, "_Query", str], tuple[str, bytes]]

_ROUTES: dict[str, _Route] = {
    "/": _overview_html,
    "/api/overview": lambda log, q, _: _json(views.overview(log, page=q.page(), per_page=q.per_page())),
    "/api/leaderboard": lambda log, q, _: _json(views.leaderboard(log, page=q.page(), per_page=q.per_page())),
    "/api/windows": lambda log, q, _: _json(views.series(log, windows=q.windows(), points=q.points())),
    "/api/rejections": lambda log, q, _: _json(log.rejection_reasons(windows=q.windows())),
    "/api/current": lambda log, q, _: _json(views.current(log)),
    "/api/agreement": lambda log, q, _: _json(views.agreement(log, windows=q.windows())),
}
_PEER_ROUTES: tuple[tuple[str, _PeerRoute], ...] = (("/peer/", _peer_html), ("/api/peers/", _peer_json))


class _Query:
    """A request's query string, read strictly: unknown forms of a number are a BadQuery."""

    def __init__(self, text: str) -> None:
        try:
            self.fields = parse_qs(text, keep_blank_values=True, strict_parsing=False, max_num_fields=16)
        except ValueError as exc:
            raise BadQuery(f"query string: {exc}") from None

    def page(self) -> int:
        return self._int("page", 1, 1, 10**9)

    def per_page(self) -> int:
        return self._int("per_page", views.PER_PAGE, 1, views.MAX_PER_PAGE)

    def points(self) -> int:
        return self._int("points", views.CHART_POINTS, 1, MAX_POINTS)

    def windows(self) -> tuple[int | None, int | None]:
        lo, hi = self._opt_int("from"), self._opt_int("to")
        return lo, hi

    def _int(self, name: str, default: int, lo: int, hi: int) -> int:
        v = self._opt_int(name)
        if v is None:
            return default
        if not lo <= v <= hi:
            raise BadQuery(f"{name} must be between {lo} and {hi}, got {v}")
        return v

    def _opt_int(self, name: str) -> int | None:
        values = self.fields.get(name)
        if not values or values[-1] == "":
            return None
        text = values[-1]
        if not (text.isascii() and text.lstrip("-").isdigit()) or len(text) > 12:
            raise BadQuery(f"{name} must be a whole number, got {text[:40]!r}")
        return int(text)

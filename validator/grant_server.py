"""The validator's grant endpoint over HTTP(S): ``POST /v1/grant`` and ``GET /v1/info``.

Standard-library ``http.server`` in a background thread, one short-lived thread per request;
the decisions are :class:`validator.grants.GrantDesk`'s::

    server = GrantServer(desk, host="0.0.0.0", port=8710, tls_cert="cert.pem", tls_key="key.pem")
    server.start()            # server.url: https://0.0.0.0:8710
    ...
    server.close()

Answers are JSON: a grant (200), the run's info (200), or ``{"error": reason, "detail": text}``
with the refusal's status (``Retry-After`` on 429). Requests larger than
:data:`protocol.store.grants.MAX_REQUEST_BYTES`, without a ``Content-Length``, or slower than
``timeout_s`` are dropped. Nothing is written to stderr: every decision is an event.
"""

from __future__ import annotations

import json
import math
import ssl
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from protocol.errors import ConfigError
from protocol.store.grants import (
    GRANT_PATH,
    INFO_PATH,
    MAX_REQUEST_BYTES,
    SIGNATURE_HEADER,
    GrantRefused,
    encode_grant,
    encode_refusal,
)
from validator.grants import GrantDesk

__all__ = ["GrantServer"]


class GrantServer:
    """Serves ``desk`` on ``host:port`` (``port`` 0: any free port; see :attr:`url`)."""

    def __init__(
        self,
        desk: GrantDesk,
        host: str = "0.0.0.0",
        port: int = 0,
        *,
        tls_cert: str = "",
        tls_key: str = "",
        timeout_s: float = 10.0,
    ) -> None:
        if bool(tls_cert) != bool(tls_key):
            raise ConfigError("--tls-cert and --tls-key go together")
        self.desk = desk
        handler = type("Handler", (_Handler,), {"desk": desk, "timeout": timeout_s})
        try:
            self._httpd = ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            raise ConfigError(f"the grant server cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
        self._httpd.daemon_threads = True
        self.scheme = "http"
        if tls_cert:
            self._httpd.socket = _tls_context(tls_cert, tls_key).wrap_socket(
                self._httpd.socket,
                server_side=True,
                do_handshake_on_connect=False,  # the handshake runs in the request's thread, not the accept loop
            )
            self.scheme = "https"
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        shown = host if isinstance(host, str) else host.decode()
        return f"{self.scheme}://{shown}:{port}"

    def start(self) -> GrantServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="grant-server", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and release the port. Idempotent."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=10)
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> GrantServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tls_context(cert: str, key: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load the TLS certificate {cert} and key {key}: {exc}") from exc
    return context


class _Handler(BaseHTTPRequestHandler):
    desk: GrantDesk
    server_version = "sparseloco-grants/1"
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        if self.path != GRANT_PATH:
            self._refuse(
                GrantRefused("not_found", f"POST {GRANT_PATH} asks for a grant; there is nothing at {self.path}")
            )
            return
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit() or int(length) > MAX_REQUEST_BYTES:
            self._refuse(
                GrantRefused("malformed", f"a grant request has a Content-Length of at most {MAX_REQUEST_BYTES}")
            )
            return
        body = self.rfile.read(int(length))
        try:
            grant = self.desk.decide(body, self.headers.get(SIGNATURE_HEADER), self.client_address[0])
        except GrantRefused as refusal:
            self._refuse(refusal)
            return
        self._answer(HTTPStatus.OK, encode_grant(grant))

    def do_GET(self) -> None:
        if self.path != INFO_PATH:
            self._refuse(
                GrantRefused("not_found", f"GET {INFO_PATH} describes the run; there is nothing at {self.path}")
            )
            return
        try:
            info = self.desk.info(self.client_address[0])
        except GrantRefused as refusal:
            self._refuse(refusal)
            return
        self._answer(HTTPStatus.OK, json.dumps(info).encode())

    def _refuse(self, refusal: GrantRefused) -> None:
        headers = {"Retry-After": str(math.ceil(refusal.retry_after_s))} if refusal.retry_after_s > 0 else {}
        self._answer(refusal.status, encode_refusal(refusal), headers, close=refusal.status >= 400)

    def _answer(self, status: int, body: bytes, headers: dict[str, str] | None = None, *, close: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Silent: the desk reports every decision as an event."""

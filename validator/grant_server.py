"""The validator's grant endpoint over HTTP(S): ``POST /v1/grant`` and ``GET /v1/info``.

An internet-facing server on aiohttp: one asyncio loop in a background thread of the validator
process; the decisions are :class:`validator.grants.GrantDesk`'s, taken on a small thread pool so
that signing never stalls the loop::

    server = GrantServer(desk, host="0.0.0.0", port=8710, tls_cert="cert.pem", tls_key="key.pem")
    server.start()            # server.url: https://0.0.0.0:8710
    ...
    server.close()

Answers are JSON: a grant (200), the run's info (200), or ``{"error": reason, "detail": text}``
with the refusal's status (``Retry-After`` on 429 and 503). What a connection may cost
(:class:`ServerLimits`):

* one request per connection: the TLS handshake within ``timeout_s``, then the whole request
  (headers and body) within ``timeout_s``; a slower one (a trickling "slowloris" client, a
  truncated body) is cut off with a ``too_slow`` event;
* at most ``max_connections`` open connections, and ``max_prefix_connections`` from one network
  prefix (:func:`validator.netprefix.network_prefix`); one over a cap is closed at once with a
  ``busy`` event;
* a body of at most :data:`protocol.store.grants.MAX_REQUEST_BYTES` (``Content-Length`` checked
  before reading, a chunked body read no further than the cap), request lines and headers of at
  most ``max_header_bytes``.

Nothing is written to stderr: every decision is an event (:class:`~protocol.events.GrantDenied`
for every refusal, including the server's own), the access log is off and aiohttp's error log
becomes ``server_error`` events.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import math
import socket
import ssl
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

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
from validator.netprefix import network_prefix

__all__ = ["GrantServer", "ServerLimits"]


@dataclass(frozen=True)
class ServerLimits:
    """What one connection may cost the grant server (see the module docstring)."""

    timeout_s: float = 10.0
    max_connections: int = 1024
    max_prefix_connections: int = 64
    max_header_bytes: int = 8190
    workers: int = 4  # threads deciding requests (signature checks, presigning)
    backlog: int = 512


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
        limits: ServerLimits | None = None,
    ) -> None:
        if bool(tls_cert) != bool(tls_key):
            raise ConfigError("--tls-cert and --tls-key go together")
        self.desk = desk
        self.limits = limits or ServerLimits(timeout_s=timeout_s)
        self._tls = _tls_context(tls_cert, tls_key) if tls_cert else None
        self.scheme = "https" if self._tls else "http"
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self._sock = socket.create_server((host, port), family=family, backlog=self.limits.backlog)
        except OSError as exc:
            raise ConfigError(f"the grant server cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
        self.connections = _Connections(self.limits, desk)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._stopped: asyncio.Event | None = None

    @property
    def url(self) -> str:
        host, port = self._sock.getsockname()[:2]
        return f"{self.scheme}://{host}:{port}"

    def start(self) -> GrantServer:
        """Serve in a background thread; returns once the server accepts connections."""
        if self._thread is not None:
            return self
        ready = threading.Event()
        failure: list[BaseException] = []
        self._pool = concurrent.futures.ThreadPoolExecutor(self.limits.workers, thread_name_prefix="grant-desk")
        self._thread = threading.Thread(target=self._serve, args=(ready, failure), name="grant-server", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self.close()
            raise ConfigError(f"the grant server cannot start: {failure[0]}")
        return self

    def close(self) -> None:
        """Stop serving, drop open connections and release the port. Idempotent."""
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and self._stopped is not None:
            loop.call_soon_threadsafe(self._stopped.set)
            thread.join(timeout=10)
        self._thread = self._loop = None
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._sock.close()

    def __enter__(self) -> GrantServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the loop's thread
    def _serve(self, ready: threading.Event, failure: list[BaseException]) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._run(ready))
        except BaseException as exc:  # reported to start(), which raises ConfigError
            failure.append(exc)
        finally:
            ready.set()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _run(self, ready: threading.Event) -> None:
        self._stopped = asyncio.Event()
        http = _Server(self, self._handle)
        server = await asyncio.get_running_loop().create_server(
            http,
            sock=self._sock.dup(),
            ssl=self._tls,
            ssl_handshake_timeout=self.limits.timeout_s if self._tls else None,
            backlog=self.limits.backlog,
        )
        ready.set()
        try:
            await self._stopped.wait()
        finally:
            server.close()
            for protocol in list(http.connections):
                protocol.force_close()
            await http.shutdown(timeout=1.0)
            await server.wait_closed()

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        address = request.remote or ""
        try:
            body = await self._arrived(request)
        except GrantRefused as refusal:  # the server's own refusals: reported here
            protocol = request.protocol
            if not (isinstance(protocol, _Connection) and protocol.cut):  # a cut one is reported already
                self.desk.refused(refusal, address)
            return _refusal(refusal)
        try:  # the desk reports its decisions itself
            if body is None:
                info = await self._off_loop(self.desk.info, address)
                return _json(200, json.dumps(info).encode())
            grant = await self._off_loop(self.desk.decide, body, request.headers.get(SIGNATURE_HEADER), address)
            return _json(200, encode_grant(grant))
        except GrantRefused as refusal:
            return _refusal(refusal)

    async def _arrived(self, request: web.BaseRequest) -> bytes | None:
        """The body of a grant request, or None for an info request, read in full."""
        if request.method == "POST" and request.path == GRANT_PATH:
            body = await _body(request)
            _answered(request)
            return body
        _answered(request)
        if request.method == "GET" and request.path == INFO_PATH:
            return None
        where = GRANT_PATH if request.method == "POST" else INFO_PATH
        raise GrantRefused("not_found", f"{request.method} {where} is served; there is nothing at {request.path}")

    async def _off_loop(self, fn: Any, *args: Any) -> Any:
        if self._pool is None:
            raise GrantRefused("busy", "the grant server is shutting down", retry_after_s=5.0)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)


async def _body(request: web.BaseRequest) -> bytes:
    """The request's body, at most MAX_REQUEST_BYTES (else GrantRefused ``malformed``)."""
    limit = MAX_REQUEST_BYTES
    declared = request.content_length
    if declared is not None and declared > limit:
        raise GrantRefused("malformed", f"a grant request has at most {limit} bytes, not {declared}")
    try:
        body = (
            await request.content.read(limit + 1) if declared is None else await request.content.readexactly(declared)
        )
        while declared is None and len(body) <= limit and (more := await request.content.read(limit + 1 - len(body))):
            body += more
    except (asyncio.IncompleteReadError, ConnectionResetError):  # the client closed its side early
        raise GrantRefused("malformed", "the request's body ended before its Content-Length") from None
    if len(body) > limit:
        raise GrantRefused("malformed", f"a grant request has at most {limit} bytes")
    return body


def _answered(request: web.BaseRequest) -> None:
    """The request has arrived in full: its connection's deadline no longer applies."""
    protocol = request.protocol
    if isinstance(protocol, _Connection):
        protocol.arrived()


def _json(status: int, body: bytes, headers: dict[str, str] | None = None) -> web.Response:
    response = web.Response(status=status, body=body, content_type="application/json", headers=headers)
    response.force_close()  # one request per connection: a connection's deadline covers all of it
    return response


def _refusal(refusal: GrantRefused) -> web.Response:
    retry = {"Retry-After": str(math.ceil(refusal.retry_after_s))} if refusal.retry_after_s > 0 else None
    return _json(refusal.status, encode_refusal(refusal), retry)


def _tls_context(cert: str, key: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load the TLS certificate {cert} and key {key}: {exc}") from exc
    return context


# ---------------------------------------------------------------------- connections
class _Connections:
    """Open connections, in all and per network prefix (owned by the loop's thread)."""

    def __init__(self, limits: ServerLimits, desk: GrantDesk) -> None:
        self.limits, self.desk = limits, desk
        self.per_prefix: Counter[str] = Counter()
        self.open = 0
        self.refused = 0  # over a cap
        self.cut = 0  # too slow

    def admit(self, address: str) -> str | None:
        """The connection's prefix if it is within the caps, else None (and a ``busy`` event)."""
        prefix = network_prefix(address, self.desk.policy.prefix_v4, self.desk.policy.prefix_v6)
        if self.open >= self.limits.max_connections:
            why = f"the grant server has {self.open} connections open, its cap"
        elif self.per_prefix[prefix] >= self.limits.max_prefix_connections:
            why = f"{prefix} has {self.per_prefix[prefix]} connections open, the cap of one network"
        else:
            self.open += 1
            self.per_prefix[prefix] += 1
            return prefix
        self.refused += 1
        self.desk.refused(GrantRefused("busy", why, retry_after_s=1.0), address)
        return None

    def release(self, prefix: str) -> None:
        self.open -= 1
        self.per_prefix[prefix] -= 1
        if self.per_prefix[prefix] <= 0:
            del self.per_prefix[prefix]

    def too_slow(self, address: str) -> None:
        self.cut += 1
        self.desk.refused(
            GrantRefused("too_slow", f"the request did not arrive in full within {self.limits.timeout_s:g} s"),
            address,
        )


_BUSY_BODY = b'{"error": "busy", "detail": "the grant server has too many connections open"}'
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY)
)


class _Connection(RequestHandler):
    """aiohttp's connection handler, within the caps and the deadline of :class:`ServerLimits`."""

    def __init__(self, server: _Server, **kwargs: Any) -> None:
        super().__init__(server, **kwargs)
        self._book = server.owner.connections
        self._prefix: str | None = None
        self._address = ""
        self._deadline: asyncio.TimerHandle | None = None
        self._admitted = False
        self.cut = False  # too slow: cut off, and reported

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        self._address = str(peer[0]) if peer else ""
        self._prefix = self._book.admit(self._address)
        if self._prefix is None:
            if isinstance(transport, asyncio.Transport):
                transport.write(_BUSY)  # a client that reads it retries; its request is not read
            transport.close()
            return
        self._admitted = True
        super().connection_made(transport)
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(self._book.limits.timeout_s, self._too_slow, transport)

    def arrived(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self, transport: asyncio.BaseTransport) -> None:
        self._deadline = None
        self.cut = True
        self._book.too_slow(self._address)
        self.force_close()
        if isinstance(transport, asyncio.Transport):
            transport.abort()

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self._admitted:
            return
        self._admitted = False
        self.arrived()
        if self._prefix is not None:
            self._book.release(self._prefix)
        super().connection_lost(exc)


class _Server(web.Server):
    """aiohttp's low-level server, making :class:`_Connection` handlers."""

    def __init__(self, owner: GrantServer, handler: Any) -> None:
        self.owner = owner
        limits = owner.limits
        super().__init__(
            handler,
            access_log=None,
            logger=_event_logger(owner.desk),
            keepalive_timeout=2 * limits.timeout_s,  # a backstop: the deadline of _Connection cuts first
            max_line_size=limits.max_header_bytes,
            max_field_size=limits.max_header_bytes,
            max_headers=32,
            lingering_time=0,
            tcp_keepalive=False,
        )

    def __call__(self) -> _Connection:
        return _Connection(self, loop=self._loop, **self._kwargs)

    def _make_request(self, message: Any, payload: Any, protocol: Any, writer: Any, task: Any) -> web.BaseRequest:
        return web.BaseRequest(message, payload, protocol, writer, task, self._loop, client_max_size=MAX_REQUEST_BYTES)


class _EventLog(logging.Handler):
    """aiohttp's error log as ``server_error`` events (nothing reaches stderr)."""

    def __init__(self, desk: GrantDesk) -> None:
        super().__init__(logging.WARNING)
        self.desk = desk

    def emit(self, record: logging.LogRecord) -> None:
        detail = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            detail += f": {record.exc_info[1]!r}"
        self.desk.refused(GrantRefused("server_error", detail), "")


def _event_logger(desk: GrantDesk) -> logging.Logger:
    """A logger outside the logging tree (nothing propagates to stderr) whose records are events."""
    logger = logging.Logger("sparseloco.grant_server.http", logging.WARNING)
    logger.addHandler(_EventLog(desk))
    logger.propagate = False
    return logger

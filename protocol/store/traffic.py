"""What a store's traffic puts on the wire: every byte its sockets send and receive.

A peer's ``upload_bytes`` and ``download_bytes`` are object sizes. What crosses its link is more:
the HTTP request and response headers of every operation, the grant server's requests and answers
(:mod:`protocol.store.granted`: one to the grant server and one to the store per operation),
listings, size queries, retries and the bodies of refused requests. A store that talks HTTP counts
all of it in one :class:`WireCounter`, at the socket: each connection it opens is wrapped in a
:class:`CountingSocket` once connected, so ``sent`` and ``received`` are the bytes the process
handed to and took from the kernel, headers included::

    wire = WireCounter()
    opener = counting_opener(wire)                     # urllib with counted connections
    with opener.open("http://127.0.0.1:8710/v1/info") as resp:
        resp.read()
    wire.sent, wire.received                           # the request and the whole response

For plain HTTP that is the TCP payload, with two exceptions: segments the kernel sends again
(retransmissions, which the process never sees) and bytes that arrived but were never read (an
answer abandoned when its connection closes). Over TLS it is the plaintext: the handshake and the
records' framing are not seen (measured: +0.25 % on a 1 MiB GET, handshake included). A CONNECT to
a proxy is not counted either (the socket is wrapped after the tunnel is up).

What a network interface counts is more again: every packet carries its headers, and the ACKs of
the reverse direction are packets too. :func:`framing_estimate` takes them off an interface's byte
and packet counters, so the two can be compared::

    payload = framing_estimate(tx_bytes, tx_packets)   # bytes − 66 per packet
    abs(payload - wire.sent) / payload                 # scripts/bench_wire.py, BENCHMARKS.md
"""

from __future__ import annotations

import http.client
import io
import socket
import ssl
import threading
import urllib.request
from typing import Any, TypeVar, cast

__all__ = [
    "FRAME_BYTES",
    "CountingSocket",
    "WireCounter",
    "counted_connection",
    "counting_opener",
    "framing_estimate",
]

# One TCP segment on an Ethernet link: Ethernet header 14 (two MACs and the type; the FCS and the
# preamble never reach the interface counters) + IPv4 header 20 (no options) + TCP header 20 + the
# timestamp option Linux puts on every segment, 10 bytes padded to 12 with two NOPs. SYNs carry more
# options (MSS, window scale, SACK permitted: 74 bytes), ACKs with SACK blocks 8 per block more;
# those are a few packets per connection. With segmentation offload (veth, most NICs) a counted
# packet may be one super-segment: its headers are counted once, and so is this constant.
FRAME_BYTES = 14 + 20 + 20 + 12

C = TypeVar("C", bound=type)


def framing_estimate(interface_bytes: int, packets: int) -> int:
    """The TCP payload in ``interface_bytes`` that ``packets`` packets carried: each packet's
    :data:`FRAME_BYTES` of Ethernet, IPv4 and TCP headers taken off (not below 0)."""
    if interface_bytes < 0 or packets < 0:
        raise ValueError(f"byte and packet counts are not negative, got {interface_bytes}, {packets}")
    return max(0, interface_bytes - packets * FRAME_BYTES)


class WireCounter:
    """Bytes sent and received on the sockets of one store (every thread's connections)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sent = 0
        self._received = 0

    def __repr__(self) -> str:
        return f"WireCounter(sent={self._sent}, received={self._received})"

    @property
    def sent(self) -> int:
        return self._sent

    @property
    def received(self) -> int:
        return self._received

    def snapshot(self) -> tuple[int, int]:
        """(sent, received), read together."""
        with self._lock:
            return self._sent, self._received

    def add_sent(self, n: int) -> None:
        with self._lock:
            self._sent += n

    def add_received(self, n: int) -> None:
        with self._lock:
            self._received += n


class _CountingReader(io.RawIOBase):
    """A socket's read stream (``makefile("rb", 0)``) that counts what it reads."""

    def __init__(self, raw: io.RawIOBase, counter: WireCounter) -> None:
        super().__init__()
        self._raw, self._counter = raw, counter

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int | None:
        n = self._raw.readinto(buffer)
        if n:
            self._counter.add_received(n)
        return n

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        try:
            self._raw.close()  # releases the socket's reference, as the plain stream would
        finally:
            super().close()


class CountingSocket:
    """A connected socket (plain or TLS) whose sends and receives add to ``counter``; everything
    else (timeouts, ``fileno`` for polling, ``close``, certificates) goes to the socket itself."""

    def __init__(self, sock: socket.socket, counter: WireCounter) -> None:
        self._sock, self._counter = sock, counter

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    def sendall(self, data: Any, *args: Any) -> None:
        self._sock.sendall(data, *args)
        self._counter.add_sent(memoryview(data).nbytes)

    def send(self, data: Any, *args: Any) -> int:
        n = self._sock.send(data, *args)
        self._counter.add_sent(n)
        return n

    def recv(self, size: int, *args: Any) -> bytes:
        data = self._sock.recv(size, *args)
        self._counter.add_received(len(data))
        return data

    def recv_into(self, buffer: Any, *args: Any) -> int:
        n = self._sock.recv_into(buffer, *args)
        self._counter.add_received(n)
        return n

    def makefile(self, mode: str = "r", buffering: int | None = None, **kwargs: Any) -> Any:
        """A read stream over the socket that counts (HTTP responses are read through one)."""
        if set(mode) - {"r", "b"} or "b" not in mode or kwargs:
            raise ValueError(f"a counting socket reads binary streams only, not mode {mode!r}")
        reader = _CountingReader(self._sock.makefile("rb", buffering=0), self._counter)
        if buffering == 0:
            return reader
        return io.BufferedReader(reader, buffering if buffering and buffering > 0 else io.DEFAULT_BUFFER_SIZE)

    def close(self) -> None:
        self._sock.close()


def counted_connection(cls: C, counter: WireCounter) -> C:
    """A subclass of the HTTP connection class ``cls`` (:mod:`http.client`'s, urllib3's or
    botocore's: each sets ``self.sock`` in ``connect``) whose sockets count into ``counter``."""

    base: Any = cls

    def connect(self: Any) -> None:
        base.connect(self)
        if self.sock is not None and not isinstance(self.sock, CountingSocket):
            self.sock = CountingSocket(self.sock, counter)

    return cast(C, type(f"Counted{cls.__name__}", (cls,), {"connect": connect, "wire": counter}))


class _CountingHTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, counter: WireCounter) -> None:
        super().__init__()
        self._connection = counted_connection(http.client.HTTPConnection, counter)

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(self._connection, req)


class _CountingHTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, counter: WireCounter, context: ssl.SSLContext | None = None) -> None:
        super().__init__(context=context)
        self._connection = counted_connection(http.client.HTTPSConnection, counter)

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        options: dict[str, Any] = {"context": self._context}  # type: ignore[attr-defined]
        if getattr(self, "_check_hostname", None) is not None:  # Python < 3.12 only
            options["check_hostname"] = self._check_hostname  # type: ignore[attr-defined]
        return self.do_open(self._connection, req, **options)


def counting_opener(counter: WireCounter, *, context: ssl.SSLContext | None = None) -> urllib.request.OpenerDirector:
    """An opener like :func:`urllib.request.urlopen`'s default one (proxies from the environment,
    redirects, :class:`urllib.error.HTTPError` for error statuses) whose HTTP and HTTPS connections
    count into ``counter``."""
    return urllib.request.build_opener(_CountingHTTPHandler(counter), _CountingHTTPSHandler(counter, context))

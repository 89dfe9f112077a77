"""What a store's sockets count is what crossed the connection, and what a link counts less framing.

Against a TCP relay on 127.0.0.1 that counts every byte it forwards each way (an observer outside
the process's sockets): the counting opener (plain requests, an error status, threads at once), an
S3 store (SeaweedFS: puts, multipart, gets, ranges, listings, sizes) and a granted store (the grant
server and the store behind two relays) count exactly what the relays forwarded, headers and all.

Over a veth pair between two network namespaces (root only, ``scripts/bench_wire.py``): 1, 10 and
100 MiB up and down, with segmentation offload and without, the counter agrees with the
interface's bytes less 66 per packet (:func:`~protocol.store.traffic.framing_estimate`) to a few
bytes per connection, except for retransmitted segments, which only the link sees.
"""

from __future__ import annotations

import http.server
import importlib.util
import socket
import ssl
import sys
import threading
import time
import urllib.error
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from servers import SeaweedS3, weed_available
from tls import self_signed

from client.metered import MeteredStore
from protocol import layout
from protocol.config import RunSpec
from protocol.events import Event, PeerWindow, WindowOpened, describe, parse_line, to_json
from protocol.identity import Identity
from protocol.store.granted import GrantedStore
from protocol.store.memory import MemoryStore
from protocol.store.traffic import FRAME_BYTES, CountingSocket, WireCounter, counting_opener, framing_estimate

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


# ---------------------------------------------------------------------- an observer on the path
class Relay:
    """Forwards every connection to 127.0.0.1 on to ``upstream`` and counts the bytes of each
    direction as it receives them (before it forwards them: whatever a client has read, the relay
    has counted)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.up = 0  # client → server
        self.down = 0  # server → client
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._threads: list[threading.Thread] = []
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            for src, dst, up in ((client, server, True), (server, client, False)):
                t = threading.Thread(target=self._pump, args=(src, dst, up), daemon=True)
                t.start()
                self._threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                with self._lock:
                    if up:
                        self.up += len(data)
                    else:
                        self.down += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed.set()
        self._listener.close()


class _Handler(http.server.BaseHTTPRequestHandler):
    """GET /<n>: n bytes; PUT: reads its body; GET /missing: 404 with a body."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        if self.path == "/missing":
            body = b"<Error><Code>NoSuchKey</Code></Error>"
            self.send_response(404)
        else:
            body = bytes(int(self.path.strip("/")))
            self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_PUT(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture
def relayed() -> Iterator[Relay]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    relay = Relay(("127.0.0.1", server.server_address[1]))
    try:
        yield relay
    finally:
        relay.close()
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------------- the pure parts
def test_framing_estimate_takes_66_bytes_off_each_packet() -> None:
    assert FRAME_BYTES == 66  # Ethernet 14 + IPv4 20 + TCP 20 + timestamps 12
    assert framing_estimate(1514 * 10, 10) == 1448 * 10  # ten full segments of a 1500-byte MTU
    assert framing_estimate(66 * 7, 7) == 0  # seven bare ACKs carry nothing
    assert framing_estimate(60, 1) == 0  # not below 0 (a packet without the timestamp option)
    assert framing_estimate(0, 0) == 0
    with pytest.raises(ValueError):
        framing_estimate(-1, 0)
    with pytest.raises(ValueError):
        framing_estimate(100, -1)


def test_the_counter_adds_from_many_threads() -> None:
    wire = WireCounter()

    def add(_: int) -> None:
        for _ in range(1000):
            wire.add_sent(3)
            wire.add_received(5)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(add, range(8)))
    assert wire.snapshot() == (8 * 1000 * 3, 8 * 1000 * 5)


def test_a_counting_socket_reads_binary_streams_only() -> None:
    a, b = socket.socketpair()
    wire = WireCounter()
    try:
        counted = CountingSocket(a, wire)
        with pytest.raises(ValueError):
            counted.makefile("w")
        b.sendall(b"hello")
        assert counted.recv(5) == b"hello"
        counted.sendall(b"abc")
        assert b.recv(3) == b"abc"
        assert wire.snapshot() == (3, 5)
        assert counted.fileno() == a.fileno()  # anything else is the socket's own
    finally:
        a.close()
        b.close()


def test_a_window_report_carries_its_wire_bytes() -> None:
    event = PeerWindow(
        window=4, outcome="uploaded", upload_bytes=17_000, wire_up_bytes=19_512, wire_down_bytes=2_950_001
    )
    back = parse_line(to_json(event))
    assert isinstance(back, PeerWindow)
    assert (back.wire_up_bytes, back.wire_down_bytes) == (19_512, 2_950_001)
    assert "wire ↑19,512 ↓2,950,001 B" in describe(event)
    assert "wire" not in describe(PeerWindow(window=4, outcome="uploaded"))  # a store without sockets


def test_a_granted_store_with_direct_reads_counts_into_one_counter() -> None:
    from protocol.store.s3 import S3Store

    reads = S3Store("bucket", endpoint_url="http://127.0.0.1:9", anonymous=True)
    try:
        assert GrantedStore("http://127.0.0.1:9", ALICE, SPEC.hash(), reads=reads).wire is reads.wire
        assert GrantedStore("http://127.0.0.1:9", ALICE, SPEC.hash()).wire is not None
        own = WireCounter()
        assert GrantedStore("http://127.0.0.1:9", ALICE, SPEC.hash(), reads=reads, wire=own).wire is own
    finally:
        reads.close()


# ---------------------------------------------------------------------- urllib, against a relay
def test_the_opener_counts_what_crossed_the_connection(relayed: Relay) -> None:
    wire = WireCounter()
    opener = counting_opener(wire)
    with opener.open(f"{relayed.url}/{3 * MiB + 17}", timeout=30) as resp:
        assert len(resp.read()) == 3 * MiB + 17
    with opener.open(urllib.request.Request(f"{relayed.url}/up", data=bytes(MiB), method="PUT"), timeout=30) as resp:
        resp.read()
    with pytest.raises(urllib.error.HTTPError) as info:
        opener.open(f"{relayed.url}/missing", timeout=30)
    info.value.read()
    info.value.close()
    assert wire.snapshot() == (relayed.up, relayed.down)
    # Headers count: more than the bodies each way.
    assert MiB < wire.sent < MiB + 1024
    assert 3 * MiB + 17 < wire.received < 3 * MiB + 17 + 2048


def test_connections_from_many_threads_all_count(relayed: Relay) -> None:
    wire = WireCounter()
    opener = counting_opener(wire)

    def fetch(i: int) -> int:
        with opener.open(f"{relayed.url}/{1000 * i}", timeout=30) as resp:
            return len(resp.read())

    with ThreadPoolExecutor(8) as pool:
        assert sum(pool.map(fetch, range(40))) == 1000 * sum(range(40))
    assert wire.snapshot() == (relayed.up, relayed.down)


def test_a_store_without_sockets_reports_zero_wire_bytes() -> None:
    store = MeteredStore(MemoryStore())
    store.put("a/b", b"x" * 10)
    assert store.get("a/b") == b"x" * 10
    assert (store.bytes_written, store.bytes_read) == (10, 10)
    assert (store.wire_sent, store.wire_received) == (0, 0)


# ---------------------------------------------------------------------- TLS: the plaintext is counted
class _ObjectHandler(_Handler):
    """GET /<bucket>/<n>: n bytes, as an S3 object (boto3 parses nothing more of a GET)."""

    def do_GET(self) -> None:
        self.path = "/" + self.path.split("?")[0].rsplit("/", 1)[-1]
        super().do_GET()


@pytest.fixture
def tls(tmp_path: Path) -> Iterator[tuple[Relay, Path]]:
    """An HTTPS server on 127.0.0.1 behind a relay, and its certificate."""
    cert, key = self_signed(tmp_path)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ObjectHandler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    relay = Relay(("127.0.0.1", server.server_address[1]))
    try:
        yield relay, cert
    finally:
        relay.close()
        server.shutdown()
        server.server_close()


def _tls_overhead(wire: WireCounter, relay: Relay, body: int) -> None:
    """The counter saw the plaintext: the body and headers, less than the relay's ciphertext by
    the handshake and the records' framing (a few KiB and about 0.2 % of a MiB)."""
    assert body < wire.received < relay.down < wire.received + body // 100 + 8192
    assert 0 < wire.sent < relay.up < wire.sent + 8192


def test_over_tls_the_opener_counts_the_plaintext(tls: tuple[Relay, Path]) -> None:
    relay, cert = tls
    wire = WireCounter()
    opener = counting_opener(wire, context=ssl.create_default_context(cafile=str(cert)))
    with opener.open(f"https://127.0.0.1:{relay.port}/{MiB}", timeout=30) as resp:
        assert len(resp.read()) == MiB
    _tls_overhead(wire, relay, MiB)


def test_over_tls_an_s3_store_counts_the_plaintext(tls: tuple[Relay, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    from protocol.store.s3 import S3Store

    relay, cert = tls
    monkeypatch.setenv("AWS_CA_BUNDLE", str(cert))
    store = S3Store(
        "bucket", endpoint_url=f"https://127.0.0.1:{relay.port}", region="us-east-1", access_key="a", secret_key="b"
    )
    try:
        assert len(store.get(str(MiB), max_bytes=2 * MiB)) == MiB
    finally:
        store.close()
    assert store.wire is not None
    _tls_overhead(store.wire, relay, MiB)


# ---------------------------------------------------------------------- S3 and grants, against relays
needs_weed = pytest.mark.skipif(not weed_available(), reason="needs the SeaweedFS weed binary")


@pytest.fixture(scope="module")
def s3() -> Iterator[SeaweedS3]:
    if not weed_available():
        pytest.skip("needs the SeaweedFS weed binary")
    with SeaweedS3() as server:
        yield server


def _relay_to(url: str) -> Relay:
    host, _, port = url.split("://", 1)[1].rstrip("/").partition(":")
    return Relay((socket.gethostbyname(host), int(port)))


@needs_weed
@pytest.mark.integration
def test_an_s3_store_counts_every_request_boto3_sends(s3: SeaweedS3) -> None:
    relay = _relay_to(s3.endpoint_url)
    try:
        store = MeteredStore(s3.store(f"t{uuid.uuid4().hex[:12]}", endpoint_url=relay.url, part_size=5 * MiB))
        store.put("big", bytes(12 * MiB))  # multipart: three parts, from the part pool's threads
        store.put("small", b"s" * 1000, if_absent=True)
        assert len(store.get("big", max_bytes=16 * MiB)) == 12 * MiB
        assert store.get_range("small", 10, 100) == b"s" * 100
        assert sorted(store.list("")) == ["big", "small"]
        assert store.size("small") == 1000
        assert store.exists("small") and not store.exists("nothing")
        store.close()
        assert (store.wire_sent, store.wire_received) == (relay.up, relay.down)
        assert store.bytes_written == 12 * MiB + 1000
        assert store.bytes_read == 12 * MiB + 100
        # Headers, listings and HEADs are on the wire and not in the payload counts.
        assert store.wire_sent > store.bytes_written and store.wire_received > store.bytes_read
    finally:
        relay.close()


VALIDATOR = Identity.from_seed(b"v" * 32)
ALICE = Identity.from_seed(b"a" * 32)
SPEC = RunSpec().replace(
    windows={"upload_deadline_s": 600.0},
    validator={"public_keys": [VALIDATOR.public_key_hex], "max_contribution_bytes": 1_000_000},
)


@needs_weed
@pytest.mark.integration
def test_a_granted_store_counts_the_grant_server_and_the_store(s3: SeaweedS3) -> None:
    from validator.grant_server import GrantServer
    from validator.grants import GrantDesk, OpenWindows

    s3_relay = _relay_to(s3.endpoint_url)
    windows = OpenWindows()
    windows.observe(WindowOpened(window=3, base="genesis", opened_at=time.time()))
    events: list[Event] = []
    admin = s3.store(f"t{uuid.uuid4().hex[:12]}", endpoint_url=s3_relay.url)  # grants point through the relay
    server = GrantServer(GrantDesk(SPEC, admin, windows.current, emit=events.append), "127.0.0.1")
    with server, admin:
        desk_relay = _relay_to(server.url)
        try:
            store = MeteredStore(GrantedStore(desk_relay.url, ALICE, SPEC.hash()))
            run = layout.run_id(SPEC.hash())
            key = layout.contrib_key(run, 3, ALICE.peer_id)
            store.put(key, b"c" * 50_000, if_absent=True)
            assert store.get(key, max_bytes=100_000) == b"c" * 50_000
            assert store.get(key, max_bytes=100_000) == b"c" * 50_000  # a cached grant: no desk request
            assert store.get_range(key, 100, 10) == b"c" * 10
            assert store.size(key) == 50_000
            assert store.list(layout.contrib_prefix(run, 3)) == [key]
            assert admin.wire is not None
            desk_sent, desk_received = admin.wire.snapshot()  # the desk's own requests to the store, if any
            total = (desk_relay.up + s3_relay.up - desk_sent, desk_relay.down + s3_relay.down - desk_received)
            assert (store.wire_sent, store.wire_received) == total
            assert desk_relay.up > 0 and desk_relay.down > 0  # the grant requests and answers count
            assert store.wire_sent > 50_000 + desk_relay.up
        finally:
            desk_relay.close()
            s3_relay.close()


# ---------------------------------------------------------------------- a real link
def _bench() -> ModuleType:
    name = "scripts_bench_wire"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "bench_wire.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.mark.parametrize("offload", [True, False], ids=["offload", "mtu_packets"])
def test_over_a_veth_link_the_counter_is_the_payload_the_interface_counts(offload: bool) -> None:
    bench = _bench()
    why = bench.netns_available()
    if why is not None:
        pytest.skip(why)
    rows = [bench.compare(r) for r in bench.measure([MiB, 10 * MiB, 100 * MiB], offload=offload)]
    print("\n" + "\n".join(str(r) for r in rows))
    for r in rows:
        bulk, other = r[r["bulk"]], r["rx" if r["bulk"] == "tx" else "tx"]
        assert bulk["wire"] >= r["size"]  # the body and the headers
        # What the link carried covers what the sockets counted: raw bytes more, payload ~ the same.
        assert bulk["iface"] > bulk["wire"] and bulk["payload"] >= bulk["wire"] - 256
        if bulk["retransmitted"] == 0:
            # A few bytes per connection: SYN options, a RST without timestamps.
            assert abs(bulk["payload"] - bulk["wire"]) <= 256, r
            assert abs(bulk["payload_diff"]) < 0.0003, r
        if bulk["retransmitted"] == 0 and other["retransmitted"] == 0:
            assert abs(other["payload"] - other["wire"]) <= 256, r  # the ACKs carry nothing
        if offload is False:
            # Every 1448 payload bytes cost 66 more on the link: raw bytes are ≈ 4.6 % over.
            assert bulk["raw_diff"] > 0.04, r

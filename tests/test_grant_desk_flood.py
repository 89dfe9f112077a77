"""The grant server under floods, on loopback: the real server, desk and S3 presigner (presigning
needs no S3 server), attacked from many source addresses of 127.0.0.0/8.

Fresh keys from one network share one budget, while keys from many networks fill only the table
of strangers; a JSON bomb, oversized, chunked and truncated bodies are refused; trickling
("slowloris") connections are cut at the deadline and connections over the per-network cap are
refused at once (a peer told so retries and gets in once connections free up). Throughout, an announced peer keeps getting its grants, every refusal is an event
(counted here), the desk's tables stay within their caps, and nothing leaks (threads, connections)
or reaches stderr. Waits are bounded waits for events or for the server to close a socket.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest

from protocol import layout
from protocol.config import RunSpec
from protocol.events import Event, GrantDenied
from protocol.identity import Identity
from protocol.store.granted import GrantedStore
from protocol.store.grants import GRANT_PATH, SIGNATURE_HEADER, GrantRequest, decode_grant, encode_request
from protocol.store.s3 import S3Store
from validator.grant_server import GrantServer, ServerLimits
from validator.grants import FixedRoster, GrantDesk, GrantPolicy, OpenWindow

VALIDATOR = Identity.from_seed(b"v" * 32)
ALICE = Identity.from_seed(b"a" * 32)  # announced, in good standing
SPEC = RunSpec().replace(
    windows={"upload_deadline_s": 600.0},
    validator={"public_keys": [VALIDATOR.public_key_hex], "max_contribution_bytes": 10_000},
)
RUN_HASH = SPEC.hash()
RUN = layout.run_id(RUN_HASH)
LEGIT = "127.0.0.1"
POLICY = GrantPolicy(
    address_rate=50.0,
    address_burst=200.0,
    unannounced_rate=0.5,
    unannounced_burst=5.0,
    max_nonces=60,
)
LIMITS = ServerLimits(timeout_s=2.0, max_connections=400, max_prefix_connections=40, workers=2)
WAIT_S = 30.0  # the longest any bounded wait here may take on a loaded machine


class Events:
    """The desk's events, and bounded waits for them."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._cond = threading.Condition()

    def __call__(self, event: Event) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def denied(self, reason: str, address_prefix: str = "") -> list[GrantDenied]:
        with self._cond:
            return [
                e
                for e in self.events
                if isinstance(e, GrantDenied) and e.reason == reason and e.address.startswith(address_prefix)
            ]

    def wait(self, condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        with self._cond:
            while not condition():
                left = deadline - time.monotonic()
                assert left > 0, f"no {what} within {WAIT_S} s"
                self._cond.wait(min(left, 0.5))


@dataclass
class Served:
    server: GrantServer
    desk: GrantDesk
    events: Events
    host: str
    port: int


@pytest.fixture
def served() -> Iterator[Served]:
    threads_before = {t.ident for t in threading.enumerate()}
    events = Events()
    store = S3Store(
        "granted", "runs", endpoint_url="http://127.0.0.1:9", region="us-east-1", access_key="k", secret_key="s"
    )
    desk = GrantDesk(
        SPEC,
        store,
        lambda: OpenWindow(3, time.time() - 1),
        policy=POLICY,
        emit=events,
        roster=FixedRoster(ALICE.peer_id),
    )
    server = GrantServer(desk, "127.0.0.1", 0, limits=LIMITS).start()
    host, port = server._sock.getsockname()[:2]
    yield Served(server, desk, events, host, port)
    assert server.connections.open == 0 or _eventually(lambda: server.connections.open == 0)
    server.close()
    store.close()
    leaked = [t for t in threading.enumerate() if t.ident not in threads_before and t.is_alive()]
    assert not [t.name for t in leaked if t.name.startswith(("grant-server", "grant-desk"))]


def _eventually(condition: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            return False
        threading.Event().wait(0.05)  # polls the loop's counters, which have no event of their own
    return True


def post(s: Served, body: bytes, headers: dict[str, str], source: str = LEGIT) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection(s.host, s.port, timeout=WAIT_S, source_address=(source, 0))
    try:
        conn.request("POST", GRANT_PATH, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def ask(s: Served, request: GrantRequest, who: Identity, source: str = LEGIT) -> tuple[int, dict[str, Any]]:
    return post(s, *encode_request(request, who), source=source)


def legit_read(s: Served) -> float:
    """ALICE reads the aggregate of window 2: granted; returns the seconds the answer took."""
    started = time.monotonic()
    status, answer = ask(s, GrantRequest.read(RUN_HASH, "get", layout.aggregate_key(RUN, 2)), ALICE)
    assert status == 200, answer
    assert decode_grant(json.dumps(answer).encode()).method == "GET"
    return time.monotonic() - started


def cut(sock: socket.socket) -> bool:
    """The server closed ``sock`` without answering (waits at most the socket's timeout)."""
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True


def fresh_keys(n: int, tag: int) -> list[Identity]:
    return [Identity.from_seed(bytes([tag, i]) + b"\0" * 30) for i in range(n)]


def test_fresh_keys_from_one_network_share_one_budget(served: Served, capfd: pytest.CaptureFixture[str]) -> None:
    s = served
    answers: list[tuple[int, dict[str, Any]]] = []
    keys = fresh_keys(60, 1)

    def flood(worker: int) -> None:  # 4 attackers, 15 fresh keys each, on addresses of 127.0.1.0/24
        for i in range(15):
            key = keys[worker * 15 + i]
            request = GrantRequest.read(RUN_HASH, "get", layout.aggregate_key(RUN, 2))
            answers.append(ask(s, request, key, source=f"127.0.1.{1 + worker * 15 + i}"))

    started = time.monotonic()
    attackers = [threading.Thread(target=flood, args=(w,)) for w in range(4)]
    for t in attackers:
        t.start()
    latencies = []
    while any(t.is_alive() for t in attackers) or len(latencies) < 3:  # the announced peer, during the flood
        latencies.append(legit_read(s))
    for t in attackers:
        t.join()
    elapsed = time.monotonic() - started
    assert max(latencies) < LIMITS.timeout_s
    granted = sum(status == 200 for status, _ in answers)
    limited = [a for status, a in answers if status == 429]
    # 60 fresh keys on 60 addresses of 127.0.1.0/24 share the budget of unannounced keys there.
    assert POLICY.unannounced_burst <= granted <= POLICY.unannounced_burst + elapsed * POLICY.unannounced_rate + 1
    assert granted + len(limited) == 60 and all(a["error"] == "rate_limited" for a in limited)
    assert len(s.events.denied("rate_limited", "127.0.1.")) == len(limited)
    assert not s.events.denied("rate_limited", LEGIT)  # the announced peer is rationed on its own
    # An announcement needs no standing (within the same small budget, on another network).
    newcomer = fresh_keys(1, 2)[0]
    status, _ = ask(
        s,
        GrantRequest.put(RUN_HASH, layout.peer_key(RUN, newcomer.peer_id), 100, if_absent=False),
        newcomer,
        "127.0.2.1",
    )
    assert status == 200
    # ... but a contribution does.
    status, answer = ask(
        s,
        GrantRequest.put(RUN_HASH, layout.contrib_key(RUN, 3, newcomer.peer_id), 100, if_absent=True),
        newcomer,
        "127.0.2.1",
    )
    assert (status, answer["error"]) == (403, "not_announced")
    assert capfd.readouterr().err == ""


def test_contribution_grants_are_rationed_per_window(served: Served) -> None:
    s = served
    key = layout.contrib_key(RUN, 3, ALICE.peer_id)
    statuses = [ask(s, GrantRequest.put(RUN_HASH, key, 100, if_absent=True), ALICE)[0] for _ in range(5)]
    assert statuses == [200] * POLICY.contribution_grants + [409] * (5 - POLICY.contribution_grants)
    assert len(s.events.denied("already_granted")) == 5 - POLICY.contribution_grants


def test_keys_from_many_networks_fill_only_the_strangers_nonce_table(served: Served) -> None:
    s = served
    keys = fresh_keys(100, 3)
    answers = [
        ask(s, GrantRequest.read(RUN_HASH, "get", layout.aggregate_key(RUN, 2)), key, source=f"127.0.{10 + i}.1")
        for i, key in enumerate(keys)
    ]
    granted = sum(status == 200 for status, _ in answers)
    busy = [a for status, a in answers if status == 503]
    assert granted == POLICY.max_nonces and len(busy) == 100 - POLICY.max_nonces
    assert all(a["error"] == "busy" for a in busy) and len(s.events.denied("busy")) == len(busy)
    tables = s.desk.tables()
    assert tables["unannounced_nonces"] == POLICY.max_nonces and tables["unannounced_networks"] <= 100
    legit_read(s)  # the announced peer's table is its own
    assert s.desk.tables()["nonces"] == 1


def test_bombs_oversized_chunked_and_truncated_bodies_are_refused(
    served: Served, capfd: pytest.CaptureFixture[str]
) -> None:
    s = served
    signature = {SIGNATURE_HEADER: "00" * 64}
    for bomb in (b"[" * 4000, b'{"a":' * 800, b"[" * 2000 + b"]" * 2000):
        assert post(s, bomb, signature)[0] == 400
    assert post(s, b"{" * 5000, signature)[1]["error"] == "malformed"  # over the cap: not read
    # A chunked body is read no further than the cap.
    conn = http.client.HTTPConnection(s.host, s.port, timeout=WAIT_S)
    conn.request("POST", GRANT_PATH, body=iter([b"x" * 3000, b"y" * 3000]), headers=signature)
    resp = conn.getresponse()
    assert resp.status == 400 and json.loads(resp.read())["error"] == "malformed"
    conn.close()
    # A body that ends before its Content-Length: refused as malformed.
    truncated = b"POST /v1/grant HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n" + b"{" * 100
    with socket.create_connection((s.host, s.port), timeout=WAIT_S) as sock:
        sock.sendall(truncated)
        sock.shutdown(socket.SHUT_WR)
        s.events.wait(lambda: len(s.events.denied("malformed")) == 6, "malformed refusals")
    # A body that stops before its Content-Length and stays open: cut at the deadline.
    with socket.create_connection((s.host, s.port), timeout=WAIT_S) as sock:
        sock.sendall(truncated)
        assert cut(sock)
    assert len(s.events.denied("too_slow")) == 1 and len(s.events.denied("malformed")) == 6
    legit_read(s)
    assert capfd.readouterr().err == ""


def test_slowloris_connections_are_cut_while_peers_are_served(
    served: Served, capfd: pytest.CaptureFixture[str]
) -> None:
    s = served
    networks = ("127.0.3.", "127.0.4.", "127.0.5.")
    per_network = LIMITS.max_prefix_connections  # each network at its cap: all admitted
    sockets: list[socket.socket] = []
    for net in networks:
        for i in range(per_network):
            sock = socket.socket()
            sock.bind((f"{net}{1 + i}", 0))
            sock.settimeout(WAIT_S)
            sock.connect((s.host, s.port))
            sockets.append(sock)
    # One network more than its cap: refused at once with 503.
    extra = socket.socket()
    extra.bind(("127.0.3.250", 0))
    extra.settimeout(WAIT_S)
    extra.connect((s.host, s.port))
    assert b" 503 " in extra.recv(4096)
    extra.close()
    assert len(s.events.denied("busy", "127.0.3.")) == 1
    request = b"POST /v1/grant HTTP/1.1\r\nHost: x\r\nContent-Length: 300\r\n\r\n" + b"{" * 300
    stop = threading.Event()
    dripped = [0]

    def drip() -> None:  # one byte on every socket in turn, until the server has closed them all
        pos = 0
        while not stop.is_set() and pos < len(request):
            for sock in sockets:
                try:
                    sock.send(request[pos : pos + 1])
                except OSError:
                    pass
            dripped[0] = pos = pos + 1
            stop.wait(0.1)

    dripper = threading.Thread(target=drip, name="slowloris")
    dripper.start()
    try:
        latencies = []
        all_cut = lambda: len(s.events.denied("too_slow")) >= len(sockets)  # noqa: E731
        while not all_cut():  # the peer is served throughout
            latencies.append(legit_read(s))
            n = len(s.events.events)
            s.events.wait(lambda: len(s.events.events) > n or all_cut(), "a connection cut")
        assert latencies and max(latencies) < LIMITS.timeout_s
        assert all(cut(sock) for sock in sockets)  # cut by the server, never answered
    finally:
        stop.set()
        dripper.join()
        for sock in sockets:
            sock.close()
    assert dripped[0] < len(request)  # none got its request in
    assert len(s.events.denied("too_slow")) == len(sockets)
    assert _eventually(lambda: s.server.connections.open == 0)
    assert capfd.readouterr().err == ""


def test_a_peer_over_the_connection_cap_retries_and_gets_in(served: Served) -> None:
    s = served
    patient = replace(LIMITS, timeout_s=WAIT_S)  # the idle connections stay until they are closed
    with GrantServer(s.desk, "127.0.0.1", 0, limits=patient) as server:
        host, port = server._sock.getsockname()[:2]
        idle = []
        for i in range(patient.max_prefix_connections):  # 127.0.0.0/24 at its cap
            sock = socket.socket()
            sock.bind((f"127.0.0.{10 + i}", 0))
            sock.connect((host, port))
            idle.append(sock)
        assert _eventually(lambda: server.connections.open == len(idle))
        waits: list[float] = []

        def sleep(seconds: float) -> None:  # the peer's backoff: the idle connections go meanwhile
            waits.append(seconds)
            for sock in idle:
                sock.close()
            assert _eventually(lambda: server.connections.open == 0)

        store = GrantedStore(f"http://{host}:{port}", ALICE, RUN_HASH, retries=2, sleep=sleep)
        assert store.info()["run_hash"] == RUN_HASH
        # 503 busy with Retry-After: 1 (or a reset, when the request reached a closed socket): one retry
        assert len(waits) == 1 and waits[0] in (1.0, store.backoff_s)
        assert len(s.events.denied("busy", "127.0.0.1")) == 1

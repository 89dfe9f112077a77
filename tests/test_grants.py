"""Grants without a real S3 server: the request format, the validator's decisions, the HTTP endpoint,
and the granted store against moto (the S3 of record, SeaweedFS, is in test_grants_s3.py).

Every refusal a hostile or confused peer can provoke is checked with its reason and status: a
forged signature, a stale or replayed request, another run, another peer's key, the aggregate, an
oversized upload, a window that is not open, too many requests.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tls import self_signed

from client.clock import measure
from protocol import layout
from protocol.config import RunSpec
from protocol.errors import AccessDenied, ConfigError, ObjectNotFound, PayloadTooLarge, StoreUnavailable
from protocol.events import Event, GrantDenied, Granted, WindowOpened, WindowPublished, describe
from protocol.identity import Identity
from protocol.settings import StoreSettings
from protocol.store import open_peer_store
from protocol.store.granted import GrantedStore, GrantNotGiven, grant_urls, parse_listing
from protocol.store.grants import (
    GRANT_PATH,
    MAX_REQUEST_BYTES,
    SIGNATURE_HEADER,
    GrantRefused,
    GrantRequest,
    decode_grant,
    decode_refusal,
    encode_grant,
    encode_request,
    read_request,
    write_scope,
)
from protocol.store.presign import Presigned
from validator.grant_server import GrantServer
from validator.grants import GrantDesk, GrantPolicy, OpenWindow, OpenWindows, Roster, TokenBuckets
from validator.netprefix import network_prefix

VALIDATOR = Identity.from_seed(b"v" * 32)
ALICE = Identity.from_seed(b"a" * 32)
BOB = Identity.from_seed(b"b" * 32)
SPEC = RunSpec().replace(
    windows={"upload_deadline_s": 60.0},
    validator={"public_keys": [VALIDATOR.public_key_hex], "max_contribution_bytes": 10_000},
)
RUN_HASH = SPEC.hash()
RUN = layout.run_id(RUN_HASH)
NOW = 1_700_000_000.0


class FakePresigner:
    """Presigns nothing real: records what it was asked and answers a recognisable URL."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def presign_put(self, key: str, size: int, *, if_absent: bool, expires_s: int) -> Presigned:
        self.calls.append(("put", key, size, if_absent, expires_s))
        return Presigned("PUT", f"http://s3.invalid/{key}", NOW + expires_s, {"Content-Length": str(size)})

    def presign_get(self, key: str, *, expires_s: int) -> Presigned:
        self.calls.append(("get", key, expires_s))
        return Presigned("GET", f"http://s3.invalid/{key}", NOW + expires_s)

    def presign_head(self, key: str, *, expires_s: int) -> Presigned:
        self.calls.append(("head", key, expires_s))
        return Presigned("HEAD", f"http://s3.invalid/{key}", NOW + expires_s)

    def presign_list(self, prefix: str, *, token: str, expires_s: int) -> Presigned:
        self.calls.append(("list", prefix, token, expires_s))
        return Presigned("GET", f"http://s3.invalid/?prefix={prefix}", NOW + expires_s, key_prefix="p/")


class Desk:
    """A desk at a settable time, window 3 open since NOW − 10 s, and the events it reported."""

    def __init__(self, policy: GrantPolicy | None = None, roster: Roster | None = None) -> None:
        self.now = NOW
        self.events: list[Event] = []
        self.open: OpenWindow | None = OpenWindow(3, NOW - 10)
        self.presigner = FakePresigner()
        self.desk = GrantDesk(
            SPEC,
            self.presigner,
            lambda: self.open,
            policy=policy,
            emit=self.events.append,
            clock=lambda: self.now,
            roster=roster,
        )

    def ask(self, request: GrantRequest, who: Identity = ALICE, address: str = "198.51.100.1") -> Presigned:
        body, headers = encode_request(request, who)
        return self.desk.decide(body, headers[SIGNATURE_HEADER], address)

    def refused(self, request: GrantRequest, who: Identity = ALICE, address: str = "198.51.100.1") -> GrantRefused:
        with pytest.raises(GrantRefused) as info:
            self.ask(request, who, address)
        denied = self.events[-1]
        assert isinstance(denied, GrantDenied) and denied.reason == info.value.reason
        return info.value


def put(key: str, size: int = 100, *, if_absent: bool = True, at: float = NOW) -> GrantRequest:
    return GrantRequest(RUN_HASH, "put", key, size, if_absent, "", at, _nonce())


def read(op: str, key: str, at: float = NOW) -> GrantRequest:
    return GrantRequest(RUN_HASH, op, key, 0, False, "", at, _nonce())


_count = iter(range(10**9))


def _nonce() -> str:
    return f"{next(_count):032x}"


# ---------------------------------------------------------------------- the request format
def test_a_signed_request_reads_back_with_the_peer_id_of_its_key() -> None:
    request = GrantRequest.put(RUN_HASH, layout.contrib_key(RUN, 3, ALICE.peer_id), 123, if_absent=True)
    body, headers = encode_request(request, ALICE)
    signed = read_request(body, headers[SIGNATURE_HEADER])
    assert signed.request == request and signed.peer_id == ALICE.peer_id


def test_a_tampered_or_unsigned_request_is_refused() -> None:
    body, headers = encode_request(GrantRequest.read(RUN_HASH, "get", f"{RUN}/aggregate/00000001"), ALICE)
    sig = headers[SIGNATURE_HEADER]
    with pytest.raises(GrantRefused, match="bad_signature"):
        read_request(body.replace(b"00000001", b"00000002"), sig)
    with pytest.raises(GrantRefused, match="bad_signature"):
        read_request(body, None)
    # Bob's public key in Alice's signed request: the signature is Alice's, so it does not verify.
    forged = body.replace(ALICE.public_key_hex.encode(), BOB.public_key_hex.encode())
    with pytest.raises(GrantRefused) as info:
        read_request(forged, sig)
    assert info.value.reason == "bad_signature" and info.value.status == 401


@pytest.mark.parametrize(
    "change",
    [
        {"extra": 1},
        {"size": "100"},
        {"if_absent": 1},
        {"op": "delete"},
        {"key": "../etc/passwd"},
        {"nonce": "short"},
        {"timestamp": True},
        {"run_hash": "ab"},
    ],
)
def test_malformed_requests_are_refused_before_the_signature(change: dict[str, Any]) -> None:
    body, headers = encode_request(GrantRequest.read(RUN_HASH, "get", f"{RUN}/aggregate/00000001"), ALICE)
    raw = {**json.loads(body), **change}
    with pytest.raises(GrantRefused) as info:
        read_request(json.dumps(raw).encode(), headers[SIGNATURE_HEADER])
    assert info.value.reason == "malformed" and info.value.status == 400


def test_garbage_is_malformed() -> None:
    for body in (b"", b"[]", b"\xff\xfe", b"{" * 5000):
        with pytest.raises(GrantRefused, match="malformed"):
            read_request(body, "0" * 128)


def test_deep_nesting_is_refused_before_any_parser_recurses() -> None:
    """4 KiB of ``[`` (within the size cap) once raised RecursionError inside json.loads on the
    server's request thread; it is a ``malformed`` refusal, reported like every other."""
    for body in (b"[" * MAX_REQUEST_BYTES, b'{"a":' * 600 + b"1" + b"}" * 600, b"[[[[[1]]]]]"):
        with pytest.raises(GrantRefused, match="nests deeper"):
            read_request(body, "0" * 128)
    d = Desk()
    with pytest.raises(GrantRefused, match="malformed"):
        d.desk.decide(b"[" * MAX_REQUEST_BYTES, "0" * 128, "198.51.100.1")
    assert isinstance(d.events[-1], GrantDenied) and d.events[-1].reason == "malformed"
    with pytest.raises(GrantRefused, match="nests deeper"):
        decode_grant(b"[" * 10_000)


def test_brackets_inside_strings_are_not_nesting() -> None:
    """Brackets and escaped quotes inside strings do not count: such a request gets as far as its
    signature check."""
    request = GrantRequest(RUN_HASH, "get", layout.aggregate_key(RUN, 1), 0, False, "", NOW, _nonce())
    body, headers = encode_request(request, ALICE)
    assert read_request(body, headers[SIGNATURE_HEADER]).request == request
    raw = json.loads(body)
    raw["nonce"] = '[[[[[[{{{{\\"[[[['
    with pytest.raises(GrantRefused) as info:
        read_request(json.dumps(raw).encode(), headers[SIGNATURE_HEADER])
    assert info.value.reason in ("malformed", "bad_signature") and "nests" not in str(info.value)


def test_write_scope_is_the_peers_own_keys() -> None:
    assert write_scope(RUN, ALICE.peer_id, layout.contrib_key(RUN, 9, ALICE.peer_id)).window == 9
    assert write_scope(RUN, ALICE.peer_id, layout.peer_key(RUN, ALICE.peer_id)).kind == "peers"
    assert write_scope(RUN, ALICE.peer_id, layout.probe_key(RUN, ALICE.peer_id)).kind == "probe"
    for key in (
        layout.contrib_key(RUN, 9, BOB.peer_id),
        layout.peer_key(RUN, BOB.peer_id),
        layout.aggregate_key(RUN, 9),
        layout.checkpoint_manifest_key(RUN, 10),
        layout.contrib_key("0123456789abcdef", 9, ALICE.peer_id),
        f"{RUN}/peers/{ALICE.peer_id}/x",
    ):
        with pytest.raises(GrantRefused, match="forbidden"):
            write_scope(RUN, ALICE.peer_id, key)


def test_grants_and_refusals_round_trip() -> None:
    grant = Presigned("PUT", "https://s3.example/b/k?X-Amz-Signature=1", NOW, {"Content-Length": "5"}, "p/")
    assert decode_grant(encode_grant(grant)) == grant
    for bad in (b"<html>", b"{}", json.dumps({**json.loads(encode_grant(grant)), "method": "DELETE"}).encode()):
        with pytest.raises(GrantRefused, match="malformed"):
            decode_grant(bad)
    refusal = decode_refusal(409, b'{"error": "window_closed", "detail": "window 3 is not open"}')
    assert (refusal.reason, refusal.status) == ("window_closed", 409) and "window 3" in str(refusal)
    assert decode_refusal(502, b"<html>bad gateway</html>").reason == "unavailable"
    assert decode_refusal(429, b"", retry_after="3").retry_after_s == 3.0


# ---------------------------------------------------------------------- the validator's decisions
def test_a_contribution_to_the_open_window_expires_at_its_deadline() -> None:
    d = Desk()
    key = layout.contrib_key(RUN, 3, ALICE.peer_id)
    grant = d.ask(put(key, 5000))
    assert d.presigner.calls == [("put", key, 5000, True, 50)]  # opened 10 s ago, 60 s deadline
    assert grant.headers == {"Content-Length": "5000"}
    granted = d.events[-1]
    assert isinstance(granted, Granted) and (granted.peer_id, granted.op, granted.key, granted.size) == (
        ALICE.peer_id,
        "put",
        key,
        5000,
    )


def test_announcements_probes_and_reads_are_granted() -> None:
    d = Desk()
    d.ask(put(layout.peer_key(RUN, ALICE.peer_id), 2000, if_absent=False))
    d.ask(put(layout.probe_key(RUN, ALICE.peer_id), 1 << 20, if_absent=False))
    d.ask(read("get", layout.aggregate_key(RUN, 2)))
    d.ask(read("head", layout.contrib_key(RUN, 2, BOB.peer_id)))  # reading others' objects is fine
    d.ask(GrantRequest(RUN_HASH, "list", layout.checkpoints_prefix(RUN), 0, False, "tok", NOW, _nonce()))
    ops = [c[0] for c in d.presigner.calls]
    assert ops == ["put", "put", "get", "head", "list"]
    assert d.presigner.calls[-1] == ("list", layout.checkpoints_prefix(RUN), "tok", 900)


@pytest.mark.parametrize(
    "request_, reason, status",
    [
        (put(layout.contrib_key(RUN, 3, BOB.peer_id)), "forbidden", 403),  # another peer's key
        (put(layout.peer_key(RUN, BOB.peer_id), if_absent=False), "forbidden", 403),
        (put(layout.aggregate_key(RUN, 3)), "forbidden", 403),
        (put(layout.checkpoint_manifest_key(RUN, 4)), "forbidden", 403),
        (put(layout.contrib_key(RUN, 3, ALICE.peer_id), 10_001), "too_large", 413),  # over the run's cap
        (put(layout.peer_key(RUN, ALICE.peer_id), 65_537, if_absent=False), "too_large", 413),
        (put(layout.contrib_key(RUN, 3, ALICE.peer_id), if_absent=False), "forbidden", 403),  # not create-only
        (put(layout.contrib_key(RUN, 2, ALICE.peer_id)), "window_closed", 409),  # an old window
        (put(layout.contrib_key(RUN, 4, ALICE.peer_id)), "window_closed", 409),  # a future one
        (read("get", "other-run/aggregate/00000001"), "forbidden", 403),
        (GrantRequest(RUN_HASH, "list", "", 0, False, "", NOW, "f" * 32), "forbidden", 403),
        (put(layout.contrib_key(RUN, 3, ALICE.peer_id), at=NOW - 400), "stale", 401),  # expired request
        (put(layout.contrib_key(RUN, 3, ALICE.peer_id), at=NOW + 400), "stale", 401),
    ],
)
def test_refusals_name_their_reason(request_: GrantRequest, reason: str, status: int) -> None:
    d = Desk()
    refusal = d.refused(request_)
    assert (refusal.reason, refusal.status) == (reason, status)
    assert d.presigner.calls == []


def test_another_runs_request_is_refused_with_both_hashes() -> None:
    other = RunSpec().replace(validator={"public_keys": [VALIDATOR.public_key_hex]}).hash()
    refusal = Desk().refused(GrantRequest(other, "get", f"{RUN}/aggregate/00000001", 0, False, "", NOW, _nonce()))
    assert refusal.reason == "wrong_run" and other in str(refusal) and RUN_HASH in str(refusal)


def test_a_replayed_request_is_refused() -> None:
    d = Desk()
    body, headers = encode_request(put(layout.contrib_key(RUN, 3, ALICE.peer_id)), ALICE)
    d.desk.decide(body, headers[SIGNATURE_HEADER], "198.51.100.1")
    with pytest.raises(GrantRefused, match="replayed"):
        d.desk.decide(body, headers[SIGNATURE_HEADER], "203.0.113.9")  # from elsewhere too


def test_no_contribution_grant_while_no_window_is_open_or_after_the_deadline() -> None:
    d = Desk()
    d.open = None
    assert "no window is open" in str(d.refused(put(layout.contrib_key(RUN, 3, ALICE.peer_id))))
    d.open = OpenWindow(3, NOW - 61)
    assert "deadline passed" in str(d.refused(put(layout.contrib_key(RUN, 3, ALICE.peer_id))))
    d.ask(put(layout.peer_key(RUN, ALICE.peer_id), if_absent=False))  # announcing needs no window


def test_rate_limits_per_peer_and_per_address() -> None:
    d = Desk(GrantPolicy(peer_rate=1.0, peer_burst=3, address_rate=1.0, address_burst=5))
    key = layout.aggregate_key(RUN, 1)
    for _ in range(3):
        d.ask(read("get", key), ALICE, "198.51.100.1")
    refusal = d.refused(read("get", key), ALICE, "203.0.113.2")  # the peer's budget, from any network
    assert refusal.reason == "rate_limited" and refusal.status == 429 and 0 < refusal.retry_after_s <= 1
    d.ask(read("get", key), BOB, "198.51.100.1")  # another peer at the same address: its own budget
    d.ask(read("get", key), BOB, "198.51.100.1")
    assert d.refused(read("get", key), BOB, "198.51.100.9").reason == "rate_limited"  # the /24's 5
    d.now += 1.0  # a token comes back every second
    d.ask(read("get", key, at=d.now), ALICE, "198.51.100.3")


class Known:
    """Announced peers and the windows each is excluded from (the validator's registry and standings)."""

    def __init__(self, announced: set[str], excluded: dict[str, int] | None = None) -> None:
        self.peers, self.excluded_until = announced, excluded or {}

    def announced(self, peer_id: str) -> bool:
        return peer_id in self.peers

    def excluded(self, peer_id: str, window: int) -> bool:
        return window < self.excluded_until.get(peer_id, 0)


def test_contributions_go_to_announced_peers_in_good_standing_a_few_times_a_window() -> None:
    known = Known({ALICE.peer_id}, {BOB.peer_id: 4})
    d = Desk(GrantPolicy(contribution_grants=2), known)
    contrib = lambda who: put(layout.contrib_key(RUN, 3, who.peer_id))  # noqa: E731
    assert d.refused(contrib(BOB), BOB).reason == "not_announced"
    d.ask(put(layout.peer_key(RUN, BOB.peer_id), if_absent=False), BOB)  # announcing needs no standing
    known.peers.add(BOB.peer_id)
    refusal = d.refused(contrib(BOB), BOB)  # announced, but excluded until window 4
    assert (refusal.reason, refusal.status) == ("forbidden", 403) and "excluded" in str(refusal)
    d.ask(contrib(ALICE))
    d.ask(contrib(ALICE))  # a retry after a lost answer
    assert d.refused(contrib(ALICE)).reason == "already_granted"
    d.open = OpenWindow(4, NOW - 5)  # the next window: a new count, and BOB's exclusion is over
    d.ask(put(layout.contrib_key(RUN, 4, ALICE.peer_id)))
    d.ask(put(layout.contrib_key(RUN, 4, BOB.peer_id)), BOB)
    reasons = [e.reason for e in d.events if isinstance(e, GrantDenied)]
    assert reasons == ["not_announced", "forbidden", "already_granted"]


def test_unannounced_keys_share_one_budget_per_network() -> None:
    d = Desk(GrantPolicy(unannounced_rate=1.0, unannounced_burst=3), Known({ALICE.peer_id}))
    key = layout.aggregate_key(RUN, 1)
    strangers = [Identity.from_seed(bytes([100 + i]) * 32) for i in range(6)]
    for who in strangers[:3]:
        d.ask(read("get", key), who, "198.51.100.7")
    assert d.refused(read("get", key), strangers[3], "198.51.100.200").reason == "rate_limited"  # same /24
    d.ask(read("get", key), strangers[4], "203.0.113.1")  # another network: its own budget
    for _ in range(5):
        d.ask(read("get", key), ALICE, "198.51.100.7")  # an announced peer: its own budget
    for who in strangers[:3]:
        d.ask(read("get", key), who, "2001:db8:1:2::5")
    assert d.refused(read("get", key), strangers[5], "2001:db8:1:ffff::9").reason == "rate_limited"  # same /48
    assert d.desk.tables()["unannounced_networks"] == 3


def test_a_full_nonce_table_refuses_and_frees_as_nonces_expire() -> None:
    d = Desk(GrantPolicy(max_nonces=3, max_skew_s=10.0))
    key = layout.aggregate_key(RUN, 1)
    for i in range(3):
        d.ask(read("get", key), ALICE, f"198.51.{i}.1")
    refusal = d.refused(read("get", key), ALICE, "198.51.9.1")
    assert (refusal.reason, refusal.status) == ("busy", 503) and refusal.retry_after_s >= 1
    assert d.desk.tables()["nonces"] == 3
    d.now += 21  # past twice the skew: the oldest expire first
    d.ask(read("get", key, at=d.now), ALICE, "198.51.9.1")
    assert d.desk.tables()["nonces"] == 1


def test_a_flood_of_refusals_costs_the_log_a_bounded_number_of_lines() -> None:
    """Refusals past a burst per (reason, network) are counted, and the next one reported says how
    many were left out; another network or reason has a budget of its own."""
    d = Desk(GrantPolicy(event_rate=1.0, event_burst=5))
    bad = b"[" * 100  # malformed: refused before any signature check
    for _ in range(50):
        with pytest.raises(GrantRefused):
            d.desk.decide(bad, None, "198.51.100.7")
    denied = [e for e in d.events if isinstance(e, GrantDenied)]
    assert len(denied) == 5 and all(e.reason == "malformed" and e.unreported == 0 for e in denied)
    with pytest.raises(GrantRefused):
        d.desk.decide(bad, None, "203.0.113.1")  # another network
    assert len(d.events) == 6 and d.desk.tables()["unreported"] == 1
    d.now += 1.0  # one more token: the next refusal is reported with the 45 left out
    with pytest.raises(GrantRefused):
        d.desk.decide(bad, None, "198.51.100.9")
    last = d.events[-1]
    assert isinstance(last, GrantDenied) and last.unreported == 45 and "45 more like it" in describe(last)
    assert d.desk.tables()["unreported"] == 0


def test_network_prefixes() -> None:
    assert network_prefix("203.0.113.7") == "203.0.113.0/24"
    assert network_prefix("2001:db8:1:2::5") == "2001:db8:1::/48"
    assert network_prefix("::ffff:203.0.113.7") == "203.0.113.0/24"  # IPv4-mapped: its IPv4 network
    assert network_prefix("203.0.113.7", v4_bits=32) == "203.0.113.7/32"
    assert network_prefix("not an address") == "not an address"


def test_token_buckets_refill_and_forget_idle_names() -> None:
    buckets = TokenBuckets(rate=2.0, burst=2, max_names=10)
    assert [buckets.take("a", 0.0) for _ in range(3)] == [0.0, 0.0, 0.5]
    assert buckets.take("a", 1.0) == 0.0
    for i in range(50):
        buckets.take(f"n{i}", 100.0)
    assert len(buckets._buckets) <= 10


def test_the_open_window_follows_the_validators_events() -> None:
    windows = OpenWindows()
    assert windows.current() is None
    windows.observe(WindowOpened(window=0, base="genesis", opened_at=10.0))
    assert windows.current() == OpenWindow(0, 10.0)
    windows.observe(
        WindowPublished(window=0, accepted=1, rejected=0, val_loss=1.0, digest="d", fingerprint="f", published_at=20.0)
    )
    assert windows.current() == OpenWindow(1, 20.0)


# ---------------------------------------------------------------------- the HTTP endpoint
def _post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url + GRANT_PATH, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_http_endpoint_answers_grants_and_refusals_with_statuses() -> None:
    d = Desk()
    d.now = time.time()
    d.open = OpenWindow(3, d.now)
    with GrantServer(d.desk, "127.0.0.1", 0) as server:
        body, headers = encode_request(
            GrantRequest.put(RUN_HASH, layout.contrib_key(RUN, 3, ALICE.peer_id), 10, if_absent=True), ALICE
        )
        status, answer = _post(server.url, body, headers)
        assert status == 200 and answer["method"] == "PUT" and decode_grant(json.dumps(answer).encode())
        status, answer = _post(server.url, body, headers)  # the same request again
        assert (status, answer["error"]) == (401, "replayed")
        other = GrantRequest.put(RUN_HASH, layout.contrib_key(RUN, 3, BOB.peer_id), 10, if_absent=True)
        body, headers = encode_request(other, ALICE)
        status, answer = _post(server.url, body, headers)
        assert (status, answer["error"]) == (403, "forbidden") and BOB.peer_id in answer["detail"]
        status, answer = _post(server.url, b"{}", {SIGNATURE_HEADER: "00"})
        assert (status, answer["error"]) == (400, "malformed")
        with urllib.request.urlopen(server.url + "/v1/info", timeout=10) as resp:
            info = json.loads(resp.read())
        assert info["run_hash"] == RUN_HASH and info["window"] == 3
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(server.url + "/elsewhere", timeout=10)
        assert err.value.code == 404
    assert [e.kind for e in d.events] == ["granted"] + ["grant_denied"] * 4
    malformed, elsewhere = d.events[-2:]
    assert isinstance(malformed, GrantDenied) and malformed.peer_id == ""  # never verified
    assert isinstance(elsewhere, GrantDenied) and elsewhere.reason == "not_found"  # the server's own refusal


def test_the_grant_servers_answers_carry_the_date_a_peer_measures_its_clock_by() -> None:
    d = Desk()
    d.now = time.time()
    with GrantServer(d.desk, "127.0.0.1", 0) as server:
        offset = measure(server.url)  # a HEAD on / : refused, and dated
    assert offset is not None and abs(offset.offset_s) <= offset.uncertainty_s


def test_grants_over_https(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cert, key = self_signed(tmp_path)
    d = Desk()
    d.now = time.time()
    with GrantServer(d.desk, "127.0.0.1", 0, tls_cert=str(cert), tls_key=str(key)) as server:
        assert server.url.startswith("https://")
        url = server.url.replace("127.0.0.1", "localhost")
        store = GrantedStore(url, ALICE, RUN_HASH, retries=0)
        with pytest.raises(StoreUnavailable, match="CERTIFICATE_VERIFY_FAILED"):  # not trusted yet
            store.info()
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        assert store.info()["run_id"] == RUN


# ---------------------------------------------------------------------- the granted store over moto
@pytest.fixture(scope="module")
def moto_s3() -> Iterator[dict[str, Any]]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options = {
        "endpoint_url": f"http://{host}:{port}",
        "region": "us-east-1",
        "access_key": "test",
        "secret_key": "test",
    }
    import boto3

    boto3.client(
        "s3",
        endpoint_url=options["endpoint_url"],
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key="test",
    ).create_bucket(Bucket="granted")
    yield options
    server.stop()


@pytest.fixture
def served(moto_s3: dict[str, Any]) -> Iterator[tuple[GrantServer, list[Event], OpenWindows]]:
    from protocol.store.s3 import S3Store

    events: list[Event] = []
    windows = OpenWindows()
    windows.observe(WindowOpened(window=3, base="genesis", opened_at=time.time()))
    with S3Store("granted", f"runs/{time.monotonic_ns()}", **moto_s3) as s3:
        desk = GrantDesk(SPEC, s3, windows.current, emit=events.append)
        with GrantServer(desk, "127.0.0.1", 0) as server:
            yield server, events, windows


def test_the_granted_store_reads_and_writes_through_presigned_requests(
    served: tuple[GrantServer, list[Event], OpenWindows],
) -> None:
    server, events, _ = served
    alice = GrantedStore(server.url + "/", ALICE, RUN_HASH)  # a trailing slash is fine
    contrib, ann = layout.contrib_key(RUN, 3, ALICE.peer_id), layout.peer_key(RUN, ALICE.peer_id)
    alice.put(ann, b"announcement")
    alice.put(ann, b"withdrawal")  # announcements are replaced
    alice.put(contrib, b"x" * 5000, if_absent=True)
    assert alice.get(contrib) == b"x" * 5000 and alice.size(contrib) == 5000
    assert alice.get(ann) == b"withdrawal"
    assert alice.list(f"{RUN}/") == sorted([contrib, ann])
    assert alice.list(layout.aggregate_prefix(RUN)) == []
    with pytest.raises(ObjectNotFound):
        alice.get(layout.aggregate_key(RUN, 3))
    assert not alice.exists(layout.aggregate_key(RUN, 3))
    assert not alice.exists(layout.aggregate_key(RUN, 3))  # polled again with the cached grant
    assert alice.stats.cached >= 1
    with pytest.raises(PayloadTooLarge):
        alice.get(contrib, max_bytes=4999)
    with pytest.raises(AccessDenied):
        alice.delete(contrib)
    assert {e.kind for e in events} == {"granted"}


def test_the_granted_store_reports_refusals_with_the_servers_reason(
    served: tuple[GrantServer, list[Event], OpenWindows],
) -> None:
    server, _, windows = served
    alice = GrantedStore(server.url, ALICE, RUN_HASH)
    with pytest.raises(GrantNotGiven) as info:
        alice.put(layout.contrib_key(RUN, 3, BOB.peer_id), b"forged", if_absent=True)
    assert info.value.refusal == "forbidden" and info.value.reason == "access_denied" and BOB.peer_id in str(info.value)
    with pytest.raises(GrantNotGiven, match="window 2 is not open") as info:
        alice.put(layout.contrib_key(RUN, 2, ALICE.peer_id), b"late", if_absent=True)
    assert info.value.refusal == "window_closed"
    with pytest.raises(PayloadTooLarge):
        alice.put(layout.contrib_key(RUN, 3, ALICE.peer_id), b"x" * 10_001, if_absent=True)
    with pytest.raises(GrantNotGiven) as info:
        alice.put(layout.aggregate_key(RUN, 3), b"forged")
    assert info.value.refusal == "forbidden"
    stranger = GrantedStore(server.url, ALICE, RunSpec().hash())
    with pytest.raises(GrantNotGiven) as info:
        stranger.get(layout.aggregate_key(RUN, 1))
    assert info.value.refusal == info.value.reason == "wrong_run"  # reported as what it is
    windows.observe(WindowOpened(window=3, base="genesis", opened_at=time.time() - 61))
    with pytest.raises(GrantNotGiven, match="deadline passed"):
        alice.put(layout.contrib_key(RUN, 3, ALICE.peer_id), b"too late", if_absent=True)


def test_a_cached_grant_the_store_refuses_is_replaced_once(
    served: tuple[GrantServer, list[Event], OpenWindows],
) -> None:
    server, _, _ = served
    alice = GrantedStore(server.url, ALICE, RUN_HASH)
    key = layout.peer_key(RUN, ALICE.peer_id)
    alice.put(key, b"hello")
    assert alice.get(key) == b"hello"
    grant = alice._cache[("get", key, "")]
    with _Refusing() as refusing:  # what the store answers an expired or revoked grant: 403
        alice._cache[("get", key, "")] = Presigned("GET", refusing.url, grant.expires_at)
        assert alice.get(key) == b"hello"  # the refused cached URL was dropped, a new grant used
    assert refusing.hits == 1


class _Refusing:
    """An HTTP server that answers every request 403 AccessDenied, as S3 does."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, HTTPServer

        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                owner.hits += 1
                body = b"<Error><Code>AccessDenied</Code><Message>Request has expired</Message></Error>"
                self.send_response(403)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.hits = 0
        self._httpd = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}/bucket/key"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> _Refusing:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def test_an_unreachable_grant_server_is_retried_then_unavailable() -> None:
    waits: list[float] = []
    store = GrantedStore("http://127.0.0.1:9", ALICE, RUN_HASH, retries=2, backoff_s=0.1, sleep=waits.append)
    with pytest.raises(StoreUnavailable, match="unreachable") as info:
        store.put(layout.peer_key(RUN, ALICE.peer_id), b"x")
    assert info.value.reason == "unavailable" and waits == [0.1, 0.2]


def test_open_peer_store_picks_grants_when_the_settings_name_a_grant_server(tmp_path: Path) -> None:
    direct = open_peer_store(StoreSettings(url=f"file://{tmp_path}"), ALICE, RUN_HASH)
    assert not isinstance(direct, GrantedStore)
    granted = open_peer_store(StoreSettings(url="s3://bucket/run", grant_url="https://v.example:8710"), ALICE, RUN_HASH)
    assert isinstance(granted, GrantedStore) and granted.reads is None
    with pytest.raises(Exception, match="grant_url"):
        GrantedStore("ftp://v.example", ALICE, RUN_HASH)


def test_listing_pages_parse_strictly() -> None:
    ns = 'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"'
    page = (
        f"<ListBucketResult {ns}><EncodingType>url</EncodingType><IsTruncated>true</IsTruncated>"
        "<Contents><Key>p/run/a%2Bb</Key></Contents><Contents><Key>p/run/dir/</Key></Contents>"
        "<Contents><Key>elsewhere/x</Key></Contents><NextContinuationToken>t1</NextContinuationToken>"
        "</ListBucketResult>"
    ).encode()
    assert parse_listing(page, "p/") == (["run/a+b"], "t1")
    for bad in (
        b"not xml",
        b"<Error><Code>AccessDenied</Code></Error>",
        page.replace(b"<NextContinuationToken>t1</NextContinuationToken>", b""),
    ):
        with pytest.raises(Exception):  # noqa: B017 - StoreError, whichever way the page is broken
            parse_listing(bad, "p/")


def test_concurrent_grants_are_all_answered(served: tuple[GrantServer, list[Event], OpenWindows]) -> None:
    server, events, _ = served
    peers = [Identity.from_seed(bytes([i]) * 32) for i in range(8)]
    errors: list[BaseException] = []

    def announce(who: Identity) -> None:
        try:
            GrantedStore(server.url, who, RUN_HASH).put(layout.peer_key(RUN, who.peer_id), who.peer_id.encode())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=announce, args=(p,)) for p in peers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len([e for e in events if isinstance(e, Granted)]) == len(peers)


# ------------------------------------------------------------------------------ several grant servers
class _Answering:
    """An HTTP server that answers every GET and POST with ``status`` and ``body`` (a failing desk)."""

    def __init__(self, status: int, body: bytes) -> None:
        from http.server import BaseHTTPRequestHandler, HTTPServer

        owner = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                owner.hits += 1
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.hits = 0
        self._httpd = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> _Answering:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def _closed_port_url() -> str:
    """A local URL nothing listens on: connections are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_a_peer_moves_to_the_next_grant_server_when_the_first_is_down(
    served: tuple[GrantServer, list[Event], OpenWindows],
) -> None:
    server, events, _ = served
    down = _closed_port_url()
    waits: list[float] = []
    alice = GrantedStore(f"{down}, {server.url}/", ALICE, RUN_HASH, sleep=waits.append)
    assert alice.grant_urls == (down, server.url) and alice.grant_url == down
    ann = layout.peer_key(RUN, ALICE.peer_id)
    alice.put(ann, b"announcement")  # the first is refused a connection: the second grants at once
    assert alice.grant_url == server.url and alice.stats.failovers == 1 and waits == []
    assert alice.get(ann) == b"announcement" and alice.info()["run_hash"] == RUN_HASH
    assert alice.list(f"{RUN}/") == [ann]
    assert alice.stats.failovers == 1 and alice.stats.retries == 0  # it stays with the one that answers
    assert sum(e.kind == "granted" for e in events) == alice.stats.grants
    with pytest.raises(GrantNotGiven) as info:  # a refusal is the answer: not asked elsewhere
        alice.put(layout.contrib_key(RUN, 3, BOB.peer_id), b"forged", if_absent=True)
    assert info.value.refusal == "forbidden" and alice.grant_url == server.url


def test_a_grant_server_that_fails_is_left_but_one_that_refuses_is_not(
    served: tuple[GrantServer, list[Event], OpenWindows],
) -> None:
    server, _, _ = served
    ann = layout.peer_key(RUN, ALICE.peer_id)
    with _Answering(503, b'{"error": "unavailable", "detail": "shutting down"}') as failing:
        alice = GrantedStore([failing.url, server.url], ALICE, RUN_HASH, sleep=lambda s: None)
        alice.put(ann, b"hello")
        alice.put(ann, b"again")
    assert failing.hits == 1 and alice.grant_url == server.url and alice.stats.failovers == 1
    with _Answering(502, b"<html>bad gateway</html>") as proxy:  # a proxy before a dead validator
        alice = GrantedStore([proxy.url, server.url], ALICE, RUN_HASH, sleep=lambda s: None)
        assert alice.get(ann) == b"again" and proxy.hits == 1 and alice.grant_url == server.url
    refusal = b'{"error": "forbidden", "detail": "not your key"}'
    with _Answering(403, refusal) as refusing:
        alice = GrantedStore([refusing.url, server.url], ALICE, RUN_HASH, sleep=lambda s: None)
        with pytest.raises(GrantNotGiven) as info:
            alice.put(ann, b"hello")
    assert info.value.refusal == "forbidden" and alice.grant_url == refusing.url and alice.stats.failovers == 0


def test_when_no_grant_server_answers_the_request_is_retried_then_unavailable() -> None:
    first, second = _closed_port_url(), _closed_port_url()
    waits: list[float] = []
    store = GrantedStore(f"{first},{second}", ALICE, RUN_HASH, retries=1, backoff_s=0.1, sleep=waits.append)
    with pytest.raises(StoreUnavailable) as info:
        store.put(layout.peer_key(RUN, ALICE.peer_id), b"x")
    assert first in str(info.value) and second in str(info.value) and waits == [0.1]
    assert store.grant_url == first and store.stats.failovers == 0


@pytest.mark.parametrize(
    "setting",
    ["", " , ", "http://a.example,", "http://a.example,ftp://b.example", "http://a.example, http://a.example/"],
)
def test_grant_server_lists_are_checked(setting: str) -> None:
    with pytest.raises(ConfigError, match="grant_url"):
        grant_urls(setting)


def test_open_peer_store_takes_several_grant_servers() -> None:
    settings = StoreSettings(url="s3://bucket/run", grant_url="https://v1.example:8710, https://v2.example:8710/")
    granted = open_peer_store(settings, ALICE, RUN_HASH)
    assert isinstance(granted, GrantedStore)
    assert granted.grant_urls == ("https://v1.example:8710", "https://v2.example:8710")
    assert "v1.example" in settings.location() and "v2.example" in settings.location()


def test_the_validators_human_log_sums_grants_up_per_window_and_prints_refusals() -> None:
    """Every request of every peer is a grant: the human log counts them and says how many
    before each publication, one line, while a refusal is printed when it happens."""
    import io

    from rich.console import Console

    from protocol.events import GrantDenied, Granted, WindowPublished
    from validator.serve import HumanLines

    out = io.StringIO()
    lines = HumanLines(Console(file=out, width=200, highlight=False, soft_wrap=True))
    peers = [ALICE.peer_id, BOB.peer_id]
    for i in range(30):
        op = "put" if i % 10 == 0 else "get"
        lines(Granted(peer_id=peers[i % 2], address="10.0.0.2", op=op, key=f"k{i}", size=8, expires_at=1.0))
    lines(GrantDenied(peer_id=BOB.peer_id, address="10.0.0.3", op="put", key="k", reason="window_closed", status=409))
    lines(
        WindowPublished(window=3, accepted=2, rejected=0, val_loss=1.0, digest="d", fingerprint="f", published_at=1.0)
    )
    text = out.getvalue().splitlines()
    assert len(text) == 3, text
    assert "grant denied" in text[0] and "window_closed" in text[0]
    assert "grants since the last window: 30 to 2 peer(s) (get 27, put 3)" in text[1]
    assert "window 3" in text[2]
    lines(
        WindowPublished(window=4, accepted=2, rejected=0, val_loss=1.0, digest="d", fingerprint="f", published_at=2.0)
    )
    assert len(out.getvalue().splitlines()) == 4  # no grants since: no summary line


def test_an_operator_is_warned_when_grants_listen_beyond_the_machine_or_go_in_the_clear() -> None:
    from protocol.events import GrantsServed, describe
    from validator.serve import listening_warnings

    assert listening_warnings("127.0.0.1", tls=False) == listening_warnings("::1", tls=False) == []
    assert listening_warnings("localhost", tls=False) == []
    public = listening_warnings("0.0.0.0", tls=False)
    assert len(public) == 2 and "0.0.0.0" in public[0] and "plain HTTP" in public[1]
    assert len(listening_warnings("10.1.2.3", tls=True)) == 1  # TLS: only that it is reachable
    line = describe(GrantsServed(url="http://0.0.0.0:8710", warnings=public))
    assert line.startswith("grants served at http://0.0.0.0:8710") and line.count("warning:") == 2


def test_run_info_says_when_the_validator_waits_for_peers_before_genesis() -> None:
    """``--wait-for-peers``: before genesis the grant server says how many peers it waits for and
    how many announced; a server that omits it (older) still decodes; hostile values do not."""
    import json as _json

    from protocol.store.grants import decode_info

    base = {"run_id": "r", "run_hash": "h", "window": None, "upload_deadline": None}
    assert decode_info(_json.dumps(base).encode())["waiting_for_peers"] is None
    waiting = decode_info(_json.dumps(base | {"waiting_for_peers": 3, "announced": 1}).encode())
    assert (waiting["waiting_for_peers"], waiting["announced"]) == (3, 1)
    for bad in ({"waiting_for_peers": -1}, {"announced": "many"}, {"waiting_for_peers": True}, {"extra": 1}):
        with pytest.raises(GrantRefused):
            decode_info(_json.dumps(base | bad).encode())

    state: list[tuple[int, int] | None] = [(3, 1)]
    desk = GrantDesk(SPEC, FakePresigner(), lambda: None, waiting=lambda: state[0])
    assert (desk.info("10.0.0.1")["waiting_for_peers"], desk.info("10.0.0.1")["announced"]) == (3, 1)
    state[0] = None  # genesis is out
    assert desk.info("10.0.0.1")["waiting_for_peers"] is None

"""Grants against a real S3 server (SeaweedFS ``weed mini`` on 127.0.0.1): what the server enforces.

A presigned PUT carries its size and create-only condition in its signature, so a peer cannot send
more or other bytes than it was granted, nor overwrite; a presigned URL dies at its expiry; a
private bucket refuses anonymous reads while granted reads work; a ranged read is the key's
cached GET grant sent with a ``Range`` header (the query-signed URL signs only ``host``, and
SeaweedFS answers 206 with exactly the range, 416 past the end); with a public-read bucket a peer
reads directly, with its own spelling of the endpoint, and asks only for write grants.
"""

from __future__ import annotations

import hashlib
import os
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from urllib.parse import parse_qs, urlsplit

import pytest
from servers import SeaweedS3

from protocol import layout
from protocol.config import RunSpec
from protocol.errors import AccessDenied, ObjectExists, ObjectNotFound, RangeNotSatisfiable
from protocol.events import Event, WindowOpened
from protocol.identity import Identity
from protocol.settings import StoreSettings
from protocol.store import open_peer_store, put_once
from protocol.store.granted import GrantedStore, GrantNotGiven
from protocol.store.grants import GrantRequest
from protocol.store.presign import Presigned
from protocol.store.s3 import S3Store
from validator.grant_server import GrantServer
from validator.grants import GrantDesk, OpenWindows

pytestmark = pytest.mark.integration

VALIDATOR = Identity.from_seed(b"v" * 32)
ALICE = Identity.from_seed(b"a" * 32)
BOB = Identity.from_seed(b"b" * 32)
SPEC = RunSpec().replace(
    windows={"upload_deadline_s": 600.0},
    validator={"public_keys": [VALIDATOR.public_key_hex], "max_contribution_bytes": 100_000},
)
RUN_HASH = SPEC.hash()
RUN = layout.run_id(RUN_HASH)


@pytest.fixture(scope="module")
def s3() -> Iterator[SeaweedS3]:
    with SeaweedS3() as server:
        yield server


class Served:
    """A grant server in this process over the admin credential, under its own store prefix."""

    def __init__(self, s3: SeaweedS3) -> None:
        self.prefix = f"t{uuid.uuid4().hex[:12]}"
        self.events: list[Event] = []
        self.windows = OpenWindows()
        self.windows.observe(WindowOpened(window=3, base="genesis", opened_at=time.time()))
        self.admin = s3.store(self.prefix)
        self.server = GrantServer(
            GrantDesk(SPEC, self.admin, self.windows.current, emit=self.events.append), "127.0.0.1"
        )

    def store(self, who: Identity = ALICE) -> GrantedStore:
        return GrantedStore(self.server.url, who, RUN_HASH)


@pytest.fixture
def served(s3: SeaweedS3) -> Iterator[Served]:
    served = Served(s3)
    with served.server, served.admin:
        yield served


def _send(grant: Presigned, body: bytes | None, headers: dict[str, str]) -> int:
    request = urllib.request.Request(grant.url, data=body, method=grant.method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return exc.code


def test_a_granted_put_carries_exactly_its_size_and_create_only_condition(served: Served) -> None:
    alice = served.store()
    key = layout.contrib_key(RUN, 3, ALICE.peer_id)
    grant = alice.ask(contribution(key, 100))
    assert _send(grant, b"x" * 101, {"If-None-Match": "*"}) == 403  # one byte more: the signature breaks
    assert _send(grant, b"x" * 99, {"If-None-Match": "*"}) == 403
    assert _send(grant, b"x" * 100, {}) == 403  # without the create-only condition it was signed with
    assert _send(grant, b"x" * 100, {"If-None-Match": "*"}) == 200
    assert _send(grant, b"y" * 100, {"If-None-Match": "*"}) == 412  # the same grant cannot overwrite
    assert served.admin.get(key) == b"x" * 100
    # Through the store: put_once finds its own bytes, another contribution is refused.
    assert not put_once(alice, key, b"x" * 100)
    with pytest.raises(ObjectExists):
        put_once(alice, key, b"z" * 100)


def test_a_grant_for_one_key_writes_no_other(served: Served) -> None:
    grant = served.store().ask(contribution(layout.contrib_key(RUN, 3, ALICE.peer_id), 5))
    elsewhere = Presigned(grant.method, grant.url.replace(ALICE.peer_id, BOB.peer_id), grant.expires_at)
    assert _send(elsewhere, b"12345", {"If-None-Match": "*"}) == 403
    assert not served.admin.exists(layout.contrib_key(RUN, 3, BOB.peer_id))


def test_a_presigned_url_dies_at_its_expiry(served: Served) -> None:
    key = layout.peer_key(RUN, ALICE.peer_id)
    served.admin.put(key, b"announcement")
    # SigV4 dates have whole seconds: a URL signed late in a second with 1 s to live may be dead
    # before its first use; 3 s leaves at least 2
    grant = served.admin.presign_get(key, expires_s=3)
    assert _send(grant, None, {}) == 200
    deadline = time.monotonic() + 30
    while _send(grant, None, {}) == 200:  # S3 checks the expiry against its own clock
        assert time.monotonic() < deadline, "the presigned GET outlived its expiry"
        time.sleep(0.2)
    assert _send(grant, None, {}) == 403


def test_a_private_bucket_is_read_through_grants_only(served: Served, s3: SeaweedS3) -> None:
    alice = served.store()
    key = layout.peer_key(RUN, ALICE.peer_id)
    alice.put(key, b"announcement")
    anonymous = Presigned("GET", f"{s3.endpoint_url}/{s3.bucket}/{served.prefix}/{key}", 0.0)
    assert _send(anonymous, None, {}) == 403
    bob = served.store(BOB)
    assert bob.get(key) == b"announcement" and bob.list(layout.peers_prefix(RUN)) == [key]
    with pytest.raises(GrantNotGiven, match="forbidden"):
        bob.put(key, b"bob overwrites alice")
    with pytest.raises(AccessDenied):
        bob.delete(key)
    assert served.admin.get(key) == b"announcement"


def test_a_ranged_read_goes_through_the_cached_get_grant(served: Served) -> None:
    shard = os.urandom(300_000)
    key = layout.shard_key(RUN, hashlib.sha256(shard).hexdigest())
    served.admin.put(key, shard)
    alice = served.store()
    n = len(shard)
    ranges = [(0, 1), (123_456, 4096), (n - 1, 1), (0, n)]  # first byte, middle, last byte, whole
    for start, length in ranges:
        assert alice.get_range(key, start, length) == shard[start : start + length]
    with pytest.raises(RangeNotSatisfiable):  # SeaweedFS: 416
        alice.get_range(key, n, 1)
    with pytest.raises(RangeNotSatisfiable):  # SeaweedFS: 206 with the range cut at the end
        alice.get_range(key, n - 10, 20)
    assert alice.stats.grants == 1 and alice.stats.cached == 5  # one GET grant for every range
    assert alice.stats.bytes_downloaded == sum(length for _, length in ranges)
    assert alice.get(key) == shard and alice.stats.grants == 1  # the same grant as a whole read
    with pytest.raises(ObjectNotFound):
        alice.get_range(layout.shard_key(RUN, "0" * 64), 0, 1)

    # What the store does with the grant: the Range header is not signed in, and is honoured.
    grant = alice.ask(GrantRequest.read(RUN_HASH, "get", key))
    assert parse_qs(urlsplit(grant.url).query)["X-Amz-SignedHeaders"] == ["host"] and grant.headers == {}
    request = urllib.request.Request(grant.url, headers={"Range": "bytes=10-19"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert (resp.status, resp.headers["Content-Range"], resp.read()) == (206, f"bytes 10-19/{n}", shard[10:20])


def test_public_reads_go_to_the_bucket_with_the_peers_own_endpoint(served: Served, s3: SeaweedS3) -> None:
    s3.allow_anonymous_reads()
    served.admin.put(layout.aggregate_key(RUN, 2), b"aggregate 2")
    settings = StoreSettings(
        url=f"s3://{s3.bucket}/{served.prefix}/",  # a trailing slash
        s3_endpoint=s3.endpoint_url.replace("127.0.0.1", "localhost") + "/",
        s3_region="us-east-1",
        grant_url=served.server.url.replace("127.0.0.1", "localhost"),
        public_reads=True,
    )
    with open_peer_store(settings, ALICE, RUN_HASH) as alice:
        assert isinstance(alice, GrantedStore) and isinstance(alice.reads, S3Store)
        assert alice.get(layout.aggregate_key(RUN, 2)) == b"aggregate 2"
        assert alice.get_range(layout.aggregate_key(RUN, 2), 10, 1) == b"2"
        assert alice.reads.stats.gets == 2 and alice.reads.stats.bytes_downloaded == len(b"aggregate 2") + 1
        assert alice.list(layout.aggregate_prefix(RUN)) == [layout.aggregate_key(RUN, 2)]
        assert alice.stats.grants == 0  # no read went through the grant server
        alice.put(layout.contrib_key(RUN, 3, ALICE.peer_id), b"contribution", if_absent=True)
        assert alice.stats.grants == 1
        with pytest.raises(GrantNotGiven, match="forbidden"):
            alice.put(layout.aggregate_key(RUN, 3), b"forged")
    assert served.admin.get(layout.contrib_key(RUN, 3, ALICE.peer_id)) == b"contribution"


def contribution(key: str, size: int) -> GrantRequest:
    return GrantRequest.put(RUN_HASH, key, size, if_absent=True)


def test_a_peers_request_counts_are_what_the_store_counted(served: Served, s3: SeaweedS3) -> None:
    """Every request a granted store sends is counted by kind, and the store's own metrics see the
    same: a PUT, GETs (a 404 and a range too), a HEAD (SeaweedFS labels it GET) and a listing."""
    alice = served.store()
    before = s3.request_counts()
    key = layout.contrib_key(RUN, 3, ALICE.peer_id)
    alice.put(key, b"x" * 10, if_absent=True)
    assert alice.get(key) == b"x" * 10
    assert alice.get_range(key, 2, 3) == b"xxx"
    assert alice.size(key) == 10
    with pytest.raises(ObjectNotFound):
        alice.get(layout.aggregate_key(RUN, 3))
    assert alice.list(layout.contrib_prefix(RUN, 3)) == [key]
    assert alice.stats.requests == {"GET": 3, "HEAD": 1, "LIST": 1, "PUT": 1}
    expected = {"GET": 4, "HEAD": 0, "LIST": 1, "PUT": 1, "other": 0}
    deadline = time.monotonic() + 10.0  # the gateway counts a request as its handler returns
    while (seen := _delta(before, s3.request_counts())) != expected and time.monotonic() < deadline:
        pass
    assert seen == expected


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {kind: after[kind] - before.get(kind, 0) for kind in after}

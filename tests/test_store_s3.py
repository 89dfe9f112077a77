"""S3 backend specifics against a real S3 server (SeaweedFS ``weed mini`` on 127.0.0.1).

Large objects and multipart, per-peer credentials scoped to a prefix, the size cap, ranged reads
(one GET, only the range transferred, a server that ignores ``Range`` cut off), conditional
create races, credentials from the environment, bad credentials, pagination.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from servers import SeaweedS3, peer_grants

from protocol.errors import (
    AccessDenied,
    ConfigError,
    ObjectExists,
    ObjectNotFound,
    PayloadTooLarge,
    RangeNotSatisfiable,
    StoreError,
)
from protocol.identity import Identity
from protocol.layout import aggregate_key, contrib_key, peer_key, probe_key
from protocol.store import open_store
from protocol.store.s3 import MiB, S3Store

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def s3() -> Iterator[SeaweedS3]:
    with SeaweedS3() as server:
        yield server


@pytest.fixture
def root() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


def test_64_mib_round_trip_uses_multipart(s3: SeaweedS3, root: str) -> None:
    data = os.urandom(64 * MiB)
    with s3.store(root) as store:
        store.put("big", data)
        assert store.size("big") == len(data)
        assert store.get("big", max_bytes=64 * MiB) == data
        assert store.stats.bytes_downloaded == len(data)
        with pytest.raises(ObjectExists):
            store.put("big", data[:MiB], if_absent=True)
    etag = s3.client().head_object(Bucket=s3.bucket, Key=f"{root}/big")["ETag"]
    assert etag.strip('"').endswith("-8"), etag  # 8 parts of 8 MiB, not one 64 MiB PUT


def test_scoped_credential_writes_only_its_own_prefix(s3: SeaweedS3, root: str) -> None:
    with s3.store(root) as admin:
        admin.put("bob/contrib", b"bob's")
    alice = s3.issue_credentials(f"{root}/alice")
    with s3.store(root, credentials=alice) as store:
        store.put("alice/contrib", b"alice's")
        store.put("alice/deeper/still", b"ok")
        for other in ("bob/contrib", "bob/new", "alicex/contrib", "top"):
            with pytest.raises(AccessDenied):
                store.put(other, b"forged")
        with pytest.raises(AccessDenied):
            store.delete("bob/contrib")
        # Reading and listing the whole bucket is allowed: peers read each other's contributions.
        assert store.get("bob/contrib") == b"bob's"
        assert store.list("") == ["alice/contrib", "alice/deeper/still", "bob/contrib"]
    with s3.store(root) as admin:
        assert admin.get("bob/contrib") == b"bob's"


def test_size_cap_refuses_without_downloading(s3: SeaweedS3, root: str) -> None:
    with s3.store(root) as store:
        store.put("huge", os.urandom(6 * MiB))
        with pytest.raises(PayloadTooLarge):
            store.get("huge", max_bytes=MiB)
        assert store.stats.bytes_downloaded == 0  # refused on ContentLength, body never read
        assert store.stats.retries == 0


def _get_requests(store: S3Store) -> list[dict[str, str]]:
    """The headers of every GetObject request ``store`` sends from now on (as sent)."""
    sent: list[dict[str, str]] = []

    def note(request: Any, **_: Any) -> None:
        sent.append({k: v.decode() if isinstance(v, bytes) else v for k, v in request.headers.items()})

    store._client.meta.events.register("before-send.s3.GetObject", note)
    return sent


def test_a_ranged_read_is_one_get_of_only_the_range(s3: SeaweedS3, root: str) -> None:
    data = os.urandom(20 * MiB)  # multipart: a range across parts
    with s3.store(root) as store:
        store.put("shard", data)
        sent = _get_requests(store)
        start, length = 8 * MiB - 100, 300  # across the first part boundary
        assert store.get_range("shard", start, length) == data[start : start + length]
        assert (store.stats.gets, store.stats.bytes_downloaded, store.stats.retries) == (1, length, 0)
        assert [r.get("Range") for r in sent] == [f"bytes={start}-{start + length - 1}"]
        assert store.get_range("shard", len(data) - 1, 1) == data[-1:]
        assert (store.stats.gets, store.stats.bytes_downloaded) == (2, length + 1)
        with pytest.raises(RangeNotSatisfiable):  # S3 answers 416: nothing downloaded
            store.get_range("shard", len(data), 1)
        with pytest.raises(RangeNotSatisfiable):  # S3 answers 206 with the range cut at the end
            store.get_range("shard", len(data) - 10, 20)
        with pytest.raises(ObjectNotFound):
            store.get_range("missing", 0, 1)
        # The cut range was refused on its Content-Range, before its body was read.
        assert store.stats.bytes_downloaded == length + 1 and store.stats.retries == 0


def test_a_server_that_ignores_range_is_cut_off(s3: SeaweedS3, root: str) -> None:
    data = os.urandom(8 * MiB)
    with s3.store(root) as store:
        store.put("shard", data)
        store.put("small", b"whole")

        def drop_range(request: Any, **_: Any) -> None:
            del request.headers["Range"]  # before signing: the server sees a plain GET

        store._client.meta.events.register("before-sign.s3.GetObject", drop_range)
        with pytest.raises(StoreError, match="answered 200"):
            store.get_range("shard", 100, 1000)
        assert store.stats.bytes_downloaded <= 1001 and store.stats.retries == 0  # not 8 MiB
        with pytest.raises(RangeNotSatisfiable):  # a 200 tells the size: too short for the range
            store.get_range("small", 2, 10)
        assert store.get_range("small", 0, 5) == b"whole"  # a 200 whose whole object is the range


def _race(stores: list[S3Store], key: str, size: int) -> list[int]:
    winners: list[int] = []
    barrier = threading.Barrier(len(stores))
    bodies = [bytes([i]) * size for i in range(len(stores))]

    def contend(i: int) -> None:
        barrier.wait()
        try:
            stores[i].put(key, bodies[i], if_absent=True)
            winners.append(i)
        except ObjectExists:
            pass

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1, winners
    assert stores[0].get(key, max_bytes=size) == bodies[winners[0]]
    return winners


def test_conditional_create_race_between_clients(s3: SeaweedS3, root: str) -> None:
    stores = [s3.store(root) for _ in range(5)]
    try:
        for round_ in range(3):
            _race(stores, f"contrib-{round_}", 1000)
    finally:
        for store in stores:
            store.close()


def test_conditional_create_race_large_objects(s3: SeaweedS3, root: str) -> None:
    # Above the multipart threshold: a conditional create must still have one winner (SeaweedFS
    # ignores IfNoneMatch on CompleteMultipartUpload, so S3Store sends these as one PUT).
    stores = [s3.store(root, multipart_threshold=5 * MiB, part_size=5 * MiB) for _ in range(3)]
    try:
        _race(stores, "ckpt", 6 * MiB)
    finally:
        for store in stores:
            store.close()


def test_bad_credentials_rejected(s3: SeaweedS3, root: str) -> None:
    with s3.store(root) as admin:
        admin.put("x", b"secret")
    wrong_secret = {"access_key": s3.admin.access_key, "secret_key": "0" * 40}
    unknown_key = {"access_key": "NOBODY", "secret_key": "0" * 40}
    for creds in (wrong_secret, unknown_key):
        store = S3Store(s3.bucket, root, endpoint_url=s3.endpoint_url, region="us-east-1", **creds)
        with store:
            with pytest.raises(AccessDenied):
                store.get("x")
            with pytest.raises(AccessDenied):
                store.put("y", b"1")
            assert store.stats.retries == 0  # a refusal is not retried


def test_no_credentials_is_a_config_error(s3: SeaweedS3, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(ConfigError):
        S3Store(s3.bucket, endpoint_url=s3.endpoint_url)


def test_credentials_and_endpoint_from_environment(s3: SeaweedS3, root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    peer = s3.issue_credentials(f"{root}/envpeer")
    for name, value in peer.env(s3.endpoint_url).items():
        monkeypatch.setenv(name, value)
    with open_store(f"s3://{s3.bucket}/{root}") as store:
        store.put("envpeer/k", b"from env")
        with pytest.raises(AccessDenied):
            store.put("other/k", b"1")
        assert store.get("envpeer/k") == b"from env"


def test_list_paginates(s3: SeaweedS3, root: str) -> None:
    with s3.store(root, page_size=2) as store:
        keys = [f"w/{i:02d}" for i in range(7)]
        for key in reversed(keys):
            store.put(key, b"1")
        assert store.list("w/") == keys


def test_prefix_isolates_stores(s3: SeaweedS3, root: str) -> None:
    with s3.store(f"{root}/a") as a, s3.store(f"{root}/b") as b:
        a.put("k", b"a")
        b.put("k", b"b")
        assert a.get("k") == b"a" and b.get("k") == b"b"
        assert a.list("") == ["k"]
    with s3.store(root) as parent:
        assert parent.list("") == ["a/k", "b/k"]


def test_objects_and_credentials_survive_a_restart(s3: SeaweedS3, root: str) -> None:
    peer = s3.issue_credentials(f"{root}/p")
    with s3.store(root, credentials=peer) as store:
        store.put("p/before", b"durable")
        s3.restart()
        assert store.get("p/before") == b"durable"  # same endpoint: the client reconnects
        store.put("p/after", b"1")
        with pytest.raises(AccessDenied):
            store.put("q/after", b"1")


_DYING_UPLOADER = """
import sys, threading
from protocol.store.s3 import S3Store
store = S3Store(sys.argv[1], sys.argv[2], multipart_threshold=5 << 20, part_size=5 << 20,
                max_concurrency=1)
real_upload = store._upload_part
def upload_then_hang(full, upload_id, number, *rest):
    part = real_upload(full, upload_id, number, *rest)
    if number == 2:
        print("PARTS-UPLOADED", flush=True)
        threading.Event().wait()  # the process is killed here, between parts
    return part
store._upload_part = upload_then_hang
store.put("dying/ckpt", bytes(11 << 20))
"""


def test_peer_killed_mid_upload_leaves_no_object(s3: SeaweedS3, root: str) -> None:
    peer = s3.issue_credentials(f"{root}/dying")
    env = {**os.environ, **peer.env(s3.endpoint_url)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _DYING_UPLOADER, s3.bucket, root],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "PARTS-UPLOADED", proc.stderr.read()
    finally:
        proc.kill()
        proc.wait(timeout=10)
    with s3.store(root, credentials=peer) as store:
        assert not store.exists("dying/ckpt")
        assert store.list("dying/") == []
        store.put("dying/ckpt", b"the restarted peer", if_absent=True)  # nothing blocks a retry
        assert store.get("dying/ckpt") == b"the restarted peer"


def test_credential_with_several_grants(s3: SeaweedS3, root: str) -> None:
    peer = s3.issue_credentials(f"{root}/contrib/alice", f"{root}/peers/alice*", name="alice")
    with s3.store(root, credentials=peer) as store:
        store.put("contrib/alice/00000001", b"1")
        store.put("peers/alice", b"announcement")
        for forged in ("peers/bob", "contrib/bob/00000001", "aggregate/00000001"):
            with pytest.raises(AccessDenied):
                store.put(forged, b"x")


def test_peer_grants_allow_own_contributions_announcement_and_probe_only(s3: SeaweedS3, root: str) -> None:
    """The grants the docs give an operator for a store URL with a path (s3://bucket/<root>/runs):
    they start with that path, as keys in the bucket do."""
    alice, bob = (Identity.from_seed(bytes([i]) * 32).peer_id for i in (1, 2))
    run, prefix = "0123456789abcdef", f"{root}/runs"
    creds = s3.issue_credentials(*peer_grants(run, alice, prefix=prefix), name="alice")
    with s3.store(prefix, credentials=creds) as store:
        for key in (
            contrib_key(run, 0, alice),
            contrib_key(run, 7, alice),
            peer_key(run, alice),
            probe_key(run, alice),
        ):
            store.put(key, b"mine")
        forged = (
            contrib_key(run, 0, bob),
            peer_key(run, bob),
            probe_key(run, bob),
            aggregate_key(run, 0),
            f"{run}/contrib/x/{alice}/y",
        )
        for key in forged:
            with pytest.raises(AccessDenied):
                store.put(key, b"forged")
    with s3.store(root, credentials=creds) as outside:  # the same keys without the store's path
        with pytest.raises(AccessDenied):
            outside.put(contrib_key(run, 0, alice), b"elsewhere")

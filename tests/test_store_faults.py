"""Fault injection: the in-memory store's hooks, and S3 failures injected under boto3.

The S3 faults are injected at botocore's ``before-send`` hook (the request never leaves, or a
scripted response comes back), in front of moto's in-process server — fine for unit-level
faults; the S3 of record is SeaweedFS (test_store_s3.py).
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterator
from typing import Any

import botocore.exceptions as bexc
import pytest
from botocore.awsrequest import AWSResponse

from protocol.errors import (
    AccessDenied,
    InvalidKey,
    ObjectExists,
    ObjectNotFound,
    PayloadTooLarge,
    StoreError,
)
from protocol.store.memory import MemoryStore, SimulatedCrash
from protocol.store.s3 import S3Store

# ---------------------------------------------------------------------- memory store hooks


@pytest.fixture
def mem() -> Iterator[MemoryStore]:
    MemoryStore.forget("faults")
    yield MemoryStore("faults")
    MemoryStore.forget("faults")


def test_drop_loses_the_write_silently(mem: MemoryStore) -> None:
    mem.faults.drop("run/contrib/")
    mem.put("run/contrib/1/a", b"lost")
    mem.put("run/aggregate/1", b"kept")
    with pytest.raises(ObjectNotFound):
        mem.get("run/contrib/1/a")
    assert mem.get("run/aggregate/1") == b"kept"
    assert mem.faults.fired == [("drop", "put", "run/contrib/1/a")]


def test_delay_slows_only_matching_reads(mem: MemoryStore) -> None:
    mem.put("slow/x", b"1")
    mem.put("fast/x", b"1")
    mem.faults.delay("slow/", 0.2)
    start = time.monotonic()
    mem.get("fast/x")
    assert time.monotonic() - start < 0.1
    start = time.monotonic()
    mem.get("slow/x")
    assert time.monotonic() - start >= 0.2


def test_corrupt_shows_one_reader_other_bytes(mem: MemoryStore) -> None:
    honest = MemoryStore("faults")  # same namespace, no faults
    mem.put("run/contrib/1/a", b"signed contribution")
    mem.faults.corrupt("run/contrib/", times=1)
    seen = mem.get("run/contrib/1/a")
    assert seen != b"signed contribution" and len(seen) == len(b"signed contribution")
    assert sum(bin(x ^ y).count("1") for x, y in zip(seen, b"signed contribution")) == 1
    assert honest.get("run/contrib/1/a") == b"signed contribution"
    assert mem.get("run/contrib/1/a") == b"signed contribution"  # times=1: fired once


def test_fail_the_nth_put(mem: MemoryStore) -> None:
    mem.faults.fail_put(nth=2)
    mem.put("a", b"1")
    with pytest.raises(StoreError, match="injected"):
        mem.put("b", b"2")
    mem.put("c", b"3")
    assert mem.list("") == ["a", "c"]


def test_fail_reads_with_a_chosen_error(mem: MemoryStore) -> None:
    mem.put("private/x", b"1")
    mem.faults.fail("private/", ops=("get", "size"), error=AccessDenied)
    with pytest.raises(AccessDenied):
        mem.get("private/x")
    with pytest.raises(AccessDenied):
        mem.exists("private/x")
    mem.faults.clear()
    assert mem.get("private/x") == b"1"


def test_crash_mid_upload_is_not_an_ordinary_error(mem: MemoryStore) -> None:
    mem.faults.crash_mid_upload("run/contrib/")

    def careful_upload() -> str:
        try:
            mem.put("run/contrib/1/a", b"x" * 100)
        except Exception:  # the code under test's own error handling must not swallow a crash
            return "handled"
        return "uploaded"

    with pytest.raises(SimulatedCrash):
        careful_upload()
    assert not mem.exists("run/contrib/1/a")
    mem.put("run/contrib/1/a", b"after restart")  # fires once
    assert mem.get("run/contrib/1/a") == b"after restart"


def test_crash_can_leave_a_partial_object(mem: MemoryStore) -> None:
    mem.faults.crash_mid_upload(keep_bytes=10)
    with pytest.raises(SimulatedCrash):
        mem.put("torn", b"x" * 100)
    assert mem.get("torn") == b"x" * 10


def test_counts_and_bad_fault_prefix(mem: MemoryStore) -> None:
    mem.put("a", b"1")
    mem.get("a")
    mem.list("")
    assert (mem.counts["put"], mem.counts["get"], mem.counts["list"]) == (1, 1, 1)
    with pytest.raises(InvalidKey):
        mem.faults.drop("../escape")


# ---------------------------------------------------------------------- S3 under injected faults


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    import boto3

    boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key="test",
    ).create_bucket(Bucket="faults")
    yield endpoint
    server.stop()


class _Raw:
    """Enough of a urllib3 response for botocore: ``stream()`` and ``read()``."""

    def __init__(self, body: bytes) -> None:
        self._io = io.BytesIO(body)

    def stream(self, **_: Any) -> Iterator[bytes]:
        yield self._io.read()

    def read(self, amt: int | None = None) -> bytes:
        return self._io.read(amt)

    def close(self) -> None:
        pass


def s3_error(status: int, code: str) -> AWSResponse:
    body = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
    return AWSResponse("http://injected", status, {"Content-Length": str(len(body))}, _Raw(body))


class Injector:
    """Calls of one S3 operation; the first ``len(script)`` get the scripted outcome."""

    def __init__(self, store: S3Store, operation: str, script: list[Callable[[], Any]]) -> None:
        self.calls = 0
        self.script = script
        store._client.meta.events.register(f"before-send.s3.{operation}", self)

    def __call__(self, **_: Any) -> Any:
        self.calls += 1
        if self.calls <= len(self.script):
            return self.script[self.calls - 1]()
        return None  # let the real request through


def make_store(endpoint: str, **opts: Any) -> S3Store:
    base: dict[str, Any] = dict(
        endpoint_url=endpoint,
        region="us-east-1",
        access_key="test",
        secret_key="test",
        max_attempts=1,
        retries=2,
        backoff_s=0.01,
    )
    return S3Store("faults", f"t{time.monotonic_ns()}", **{**base, **opts})


def closed() -> Any:
    raise bexc.ConnectionClosedError(endpoint_url="http://injected")


def test_throttling_is_retried_by_botocore(moto_endpoint: str) -> None:
    with make_store(moto_endpoint, max_attempts=3, retries=0) as store:
        inject = Injector(store, "PutObject", [lambda: s3_error(503, "SlowDown")] * 2)
        store.put("k", b"data")
        assert inject.calls == 3 and store.stats.retries == 0
        assert store.get("k") == b"data"


def test_transient_errors_are_retried_by_our_layer(moto_endpoint: str) -> None:
    with make_store(moto_endpoint) as store:
        store.put("k", b"data")
        inject = Injector(store, "GetObject", [lambda: s3_error(500, "InternalError"), closed])
        assert store.get("k") == b"data"
        assert inject.calls == 3 and store.stats.retries == 2


def test_persistent_failure_is_bounded(moto_endpoint: str) -> None:
    with make_store(moto_endpoint) as store:
        inject = Injector(store, "HeadObject", [lambda: s3_error(503, "ServiceUnavailable")] * 50)
        start = time.monotonic()
        with pytest.raises(StoreError):
            store.size("k")
        assert inject.calls == 3  # 1 try + retries=2 (botocore's own retries are off here)
        assert time.monotonic() - start < 2


def test_refusals_are_not_retried(moto_endpoint: str) -> None:
    with make_store(moto_endpoint) as store:
        inject = Injector(store, "PutObject", [lambda: s3_error(403, "AccessDenied")])
        with pytest.raises(AccessDenied):
            store.put("k", b"1")
        assert inject.calls == 1


def test_conflicting_conditional_write_is_retried(moto_endpoint: str) -> None:
    with make_store(moto_endpoint) as store:
        inject = Injector(store, "PutObject", [lambda: s3_error(409, "ConditionalRequestConflict")])
        store.put("k", b"1", if_absent=True)
        assert inject.calls == 2 and store.get("k") == b"1"


def test_truncated_body_is_fetched_again(moto_endpoint: str) -> None:
    def short_body() -> AWSResponse:
        return AWSResponse("http://injected", 200, {"Content-Length": "100"}, _Raw(b"y" * 50))

    with make_store(moto_endpoint) as store:
        store.put("k", b"z" * 100)
        inject = Injector(store, "GetObject", [short_body])
        assert store.get("k") == b"z" * 100
        assert inject.calls == 2 and store.stats.retries == 1


def test_cap_enforced_while_streaming_when_length_lies(moto_endpoint: str) -> None:
    def lying() -> AWSResponse:
        return AWSResponse("http://injected", 200, {"Content-Length": "10"}, _Raw(b"y" * 5000))

    with make_store(moto_endpoint) as store:
        store.put("k", b"z" * 10)
        Injector(store, "GetObject", [lying])
        with pytest.raises(PayloadTooLarge):
            store.get("k", max_bytes=100)


def test_landed_create_with_lost_response_is_ours(moto_endpoint: str) -> None:
    with make_store(moto_endpoint, max_attempts=1, retries=2) as store:
        twin = make_store(moto_endpoint)
        twin.prefix = store.prefix

        def lands_then_drops() -> Any:
            twin.put("k", b"mine")  # the request reached the server ...
            return closed()  # ... and the connection died before the answer

        Injector(store, "PutObject", [lands_then_drops])
        store.put("k", b"mine", if_absent=True)  # the retry meets 412 on its own bytes: success
        assert store.get("k") == b"mine"

        def other_wins() -> Any:
            twin.put("j", b"theirs")
            return closed()

        Injector(store, "PutObject", [other_wins])
        with pytest.raises(ObjectExists):
            store.put("j", b"mine", if_absent=True)
        twin.close()

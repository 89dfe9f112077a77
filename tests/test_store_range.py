"""Ranged reads (``ObjectStore.get_range``) beyond the behavioural suite of every backend.

``get_range`` equals ``get()[start:start + length]`` (a property, on the memory and the local store
and on the base class's default); the memory store's ``get`` faults apply to ranged reads; the
default reads the whole object once, capped at its size, and copes with an object replaced
mid-read; the metered store counts ranges; the granted store accepts only the range it asked for
from a store that answers it otherwise (an in-process HTTP server playing the store). Real S3,
grants and DHT: test_store.py, test_store_s3.py, test_grants_s3.py, test_store_dht.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import BinaryIO

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from client.metered import MeteredStore
from protocol.errors import (
    AccessDenied,
    ObjectNotFound,
    PayloadTooLarge,
    RangeNotSatisfiable,
    StoreError,
    StoreUnavailable,
)
from protocol.identity import Identity
from protocol.store import DEFAULT_MAX_BYTES, LocalStore, MemoryStore, ObjectStore
from protocol.store.granted import GrantedStore
from protocol.store.presign import Presigned


class WholeReads(ObjectStore):
    """A store with only the abstract methods (so ``get_range`` is the base class's default) that
    notes every ``get`` and its cap; ``before_get`` runs between ``size`` and ``get``."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.gets: list[tuple[str, int]] = []
        self.before_get = lambda: None

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        self.inner.put(key, data, if_absent=if_absent)

    def get(self, key: str, *, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
        self.before_get()
        self.gets.append((key, max_bytes))
        return self.inner.get(key, max_bytes=max_bytes)

    def list(self, prefix: str) -> list[str]:
        return self.inner.list(prefix)

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ObjectStore]:
    return {
        "memory": MemoryStore(),
        "local": LocalStore(tmp_path_factory.mktemp("range"), fsync=False),
        "default": WholeReads(MemoryStore()),
    }


# ---------------------------------------------------------------------- the property
@pytest.mark.parametrize("name", ["memory", "local", "default"])
@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=600), start=st.integers(0, 700), length=st.integers(1, 700))
def test_get_range_is_a_slice_of_get(
    stores: dict[str, ObjectStore], name: str, data: bytes, start: int, length: int
) -> None:
    store = stores[name]
    store.put("obj", data)
    if start + length <= len(data):
        assert store.get_range("obj", start, length) == store.get("obj")[start : start + length]
    else:
        with pytest.raises(RangeNotSatisfiable):
            store.get_range("obj", start, length)


# ---------------------------------------------------------------------- memory store faults
@pytest.fixture
def mem() -> Iterator[MemoryStore]:
    MemoryStore.forget("range")
    yield MemoryStore("range")
    MemoryStore.forget("range")


def test_a_corrupt_fault_flips_one_bit_of_a_ranged_read(mem: MemoryStore) -> None:
    honest = MemoryStore("range")
    data = bytes(range(256))
    mem.put("run/data/shard/a", data)
    mem.faults.corrupt("run/data/", times=1)
    seen = mem.get_range("run/data/shard/a", 16, 32)
    assert len(seen) == 32 and seen != data[16:48]
    assert sum(bin(x ^ y).count("1") for x, y in zip(seen, data[16:48])) == 1
    assert mem.faults.fired == [("corrupt", "get", "run/data/shard/a")]
    assert honest.get_range("run/data/shard/a", 16, 32) == data[16:48]
    assert mem.get_range("run/data/shard/a", 16, 32) == data[16:48]  # times=1: fired once
    assert mem.counts["get"] == 2  # a ranged read is a get to the counts


def test_fail_and_delay_faults_apply_to_ranged_reads(mem: MemoryStore) -> None:
    mem.put("slow/x", b"0123456789")
    mem.put("private/x", b"0123456789")
    mem.faults.fail("private/", ops=("get",), error=AccessDenied)
    with pytest.raises(AccessDenied):
        mem.get_range("private/x", 0, 1)
    mem.faults.delay("slow/", 0.2)
    started = time.monotonic()
    assert mem.get_range("slow/x", 3, 4) == b"3456"
    assert time.monotonic() - started >= 0.2
    mem.faults.fail("", ops=("get",), nth=1)
    with pytest.raises(StoreError, match="injected get failure"):
        mem.get_range("missing/x", 0, 1)  # the fault fires before the lookup, as for get
    with pytest.raises(ObjectNotFound):
        mem.get_range("missing/x", 0, 1)


# ---------------------------------------------------------------------- the default
def test_the_default_reads_the_object_once_capped_at_its_size() -> None:
    store = WholeReads(MemoryStore())
    store.put("k", b"0123456789")
    assert store.get_range("k", 2, 3) == b"234"
    assert store.gets == [("k", 10)]
    with pytest.raises(RangeNotSatisfiable):  # refused on size(): nothing read
        store.get_range("k", 8, 3)
    with pytest.raises(ObjectNotFound):
        store.get_range("missing", 0, 1)
    assert store.gets == [("k", 10)]


def test_the_default_copes_with_an_object_replaced_mid_read() -> None:
    store = WholeReads(MemoryStore())
    store.put("k", b"0123456789")
    replacements = iter([b"0123456789 and more", b"ABCDEFGHIJKLMNOPQRSTUVWXYZ"])
    store.before_get = lambda: store.inner.put("k", next(replacements, b"ABCDEFGHIJKLMNOPQRSTUVWXYZ"))
    # Grew twice between size() and get(): get refused twice, the third look read what is there.
    assert store.get_range("k", 2, 3) == b"CDE"
    assert [cap for _, cap in store.gets] == [10, 19, 26]

    store.before_get = lambda: store.inner.put("k", b"tiny")  # shrank: the range is past its end now
    with pytest.raises(RangeNotSatisfiable):
        store.get_range("k", 2, 8)

    store.before_get = lambda: store.inner.put("k", store.inner.get("k") + b"+")  # keeps growing
    with pytest.raises(StoreError, match="kept growing") as err:
        store.get_range("k", 0, 1)
    assert not isinstance(err.value, PayloadTooLarge)


def test_helper_stores_of_other_tests_read_ranges() -> None:
    from test_peer_state import UnreadableKey
    from test_run_data import Recording

    inner = MemoryStore()
    inner.put("a", b"abc")
    inner.put("b", b"xyz")
    store = UnreadableKey(inner, "b")  # the default get_range, through its own get
    assert store.get_range("a", 1, 2) == b"bc"
    with pytest.raises(StoreError, match="unreachable"):  # its get fails, so its ranges fail too
        store.get_range("b", 0, 1)
    rec = Recording(inner)
    assert rec.get_range("b", 2, 1) == b"z" and rec.get("a") == b"abc"
    assert (rec.ranges, rec.gets) == ([("b", 2, 1)], ["a"])  # ranges noted apart from whole reads


# ---------------------------------------------------------------------- metered
def test_the_metered_store_counts_the_bytes_of_ranges() -> None:
    inner = MemoryStore()
    inner.put("k", bytes(1000))
    store = MeteredStore(inner)
    store.get_range("k", 100, 250)
    store.get("k")
    assert store.bytes_read == 1250 and inner.counts["get"] == 2
    with pytest.raises(RangeNotSatisfiable):
        store.get_range("k", 999, 2)
    assert store.bytes_read == 1250


# ---------------------------------------------------------------------- granted, against odd stores
BODY = bytes(range(256)) * 64 * 1024  # 16 MiB the store would send were it let


class OddStore(BaseHTTPRequestHandler):
    """Answers a GET of ``/obj`` the way ``server.mode`` says; notes the Range asked and the bytes
    the client took (what the socket accepted before the client hung up)."""

    server: OddServer

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self.server.asked.append(self.headers.get("Range"))
        mode = self.server.mode
        if mode == "416":
            self._head(416, {"Content-Length": "0"})
        elif mode == "ignore":  # no Range support: 200 and the whole object
            self._head(200, {"Content-Length": str(len(BODY))})
            self._body(BODY)
        elif mode == "ignore-small":
            self._head(200, {"Content-Length": "5"})
            self._body(b"whole")
        elif mode == "wrong-range":  # the right length, but other bytes than asked
            self._head(206, {"Content-Length": "10", "Content-Range": f"bytes 0-9/{len(BODY)}"})
            self._body(BODY[:10])
        elif mode == "cut":  # promises the range, sends half of it
            self._head(206, {"Content-Length": "10", "Content-Range": f"bytes 5-14/{len(BODY)}"})
            self._body(BODY[5:10])
        else:  # honest
            self._head(206, {"Content-Length": "10", "Content-Range": f"bytes 5-14/{len(BODY)}"})
            self._body(BODY[5:15])

    def _head(self, status: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Connection", "close")
        self.end_headers()

    def _body(self, body: bytes) -> None:
        try:
            for i in range(0, len(body), 1 << 16):
                self.wfile.write(body[i : i + (1 << 16)])
        except OSError:
            pass  # the client hung up: it wanted no more


class OddServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), OddStore)
        self.mode = "honest"
        self.asked: list[str | None] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/obj"


@pytest.fixture
def odd() -> Iterator[tuple[OddServer, GrantedStore]]:
    server = OddServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    # No grant server: the store's cache already holds a GET grant for "obj" that points here.
    store = GrantedStore("http://127.0.0.1:9", Identity.from_seed(b"o" * 32), "0" * 64, retries=1, sleep=lambda s: None)
    store._cache[("get", "obj", "")] = Presigned("GET", server.url, time.time() + 3600)
    yield server, store
    server.shutdown()
    server.server_close()


def test_granted_ranges_from_stores_that_answer_otherwise(odd: tuple[OddServer, GrantedStore]) -> None:
    server, store = odd
    assert store.get_range("obj", 5, 10) == BODY[5:15] and server.asked == ["bytes=5-14"]
    server.mode = "ignore"
    with pytest.raises(StoreError, match="answered 200"):
        store.get_range("obj", 5, 10)
    assert store.stats.bytes_downloaded == 10  # the whole body was refused on its length, never read
    server.mode = "ignore-small"
    assert store.get_range("obj", 0, 5) == b"whole"  # a 200 whose whole object is the range
    with pytest.raises(RangeNotSatisfiable):  # a 200 tells the size
        store.get_range("obj", 3, 5)
    server.mode = "wrong-range"
    with pytest.raises(StoreError, match="bytes 0-9"):
        store.get_range("obj", 5, 10)
    server.mode = "416"
    with pytest.raises(RangeNotSatisfiable):
        store.get_range("obj", 5, 10)
    server.mode = "cut"
    with pytest.raises(StoreUnavailable, match="cut off"):  # retried, then given up
        store.get_range("obj", 5, 10)
    assert store.stats.retries == 1 and store.stats.grants == 0


def test_the_local_store_reads_only_the_range(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = LocalStore(tmp_path, fsync=False)
    store.put("big", bytes(8 << 20))
    reads: list[tuple[int, int | None]] = []

    class Noted:
        def __init__(self, f: BinaryIO) -> None:
            self.f = f

        def __enter__(self) -> Noted:
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

        def fileno(self) -> int:
            return self.f.fileno()

        def seek(self, offset: int) -> int:
            return self.f.seek(offset)

        def read(self, n: int | None = None) -> bytes:
            reads.append((self.f.tell(), n))
            return self.f.read(n)

    monkeypatch.setattr("protocol.store.local.open", lambda path, mode: Noted(open(path, mode)), raising=False)
    assert store.get_range("big", 5 << 20, 100) == bytes(100)
    assert reads == [(5 << 20, 100)]

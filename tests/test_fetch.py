"""Ranged, parallel, resumable, verified fetches of large objects (protocol/store/fetch.py).

The ranges land in order whatever order they arrive in; a range that fails is read again alone
(the bytes read twice are that range's only); a damaged range or an object of another size is a
named ``ProtocolError`` naming the key; no more ranges are in flight than asked; progress grows to
the object's size; a peer shows it on its panel, or as a line every ten seconds. The same over a real S3 server (SeaweedFS) and through a validator's grants.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
from rich.console import Console
from servers import SeaweedS3

from client.progress import DownloadMeter, PeerDisplay
from protocol.errors import DigestMismatch, ObjectNotFound, PayloadTooLarge, ProtocolError, StoreUnavailable
from protocol.events import Downloaded, Downloading, Event, download_line
from protocol.store.base import DEFAULT_MAX_BYTES, ObjectStore
from protocol.store.fetch import SizeMismatch, fetch, fetch_capped
from protocol.store.memory import MemoryStore

KEY = "run/checkpoints/7/model.safetensors"
PART = 1000


def blob(n: int) -> bytes:
    return os.urandom(n)


class Flaky(ObjectStore):
    """A store over ``inner`` that drops the answer to a range after reading it (a connection cut
    mid-body): ``fail[start]`` times for the range starting at ``start``. Counts what it transferred."""

    def __init__(
        self, inner: ObjectStore, fail: dict[int, int] | None = None, *, error: type[Exception] = StoreUnavailable
    ):
        self.inner = inner
        self.fail = dict(fail or {})
        self.error = error
        self.calls: dict[int, int] = {}
        self.transferred = 0
        self.lock = threading.Lock()

    def get_range(self, key: str, start: int, length: int) -> bytes:
        data = self.inner.get_range(key, start, length)
        with self.lock:
            self.calls[start] = self.calls.get(start, 0) + 1
            self.transferred += len(data)
            if self.fail.get(start, 0) > 0:
                self.fail[start] -= 1
                raise self.error(f"connection dropped reading {key!r} at {start}")
        return data

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        self.inner.put(key, data, if_absent=if_absent)

    def get(self, key: str, *, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
        return self.inner.get(key, max_bytes=max_bytes)

    def list(self, prefix: str) -> list[str]:
        return self.inner.list(prefix)

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)


def stored(data: bytes) -> MemoryStore:
    store = MemoryStore()
    store.put(KEY, data)
    return store


def test_ranges_land_in_order_and_verify() -> None:
    data = blob(10 * PART + 7)  # ten whole ranges and a short last one
    digest = hashlib.sha256(data).hexdigest()
    store = stored(data)
    assert fetch(store, KEY, size=len(data), sha256=digest, part_bytes=PART, parallel=3) == data
    assert store.counts["get"] == 11 and store.counts["size"] == 1  # ranges only, never the whole object


def test_a_small_object_is_one_get() -> None:
    data = blob(PART - 1)
    store = stored(data)
    got = fetch(store, KEY, size=len(data), sha256=hashlib.sha256(data).hexdigest(), part_bytes=PART)
    assert got == data and store.counts["get"] == 1 and store.counts["size"] == 0
    assert fetch(stored(b""), KEY, size=0, sha256=hashlib.sha256(b"").hexdigest()) == b""


def test_a_failed_range_is_read_again_alone() -> None:
    data = blob(8 * PART)
    flaky = Flaky(stored(data), {3 * PART: 2, 6 * PART: 1})
    got = fetch(flaky, KEY, size=len(data), sha256=hashlib.sha256(data).hexdigest(), part_bytes=PART, backoff_s=0.001)
    assert got == data
    assert flaky.calls == {s: 1 + {3 * PART: 2, 6 * PART: 1}.get(s, 0) for s in range(0, len(data), PART)}
    assert flaky.transferred - len(data) == 3 * PART  # the dropped answers, nothing else


def test_a_reset_connection_is_retried_too() -> None:
    data = blob(3 * PART)
    flaky = Flaky(stored(data), {0: 1}, error=ConnectionResetError)
    assert fetch(flaky, KEY, size=len(data), part_bytes=PART, backoff_s=0.001) == data


def test_a_range_that_keeps_failing_gives_up_at_the_deadline() -> None:
    data = blob(4 * PART)
    flaky = Flaky(stored(data), {2 * PART: 10**9})
    with pytest.raises(StoreUnavailable):
        fetch(flaky, KEY, size=len(data), part_bytes=PART, backoff_s=0.001, give_up_at=time.time() + 0.2)
    assert flaky.calls[2 * PART] > 1


def test_a_missing_object_is_not_retried() -> None:
    store = MemoryStore()
    with pytest.raises(ObjectNotFound):
        fetch(store, KEY, size=5 * PART, part_bytes=PART, backoff_s=10.0)
    assert store.counts["size"] == 1 and store.counts["get"] == 0


def test_a_corrupted_range_names_the_key() -> None:
    data = blob(6 * PART)
    store = stored(data)
    store.faults.corrupt(KEY, times=1)  # one range comes back with a bit flipped
    with pytest.raises(DigestMismatch, match="model.safetensors") as caught:
        fetch(store, KEY, size=len(data), sha256=hashlib.sha256(data).hexdigest(), part_bytes=PART)
    assert not isinstance(caught.value, SizeMismatch) and caught.value.reason == "digest_mismatch"
    small = stored(data[:10])
    small.faults.corrupt(KEY, times=1)
    with pytest.raises(DigestMismatch, match="model.safetensors"):
        fetch(small, KEY, size=10, sha256=hashlib.sha256(data[:10]).hexdigest(), part_bytes=PART)


@pytest.mark.parametrize("actual", [5 * PART - 1, 5 * PART + 1, 3, 2 * PART])
def test_an_object_of_another_size_is_refused(actual: int) -> None:
    expected = 5 * PART if actual > PART else 7  # ranged reads, and the one small get
    store = stored(blob(actual))
    with pytest.raises(SizeMismatch, match="model.safetensors") as caught:
        fetch(store, KEY, size=expected, part_bytes=PART)
    assert isinstance(caught.value, ProtocolError) and caught.value.reason == "size_mismatch"


def test_an_object_that_shrinks_mid_read_is_refused() -> None:
    data = blob(4 * PART)
    store = stored(data)

    class Shrinks(Flaky):
        def size(self, key: str) -> int:  # says the old size; the ranges find the new object
            size = self.inner.size(key)
            self.inner.put(key, data[: 2 * PART + 1])
            return size

    with pytest.raises(SizeMismatch):
        fetch(Shrinks(store), KEY, size=len(data), part_bytes=PART)


def test_no_more_ranges_in_flight_than_asked() -> None:
    parallel = 4
    data = blob(3 * parallel * PART)
    barrier = threading.Barrier(parallel, timeout=10)  # broken unless exactly `parallel` reads meet
    in_flight, peak = [0], [0]
    lock = threading.Lock()

    class Counted(Flaky):
        def get_range(self, key: str, start: int, length: int) -> bytes:
            with lock:
                in_flight[0] += 1
                peak[0] = max(peak[0], in_flight[0])
            try:
                barrier.wait()
                return super().get_range(key, start, length)
            finally:
                with lock:
                    in_flight[0] -= 1

    assert fetch(Counted(stored(data)), KEY, size=len(data), part_bytes=PART, parallel=parallel) == data
    assert peak[0] == parallel


def test_progress_grows_to_the_size() -> None:
    data = blob(9 * PART + 1)
    seen: list[tuple[int, int]] = []
    flaky = Flaky(stored(data), {PART: 1})
    fetch(
        flaky,
        KEY,
        size=len(data),
        part_bytes=PART,
        parallel=3,
        progress=lambda d, t: seen.append((d, t)),
        backoff_s=0.001,
    )
    done = [d for d, _ in seen]
    assert done == sorted(done) and len(set(done)) == len(done) == 10
    assert seen[-1] == (len(data), len(data)) and {t for _, t in seen} == {len(data)}


def test_capped_reads_a_small_object_in_one_get_and_a_large_one_in_ranges() -> None:
    small, large = blob(PART // 2), blob(7 * PART)
    store = stored(small)
    assert fetch_capped(store, KEY, max_bytes=100 * PART, part_bytes=PART) == small
    assert store.counts["get"] == 1 and store.counts["size"] == 0
    store = stored(large)
    seen: list[int] = []
    got = fetch_capped(store, KEY, max_bytes=100 * PART, part_bytes=PART, progress=lambda d, t: seen.append(d))
    assert got == large and seen[-1] == len(large)
    assert store.counts["get"] == 1 + 7 and store.counts["size"] == 1  # the refused get, then the ranges
    with pytest.raises(PayloadTooLarge):
        fetch_capped(store, KEY, max_bytes=7 * PART - 1, part_bytes=PART)
    with pytest.raises(PayloadTooLarge):
        fetch_capped(store, KEY, max_bytes=PART, part_bytes=PART)
    with pytest.raises(ObjectNotFound):
        fetch_capped(MemoryStore(), KEY, max_bytes=100 * PART, part_bytes=PART)


# ---------------------------------------------------------------------- a real S3 server
@pytest.fixture(scope="module")
def s3() -> Iterator[SeaweedS3]:
    with SeaweedS3() as server:
        yield server


@pytest.mark.integration
def test_fetch_over_seaweedfs(s3: SeaweedS3) -> None:
    mib = 1 << 20
    data = blob(21 * mib + 12345)
    digest = hashlib.sha256(data).hexdigest()
    store = s3.store(f"t{uuid.uuid4().hex[:12]}")
    with store:
        store.put(KEY, data)
        before = store.stats.bytes_downloaded
        seen: list[int] = []
        got = fetch(
            store,
            KEY,
            size=len(data),
            sha256=digest,
            part_bytes=5 * mib,
            parallel=3,
            progress=lambda d, t: seen.append(d),
        )
        assert got == data and seen[-1] == len(data) and len(seen) == 5
        assert store.stats.bytes_downloaded - before == len(data)  # each byte once
        with pytest.raises(SizeMismatch):
            fetch(store, KEY, size=len(data) + 1, part_bytes=5 * mib)
        with pytest.raises(DigestMismatch, match="model.safetensors"):
            fetch(store, KEY, size=len(data), sha256="0" * 64, part_bytes=5 * mib)


@pytest.mark.integration
def test_fetch_through_a_validators_grants(s3: SeaweedS3) -> None:
    from test_grants_s3 import RUN, Served

    from protocol import layout

    data = blob(3 * (1 << 20) + 17)
    digest = hashlib.sha256(data).hexdigest()
    key = layout.shard_key(RUN, digest)
    served = Served(s3)
    with served.server, served.admin:
        served.admin.put(key, data)
        alice = served.store()
        assert fetch(alice, key, size=len(data), sha256=digest, part_bytes=1 << 20, parallel=4) == data
        assert alice.stats.bytes_downloaded == len(data) and alice.stats.grants == 2
        # a HEAD grant, then one GET grant for every range: the first ranges in flight wait for it


# ---------------------------------------------------------------------- what a peer shows
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_download_line_reads_like_a_person_would_write_it() -> None:
    line = download_line("checkpoint 120", 1_200_000_000, 3_400_000_000, 12e6, 182.0)
    assert line == "checkpoint 120 1.2/3.4 GB, 12.0 MB/s, ETA 3m02s"
    assert download_line("aggregate 5", 0, 20_000_000, 0.0, None).endswith("ETA -")


def test_off_a_terminal_progress_is_a_line_every_ten_seconds_then_downloaded(
    capsys: pytest.CaptureFixture[str],
) -> None:
    events: list[Event] = []
    display = PeerDisplay(json_lines=True, sinks=[events.append])
    clock = Clock()
    meter = DownloadMeter("checkpoint 7", display, clock=clock)
    total = 100 * PART
    for i in range(1, 101):  # one range a second
        clock.now += 1.0
        meter(i * PART, total)
    progress = [e for e in events if isinstance(e, Downloading)]
    assert [e.done_bytes for e in progress] == [10 * PART * k for k in range(1, 10)]
    assert all(e.total_bytes == total and e.bytes_per_s == pytest.approx(PART) for e in progress)
    assert progress[0].eta_s == pytest.approx(90.0)
    (done,) = [e for e in events if isinstance(e, Downloaded)]
    assert (done.what, done.size_bytes, done.seconds) == ("checkpoint 7", total, 100.0)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["event"] for line in lines] == ["downloading"] * 9 + ["downloaded"]


def test_on_a_terminal_the_panel_shows_progress_and_only_the_end_is_an_event() -> None:
    events: list[Event] = []
    out = io.StringIO()
    clock = Clock()
    with PeerDisplay(
        console=Console(file=out, force_terminal=True, width=200, highlight=False), sinks=[events.append]
    ) as display:
        assert display.live
        meter = display.watch("checkpoint 7")
        assert isinstance(meter, DownloadMeter)
        meter.clock = clock
        meter.started = clock.now
        for i in range(1, 31):
            clock.now += 1.0
            meter(i * PART * 1000, 40 * PART * 1000)
            assert display.fields["download"] == download_line(
                "checkpoint 7", i * PART * 1000, 40 * PART * 1000, PART * 1000, (40 - i)
            )
        meter(40 * PART * 1000, 40 * PART * 1000)
        assert display.fields["download"] is None
    assert [type(e) for e in events] == [Downloaded]
    assert "checkpoint 7 downloaded" in out.getvalue()

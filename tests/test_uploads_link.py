"""Uploads over a slow link that drops: retried until the window's deadline, never sent twice,
not started when the measured uplink cannot make it, and an HTTP put that notices a dead link.

Most tests run :func:`client.uplink.put_by_deadline` on a fake clock: the store below advances it by
the time a transfer takes, so a link down for 30 s or a 2 Mbit/s uplink costs the test nothing.
The granted store's timeouts are tested over real sockets (a server that never reads, one that
reads slowly); the peer's handling of a skipped or retried put with a real peer.
"""

from __future__ import annotations

import logging
import os
import random
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from client.peer import Staged
from client.uplink import Backoff, LinkRate, megabytes, put_by_deadline, transient
from protocol import layout
from protocol.errors import (
    AccessDenied,
    ObjectExists,
    PayloadTooLarge,
    StoreError,
    StoreUnavailable,
)
from protocol.events import PeerWindow
from protocol.store import open_store
from protocol.store.base import ObjectStore, deadline, seconds_left
from protocol.store.granted import GrantedStore, GrantNotGiven
from protocol.store.memory import MemoryStore
from protocol.store.presign import Presigned
from tests.test_peer_state import FlakyStore, MiniValidator, assert_window_kept, copy_of, make_peer, tiny_spec

KEY = "run/contrib/00000007/peer"


class Clock:
    """A fake Unix clock; ``sleep`` advances it and records the wait."""

    def __init__(self) -> None:
        self.t = 1_000_000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.slept.append(seconds)
        self.t += seconds


class Link(ObjectStore):
    """A store behind a link of ``bytes_per_s`` that is down until ``down_until`` (fake time): a put
    then costs ``timeout_s`` and raises ``StoreUnavailable``. ``lose_answers``: that many puts land
    but their answer is lost (they raise after storing)."""

    def __init__(self, clock: Clock, *, bytes_per_s: float = 1e6, down_until: float = 0.0, timeout_s: float = 5.0):
        self.inner = MemoryStore(f"link-{time.time_ns()}")
        self.clock, self.bytes_per_s, self.down_until, self.timeout_s = clock, bytes_per_s, down_until, timeout_s
        self.lose_answers = 0
        self.puts = 0
        self.late: list[float] = []  # how far past the caller's deadline each put began

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        self.puts += 1
        left = seconds_left()
        assert left is not None, "a put by deadline runs under a store deadline"
        if self.clock.t < self.down_until:
            self.clock.t += min(self.timeout_s, max(left, 0.05))  # the store clips its wait to the deadline
            raise StoreUnavailable(f"{key!r}: connection timed out")
        self.clock.t += len(data) / self.bytes_per_s
        self.inner.put(key, data, if_absent=if_absent)
        if self.lose_answers:
            self.lose_answers -= 1
            raise StoreError(f"{key!r}: connection reset by peer")  # it landed; the answer did not

    def get(self, key: str, *, max_bytes: int = 1 << 26) -> bytes:
        return self.inner.get(key, max_bytes=max_bytes)

    def list(self, prefix: str) -> list[str]:
        return self.inner.list(prefix)

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)


def send(link: Link, clock: Clock, data: bytes, *, left_s: float, rate: LinkRate | None = None):
    at = clock() + left_s
    return put_by_deadline(
        link,
        KEY,
        data,
        deadline_at=lambda: at,
        rate=rate or LinkRate(),
        backoff=Backoff(rng=random.Random(7)),
        clock=clock,
        sleep=clock.sleep,
    )


# ---------------------------------------------------------------------- retried until the deadline
def test_a_link_down_for_30_s_is_retried_until_it_is_back() -> None:
    clock = Clock()
    link = Link(clock, down_until=clock.t + 30)
    blob = b"c" * 300_000
    sent = send(link, clock, blob, left_s=600)
    assert sent.outcome == "uploaded" and sent.reason is None
    assert link.get(KEY) == blob
    assert sent.attempts == link.puts >= 3
    assert 30 <= sent.down_s <= sent.seconds <= 30 + 15 * 1.25 + 5 + 1
    # exponential backoff with jitter: 1, 2, 4, 8 s ± 25 %, never above the 15 s cap
    for n, wait in enumerate(clock.slept):
        assert 0.75 * min(15, 2**n) <= wait <= 1.25 * min(15, 2**n)
    line = sent.summary("upload of window 7")
    assert line.startswith(f"upload of window 7 took {sent.attempts} attempts, ") and re.search(
        r"; link was down \d+ s$", line
    )


def test_backoff_is_capped_and_jittered() -> None:
    waits = [Backoff(rng=random.Random(1)).next() for _ in range(3)]
    assert len(set(waits)) == 1  # the same seed, the same first wait
    backoff = Backoff(first_s=1.0, cap_s=15.0, jitter=0.25, rng=random.Random(3))
    seq = [backoff.next() for _ in range(10)]
    assert all(11.25 <= w <= 18.75 for w in seq[4:])  # capped at 15 s (± jitter)
    assert len({round(w, 6) for w in seq[4:]}) > 1  # and not in step


def test_retries_stop_at_the_deadline_and_no_wait_runs_past_it() -> None:
    clock = Clock()
    link = Link(clock, down_until=float("inf"))
    started = clock.t
    sent = send(link, clock, b"c" * 1000, left_s=60)
    assert sent.outcome == "failed" and not sent.refused
    assert sent.reason is not None and sent.reason.startswith(
        f"the upload deadline passed after {sent.attempts} attempts"
    )
    assert "connection timed out" in sent.reason
    assert clock.t <= started + 60 + 0.05  # every wait and every attempt clipped to the deadline
    assert sent.seconds == pytest.approx(sent.down_s)


def test_a_peer_that_stops_starts_no_further_attempt() -> None:
    clock = Clock()
    link = Link(clock, down_until=float("inf"))
    stop = threading.Event()

    def wait(seconds: float) -> bool:
        stop.set()  # asked to stop during the first wait
        clock.t += 0.01
        return True

    at = clock() + 600
    sent = put_by_deadline(
        link, KEY, b"c", deadline_at=lambda: at, rate=LinkRate(), clock=clock, sleep=wait, stopping=stop.is_set
    )
    assert (sent.outcome, sent.attempts, link.puts) == ("failed", 1, 1)
    assert sent.reason is not None and sent.reason.startswith("the peer is stopping (last: unavailable")
    assert clock.t < at - 500


@pytest.mark.parametrize(
    "error",
    [AccessDenied("denied"), GrantNotGiven("the window closed", "window_closed"), PayloadTooLarge("too large")],
)
def test_a_refusal_is_not_retried(error: StoreError) -> None:
    clock = Clock()

    class Refusing(Link):
        def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
            self.puts += 1
            raise error

    refusing = Refusing(clock)
    sent = send(refusing, clock, b"c" * 100, left_s=600)
    assert sent.outcome == "failed" and sent.refused and sent.attempts == refusing.puts == 1
    assert not clock.slept and not transient(error)


def test_transient_errors_are_the_unanswered_ones() -> None:
    assert transient(StoreUnavailable("grant server down")) and transient(StoreError("reset"))
    assert not any(transient(e) for e in (AccessDenied("x"), ObjectExists("x"), PayloadTooLarge("x")))


def test_a_contribution_asked_for_before_the_announcement_was_read_is_retried() -> None:
    """A peer that rejoined after a withdrawal asks for its contribution's grant before the
    validator has read its new announcement (403 not_announced): that passes within seconds, so
    the put is retried until the deadline instead of losing the window."""
    clock = Clock()

    class NotYetAnnounced(Link):
        def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
            self.puts += 1
            if self.puts <= 2:
                raise GrantNotGiven(
                    "not_announced: the validator has not read this peer's announcement", "not_announced"
                )
            super().put(key, data, if_absent=if_absent)

    link = NotYetAnnounced(clock)
    sent = send(link, clock, b"c" * 100, left_s=60)
    assert (sent.outcome, sent.attempts, sent.refused) == ("uploaded", 3, False) and link.inner.get(KEY) == b"c" * 100
    assert len(clock.slept) == 2 and transient(GrantNotGiven("x", "not_announced"))
    line = sent.summary("upload of window 7")
    assert "for the validator to read this peer's announcement" in line and "link was down" not in line, line


# ---------------------------------------------------------------------- never twice
def test_a_put_that_landed_but_lost_its_answer_is_not_sent_twice() -> None:
    clock = Clock()
    link = Link(clock)
    link.lose_answers = 1  # the store commits, then the connection drops before the answer
    blob = b"ours" * 50_000
    sent = send(link, clock, blob, left_s=600)
    assert (sent.outcome, sent.reason, sent.attempts) == ("uploaded", "already present", 2)
    assert link.list("run/contrib/") == [KEY] and link.get(KEY) == blob


def test_a_different_object_under_our_key_is_not_overwritten() -> None:
    clock = Clock()
    link = Link(clock)
    link.inner.put(KEY, b"someone else's bytes")
    sent = send(link, clock, b"ours", left_s=600)
    assert (sent.outcome, sent.reason, sent.refused) == ("failed", "a different contribution exists", False)
    assert link.get(KEY) == b"someone else's bytes"


# ---------------------------------------------------------------------- late is not sent
def test_a_link_that_cannot_make_the_deadline_skips_with_the_figures() -> None:
    clock = Clock()
    link = Link(clock)
    rate = LinkRate()
    rate.observe(2_500_000, 10.0)  # 2 Mbit/s measured on an earlier put
    sent = send(link, clock, b"c" * 23_400_000, left_s=40, rate=rate)
    assert sent.outcome == "skipped" and sent.attempts == link.puts == 0
    assert sent.reason == "the link needs ~94 s for 23.4 MB at 2.0 Mbit/s, 40 s left"
    assert link.list("run/") == []


def test_an_unmeasured_link_tries_and_a_completed_put_measures_it() -> None:
    clock = Clock()
    link = Link(clock, bytes_per_s=250_000)
    rate = LinkRate()
    sent = send(link, clock, b"c" * 2_500_000, left_s=5, rate=rate)  # would need 10 s: unknown, so tried
    assert sent.outcome == "uploaded" and rate.bytes_per_s == pytest.approx(250_000)
    assert rate.seconds_for(23_400_000) == pytest.approx(93.6)


def test_the_rate_is_a_moving_mean_of_real_transfers() -> None:
    rate = LinkRate(weight=0.5)
    rate.observe(1000, 0.001)  # too small to measure bandwidth
    assert rate.bytes_per_s is None and rate.seconds_for(10) is None
    rate.observe(1_000_000, 1.0)
    rate.observe(1_000_000, 0.5)
    assert rate.bytes_per_s == pytest.approx(1_500_000)


def test_a_rate_that_only_skips_is_forgotten_and_measured_again() -> None:
    """A slow moment must not skip every later window: after 3 skips in a row the peer tries."""
    clock = Clock()
    link = Link(clock, bytes_per_s=1e6)
    rate = LinkRate(forget_after=3)
    rate.observe(1_000_000, 100.0)  # 80 kbit/s, once
    sent = [send(link, clock, b"c" * 1_000_000, left_s=60, rate=rate) for _ in range(4)]
    assert [s.outcome for s in sent] == ["skipped", "skipped", "skipped", "uploaded"]
    assert all("at 0.1 Mbit/s" in s.reason for s in sent[:3]), [s.reason for s in sent]  # the third forgot it after
    assert rate.bytes_per_s == pytest.approx(1e6)


def test_store_deadlines_nest_to_the_earliest() -> None:
    assert seconds_left() is None
    now = time.time()
    with deadline(now + 100):
        with deadline(now + 10):
            assert 9 < (seconds_left() or 0) <= 10
        with deadline(now + 1000):
            assert 99 < (seconds_left() or 0) <= 100
        with deadline(None):
            assert 99 < (seconds_left() or 0) <= 100
    assert seconds_left() is None


# ---------------------------------------------------------------------- the granted store's HTTP put
class Sink:
    """A TCP server that accepts a connection and reads ``bytes_per_s`` of it (0: never reads, a
    socket stuck on a link that is down). Its receive buffer is small, so the sender feels it."""

    def __init__(self, bytes_per_s: int) -> None:
        self.bytes_per_s = bytes_per_s
        self.server = socket.socket()
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(4)
        self.stop = threading.Event()
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.getsockname()[1]}/bucket/key"

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._drain, args=(conn,), daemon=True).start()

    def _drain(self, conn: socket.socket) -> None:
        block = max(1, self.bytes_per_s // 20)
        while self.bytes_per_s and not self.stop.wait(0.05):
            try:
                if not conn.recv(block):
                    return
            except OSError:
                return

    def close(self) -> None:
        self.stop.set()
        for conn in self.conns:
            conn.close()
        self.server.close()


@pytest.fixture
def sink_factory() -> Iterator[type[Sink]]:
    made: list[Sink] = []

    class Made(Sink):
        def __init__(self, bytes_per_s: int) -> None:
            super().__init__(bytes_per_s)
            made.append(self)

    yield Made
    for sink in made:
        sink.close()


def granted_to(url: str, size: int, **options: float) -> GrantedStore:
    from protocol.identity import Identity

    store = GrantedStore("http://127.0.0.1:9", Identity.from_seed(bytes(32)), "0" * 64, **options)  # type: ignore[arg-type]
    grant = Presigned("PUT", url, time.time() + 600, {"Content-Length": str(size)})
    store._ask_once = lambda request: grant  # type: ignore[method-assign]  # the grant server is not under test
    return store


def test_a_put_on_a_dead_link_ends_by_the_deadline(sink_factory: type[Sink]) -> None:
    sink = sink_factory(0)
    body = b"x" * (16 << 20)  # more than the socket buffers hold
    store = granted_to(sink.url, len(body), timeout_s=30.0, retries=3, backoff_s=0.1)
    t0 = time.monotonic()
    with deadline(time.time() + 1.5), pytest.raises(StoreUnavailable, match="did not answer"):
        store.put(KEY, body, if_absent=True)
    assert time.monotonic() - t0 < 4.0  # not the 30 s socket timeout, nor its retries
    assert store.stats.retries == 0  # under a deadline the caller retries, and counts


def test_retried_puts_reuse_their_grant_across_calls(sink_factory: type[Sink]) -> None:
    """The grant server gives a contribution only a few grants a window: the peer's retries,
    each a new put, must not spend them."""
    sink = sink_factory(0)
    body = b"x" * (16 << 20)
    store = granted_to(sink.url, len(body), timeout_s=0.2)
    asked: list[str] = []
    grant = store._ask_once(None)  # type: ignore[arg-type]
    store._ask_once = lambda request: asked.append(request.key) or grant  # type: ignore[method-assign]
    for _ in range(3):
        with deadline(time.time() + 0.5), pytest.raises(StoreUnavailable):
            store.put(KEY, body, if_absent=True)
    assert asked == [KEY]
    with deadline(time.time() + 0.5), pytest.raises(StoreUnavailable):
        store.put(KEY, body[:-1], if_absent=True)  # another size: another grant
    assert asked == [KEY, KEY]


def test_a_put_slower_than_the_floor_rate_is_cut_off(sink_factory: type[Sink]) -> None:
    sink = sink_factory(256 << 10)  # reads 2 Mbit/s: 16 MiB would take a minute
    body = b"x" * (16 << 20)
    store = granted_to(sink.url, len(body), timeout_s=0.5, retries=0, floor_bytes_per_s=8 << 20)
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match="too slow or down"):
        store.put(KEY, body, if_absent=True)
    assert time.monotonic() - t0 < 0.5 + 2.0 + 2.0  # its budget: 0.5 s + 16 MiB at 8 MiB/s


# ---------------------------------------------------------------------- the peer
@pytest.fixture
def one_peer(tmp_path: Path):
    from protocol.identity import Identity

    vident = Identity.from_seed(bytes(range(32)))
    spec = tiny_spec(vident).replace(outer={"delay": 0})
    store = open_store(f"memory://uploads-link-{time.time_ns()}")
    return spec, store, MiniValidator(spec, store, vident), tmp_path


def test_a_peer_whose_link_is_too_slow_skips_and_keeps_its_contribution_in_e(one_peer, caplog) -> None:
    spec, store, val, root = one_peer
    peer, rec = make_peer(spec, store, root, "dsl")
    peer.join()
    e_0 = copy_of(peer.feedback)
    peer.uploads.rate.observe(1 << 20, 1 << 20)  # measured: 1 byte a second
    staged = peer.train(0)
    assert isinstance(staged, Staged)
    with caplog.at_level(logging.INFO, logger="client.peer.uploads"):
        peer.upload(staged)
        peer.flush()
    report = rec.of(PeerWindow)[-1]
    assert report.outcome == "skipped" and report.upload_attempts == 0
    assert report.reason is not None and report.reason.startswith("the link needs ~")
    assert_window_kept(peer, e_0, peer)  # Δ̂ went back to e: nothing is lost
    assert peer.pending is None and not store.list(layout.contrib_prefix(val.run, 0))
    assert [r.getMessage() for r in caplog.records if "upload of window 0" in r.getMessage()] == [
        f"upload of window 0 took 0 attempts, 0 s: skipped ({report.reason})"
    ]


class LosesOneAnswer(FlakyStore):
    """Contribution puts land, but the first one's answer is lost (the connection dropped)."""

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        self.inner.put(key, data, if_absent=if_absent)
        if self.bad in key and not self.refused:
            self.refused += 1
            raise StoreError(f"{key!r}: connection reset by peer")


def test_a_peer_whose_put_lost_its_answer_reports_one_upload(one_peer, caplog) -> None:
    spec, store, val, root = one_peer
    peer, rec = make_peer(spec, LosesOneAnswer(store, window=0), root, "reset")
    peer.join()
    staged = peer.train(0)
    assert isinstance(staged, Staged)
    with caplog.at_level(logging.INFO, logger="client.peer.uploads"):
        peer.upload(staged)
        peer.flush()
    report = rec.of(PeerWindow)[-1]
    assert (report.outcome, report.reason, report.upload_attempts) == ("uploaded", "already present", 2)
    assert report.upload_down_s > 0 and report.upload_s >= report.upload_down_s
    assert store.list(layout.contrib_prefix(val.run, 0)) == [layout.contrib_key(val.run, 0, peer.identity.peer_id)]
    assert peer.pending is staged  # uploaded: it stays staged until its aggregate is out
    lines = [r for r in caplog.records if "upload of window 0" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING and "took 2 attempts" in lines[0].getMessage()


# ---------------------------------------------------------------------- preflight's link check
class Throttled(MemoryStore):
    """A store behind a link of ``up`` and ``down`` bytes per second (it sleeps for the transfer:
    unit tests only). ``puts`` records the size of every put."""

    def __init__(self, name: str, *, up: float, down: float) -> None:
        super().__init__(name)
        self.up, self.down = up, down
        self.puts: list[int] = []

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        self.puts.append(len(data))
        time.sleep(len(data) / self.up)
        super().put(key, data, if_absent=if_absent)

    def get(self, key: str, *, max_bytes: int = 1 << 26) -> bytes:
        data = super().get(key, max_bytes=max_bytes)
        time.sleep(len(data) / self.down)
        return data


def preflight_over(store: ObjectStore, deadline_s: float, contribution: int | None = None, **options: float):
    from client.preflight import Preflight
    from protocol.identity import Identity
    from protocol.settings import LocalSettings

    vident = Identity.from_seed(bytes(range(32)))
    spec = tiny_spec(vident, upload_deadline_s=deadline_s)
    checks = Preflight(spec, LocalSettings(), Identity.from_seed(b"v" * 32), store, device="cpu", **options)  # type: ignore[arg-type]
    checks._contribution_bytes = contribution
    return checks


def test_preflight_measures_the_link_with_probes_sized_to_it() -> None:
    fast = Throttled(f"fast-{time.time_ns()}", up=16e6, down=64e6)
    checks = preflight_over(fast, 600, probe_sizes=(256 << 10, 1 << 20), probe_budget_s=20.0)
    write = checks._write()
    assert write.status == "ok" and fast.puts == [256 << 10, 1 << 20]  # the larger probe measures the rate
    assert write.figures["probe_bytes"] == 1 << 20
    assert 8e6 < write.figures["up_bytes_per_s"] <= 16e6 and 16e6 < write.figures["down_bytes_per_s"] <= 64e6
    slow = Throttled(f"slow-{time.time_ns()}", up=2e6, down=8e6)
    checks = preflight_over(slow, 600, probe_sizes=(256 << 10, 4 << 20), probe_budget_s=2.0)
    assert checks._write().status == "ok" and slow.puts == [256 << 10]  # 4 MiB would take 2 s: not tried


def test_preflight_fails_a_link_too_slow_for_the_contribution_with_the_numbers() -> None:
    store = Throttled(f"dsl-{time.time_ns()}", up=4e6, down=16e6)
    checks = preflight_over(store, 1.0, contribution=8_000_000, probe_sizes=(256 << 10,))
    assert checks._write().status == "ok"
    link = checks._link()
    assert (link.status, link.reason) == ("failed", "uplink_too_slow")
    up = link.figures["up_bits_per_s"]
    assert 16e6 < up <= 32e6 and link.figures["needed_up_bits_per_s"] == 64_000_000
    assert link.figures["contribution_source"] == "measured" and link.figures["upload_s"] > 1.0
    assert re.fullmatch(
        r"uplink \d+\.\d Mbit/s: a 8\.0 MB contribution needs \d+ s, the upload window is 1 s; needs ≥ 64\.0 Mbit/s",
        link.detail,
    ), link.detail
    assert link.to_json()["needed_up_bits_per_s"] == 64_000_000


def test_preflight_warns_when_the_link_is_marginal_and_passes_when_it_is_not() -> None:
    store = Throttled(f"dsl-{time.time_ns()}", up=4e6, down=16e6)
    checks = preflight_over(store, 4.0, contribution=8_000_000, probe_sizes=(256 << 10,))
    checks._write()
    checks._aggregate_bytes = 1_000_000
    marginal = checks._link()  # ~2-4 s of a 4 s window
    assert (marginal.status, marginal.reason) == ("warning", "marginal") and "the aggregate" in marginal.detail
    checks = preflight_over(store, 600.0, contribution=8_000_000, probe_sizes=(256 << 10,))
    checks._write()
    fine = checks._link()
    assert fine.status == "ok" and fine.figures["upload_deadline_s"] == 600.0


def test_preflight_counts_the_forecasts_reads_and_warns_when_they_fill_the_window() -> None:
    """With ``outer.eager`` a peer reads the contributions of the other peers of an aggregate each
    window (at most ``max_contributors``): 9 announced peers cost 9 contributions of downlink."""
    from protocol import layout
    from protocol.identity import Identity

    store = Throttled(f"eager-{time.time_ns()}", up=64e6, down=2e6)
    checks = preflight_over(store, 60.0, contribution=1_000_000, probe_sizes=(256 << 10,))
    tight_checks = preflight_over(store, 6.0, contribution=1_000_000, probe_sizes=(256 << 10,))
    for run_id in (checks.run_id, tight_checks.run_id):  # the deadline is in the RunSpec: two runs
        for i in range(9):
            store.put(layout.peer_key(run_id, Identity.from_seed(bytes([i]) * 32).peer_id), b"announced")
    checks._write()
    link = checks._link()
    assert checks.spec.outer.eager and checks.spec.outer.delay == 1  # the defaults
    assert link.figures["forecast_bytes"] == 9_000_000
    assert 3.0 < link.figures["forecast_download_s"] < 9.0  # 9 MB at ~2 MB/s
    assert link.status == "ok" and "forecast" in link.detail  # well within a 60 s window
    tight_checks._write()
    tight = tight_checks._link()  # over half of a 6 s window
    assert (tight.status, tight.reason) == ("warning", "marginal") and "outer.eager" in tight.detail


def test_preflight_estimates_the_contribution_from_the_codec_without_compute() -> None:
    from protocol.caps import contribution_bound
    from protocol.model import param_schema

    store = Throttled(f"est-{time.time_ns()}", up=64e6, down=64e6)
    checks = preflight_over(store, 600.0, probe_sizes=(256 << 10,))
    size, source = checks.contribution_estimate()
    assert source == "bound" and size == contribution_bound(param_schema(checks.spec.model), checks.spec.codec_at(0))
    assert checks._link().status == "skipped"  # nothing measured yet
    checks._write()
    assert checks._link().figures["contribution_source"] == "bound"


def test_preflight_sizes_the_contribution_with_the_largest_k_of_the_run() -> None:
    """A Top-k warm-up may start below ``codec.k`` (512, then up to 1024 from window 4): the link
    is judged against the contribution of the largest k, not window 0's smaller one."""
    from client.preflight import Preflight, largest_window
    from protocol.caps import contribution_bound
    from protocol.identity import Identity
    from protocol.model import param_schema
    from protocol.settings import LocalSettings

    vident = Identity.from_seed(bytes(range(32)))
    spec = tiny_spec(vident, upload_deadline_s=600.0)
    assert spec.codec.k < spec.outer.warmup_k and largest_window(spec) == 0
    wide = spec.replace(codec={"k": 1024})
    assert largest_window(wide) == wide.outer.warmup_windows and wide.codec_at(largest_window(wide)).k == 1024
    assert largest_window(wide.replace(outer={"warmup_k": 0})) == 0
    sizes = []
    for s in (spec.replace(codec={"k": 512}), wide):  # window 0 keeps 512 per 4096 in both
        checks = Preflight(
            s, LocalSettings(), Identity.from_seed(b"v" * 32), MemoryStore(f"k-{time.time_ns()}"), device="cpu"
        )
        bound, source = checks.contribution_estimate()
        assert source == "bound" and bound == contribution_bound(param_schema(s.model), s.codec_at(largest_window(s)))
        assert checks._memory().status == "ok"
        compute = checks._compute()
        assert compute.status == "ok" and checks.contribution_estimate() == (
            compute.figures["contribution_bytes"],
            "measured",
        )
        sizes.append(compute.figures["contribution_bytes"])
    assert sizes[1] > 1.5 * sizes[0], sizes  # twice the values kept


def test_preflight_before_genesis_says_the_validator_waits_for_peers() -> None:
    """Before genesis, with ``--wait-for-peers``, the run is not missing: the grant server says it
    waits, and preflight passes on that with a warning instead of failing ``run_not_found``."""
    from client.preflight import Preflight
    from protocol.errors import ObjectNotFound
    from protocol.identity import Identity
    from protocol.settings import LocalSettings
    from protocol.store.granted import GrantedStore

    spec = tiny_spec(Identity.from_seed(bytes(range(32))))
    me = Identity.from_seed(b"w" * 32)
    store = GrantedStore("http://127.0.0.1:9", me, spec.hash())
    info = {"run_hash": spec.hash(), "window": None, "waiting_for_peers": 3, "announced": 1}
    store.info = lambda: info  # type: ignore[method-assign]
    checks = Preflight(spec, LocalSettings(), me, store, device="cpu")

    def no_genesis() -> None:
        raise ObjectNotFound("no genesis yet")

    checks.chain.launch = no_genesis  # type: ignore[method-assign]
    run = checks._run()
    assert (run.status, run.reason) == ("warning", "waiting_for_peers"), run
    assert "waits for 3 peer(s)" in run.detail and "1 announced" in run.detail
    assert checks._reads().status == "skipped"
    info["run_hash"] = "another run"
    assert (
        preflight_run_reason(Preflight(spec, LocalSettings(), me, store, device="cpu"), no_genesis) == "run_not_found"
    )


def test_preflight_asks_again_when_the_window_closes_before_its_grant() -> None:
    """``/v1/info`` names window 7, which closes before the grant request reaches the server (a
    window boundary): the check asks for the open window again instead of failing a healthy
    machine; a window that closes every time fails ``window_closed`` after GRANT_TRIES asks."""
    from client.preflight import GRANT_TRIES, Preflight
    from protocol.identity import Identity
    from protocol.settings import LocalSettings
    from protocol.store.granted import GrantedStore, GrantNotGiven

    spec = tiny_spec(Identity.from_seed(bytes(range(32))))
    me = Identity.from_seed(b"g" * 32)
    store = GrantedStore("http://127.0.0.1:9", me, spec.hash())
    windows = iter(range(7, 100))
    store.info = lambda: {"run_hash": spec.hash(), "window": next(windows)}  # type: ignore[method-assign]
    asked: list[str] = []
    closes = {"keys": 1}

    def ask(request):  # type: ignore[no-untyped-def]
        asked.append(request.key)
        if len(asked) <= closes["keys"]:
            raise GrantNotGiven("window 7 is not open; window 8 is", "window_closed")
        return None

    store.ask = ask  # type: ignore[method-assign]
    checks = Preflight(spec, LocalSettings(), me, store, device="cpu")
    check = checks._grant()
    assert (check.status, check.figures["window"]) == ("ok", 8), check
    run = layout.run_id(spec.hash())
    assert asked == [layout.contrib_key(run, w, me.peer_id) for w in (7, 8)]
    asked.clear()
    closes["keys"] = GRANT_TRIES
    check = checks._grant()
    assert (check.status, check.reason) == ("failed", "window_closed"), check
    assert len(asked) == GRANT_TRIES


def preflight_run_reason(checks, launch) -> str:  # type: ignore[no-untyped-def]
    checks.chain.launch = launch
    return str(checks._run().reason)


class ReadOnly(MemoryStore):
    """A store that refuses every put: a credential that may read and list, not write."""

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        raise AccessDenied(f"{key!r}: AccessDenied: Access Denied.")


def test_preflight_names_the_refused_own_credential_and_what_it_may_not_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a grant server a refused write names the credential (its access key id, never the
    secret, and where it came from), the setting that made it be used and the keys it must be
    allowed to write."""
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "READONLY0001")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-not-shown")
    checks = preflight_over(ReadOnly(f"ro-{time.time_ns()}"), 60)
    write = checks._write()
    assert (write.status, write.reason) == ("failed", "access_denied")
    assert "access key READONLY0001, from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in the environment" in write.detail
    assert "store.grant_url is empty" in write.detail and "s3cr3t" not in write.detail
    me, run = checks.identity.peer_id, checks.run_id
    assert f"may write {run}/peers/{me}, {run}/contrib/*/{me} and {run}/probe/{me}" in write.detail
    refused = GrantNotGiven("window_closed: no", "window_closed")  # a grant server's refusal: no credential hint
    assert checks._denied(refused, "write") == "" and checks._denied(AccessDenied("x"), "read") != ""


def test_sizes_in_messages_never_read_as_zero() -> None:
    assert [megabytes(n) for n in (12_000, 99_999, 100_000, 23_400_000, 3_400_000_000)] == [
        "12.0 kB",
        "100.0 kB",
        "0.1 MB",
        "23.4 MB",
        "3.40 GB",
    ]

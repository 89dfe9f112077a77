"""Gathering a window's contributions: polling listings, bounded concurrent fetches, size caps.

:func:`gather` polls ``contrib/<window>/`` every ``poll_interval_s`` and fetches each new object on a
pool of ``concurrency`` threads (local settings). Every object is size-checked (``store.size``)
before its body is read, and read with ``max_bytes``, so one huge upload costs one HEAD request, not
the window. It stops at :func:`protocol.windows.should_close`: past the deadline plus grace, or as
soon as every expected peer has uploaded. The validator expects the peers that are actually
contributing (:func:`expected_peers`): announced, not withdrawn, not excluded, and either uploaded
in the previous window or announced since it opened. A peer that missed one window is no longer
waited for, but its upload is accepted whenever it arrives while the window is open. Store failures
are values: a fetch that fails is retried on the next poll and, if the window closes first, recorded
with its reason.

The first time a key is listed is its *received* time (``on_seen`` lets the contribution log keep
the earliest one across restarts); copy detection orders uploads by it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass

from protocol import layout
from protocol.config import WindowConfig
from protocol.errors import ObjectNotFound, PayloadTooLarge, ProtocolError, StoreError
from protocol.store.base import ObjectStore
from protocol.windows import should_close
from protocol.wire import Announcement, decode_announcement

__all__ = ["PeerRegistry", "Received", "expected_peers", "fetch", "gather", "list_contributions"]

log = logging.getLogger(__name__)
MAX_ANNOUNCEMENT_BYTES = 64 * 1024


@dataclass(frozen=True, kw_only=True)
class Received:
    """One listed contribution: its bytes, or why they could not be read."""

    peer: str
    key: str
    received_at: float
    data: bytes | None = None
    nbytes: int | None = None
    reason: str | None = None  # too_large | not_found | store_error (data is None)
    detail: str | None = None


def list_contributions(store: ObjectStore, run: str, window: int) -> dict[str, str]:
    """peer id -> key of every well-formed key under ``contrib/<window>/`` (others are ignored:
    a key that names no peer cannot be attributed to anyone)."""
    out: dict[str, str] = {}
    for key in store.list(layout.contrib_prefix(run, window)):
        try:
            parsed = layout.parse_key(key, run=run)
        except ProtocolError:
            log.warning("ignoring foreign key %r", key)
            continue
        if parsed.kind == "contrib" and parsed.window == window and parsed.peer_id:
            out[parsed.peer_id] = key
    return out


Fetched = tuple[bytes | None, int | None, str | None, str | None]


def fetch(store: ObjectStore, key: str, max_bytes: int) -> Fetched:
    """(data, nbytes, reason, detail): the size is checked before the body is transferred."""
    try:
        n = store.size(key)
        if n > max_bytes:
            return None, n, "too_large", f"{n} bytes, cap {max_bytes}"
        data = store.get(key, max_bytes=max_bytes)
        return data, len(data), None, None
    except PayloadTooLarge as exc:
        return None, None, "too_large", str(exc)
    except ObjectNotFound as exc:
        return None, None, "not_found", str(exc)
    except StoreError as exc:
        return None, None, "store_error", str(exc)


def expected_peers(
    first_seen: Mapping[str, float],
    withdrawn: Collection[str],
    uploaded_last: Collection[str],
    since: float | None,
) -> frozenset[str]:
    """The announced peers a window waits for: not withdrawn, and either uploaded in the previous
    window (``uploaded_last``) or announced (first seen) at or after ``since``, when the previous
    window opened. ``since`` None (window 0, or an unknown opening time): every announced peer
    that has not withdrawn. Pure."""
    return frozenset(
        p
        for p, seen in first_seen.items()
        if p not in withdrawn and (since is None or p in uploaded_last or seen >= since)
    )


class PeerRegistry:
    """Peers with a valid signed announcement under ``peers/`` (withdrawn ones included: a
    contribution uploaded before its peer left is still theirs).

    :meth:`refresh` fetches only keys not seen before (a rejected announcement is logged once);
    :meth:`recheck` re-reads the announcements of given peers, which is how a withdrawal (or a
    return after one) is noticed. ``first_seen``: when this validator first saw each peer's current
    announcement (its own clock); announcements already in the store when the validator starts
    count as old (``-inf``): the contribution log says whether those peers uploaded lately.
    """

    def __init__(self, store: ObjectStore, run: str, run_hash: str, clock: Callable[[], float] = time.time) -> None:
        self.store, self.run, self.run_hash, self.clock = store, run, run_hash, clock
        self.announcements: dict[str, Announcement] = {}
        self.first_seen: dict[str, float] = {}
        self.withdrawn: set[str] = set()
        self._rejected: set[str] = set()
        self._checked: dict[str, float] = {}  # peer -> when its announcement was last read
        self._started = False

    def expected(self, uploaded_last: Collection[str], since: float | None) -> frozenset[str]:
        """:func:`expected_peers` of every accepted announcement (no store access)."""
        return expected_peers(self.first_seen, self.withdrawn, uploaded_last, since)

    def refresh(self) -> frozenset[str]:
        try:
            keys = self.store.list(layout.peers_prefix(self.run))
        except StoreError as exc:
            log.warning("cannot list announcements: %s", exc)
            return frozenset(self.announcements)
        first = not self._started
        self._started = True
        for key in keys:
            if key in self._rejected:
                continue
            try:
                peer = layout.parse_key(key, run=self.run).peer_id
            except ProtocolError as exc:
                log.warning("announcement %s rejected: %s", key, exc)
                self._rejected.add(key)
                continue
            if peer is not None and peer not in self.announcements:
                self._read(peer, key, old=first)
        return frozenset(self.announcements)

    def recheck(self, peers: Collection[str], min_interval_s: float) -> None:
        """Re-read the announcements of ``peers``, each at most once per ``min_interval_s``."""
        now = self.clock()
        for peer in sorted(peers):
            if peer in self.announcements and now - self._checked.get(peer, -math.inf) >= min_interval_s:
                self._read(peer, layout.peer_key(self.run, peer), old=False)

    def _read(self, peer: str, key: str, *, old: bool) -> None:
        """Fetch and verify one announcement; record it, and whether it withdraws the peer."""
        self._checked[peer] = self.clock()
        try:
            blob = self.store.get(key, max_bytes=MAX_ANNOUNCEMENT_BYTES)
            ann = decode_announcement(
                blob, run_hash=self.run_hash, max_bytes=MAX_ANNOUNCEMENT_BYTES, sender=peer
            ).value  # signed by ``peer``, the key it is kept under
        except ProtocolError as exc:
            if peer not in self.announcements:
                log.warning("announcement %s rejected: %s", key, exc)
                self._rejected.add(key)
            return
        except StoreError as exc:  # transient: try again on the next refresh
            log.warning("announcement %s unreadable: %s", key, exc)
            return
        returned = peer in self.withdrawn and not ann.withdrawn
        if peer not in self.announcements or returned:
            self.first_seen[peer] = -math.inf if old else self.clock()
        self.announcements[peer] = ann
        if ann.withdrawn:
            self.withdrawn.add(peer)
        else:
            self.withdrawn.discard(peer)


def gather(
    store: ObjectStore,
    run: str,
    window: int,
    *,
    opened_at: float,
    windows: WindowConfig,
    poll_interval_s: float,
    max_bytes: int,
    concurrency: int,
    expected: Collection[str] | Callable[[frozenset[str]], Collection[str]],
    on_seen: Callable[[str, float], float] | None = None,
    stop: threading.Event | None = None,
    clock: Callable[[], float] = time.time,
    fetch_timeout_s: float = 30.0,
) -> dict[str, Received]:
    """Every contribution of ``window`` that could be listed before the window closed.

    ``expected``: the peers whose uploads complete the window early, or a function of the peers
    that have uploaded so far returning them (called on every poll, so peers announcing or
    withdrawing mid-window count)."""
    stop = stop or threading.Event()
    seen: dict[str, float] = {}
    keys: dict[str, str] = {}
    done: dict[str, Received] = {}
    pending: dict[str, Future[Fetched]] = {}
    pool = ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="gather")
    try:
        while True:
            _collect(pending, done, keys, seen)
            try:
                listed = list_contributions(store, run, window)
            except StoreError as exc:
                log.warning("listing window %d failed: %s", window, exc)
                listed = {}
            now = clock()
            for peer, key in listed.items():
                if peer not in seen:
                    seen[peer] = on_seen(peer, now) if on_seen else now
                    keys[peer] = key
                retry = peer in done and done[peer].reason == "store_error"
                if (peer not in done or retry) and peer not in pending:
                    done.pop(peer, None)
                    pending[peer] = pool.submit(fetch, store, key, max_bytes)
            want = expected(frozenset(seen)) if callable(expected) else expected  # peers come and go mid-window
            if stop.is_set() or should_close(now, opened_at, windows, expected=want, uploaded=seen):
                break
            stop.wait(poll_interval_s)
        # Objects listed before the close are still read, for a bounded time.
        _collect(pending, done, keys, seen, wait_s=0.0 if stop.is_set() else fetch_timeout_s)
    finally:
        # a fetch stuck in the store must not hold the window: abandon it (reads are size-capped)
        pool.shutdown(wait=False, cancel_futures=True)
    for peer in pending:
        done[peer] = Received(
            peer=peer,
            key=keys[peer],
            received_at=seen[peer],
            reason="store_error",
            detail="fetch did not finish in time",
        )
    return done


def _collect(
    pending: dict[str, Future[Fetched]],
    done: dict[str, Received],
    keys: dict[str, str],
    seen: dict[str, float],
    wait_s: float = 0.0,
) -> None:
    if wait_s > 0 and pending:
        futures_wait(list(pending.values()), timeout=wait_s)
    for peer, fut in list(pending.items()):
        if not fut.done() or fut.cancelled():
            continue
        exc = fut.exception()  # fetch() turns store failures into values; anything else is a bug
        data, nbytes, reason, detail = fut.result() if exc is None else (None, None, "store_error", repr(exc))
        done[peer] = Received(
            peer=peer, key=keys[peer], received_at=seen[peer], data=data, nbytes=nbytes, reason=reason, detail=detail
        )
        del pending[peer]

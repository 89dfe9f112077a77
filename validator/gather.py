"""Gathering a window's contributions: polling listings, bounded and prioritised fetches, budgets.

:func:`gather` polls ``contrib/<window>/`` every ``poll_interval_s`` (a local setting) while uploads
arrive, and backs off while none does (:func:`protocol.windows.poll_delays`: each look is a LIST
the bucket bills, class A). Only keys of announced,
non-excluded peers are read (``admit``); the others are counted (``unannounced``) or logged
without a read (``excluded``). The listing names the announced peers (``writers``): a DHT store
decodes no listing entry of anyone else, so a flood of self-signed entries costs it no more. Admitted keys wait in a queue and are read on a pool of
``concurrency`` threads (a local setting) in ``priority`` order (the validator puts established peers by
reputation first, then newcomers in an order derived from its secret), within the window's
:class:`~validator.budgets.Budgets`: at most ``max_fetches`` reads and ``max_fetch_bytes`` bytes
(uploads beyond are ``over_budget``). Every object is size-checked (``store.size``) before its body
is read, and read with ``max_bytes``, so one huge upload costs one HEAD request.

A read object is checked at once (``screen``: decoding, signature, per-contribution checks) and only
the verdict with the decoded sparse form is kept; the bytes are dropped. Its **time** is when its
exact bytes arrived, kept with their sha256 ``digest``: copy detection orders uploads by it, and
bytes that change later at the same key are noticed (the log keeps the first digest).

It stops at :func:`protocol.windows.should_close`: past the deadline plus grace, or as soon as every
expected peer has uploaded. The validator expects the peers that are actually contributing
(:func:`expected_peers`): announced, not withdrawn, not excluded, and either uploaded in one of the
last G windows (``validator.expect_windows``, a local setting, default
:data:`~protocol.settings.DEFAULT_EXPECT_WINDOWS` = 3) or announced since the previous window
opened. Its upload is accepted whenever it arrives while the window is open.

**Why G windows, not one.** The window closes as soon as every expected peer is in, often long
before the deadline. A peer that missed one window (a link drop, a store outage, a slow catch-up)
trains the next one late; were only the previous window's uploaders expected, the next window would
close before it uploads, so it would miss that one too and never be expected again. With G = 3 a
peer that missed one or two windows is waited for while it catches up. The price is a departed
peer that did not withdraw (killed, lost its machine): it holds the G windows after its last
upload open until their deadline plus grace, at most G × (``upload_deadline_s`` +
``gather_grace_s``) of waiting in all, once (G = 1 is the former rule: one window). A peer that
stops cleanly withdraws and is not waited for at all. The rule reads the contribution log's rows of
the last G windows (:meth:`validator.intake.Intake.gather`): O(G × uploads) per window, whatever
the run's length, and it survives a restart because the log lies in the state directory.

Reads listed before the close still finish, for at most ``fetch_timeout_s``. Store failures are
values: a failed read is retried on the next poll and, after the close, with backoff (from
:data:`RETRY_FIRST_S`, doubling to :data:`RETRY_MAX_S`) while reads may still finish, so a store
that is back within ``fetch_timeout_s`` of the close costs no upload; what still fails then is
recorded with its reason — never held against the peer. Failed store requests are not logged one
by one: they are counted by kind (:class:`validator.outage.StoreTrouble`), and the window's one
``store_errors`` event says how many failed, when, and whether the store answered again.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from protocol import layout
from protocol.config import WindowConfig
from protocol.errors import ObjectNotFound, PayloadTooLarge, ProtocolError, StoreError
from protocol.store.base import ObjectStore
from protocol.windows import poll_delays, should_close
from protocol.wire import Announcement, decode_announcement
from validator.budgets import Budgets
from validator.checks import Screened
from validator.outage import (
    LIST_ANNOUNCEMENTS,
    LIST_CONTRIBUTIONS,
    READ_ANNOUNCEMENT,
    READ_CONTRIBUTION,
    StoreTrouble,
)
from validator.randomness import keyed_order
from validator.reasons import EXCLUDED, FETCH_TIMEOUT, OVER_BUDGET

__all__ = [
    "EXCLUDED",
    "OVER_BUDGET",
    "UNANNOUNCED",
    "Gathered",
    "PeerRegistry",
    "Received",
    "active_peers",
    "expected_peers",
    "fetch",
    "gather",
    "list_contributions",
    "recent_windows",
]

log = logging.getLogger(__name__)
MAX_ANNOUNCEMENT_BYTES = 64 * 1024
# After the close, a read that failed with a store error is tried again after this long, doubling
# up to RETRY_MAX_S, while the reads listed before the close may still finish (fetch_timeout_s).
RETRY_FIRST_S = 0.25
RETRY_MAX_S = 4.0
UNANNOUNCED = "unannounced"


@dataclass(frozen=True, kw_only=True)
class Received:
    """One listed contribution of an admitted peer: the verdict on its bytes, or why it has none."""

    peer: str
    key: str
    received_at: float  # when its bytes arrived (or when the validator gave up on them)
    listed_at: float | None = None  # when its key was first listed in this gather
    nbytes: int | None = None
    digest: str | None = None  # sha256 of the bytes read
    screened: Screened | None = None  # the per-contribution checks, with the decoded sparse form
    reason: str | None = None  # too_large | not_found | store_error | fetch_timeout | over_budget | excluded
    detail: str | None = None


@dataclass(frozen=True)
class Gathered:
    """A window's uploads: per admitted peer what was read, and how many keys were not read
    because no announcement names their peer (junk is counted, never stored per key)."""

    received: dict[str, Received]
    unannounced: int = 0


def list_contributions(
    store: ObjectStore, run: str, window: int, writers: Collection[str] | None = None
) -> dict[str, str]:
    """peer id -> key of every well-formed key under ``contrib/<window>/`` (others are ignored:
    a key that names no peer cannot be attributed to anyone). ``writers``: the peers worth
    reading (a store that knows who wrote each entry, the DHT, lists only theirs)."""
    out: dict[str, str] = {}
    prefix = layout.contrib_prefix(run, window)
    for key in store.list(prefix) if writers is None else store.list_written_by(prefix, writers):
        try:
            parsed = layout.parse_key(key, run=run)
        except ProtocolError:
            log.debug("ignoring foreign key %r", key)
            continue
        if parsed.kind == "contrib" and parsed.window == window and parsed.peer_id:
            out[parsed.peer_id] = key
    return out


class _ByteBudget:
    """Bytes a window may still read, shared by the fetch threads."""

    def __init__(self, total: int) -> None:
        self.left = total
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if n > self.left:
                return False
            self.left -= n
            return True


@dataclass(frozen=True)
class Fetched:
    """What one read produced (``fetch``'s value)."""

    nbytes: int | None = None
    digest: str | None = None
    screened: Screened | None = None
    reason: str | None = None
    detail: str | None = None
    at: float = field(default_factory=time.time)


def fetch(
    store: ObjectStore,
    key: str,
    max_bytes: int,
    screen: Callable[[bytes], Screened],
    budget: _ByteBudget | None = None,
    clock: Callable[[], float] = time.time,
    trouble: StoreTrouble | None = None,
) -> Fetched:
    """Size-check, read and screen one object; the bytes do not outlive this call. A store
    failure is a value, and noted in ``trouble``."""
    try:
        n = store.size(key)
        if n > max_bytes:
            return Fetched(nbytes=n, reason="too_large", detail=f"{n} bytes, cap {max_bytes}", at=clock())
        if budget is not None and not budget.take(n):
            return Fetched(nbytes=n, reason=OVER_BUDGET, detail="the window's byte budget is spent", at=clock())
        data = store.get(key, max_bytes=max_bytes)
    except PayloadTooLarge as exc:
        return Fetched(reason="too_large", detail=str(exc), at=clock())
    except ObjectNotFound as exc:
        return Fetched(reason="not_found", detail=str(exc), at=clock())
    except StoreError as exc:
        if trouble is not None:
            trouble.failed(READ_CONTRIBUTION, exc, key)
        return Fetched(reason="store_error", detail=str(exc), at=clock())
    if trouble is not None:
        trouble.answered()
    at = clock()
    return Fetched(nbytes=len(data), digest=hashlib.sha256(data).hexdigest(), screened=screen(data), at=at)


def expected_peers(
    first_seen: Mapping[str, float],
    withdrawn: Collection[str],
    active: Collection[str],
    since: float | None,
) -> frozenset[str]:
    """The announced peers a window waits for: not withdrawn, and either uploaded in one of the
    last G windows (``active``, :func:`active_peers`) or announced (first seen) at or after
    ``since``, when the previous window opened. ``since`` None (window 0, or an unknown opening
    time): every announced peer that has not withdrawn. Pure."""
    return frozenset(
        p for p, seen in first_seen.items() if p not in withdrawn and (since is None or p in active or seen >= since)
    )


def recent_windows(t: int, expect_windows: int) -> tuple[int, int] | None:
    """The windows whose uploads make a peer expected in window ``t`` (inclusive; None in window 0):
    the last ``expect_windows`` (G) before it."""
    return None if t <= 0 else (max(0, t - expect_windows), t - 1)


def active_peers(uploads: Iterable[tuple[int, str]], t: int, expect_windows: int) -> frozenset[str]:
    """The peers of ``uploads`` ((window, peer) of uploads the peer itself made) that uploaded in
    one of the ``expect_windows`` windows before ``t``. Pure."""
    span = recent_windows(t, expect_windows)
    if span is None:
        return frozenset()
    return frozenset(p for w, p in uploads if span[0] <= w <= span[1])


class PeerRegistry:
    """Peers with a valid signed announcement under ``peers/`` (withdrawn ones included: a
    contribution uploaded before its peer left is still theirs), within a budget.

    :meth:`refresh` reads at most ``max_per_poll`` announcements not seen before per call, in an
    order derived from ``secret``, and tracks at most ``max_tracked`` identities (idle ones make
    room, :meth:`make_room`); a rejected announcement is logged once. :meth:`recheck` re-reads the
    announcements of given peers, which is how a withdrawal (or a return after one, or a peer that
    joined again: its announcement changed) is noticed.
    ``first_seen``: when this validator first saw each peer's current announcement (its own
    clock); announcements already in the store when the validator starts count as old (``-inf``):
    the contribution log says whether those peers uploaded lately.
    """

    def __init__(
        self,
        store: ObjectStore,
        run: str,
        run_hash: str,
        clock: Callable[[], float] = time.time,
        *,
        secret: bytes = b"",
        max_per_poll: int = 64,
        max_tracked: int = 4096,
    ) -> None:
        self.store, self.run, self.run_hash, self.clock = store, run, run_hash, clock
        self.secret, self.max_per_poll, self.max_tracked = secret, max_per_poll, max_tracked
        self.announcements: dict[str, Announcement] = {}
        self.first_seen: dict[str, float] = {}
        self.withdrawn: set[str] = set()
        self._rejected: set[str] = set()
        self._dismissed: dict[str, float] = {}  # key -> until when it is not read again
        self._checked: dict[str, float] = {}  # peer -> when its announcement was last read
        self._started = False
        self.ignored = 0  # announcements not read at the last refresh (budget or capacity)
        self.trouble = StoreTrouble(clock)  # failed listings and reads (the intake sums them per window)

    def expected(self, active: Collection[str], since: float | None) -> frozenset[str]:
        """:func:`expected_peers` of every accepted announcement (no store access)."""
        return expected_peers(self.first_seen, self.withdrawn, active, since)

    def refresh(self) -> frozenset[str]:
        try:
            keys = self.store.list(layout.peers_prefix(self.run))
        except StoreError as exc:
            self.trouble.failed(LIST_ANNOUNCEMENTS, exc)
            return frozenset(self.announcements)
        self.trouble.answered()
        first = not self._started
        self._started = True
        now = self.clock()
        new = [k for k in keys if k not in self._rejected and self._dismissed.get(k, 0.0) <= now]
        named = [(k, _peer_of(k, self.run)) for k in new]
        for key, peer in named:
            if peer is None:
                log.info("announcement %s rejected: not a peer key", key)
                if len(self._rejected) < self.max_tracked:
                    self._rejected.add(key)
        fresh = {k: p for k, p in named if p is not None and p not in self.announcements}
        room = max(0, self.max_tracked - len(self.announcements))
        take = keyed_order(self.secret, "announcement", list(fresh))[: min(self.max_per_poll, room)]
        self.ignored = len(fresh) - len(take)
        for key in take:
            self._read(fresh[key], key, old=first)
        return frozenset(self.announcements)

    def recheck(self, peers: Collection[str], min_interval_s: float) -> None:
        """Re-read the announcements of ``peers``, each at most once per ``min_interval_s``."""
        now = self.clock()
        for peer in sorted(peers):
            if peer in self.announcements and now - self._checked.get(peer, -math.inf) >= min_interval_s:
                self._read(peer, layout.peer_key(self.run, peer), old=False)

    def make_room(self, keep: Collection[str], idle_s: float) -> int:
        """When at capacity, forget announcements first seen more than ``idle_s`` ago of peers
        not in ``keep`` (the validator keeps those with a record or a recent upload); they are not
        read again for ``idle_s``. Returns how many were dropped."""
        if len(self.announcements) < self.max_tracked:
            return 0
        now = self.clock()
        idle = [p for p, seen in self.first_seen.items() if p not in keep and now - seen >= idle_s]
        for peer in idle:
            del self.announcements[peer], self.first_seen[peer]
            self.withdrawn.discard(peer)
            self._checked.pop(peer, None)
            self._dismissed[layout.peer_key(self.run, peer)] = now + idle_s
        self._dismissed = {k: t for k, t in self._dismissed.items() if t > now}
        return len(idle)

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
                log.info("announcement %s rejected: %s", key, exc)
                if len(self._rejected) < self.max_tracked:
                    self._rejected.add(key)
            return
        except StoreError as exc:  # transient: try again on the next refresh
            self.trouble.failed(READ_ANNOUNCEMENT, exc, key)
            return
        self.trouble.answered()
        returned = peer in self.withdrawn and not ann.withdrawn
        # A peer announces again each time it joins (with when): a changed announcement is a rejoin.
        renewed = peer in self.announcements and not ann.withdrawn and ann != self.announcements[peer]
        if peer not in self.announcements or returned or renewed:
            self.first_seen[peer] = -math.inf if old else self.clock()
        self.announcements[peer] = ann
        if ann.withdrawn:
            self.withdrawn.add(peer)
        else:
            self.withdrawn.discard(peer)


def _peer_of(key: str, run: str) -> str | None:
    try:
        return layout.parse_key(key, run=run).peer_id
    except ProtocolError:
        return None


class _Fetcher:
    """The queue and the pool of one window's reads, within its budgets."""

    def __init__(
        self,
        store: ObjectStore,
        budgets: Budgets,
        max_bytes: int,
        concurrency: int,
        screen: Callable[[str, bytes], Screened],
        priority: Callable[[str], Any],
        clock: Callable[[], float],
        trouble: StoreTrouble,
    ) -> None:
        self.store, self.budgets, self.max_bytes, self.screen = store, budgets, max_bytes, screen
        self.trouble = trouble
        self.priority, self.clock, self.concurrency = priority, clock, max(1, concurrency)
        self.pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="gather")
        self.bytes = _ByteBudget(budgets.max_fetch_bytes)
        self.queue: dict[str, str] = {}  # peer -> key, waiting for a slot
        self.pending: dict[str, Future[Fetched]] = {}
        self.keys: dict[str, str] = {}
        self.done: dict[str, Received] = {}
        self.started: set[str] = set()
        self.listed: dict[str, float] = {}

    def want(self, peer: str, key: str, now: float) -> None:
        """Queue ``peer``'s upload unless it is read, being read or queued (a store error is retried)."""
        self.listed.setdefault(peer, now)
        retry = peer in self.done and self.done[peer].reason == "store_error"
        if (peer in self.done and not retry) or peer in self.pending or peer in self.queue:
            return
        self.done.pop(peer, None)
        self.queue[peer], self.keys[peer] = key, key

    def submit(self) -> None:
        """Start reads, highest priority first, while threads and the window's read budget allow."""
        for peer in sorted(self.queue, key=self.priority):
            if len(self.pending) >= self.concurrency:
                return
            key = self.queue.pop(peer)
            if peer not in self.started and len(self.started) >= self.budgets.max_fetches:
                detail = f"more than {self.budgets.max_fetches} uploads in this window"
                self.done[peer] = Received(
                    peer=peer, key=key, received_at=self.clock(), reason=OVER_BUDGET, detail=detail
                )
                continue
            self.started.add(peer)
            self.pending[peer] = self.pool.submit(
                fetch,
                self.store,
                key,
                self.max_bytes,
                partial(self.screen, peer),
                self.bytes,
                self.clock,
                self.trouble,
            )

    def collect(self, wait_s: float = 0.0) -> None:
        if wait_s > 0 and self.pending:
            futures_wait(list(self.pending.values()), timeout=wait_s, return_when=FIRST_COMPLETED)
        for peer, fut in list(self.pending.items()):
            if not fut.done() or fut.cancelled():
                continue
            exc = fut.exception()  # fetch() turns store failures into values; anything else is a bug
            f = fut.result() if exc is None else Fetched(reason="store_error", detail=repr(exc), at=self.clock())
            self.done[peer] = Received(
                peer=peer,
                key=self.keys[peer],
                received_at=f.at,
                listed_at=self.listed.get(peer),
                nbytes=f.nbytes,
                digest=f.digest,
                screened=f.screened,
                reason=f.reason,
                detail=f.detail,
            )
            del self.pending[peer]

    def drain(self, deadline: float, stop: threading.Event) -> None:
        """Finish what was listed before the close, until ``deadline`` (monotonic); a read that
        failed with a store error is tried again with backoff meanwhile (the store may be back)."""
        waits: dict[str, float] = {}  # peer -> the wait before its next retry
        retry_at: dict[str, float] = {}  # peer -> when (monotonic)
        while not stop.is_set():
            now = time.monotonic()
            for peer, r in self.done.items():
                if r.reason == "store_error" and peer not in retry_at:
                    wait = waits.get(peer, RETRY_FIRST_S)
                    waits[peer], retry_at[peer] = min(2 * wait, RETRY_MAX_S), now + wait
            for peer in [p for p, at in retry_at.items() if at <= now]:
                del retry_at[peer]
                self.want(peer, self.keys[peer], self.clock())
            left = deadline - now
            if left <= 0 or not (self.pending or self.queue or retry_at):
                break
            self.submit()
            soonest = min(retry_at.values(), default=now + 0.5) - now
            self.collect(wait_s=max(0.01, min(left, 0.5, soonest)))
        self.pool.shutdown(wait=False, cancel_futures=True)  # a read stuck in the store is abandoned
        now = self.clock()
        for peer in list(self.pending) + list(self.queue):
            self.done[peer] = Received(
                peer=peer,
                key=self.keys[peer],
                received_at=now,
                reason=FETCH_TIMEOUT,
                detail="read did not finish in time",
            )


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
    admit: Callable[[str], str | None],
    screen: Callable[[str, bytes], Screened],
    priority: Callable[[str], Any] = lambda peer: peer,
    budgets: Budgets | None = None,
    on_listed: Callable[[str], None] | None = None,
    writers: Callable[[], Collection[str]] | None = None,
    stop: threading.Event | None = None,
    clock: Callable[[], float] = time.time,
    trouble: StoreTrouble | None = None,
) -> Gathered:
    """Every admitted contribution of ``window`` that could be listed before the window closed.

    ``expected``: the peers whose uploads complete the window early, or a function of the peers
    that have uploaded so far returning them (called on every poll, so peers announcing or
    withdrawing mid-window count). ``admit(peer)``: None
    to read the peer's upload, :data:`UNANNOUNCED` or :data:`EXCLUDED` not to. ``on_listed``:
    called once per admitted peer when its upload is first listed. ``writers()``: the peers
    worth listing at each poll (the announced ones; :func:`list_contributions`). ``trouble``: where
    failed listings and reads are counted (:mod:`validator.outage`)."""
    stop = stop or threading.Event()
    budgets = budgets or Budgets()
    trouble = trouble or StoreTrouble(clock)
    f = _Fetcher(store, budgets, max_bytes, concurrency, screen, priority, clock, trouble)
    uploaded: set[str] = set()
    unannounced: set[str] = set()
    delays = poll_delays(poll_interval_s, windows)
    try:
        while True:
            before = len(uploaded)
            f.collect()
            try:
                listed = list_contributions(store, run, window, None if writers is None else writers())
            except StoreError as exc:  # tried again at the next poll; summed up in the window's store_errors
                trouble.failed(LIST_CONTRIBUTIONS, exc, layout.contrib_prefix(run, window))
                listed = {}
            else:
                trouble.answered()
            now = clock()
            for peer, key in listed.items():
                verdict = admit(peer)
                if verdict == UNANNOUNCED:
                    unannounced.add(peer)  # it may still announce: looked at again next poll
                    continue
                unannounced.discard(peer)
                if verdict == EXCLUDED:
                    if peer not in f.done:
                        f.done[peer] = Received(peer=peer, key=key, received_at=now, reason=EXCLUDED)
                    continue
                if peer not in uploaded:
                    uploaded.add(peer)
                    if on_listed is not None:
                        on_listed(peer)
                f.want(peer, key, now)
            f.submit()
            done = frozenset(uploaded)
            want = expected(done) if callable(expected) else expected  # peers come and go mid-window
            if stop.is_set() or should_close(now, opened_at, windows, expected=want, uploaded=uploaded):
                break
            if len(uploaded) > before:
                delays = poll_delays(poll_interval_s, windows)  # uploads arrive: the next may be close behind
            stop.wait(next(delays))
        f.drain(time.monotonic() + budgets.fetch_timeout_s, stop)
    finally:
        f.pool.shutdown(wait=False, cancel_futures=True)
    return Gathered(received=f.done, unannounced=len(unannounced))

"""Who gets which presigned request: the validator's grant desk.

A peer without a store credential asks for one presigned request at a time (:mod:`protocol.store.grants`);
:class:`GrantDesk` decides, presigns with the validator's own store (:class:`~protocol.store.presign.
Presigner`, the S3 store that holds the write credential) and reports every decision as an event
(:class:`~protocol.events.Granted`, :class:`~protocol.events.GrantDenied`)::

    windows = OpenWindows()                       # fed the validator's events: which window is open
    desk = GrantDesk(spec, s3_store, windows.current, emit=emit, roster=roster)
    grant = desk.decide(body, signature_header, "203.0.113.7")    # Presigned, or GrantRefused

In order, a request must: come from a network within its rate (``address_rate``/``address_burst``
requests per second/at once for all addresses of one network prefix, IPv4 /24 and IPv6 /48 by
default, :mod:`validator.netprefix`), parse and verify (Ed25519 over the exact body; the parse is
bounded in size and depth), be fresh (timestamp within ``max_skew_s``), name this run's hash, come
from a peer within its rate, carry a nonce never seen, and ask for something this peer may have.

Keys are free, so the per-peer rate binds only identities the validator knows. With a
:class:`Roster` (the validator's announced peers and their standing), an identity that has not
announced shares one small budget per network prefix (``unannounced_rate``/``unannounced_burst``)
for everything it may ask for: its announcement, its probe and reads of the run (a newcomer reads
the run's checkpoint once and announces; a flood of fresh keys from one network costs that budget,
not the desk). An announced identity has its own ``peer_rate``/``peer_burst``. Write grants of a
contribution go only to an announced identity that is not excluded
(:func:`validator.reputation.is_excluded`), at most ``contribution_grants`` per identity and window.
A contribution grant is create-only, so one identity writes at most one contribution a window
whatever it is granted; the few grants more are for an honest peer whose answer was lost or that
restarted (a retried upload reuses its grant). The nonce table holds at most ``max_nonces``
(the oldest expire first); a full table refuses (``busy``, with when to retry) rather than grow.
Unannounced identities have a nonce table of their own, so that their flood never fills the one of
the announced peers.

* ``put`` of its contribution to the *open* window, create-only, at most
  the contribution cap (:func:`protocol.caps.object_caps`): the URL expires at the window's upload deadline;
* ``put`` of its announcement (withdrawals replace it) or its preflight probe, small, short-lived;
* ``get``/``head`` of a key, or ``list`` of a prefix, under the run (``<run>/``) or one of
  ``read_prefixes``: valid ``read_expiry_s``, so peers poll with a cached URL.

Everything else is refused with a reason and an HTTP status (:data:`protocol.store.grants.STATUS`). The
HTTP side is :mod:`validator.grant_server`.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from protocol import layout
from protocol.caps import object_caps
from protocol.config import RunSpec
from protocol.errors import ConfigError, StoreError
from protocol.events import Event, GrantDenied, Granted, WindowOpened, WindowPublished
from protocol.store.grants import (
    MAX_SKEW_S,
    PROBE_MAX_BYTES,
    GrantRefused,
    GrantRequest,
    SignedRequest,
    read_request,
    write_scope,
)
from protocol.store.presign import Presigned, Presigner
from protocol.windows import upload_deadline
from validator.gather import MAX_ANNOUNCEMENT_BYTES
from validator.netprefix import network_prefix

__all__ = ["FixedRoster", "GrantDesk", "GrantPolicy", "OpenWindow", "OpenWindows", "Roster", "TokenBuckets"]


@dataclass(frozen=True)
class GrantPolicy:
    """The desk's limits (see the module docstring). ``probe_max_bytes``: the preflight probe.
    ``address_*`` and ``unannounced_*`` count per network prefix (``prefix_v4``/``prefix_v6`` bits)."""

    read_expiry_s: int = 900
    write_expiry_s: int = 120
    max_skew_s: float = MAX_SKEW_S
    peer_rate: float = 20.0
    peer_burst: float = 400.0
    address_rate: float = 100.0
    address_burst: float = 2000.0
    unannounced_rate: float = 1.0
    unannounced_burst: float = 60.0
    prefix_v4: int = 24
    prefix_v6: int = 48
    contribution_grants: int = 3
    max_nonces: int = 200_000
    max_rate_names: int = 100_000
    # Refusal events per (reason, network): a burst, then this many a second; the rest are counted
    # and reported with the next one that is (GrantDenied.unreported), so a flood of requests
    # costs the operator's log a bounded number of lines.
    event_rate: float = 1.0
    event_burst: float = 200.0
    probe_max_bytes: int = PROBE_MAX_BYTES
    announcement_max_bytes: int = MAX_ANNOUNCEMENT_BYTES
    read_prefixes: tuple[str, ...] = ()


class Roster(Protocol):
    """Who the validator knows: announced identities and their standing (thread-safe reads)."""

    def announced(self, peer_id: str) -> bool:
        """``peer_id`` has a valid announcement the validator has read (and not withdrawn)."""
        ...

    def excluded(self, peer_id: str, window: int) -> bool:
        """``peer_id`` is excluded from ``window`` (:func:`validator.reputation.is_excluded`)."""
        ...


class FixedRoster:
    """A roster of a fixed set of announced identities, none excluded: a desk beside a static list
    of participants, and the desks of benchmarks and tests."""

    def __init__(self, *peers: str) -> None:
        self.peers = set(peers)

    def announced(self, peer_id: str) -> bool:
        return peer_id in self.peers

    def excluded(self, peer_id: str, window: int) -> bool:
        return False


@dataclass(frozen=True)
class OpenWindow:
    """Window ``window`` is open since ``opened_at`` (unix s, the validator's signed time)."""

    window: int
    opened_at: float


class OpenWindows:
    """Which window is open, from the validator's own events: ``WindowOpened`` (genesis, a
    restart) and ``WindowPublished`` (window t published opens t + 1 at its ``published_at``, the
    moment peers see it, before the validator has written a checkpoint). Thread-safe."""

    def __init__(self) -> None:
        self._open: OpenWindow | None = None
        self._lock = threading.Lock()

    def observe(self, event: Event) -> None:
        with self._lock:
            if isinstance(event, WindowOpened):
                self._open = OpenWindow(event.window, event.opened_at)
            elif isinstance(event, WindowPublished):
                self._open = OpenWindow(event.window + 1, event.published_at)

    def current(self) -> OpenWindow | None:
        with self._lock:
            return self._open


class TokenBuckets:
    """One token bucket per name: ``rate`` tokens a second up to ``burst``; :meth:`take` returns 0
    when a token was taken, else the seconds until one is there. Thread-safe; idle full buckets
    are dropped, so memory follows the names active within about ``burst / rate`` seconds."""

    def __init__(self, rate: float, burst: float, *, max_names: int = 100_000) -> None:
        if rate <= 0 or burst < 1:
            raise ConfigError("a rate limit needs rate > 0 and burst >= 1")
        self.rate, self.burst, self.max_names = rate, burst, max_names
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # name -> (tokens, at)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, name: str, now: float) -> float:
        with self._lock:
            tokens, at = self._buckets.pop(name, (self.burst, now))
            tokens = min(self.burst, tokens + (now - at) * self.rate)
            wait = 0.0 if tokens >= 1 else (1 - tokens) / self.rate
            self._buckets[name] = (tokens - 1 if wait == 0 else tokens, now)  # most recent last
            self._forget_idle(now)
            return wait

    def _forget_idle(self, now: float) -> None:
        full_after = self.burst / self.rate
        while self._buckets:
            name, (_, at) = next(iter(self._buckets.items()))
            if now - at < full_after and len(self._buckets) <= self.max_names:
                return
            del self._buckets[name]


class _Nonces:
    """Nonces seen within the freshness window (a replayed request is refused), at most ``cap``:
    the oldest expire first, and a full table refuses (``busy``) rather than grow."""

    def __init__(self, keep_s: float, cap: int) -> None:
        self.keep_s, self.cap = keep_s, cap
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seen)

    def __contains__(self, nonce: str) -> bool:
        with self._lock:
            return nonce in self._seen

    def first_use(self, nonce: str, now: float) -> bool:
        with self._lock:
            while self._seen and next(iter(self._seen.values())) < now - self.keep_s:
                self._seen.popitem(last=False)
            if nonce in self._seen:
                return False
            if len(self._seen) >= self.cap:
                oldest = next(iter(self._seen.values()))
                raise GrantRefused(
                    "busy",
                    f"the desk holds {self.cap} recent requests, its cap; retry shortly",
                    retry_after_s=max(1.0, oldest + self.keep_s - now),
                )
            self._seen[nonce] = now
            return True


class _Contributions:
    """How many contribution grants each identity got for the open window (older windows are
    forgotten as the next one is asked for)."""

    def __init__(self, per_window: int, cap: int) -> None:
        self.per_window, self.cap = per_window, cap
        self._window = -1
        self._given: dict[str, int] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._given)

    def take(self, peer_id: str, window: int) -> None:
        """Count one grant to ``peer_id`` for ``window``, or refuse ``already_granted``/``busy``."""
        with self._lock:
            if window != self._window:
                self._window, self._given = window, {}
            given = self._given.get(peer_id, 0)
            if given >= self.per_window:
                raise GrantRefused(
                    "already_granted",
                    f"peer {peer_id} was granted its contribution to window {window} already "
                    "(the grant is valid until the upload deadline: retry with it)",
                )
            if peer_id not in self._given and len(self._given) >= self.cap:
                raise GrantRefused("busy", f"{self.cap} identities hold contribution grants, the cap", retry_after_s=5)
            self._given[peer_id] = given + 1


class GrantDesk:
    """Decides grant requests for one run; see the module docstring."""

    def __init__(
        self,
        spec: RunSpec,
        presigner: Presigner,
        open_window: Callable[[], OpenWindow | None],
        *,
        policy: GrantPolicy | None = None,
        emit: Callable[[Event], None] | None = None,
        clock: Callable[[], float] = time.time,
        roster: Roster | None = None,
        waiting: Callable[[], tuple[int, int] | None] | None = None,
    ) -> None:
        """``roster`` None: every identity counts as announced and in good standing (a desk
        without a validator behind it, as in tests and demos). ``waiting``: while the validator
        waits for peers before genesis (``--wait-for-peers``), how many it waits for and how many
        have announced (None otherwise); ``/v1/info`` says so."""
        self.spec, self.presigner, self.open_window = spec, presigner, open_window
        self.roster = roster
        self.waiting = waiting
        self.policy = policy or GrantPolicy()
        self.run_hash = spec.hash()
        self.run_id = layout.run_id(self.run_hash)
        self.max_contribution_bytes = object_caps(spec).contribution  # what the validator reads
        self.emit = emit or (lambda event: None)
        self.clock = clock
        p = self.policy
        self._peers = TokenBuckets(p.peer_rate, p.peer_burst, max_names=p.max_rate_names)
        self._addresses = TokenBuckets(p.address_rate, p.address_burst, max_names=p.max_rate_names)
        self._unannounced = TokenBuckets(p.unannounced_rate, p.unannounced_burst, max_names=p.max_rate_names)
        # A timestamp is accepted max_skew_s either way. Unannounced keys have a table of their own:
        # a flood of fresh keys fills theirs, never the one of the peers the validator knows.
        self._nonces = _Nonces(2 * p.max_skew_s, p.max_nonces)
        self._strangers = _Nonces(2 * p.max_skew_s, p.max_nonces)
        self._contributions = _Contributions(p.contribution_grants, p.max_rate_names)
        self._events = TokenBuckets(p.event_rate, p.event_burst, max_names=p.max_rate_names)
        self._unreported: OrderedDict[str, int] = OrderedDict()  # (reason, network) -> refusals not reported
        self._unreported_lock = threading.Lock()
        self._reads = (f"{self.run_id}/", *p.read_prefixes)

    def decide(self, body: bytes, signature: str | None, address: str) -> Presigned:
        """The presigned request ``body`` asks for, or :class:`GrantRefused`; reported either way."""
        signed: SignedRequest | None = None
        try:
            now = self.clock()
            prefix = self.prefix(address)
            self._within_rate(self._addresses, prefix, now, f"network {prefix}")
            signed = read_request(body, signature)
            self._fresh(signed.request, now)
            self._admit(signed, prefix, now)
            grant = self._grant(signed, now)
        except GrantRefused as refusal:
            self._report_refusal(refusal, signed, address)
            raise
        req = signed.request
        self.emit(
            Granted(
                peer_id=signed.peer_id,
                address=address,
                op=req.op,
                key=req.key,
                size=req.size,
                expires_at=round(grant.expires_at, 3),
            )
        )
        return grant

    def info(self, address: str) -> dict[str, object]:
        """What ``GET /v1/info`` answers ``address`` (within its rate): the run, and the open
        window and its upload deadline."""
        try:
            prefix = self.prefix(address)
            self._within_rate(self._addresses, prefix, self.clock(), f"network {prefix}")
        except GrantRefused as refusal:
            self._report_refusal(refusal, None, address)
            raise
        open_now = self.open_window()
        waiting = self.waiting() if self.waiting is not None else None
        return {
            "run_id": self.run_id,
            "run_hash": self.run_hash,
            "window": open_now.window if open_now else None,
            "upload_deadline": upload_deadline(open_now.opened_at, self.spec.windows) if open_now else None,
            "waiting_for_peers": waiting[0] if waiting else None,
            "announced": waiting[1] if waiting else None,
        }

    def refused(self, refusal: GrantRefused, address: str) -> None:
        """Report a refusal the HTTP side decided (a malformed body, a connection over a cap)."""
        self._report_refusal(refusal, None, address)

    def prefix(self, address: str) -> str:
        """The network prefix ``address`` is rationed with."""
        return network_prefix(address, self.policy.prefix_v4, self.policy.prefix_v6)

    def tables(self) -> dict[str, int]:
        """How many entries each of the desk's tables holds (all capped)."""
        return {
            "nonces": len(self._nonces),
            "unannounced_nonces": len(self._strangers),
            "peers": len(self._peers),
            "networks": len(self._addresses),
            "unannounced_networks": len(self._unannounced),
            "contributions": len(self._contributions),
            "unreported": len(self._unreported),
        }

    # ------------------------------------------------------------------ checks
    def _announced(self, peer_id: str) -> bool:
        return self.roster is None or self.roster.announced(peer_id)

    def _within_rate(self, buckets: TokenBuckets, name: str, now: float, who: str) -> None:
        wait = buckets.take(name, now)
        if wait > 0:
            raise GrantRefused("rate_limited", f"{who} asks too often; retry in {wait:.1f} s", retry_after_s=wait)

    def _admit(self, signed: SignedRequest, prefix: str, now: float) -> None:
        """Within the rate of the peer (announced) or of its network's unannounced keys, and a
        nonce never seen (checked after the rates, so that refused requests do not fill its table)."""
        if self._announced(signed.peer_id):
            self._within_rate(self._peers, signed.peer_id, now, f"peer {signed.peer_id}")
            nonces, other = self._nonces, self._strangers
        else:
            self._within_rate(self._unannounced, prefix, now, f"unannounced keys of network {prefix}")
            nonces, other = self._strangers, self._nonces
        if signed.request.nonce in other or not nonces.first_use(signed.request.nonce, now):  # other: a peer
            raise GrantRefused("replayed", "this request (its nonce) was already used")  # that just (un)announced

    def _fresh(self, req: GrantRequest, now: float) -> None:
        """A timestamp within max_skew_s and this run's hash."""
        skew = req.timestamp - now
        if abs(skew) > self.policy.max_skew_s:
            raise GrantRefused(
                "stale",
                f"the request's timestamp is {skew:+.0f} s off the validator's clock (at most "
                f"{self.policy.max_skew_s:.0f} s): set this machine's clock (NTP)",
            )
        if req.run_hash != self.run_hash:
            raise GrantRefused(
                "wrong_run",
                f"this grant server serves run {self.run_id} (hash {self.run_hash}), not hash {req.run_hash}: "
                "compare `sparseloco run-id run.toml` with the operator's",
            )

    # ------------------------------------------------------------------ grants
    def _grant(self, signed: SignedRequest, now: float) -> Presigned:
        req = signed.request
        try:
            if req.op == "put":
                return self._put(signed.peer_id, req, now)
            self._readable(req)
            expires = self.policy.read_expiry_s
            if req.op == "get":
                return self.presigner.presign_get(req.key, expires_s=expires)
            if req.op == "head":
                return self.presigner.presign_head(req.key, expires_s=expires)
            return self.presigner.presign_list(req.key, token=req.token, expires_s=expires)
        except (StoreError, ConfigError) as exc:
            raise GrantRefused("unavailable", f"the validator cannot sign this request: {exc}") from None

    def _readable(self, req: GrantRequest) -> None:
        if not req.key.startswith(self._reads):
            raise GrantRefused("forbidden", f"{req.key!r} is not under {', '.join(self._reads)}")

    def _put(self, peer_id: str, req: GrantRequest, now: float) -> Presigned:
        parsed = write_scope(self.run_id, peer_id, req.key)
        if parsed.kind != "contrib":
            cap = self.policy.announcement_max_bytes if parsed.kind == "peers" else self.policy.probe_max_bytes
            self._size(req.size, cap, "an announcement" if parsed.kind == "peers" else "a probe")
            return self.presigner.presign_put(
                req.key, req.size, if_absent=req.if_absent, expires_s=self.policy.write_expiry_s
            )
        assert parsed.window is not None  # a contribution key always names its window
        expires = self._contribution_expiry(parsed.window, req, now)
        self._in_standing(peer_id, parsed.window)
        grant = self.presigner.presign_put(req.key, req.size, if_absent=req.if_absent, expires_s=expires)
        self._contributions.take(peer_id, parsed.window)
        return grant

    def _in_standing(self, peer_id: str, window: int) -> None:
        """A contribution is granted to an announced identity that is not excluded."""
        if self.roster is None:
            return
        if not self.roster.announced(peer_id):
            raise GrantRefused(
                "not_announced",
                f"peer {peer_id} has no announcement the validator has read: announce, then upload "
                "(the validator reads new announcements as each window opens)",
            )
        if self.roster.excluded(peer_id, window):
            raise GrantRefused("forbidden", f"peer {peer_id} is excluded from window {window}")

    def _contribution_expiry(self, window: int, req: GrantRequest, now: float) -> int:
        """Seconds a contribution PUT for ``window`` may live: until its upload deadline."""
        self._size(req.size, self.max_contribution_bytes, "a contribution")
        if not req.if_absent:
            raise GrantRefused("forbidden", "a contribution is created once: ask with if_absent")
        open_now = self.open_window()
        if open_now is None:
            raise GrantRefused(
                "window_closed", "no window is open (the run has not started, or the validator restarts)"
            )
        if window != open_now.window:
            raise GrantRefused("window_closed", f"window {window} is not open; window {open_now.window} is")
        left = upload_deadline(open_now.opened_at, self.spec.windows) - now
        if left <= 0:
            raise GrantRefused("window_closed", f"window {window}'s upload deadline passed {-left:.0f} s ago")
        return max(1, math.ceil(left))

    @staticmethod
    def _size(size: int, cap: int, what: str) -> None:
        if size > cap:
            raise GrantRefused("too_large", f"{what} may have at most {cap} bytes, not {size}")

    def _report_refusal(self, refusal: GrantRefused, signed: SignedRequest | None, address: str) -> None:
        unreported = self._unreported_before(f"{refusal.reason} {self.prefix(address)}")
        if unreported is None:
            return
        req = signed.request if signed else None
        self.emit(
            GrantDenied(
                peer_id=signed.peer_id if signed else "",
                address=address,
                op=req.op if req else "",
                key=req.key if req else "",
                reason=refusal.reason,
                status=refusal.status,
                detail=str(refusal).removeprefix(f"{refusal.reason}: "),
                unreported=unreported,
            )
        )

    def _unreported_before(self, key: str) -> int | None:
        """None when a refusal for ``key`` (reason and network) is over its event budget (it is
        counted instead); else how many were counted since the last one reported. The counts
        are capped at ``max_rate_names`` keys, the oldest dropped first."""
        with self._unreported_lock:
            if self._events.take(key, self.clock()) > 0:
                self._unreported[key] = self._unreported.pop(key, 0) + 1
                while len(self._unreported) > self.policy.max_rate_names:
                    self._unreported.popitem(last=False)
                return None
            return self._unreported.pop(key, 0)

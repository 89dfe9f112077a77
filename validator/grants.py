"""Who gets which presigned request: the validator's grant desk.

A peer without a store credential asks for one presigned request at a time (:mod:`protocol.store.grants`);
:class:`GrantDesk` decides, presigns with the validator's own store (:class:`~protocol.store.presign.
Presigner`, the S3 store that holds the write credential) and reports every decision as an event
(:class:`~protocol.events.Granted`, :class:`~protocol.events.GrantDenied`)::

    windows = OpenWindows()                       # fed the validator's events: which window is open
    desk = GrantDesk(spec, s3_store, windows.current, emit=emit)
    grant = desk.decide(body, signature_header, "203.0.113.7")    # Presigned, or GrantRefused

In order, a request must: come from an address within its rate (``address_rate``/``address_burst``
requests per second/at once), parse and verify (Ed25519 over the exact body), be fresh (timestamp
within ``max_skew_s``, nonce never seen), name this run's hash, come from a peer within its rate,
and ask for something this peer may have:

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

__all__ = ["GrantDesk", "GrantPolicy", "OpenWindow", "OpenWindows", "TokenBuckets"]


@dataclass(frozen=True)
class GrantPolicy:
    """The desk's limits (see the module docstring). ``probe_max_bytes``: the preflight probe."""

    read_expiry_s: int = 900
    write_expiry_s: int = 120
    max_skew_s: float = MAX_SKEW_S
    peer_rate: float = 20.0
    peer_burst: float = 400.0
    address_rate: float = 100.0
    address_burst: float = 2000.0
    probe_max_bytes: int = PROBE_MAX_BYTES
    announcement_max_bytes: int = MAX_ANNOUNCEMENT_BYTES
    read_prefixes: tuple[str, ...] = ()


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
    """Nonces seen within the freshness window (a replayed request is refused)."""

    def __init__(self, keep_s: float) -> None:
        self.keep_s = keep_s
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def first_use(self, nonce: str, now: float) -> bool:
        with self._lock:
            while self._seen and next(iter(self._seen.values())) < now - self.keep_s:
                self._seen.popitem(last=False)
            if nonce in self._seen:
                return False
            self._seen[nonce] = now
            return True


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
    ) -> None:
        self.spec, self.presigner, self.open_window = spec, presigner, open_window
        self.policy = policy or GrantPolicy()
        self.run_hash = spec.hash()
        self.run_id = layout.run_id(self.run_hash)
        self.max_contribution_bytes = object_caps(spec).contribution  # what the validator reads
        self.emit = emit or (lambda event: None)
        self.clock = clock
        p = self.policy
        self._peers = TokenBuckets(p.peer_rate, p.peer_burst)
        self._addresses = TokenBuckets(p.address_rate, p.address_burst)
        self._nonces = _Nonces(2 * p.max_skew_s)  # a timestamp is accepted max_skew_s either way
        self._reads = (f"{self.run_id}/", *p.read_prefixes)

    def decide(self, body: bytes, signature: str | None, address: str) -> Presigned:
        """The presigned request ``body`` asks for, or :class:`GrantRefused`; reported either way."""
        signed: SignedRequest | None = None
        try:
            now = self.clock()
            self._within_rate(self._addresses, address, now, f"address {address}")
            signed = read_request(body, signature)
            self._fresh(signed.request, now)
            self._within_rate(self._peers, signed.peer_id, now, f"peer {signed.peer_id}")
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
        self._within_rate(self._addresses, address, self.clock(), f"address {address}")
        open_now = self.open_window()
        return {
            "run_id": self.run_id,
            "run_hash": self.run_hash,
            "window": open_now.window if open_now else None,
            "upload_deadline": upload_deadline(open_now.opened_at, self.spec.windows) if open_now else None,
        }

    # ------------------------------------------------------------------ checks
    def _within_rate(self, buckets: TokenBuckets, name: str, now: float, who: str) -> None:
        wait = buckets.take(name, now)
        if wait > 0:
            raise GrantRefused("rate_limited", f"{who} asks too often; retry in {wait:.1f} s", retry_after_s=wait)

    def _fresh(self, req: GrantRequest, now: float) -> None:
        skew = req.timestamp - now
        if abs(skew) > self.policy.max_skew_s:
            raise GrantRefused(
                "stale",
                f"the request's timestamp is {skew:+.0f} s off the validator's clock (at most "
                f"{self.policy.max_skew_s:.0f} s): set this machine's clock (NTP)",
            )
        if not self._nonces.first_use(req.nonce, now):
            raise GrantRefused("replayed", "this request (its nonce) was already used")
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
        if parsed.kind == "contrib":
            assert parsed.window is not None  # a contribution key always names its window
            expires = self._contribution_expiry(parsed.window, req, now)
        else:
            cap = self.policy.announcement_max_bytes if parsed.kind == "peers" else self.policy.probe_max_bytes
            self._size(req.size, cap, "an announcement" if parsed.kind == "peers" else "a probe")
            expires = self.policy.write_expiry_s
        return self.presigner.presign_put(req.key, req.size, if_absent=req.if_absent, expires_s=expires)

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
            )
        )

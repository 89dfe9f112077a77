"""The peer's link to the store: how fast it uploads, and putting an object before a deadline.

A volunteer's uplink is slow (a DSL line sends 2 Mbit/s) and drops for tens of seconds. A window's
contribution is worth sending only until the window's upload deadline, so its put is retried on
transient failures until then, not a fixed number of times, and not started when it cannot end in
time::

    rate = LinkRate()                                   # bytes/s of this peer's own completed puts
    sent = put_by_deadline(store, key, blob, deadline=opened_at + 600, rate=rate)
    sent.outcome, sent.reason, sent.attempts, sent.seconds, sent.down_s

* **retried** (:func:`transient`): the store or the grant server did not answer, timed out, or
  answered 5xx (``StoreUnavailable``, a plain ``StoreError``); a refusal (``AccessDenied``, a
  grant the validator will not give, ``PayloadTooLarge``, a different object under the key) is an
  answer and is not. Waits between attempts grow exponentially with jitter, capped
  (:class:`Backoff`: 1, 2, 4, 8, 15, 15 ... s, each ±25 %), and never past the deadline.
* **once** (:func:`~protocol.store.base.put_once`): each attempt is a create-only put; when an
  earlier attempt landed but its answer was lost, the next one finds the same bytes and the put
  is ``uploaded`` (``"already present"``), with no second object.
* **not late**: before each attempt, when the time left is shorter than the object at the
  measured uplink rate (:class:`LinkRate`, an EWMA of completed puts; none measured yet: try),
  the put is ``skipped`` with the figures (``the link needs ~95 s for 23.4 MB, 40 s left``);
  three skips in a row forget the rate, so that one slow moment does not skip every later window.
* **bounded**: each attempt runs under the deadline (:func:`~protocol.store.base.deadline`), so a
  store that waits on the network clips its timeouts to the time left.

:func:`required_bits_per_s` and the formatters are shared with ``sparseloco-peer preflight``'s
``link`` check.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from protocol.errors import ObjectExists, ProtocolError, StoreError, StoreUnavailable
from protocol.store.base import ObjectStore, deadline, put_once

__all__ = [
    "Backoff",
    "LinkRate",
    "Sent",
    "megabits",
    "megabytes",
    "put_by_deadline",
    "required_bits_per_s",
    "transient",
]


def megabytes(n: float) -> str:
    """``23.4 MB`` (decimal units, as link speeds are quoted); ``12.0 kB`` below 0.1 MB and
    ``1.20 GB`` from 1 GB on, so no size reads as ``0.0 MB``."""
    if n < 1e5:
        return f"{n / 1e3:.1f} kB"
    if n >= 1e9:
        return f"{n / 1e9:.2f} GB"
    return f"{n / 1e6:.1f} MB"


def megabits(bytes_per_s: float) -> str:
    """``1.9 Mbit/s`` for a rate in bytes per second."""
    return f"{bytes_per_s * 8 / 1e6:.1f} Mbit/s"


def required_bits_per_s(size: int, seconds: float) -> float:
    """The rate in bits per second that sends ``size`` bytes in ``seconds``."""
    return 8 * size / max(seconds, 1e-9)


class LinkRate:
    """An exponentially weighted mean of the upload rate, bytes per second, of completed puts.

    Puts smaller than ``min_bytes`` measure latency rather than the rate and are not counted. A
    rate is only measured by puts, and puts skipped for it measure nothing: after ``forget_after``
    skips in a row it is forgotten, so that a link that got faster is tried (and measured) again.
    """

    def __init__(self, *, weight: float = 0.3, min_bytes: int = 64 << 10, forget_after: int = 3) -> None:
        self.weight, self.min_bytes, self.forget_after = weight, min_bytes, forget_after
        self.bytes_per_s: float | None = None
        self._skips = 0

    def observe(self, size: int, seconds: float) -> None:
        """A put of ``size`` bytes took ``seconds``."""
        if size < self.min_bytes or seconds <= 0:
            return
        rate = size / seconds
        old = self.bytes_per_s
        self.bytes_per_s = rate if old is None else (1 - self.weight) * old + self.weight * rate
        self._skips = 0

    def skipped(self) -> None:
        """A put was not started for this rate."""
        self._skips += 1
        if self._skips >= self.forget_after:
            self.bytes_per_s, self._skips = None, 0

    def seconds_for(self, size: int) -> float | None:
        """How long ``size`` bytes take at the measured rate (``None``: nothing measured yet)."""
        return None if self.bytes_per_s is None else size / self.bytes_per_s


class Backoff:
    """Waits between attempts: ``first_s · 2^n`` capped at ``cap_s``, each scaled by a random
    factor in ``[1 − jitter, 1 + jitter]`` (peers that lost the same link do not retry in step)."""

    def __init__(
        self, *, first_s: float = 1.0, cap_s: float = 15.0, jitter: float = 0.25, rng: random.Random | None = None
    ) -> None:
        self.first_s, self.cap_s, self.jitter = first_s, cap_s, jitter
        self._rng = rng or random.Random()
        self._n = 0

    def next(self) -> float:
        """The wait before the next attempt."""
        base = min(self.cap_s, self.first_s * 2**self._n)
        self._n += 1
        return float(base * self._rng.uniform(1 - self.jitter, 1 + self.jitter))


#: Refusals that pass by themselves: ``not_announced``, a contribution asked for before the
#: validator has read this peer's announcement (a peer that just joined or rejoined after a
#: withdrawal; the validator reads new announcements while it gathers, within seconds).
PASSING_REFUSALS = frozenset({"not_announced"})


def transient(exc: StoreError | ProtocolError) -> bool:
    """Whether a store error may pass if tried again: the store or grant server did not answer
    (``StoreUnavailable``), failed without naming a refusal (a plain ``StoreError``: a reset
    connection, a 5xx), or refused for a reason that passes by itself (:data:`PASSING_REFUSALS`).
    Any other named refusal or answer (access denied, too large, exists ...) is not."""
    if isinstance(exc, StoreUnavailable) or type(exc) is StoreError:
        return True
    return isinstance(exc, StoreError) and exc.reason in PASSING_REFUSALS


@dataclass(frozen=True)
class Sent:
    """How :func:`put_by_deadline` ended.

    ``outcome``: ``uploaded``, ``skipped`` (not tried: the link cannot make the deadline, or it
    had passed) or ``failed`` (refused, or transient failures until the deadline); ``reason``: why not uploaded, or ``"already present"`` when an earlier
    attempt had landed; ``refused``: the store refused the write (not a transient failure);
    ``attempts``: puts tried; ``seconds``: from the first attempt to the end, waits included;
    ``down_s``: of those, the time in failed attempts and the waits after them; ``held_s``: of
    those, the time in attempts refused for a reason that passes (:data:`PASSING_REFUSALS`: the
    link was up, the validator had not read this peer's announcement yet).
    """

    outcome: str
    reason: str | None = None
    refused: bool = False
    attempts: int = 0
    seconds: float = 0.0
    down_s: float = 0.0
    held_s: float = 0.0

    @property
    def uploaded(self) -> bool:
        return self.outcome == "uploaded"

    def summary(self, what: str) -> str:
        """One line for the log: ``upload of window 7 took 3 attempts, 41 s; link was down 30 s``."""
        tries = f"{self.attempts} attempt{'s' if self.attempts != 1 else ''}"
        line = f"{what} took {tries}, {self.seconds:.0f} s"
        if self.down_s - self.held_s >= 0.5:
            line += f"; link was down {self.down_s - self.held_s:.0f} s"
        if self.held_s >= 0.5:
            line += f"; waited {self.held_s:.0f} s for the validator to read this peer's announcement"
        if not self.uploaded:
            line += f": {self.outcome} ({self.reason})"
        return line


def put_by_deadline(
    store: ObjectStore,
    key: str,
    data: bytes,
    *,
    deadline_at: Callable[[], float],
    rate: LinkRate,
    backoff: Backoff | None = None,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], object] = time.sleep,
    stopping: Callable[[], bool] = lambda: False,
) -> Sent:
    """Create ``key`` holding ``data`` (:func:`put_once`), retried on transient failures until
    ``deadline_at()`` (Unix time, asked before every attempt: a window that opens meanwhile gets
    its real deadline); see the module docstring. A completed put feeds ``rate``. Once
    ``stopping()`` (the peer is leaving) no further attempt starts; ``sleep`` may return early
    then (an event's ``wait``)."""
    backoff = backoff or Backoff()
    started = clock()
    attempts, down, held = 0, 0.0, 0.0
    last_error: str | None = None

    def ended(outcome: str, reason: str | None = None, *, refused: bool = False) -> Sent:
        return Sent(outcome, reason, refused, attempts, clock() - started, down, held)

    while True:
        if attempts and stopping():
            return ended("failed", f"the peer is stopping (last: {last_error})")
        at = deadline_at()
        left = at - clock()
        if left <= 0:
            if not attempts:
                return ended("skipped", "the upload deadline passed")
            return ended("failed", f"the upload deadline passed after {attempts} attempts (last: {last_error})")
        need = rate.seconds_for(len(data))
        if need is not None and need > left:
            why = (
                f"the link needs ~{need:.0f} s for {megabytes(len(data))} at {megabits(rate.bytes_per_s or 0)}, "
                f"{left:.0f} s left"
            )
            rate.skipped()  # (may forget the rate: the reason is worded first)
            return ended("skipped", why)
        attempts += 1
        t0 = clock()
        try:
            with deadline(at):
                created = put_once(store, key, data)
        except ObjectExists:
            return ended("failed", "a different contribution exists")
        except (StoreError, ProtocolError) as exc:  # ProtocolError: PayloadTooLarge, a grant refused as too large
            if not transient(exc):
                return ended("failed", f"{exc.reason}: {exc}", refused=True)
            last_error = f"{exc.reason}: {exc}"
            wait = min(backoff.next(), max(0.0, at - clock()))
            sleep(wait)
            down += clock() - t0
            if exc.reason in PASSING_REFUSALS:
                held += clock() - t0
            continue
        if created:
            rate.observe(len(data), clock() - t0)
        return ended("uploaded", None if created else "already present")

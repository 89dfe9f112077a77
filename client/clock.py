"""This machine's clock against the run's: measured from the ``Date`` header of HTTP answers.

A peer decides from its own clock whether a window is still open: the validator stamps when a
window opened, and the peer trains only while ``opened_at + upload_deadline_s`` lies ahead of
``time.time()``. A clock that is minutes ahead makes every window look closed before training
starts; one that is behind uploads after the validator has gathered. Neither says "clock" by
itself, so ``preflight`` and ``join`` measure it first.

The measurement: one HTTP request to each server the peer talks to (the S3 endpoint of its store,
its grant servers); the answer's ``Date`` header (RFC 9110, every S3-compatible store and aiohttp
send one, whatever the status) is the server's time, truncated to the second. With ``t0``/``t1``
this machine's times when the request left and the answer came back::

    offset = (t0 + t1) / 2 - (Date + 0.5 s)   # > 0: this machine is ahead
    uncertainty = (t1 - t0) / 2 + 1 s         # the round trip, and Date's 1 s resolution

(``Date`` truncates: the server's time lay in ``[Date, Date + 1 s)``, whose middle is taken.)

The bound, from the RunSpec's window timing (:func:`bound_s`)::

    bound = min(upload_deadline_s / 10, gather_grace_s)

A tenth of the deadline is time a peer may lose from each window without noticing; past
``gather_grace_s`` the validator's grace no longer covers an upload made at this peer's idea of
the deadline. The clock check fails only when the offset is beyond the bound even at the
measurement's most favourable reading (``|offset| - uncertainty > bound``), and warns when the
offset is beyond it but within the uncertainty (``|offset| > bound``). (The uncertainty is at
least 1 s: a run whose bound is below that still passes a clock in step.) A store without HTTP (a directory, memory, a DHT) has no
``Date`` to read: the check is skipped and says so. The verdict names whose clock it measured:
the store's, or, when the store's endpoint did not answer, a grant server's.
"""

from __future__ import annotations

import dataclasses
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from email.message import Message
from email.utils import parsedate_to_datetime

from protocol.config import RunSpec, WindowConfig
from protocol.settings import StoreSettings

__all__ = ["ClockCheck", "Offset", "bound_s", "check_clock", "measure", "sources"]

TIMEOUT_S = 5.0
RESOLUTION_S = 1.0  # Date names whole seconds
DEADLINE_FRACTION = 0.1  # of upload_deadline_s
NTP_HINT = "enable NTP (timedatectl set-ntp true) and check again"


STORE = "store"
GRANT_SERVER = "grant server"


@dataclass(frozen=True)
class Offset:
    """This machine's clock minus ``source``'s (positive: ahead), ± ``uncertainty_s``; ``role``
    says whose clock ``source`` is: the store's (:data:`STORE`) or a grant server's
    (:data:`GRANT_SERVER`)."""

    source: str
    offset_s: float
    uncertainty_s: float
    role: str = STORE

    def worded(self) -> str:
        side = "ahead of" if self.offset_s >= 0 else "behind"
        return f"this machine's clock is {abs(self.offset_s):.0f} s {side} the {self.role}'s ({self.source})"


@dataclass(frozen=True)
class ClockCheck:
    """The verdict: ``status`` ok | warning | failed | skipped, a stable ``reason``, ``detail``
    for people, the measured ``offset`` (None when nothing was measured) and the ``bound``."""

    status: str
    reason: str
    detail: str
    offset: Offset | None
    bound_s: float

    def figures(self) -> dict[str, float | str]:
        if self.offset is None:
            return {}
        return {
            "offset_s": round(self.offset.offset_s, 2),
            "uncertainty_s": round(self.offset.uncertainty_s, 2),
            "bound_s": round(self.bound_s, 2),
            "source": self.offset.source,
        }


def bound_s(windows: WindowConfig) -> float:
    """How far this machine's clock may be off the run's: ``min(upload_deadline_s / 10, gather_grace_s)``."""
    return min(windows.upload_deadline_s * DEADLINE_FRACTION, windows.gather_grace_s)


def sources(store: StoreSettings) -> list[str]:
    """The HTTP servers this peer talks to, store first: its S3 endpoint (AWS's when none is
    given), then each grant server. Empty for a store without HTTP."""
    return [url for url, _ in _roles(store)]


def _roles(store: StoreSettings) -> list[tuple[str, str]]:
    """:func:`sources`, each with whose clock it is (:data:`STORE` or :data:`GRANT_SERVER`)."""
    out: list[tuple[str, str]] = []
    if store.url.lower().startswith("s3://"):
        region = store.s3_region
        aws = "https://s3.amazonaws.com" if region in ("", "auto") else f"https://s3.{region}.amazonaws.com"
        out.append((store.s3_endpoint or aws, STORE))
    out += [(url.strip(), GRANT_SERVER) for url in store.grant_url.split(",") if url.strip()]
    return out


def measure(url: str, *, timeout_s: float = TIMEOUT_S, now: Callable[[], float] = time.time) -> Offset | None:
    """One HEAD request to ``url``: the offset from its answer's ``Date``; None when the server
    does not answer or its answer carries no parseable ``Date``."""
    request = urllib.request.Request(url, method="HEAD")
    t0 = now()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            headers: Message = answer.headers
    except urllib.error.HTTPError as exc:  # any status: the Date is what counts
        headers = exc.headers
    except (OSError, ValueError):
        return None
    t1 = now()
    date = headers.get("Date") if headers is not None else None
    if not date:
        return None
    try:
        server = parsedate_to_datetime(date).timestamp()
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    return Offset(url, (t0 + t1) / 2 - (server + RESOLUTION_S / 2), (t1 - t0) / 2 + RESOLUTION_S)


def check_clock(
    spec: RunSpec, store: StoreSettings, *, measure: Callable[[str], Offset | None] = measure
) -> ClockCheck:
    """The clock check of ``preflight`` and ``join``: the first server of :func:`sources` that
    answers with a ``Date``, against :func:`bound_s`."""
    bound = bound_s(spec.windows)
    roles = _roles(store)
    urls = [url for url, _ in roles]
    if not urls:
        return ClockCheck(
            "skipped", "no_http", f"{store.url} is not an HTTP store: no Date header to read", None, bound
        )
    offset = _first(_as(role, measure(url)) for url, role in roles)
    if offset is None:
        return ClockCheck("skipped", "no_date", f"no answer with a Date header from {', '.join(urls)}", None, bound)
    off, unc = abs(offset.offset_s), offset.uncertainty_s
    within = f"{offset.worded()}, ± {unc:.1f} s; the run allows {bound:.1f} s"
    if off - unc > bound:
        return ClockCheck("failed", "clock_offset", f"{offset.worded()}; {NTP_HINT}", offset, bound)
    if off > bound:
        return ClockCheck("warning", "clock_marginal", f"{within}: {NTP_HINT}", offset, bound)
    return ClockCheck("ok", "ok", within, offset, bound)


def _first(offsets: Iterable[Offset | None]) -> Offset | None:
    return next((o for o in offsets if o is not None), None)


def _as(role: str, offset: Offset | None) -> Offset | None:
    """``offset``, said to be ``role``'s clock (the server it was read from)."""
    return None if offset is None else dataclasses.replace(offset, role=role)

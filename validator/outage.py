"""Store trouble during a window: counted by kind and summed up once, never a line per request.

While the store is out, every look the validator takes while it gathers a window fails: the
listing of the window's contributions and of the announcements (every poll), the re-reads of the
announcements of the peers it waits for (about once a second each), the reads of uploads. Logged
one by one, a 15 s outage was over a hundred warning lines, most quoting the request's URL with its
query string. Instead each failure is noted here (:meth:`StoreTrouble.failed`) with what was
asked (its *kind*) and its reason, each success too (:meth:`StoreTrouble.answered`), and the
window's gather ends with one :class:`~protocol.events.StoreErrors` event (:meth:`StoreTrouble.summary`):
how many requests failed by kind and by reason, the first and last failure, whether the store
answered again after the last one, and the last error (its URL without query string:
:func:`protocol.errors.strip_queries`). Each failed request is still logged at DEBUG (``--verbose``).

Nothing here decides what a failure costs: the gather retries a failed listing on its next poll
and a failed read on its next poll and, after the close, with backoff while reads may still finish
(:mod:`validator.gather`); the window's publication is retried by :mod:`validator.retry`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

from protocol.errors import StoreError, strip_queries
from protocol.events import StoreErrors

__all__ = [
    "LIST_ANNOUNCEMENTS",
    "LIST_CONTRIBUTIONS",
    "READ_ANNOUNCEMENT",
    "READ_CONTRIBUTION",
    "StoreTrouble",
]

log = logging.getLogger(__name__)

# What was asked of the store (the kinds of a summary).
LIST_CONTRIBUTIONS = "list_contributions"
LIST_ANNOUNCEMENTS = "list_announcements"
READ_ANNOUNCEMENT = "read_announcement"
READ_CONTRIBUTION = "read_contribution"


class StoreTrouble:
    """The failed store requests of one window so far (thread-safe: reads fail on the gather's
    threads). :meth:`summary` is the window's one report, :meth:`reset` starts the next window."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.kinds: Counter[str] = Counter()
            self.reasons: Counter[str] = Counter()
            self.first_at: float | None = None
            self.last_at: float | None = None
            self.answered_at: float | None = None
            self.detail = ""

    def failed(self, kind: str, exc: StoreError, what: str = "") -> None:
        """One request of ``kind`` (on ``what``: a key or prefix) failed with ``exc``."""
        now = self.clock()
        detail = strip_queries(f"{what}: {exc}" if what else str(exc))
        with self._lock:
            self.kinds[kind] += 1
            self.reasons[exc.reason] += 1
            self.first_at = now if self.first_at is None else self.first_at
            self.last_at, self.detail = now, detail
        log.debug("store request failed (%s): %s", kind, detail)

    def answered(self) -> None:
        """A request got its answer (after a failure: the store is back)."""
        if self.last_at is None:
            return
        now = self.clock()
        with self._lock:
            self.answered_at = now

    @property
    def count(self) -> int:
        return sum(self.kinds.values())

    @property
    def recovered(self) -> bool:
        """A request succeeded after the last failure."""
        return self.last_at is not None and self.answered_at is not None and self.answered_at >= self.last_at

    def summary(self, window: int) -> StoreErrors | None:
        """The window's one report of its failed requests (None: none failed)."""
        with self._lock:
            if self.first_at is None or self.last_at is None:
                return None
            return StoreErrors(
                window=window,
                failed=dict(sorted(self.kinds.items())),
                reasons=dict(sorted(self.reasons.items())),
                first_at=round(self.first_at, 3),
                last_at=round(self.last_at, 3),
                recovered=self.recovered,
                detail=self.detail[:500],
            )

"""How long the validator retries a window after a store error: a stated bound, then it says so.

A window that fails with a :class:`~protocol.errors.StoreError` (an outcomes or aggregate put
that did not get through, a store that cannot be reached) is retried, and every retry first looks
for the aggregate in the store (a put that got out before its error is adopted, not redone).
Retry ``i`` (1-based) of one window waits ``min(poll_interval_s · 2^(i−1), MAX_BACKOFF_S)``
first, and after ``validator.window_retries`` consecutive failures of the same window (default
:data:`DEFAULT_RETRIES`) the validator gives up on it: :class:`WindowFailed`, which the
``run`` command reports as a ``failed`` event (the window, the attempts, the seconds waited, the
last error) and exit status 1, so a supervisor restarts it and the restart redoes the window.
With the default poll of 1 s the bound is 1 + 2 + 4 + 8 + 16 + 32 + 60 · 3 = 243 s of waiting
over 10 attempts (:func:`bound_s`); every retry is a ``window_retry`` event with its attempt and wait.

What a window does not need never holds it: the reads of uploads and announcements turn store
errors into per-peer outcomes (:mod:`validator.gather`), a damaged dataset block leaves a peer
unscored and a loss unmeasured (:mod:`validator.decide`, :mod:`validator.trial`), the periodic
evaluation skips a window whose data or tokenizer cannot be read, late rows and retention wait
for the next window, and a checkpoint that cannot be published is skipped with a
``checkpoint_skipped`` event (:meth:`validator.commit.Committer.advance`; θ is kept in the state
directory, and joiners start from the checkpoint before it). So what is retried is only what the
chain cannot go on without: the window's outcomes and its signed aggregate.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.errors import StoreError

__all__ = ["DEFAULT_RETRIES", "MAX_BACKOFF_S", "Retries", "WindowFailed", "backoff", "bound_s"]

#: The longest wait between two attempts of one window.
MAX_BACKOFF_S = 60.0
#: Consecutive failures of one window before the validator gives up on it (``validator.window_retries``).
DEFAULT_RETRIES = 10


class WindowFailed(StoreError):
    """A window failed ``attempts`` times in a row with store errors (the last one's reason)."""

    def __init__(self, window: int, attempts: int, waited_s: float, last: StoreError) -> None:
        super().__init__(
            f"window {window} failed {attempts} times in a row over {waited_s:.1f} s of waiting; last: {last}"
        )
        self.reason = last.reason
        self.window, self.attempts, self.waited_s = window, attempts, waited_s


@dataclass
class Retries:
    """The consecutive failures of the window being worked on, and the wait before the next try."""

    limit: int
    base_s: float
    cap_s: float = MAX_BACKOFF_S
    window: int | None = None
    attempts: int = 0
    waited_s: float = 0.0

    def failed(self, window: int, exc: StoreError) -> float:
        """Record a failure of ``window``; the seconds to wait before the next attempt, or
        :class:`WindowFailed` once the window has failed ``limit`` times in a row."""
        if window != self.window:
            self.window, self.attempts, self.waited_s = window, 0, 0.0
        self.attempts += 1
        if self.attempts >= self.limit:
            raise WindowFailed(window, self.attempts, self.waited_s, exc) from exc
        wait = backoff(self.attempts, self.base_s, self.cap_s)
        self.waited_s += wait
        return wait


def backoff(attempt: int, base_s: float, cap_s: float = MAX_BACKOFF_S) -> float:
    """The wait before retry ``attempt`` (1-based): doubling from ``base_s``, at most ``cap_s``."""
    return float(min(base_s * 2.0 ** min(attempt - 1, 60), cap_s))


def bound_s(limit: int, base_s: float, cap_s: float = MAX_BACKOFF_S) -> float:
    """The most a window waits in total before :class:`WindowFailed` (the module doc's 243 s)."""
    return sum(backoff(i, base_s, cap_s) for i in range(1, limit))

"""The window clock: when a window opens, when uploads are due, when the validator closes it.

Pure functions of the RunSpec's :class:`~protocol.config.WindowConfig` and the validator's signed
``published_at`` time; no global clock, no I/O. Peers and the validator read the same rules:

    opened = aggregate_t_minus_1.published_at            # or the genesis checkpoint's time
    upload_deadline(opened, spec.windows)                # peers must have uploaded by then
    gather_close(opened, spec.windows)                   # validator stops listing (deadline + grace)
    should_close(now, opened, spec.windows, expected=announced, uploaded=seen)
    for delay in poll_delays(poll_s, spec.windows): …     # the waits of a reader polling for an object

Window ``t`` opens when the signed aggregate of window ``t − 1`` is published (``t = 0``: the
genesis checkpoint). Its uploads are due ``upload_deadline_s`` later. The validator keeps listing for
``gather_grace_s`` more (slow listings, clock skew) and closes early once every expected peer
(announced, not withdrawn, not excluded, and uploaded in one of the last ``validator.expect_windows``
windows or announced since the previous one opened: :mod:`validator.gather`) has uploaded, so a run does not wait for the deadline for peers that are not contributing.

**Polling.** Every look for an object that is not there yet is a request the bucket bills, times
every peer. A reader waiting for one (the next aggregate, genesis, the others' contributions)
looks after ``poll_s`` (the local ``poll_interval_s``), then twice as long after each miss, up to
:func:`max_poll_s`: a hundredth of the upload deadline, at most :data:`MAX_POLL_S` and at most
:data:`MAX_BACKOFF` times ``poll_s``. Found late by at most that, what it waited for costs a few
looks per window instead of one every ``poll_s``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator

from protocol.config import WindowConfig

__all__ = [
    "MAX_BACKOFF",
    "MAX_POLL_S",
    "gather_close",
    "max_poll_s",
    "poll_delays",
    "should_close",
    "upload_deadline",
    "is_checkpoint_window",
]


MAX_POLL_S = 5.0  # the longest wait between two looks for an object (module docstring)
POLLS_PER_DEADLINE = 100  # a poll backs off to at most upload_deadline_s / this
MAX_BACKOFF = 32  # … and to at most this many times poll_interval_s


def max_poll_s(poll_s: float, cfg: WindowConfig) -> float:
    """The longest wait between two looks for an object: a hundredth of the upload deadline, at
    most :data:`MAX_POLL_S` and :data:`MAX_BACKOFF` times ``poll_s``, never less than ``poll_s``."""
    return max(poll_s, min(MAX_POLL_S, MAX_BACKOFF * poll_s, cfg.upload_deadline_s / POLLS_PER_DEADLINE))


def poll_delays(poll_s: float, cfg: WindowConfig) -> Iterator[float]:
    """The waits between looks for an object not there yet: ``poll_s``, doubled after each miss,
    up to :func:`max_poll_s` (endless: the caller stops when it found it or gave up)."""
    cap, delay = max_poll_s(poll_s, cfg), poll_s
    while True:
        yield min(delay, cap)
        delay = min(delay * 2, cap)


def upload_deadline(opened_at: float, cfg: WindowConfig) -> float:
    """Unix time by which a contribution for the window opened at ``opened_at`` must be uploaded."""
    return opened_at + cfg.upload_deadline_s


def gather_close(opened_at: float, cfg: WindowConfig) -> float:
    """Unix time at which the validator stops gathering the window, at the latest."""
    return upload_deadline(opened_at, cfg) + cfg.gather_grace_s


def should_close(
    now: float,
    opened_at: float,
    cfg: WindowConfig,
    *,
    expected: Collection[str],
    uploaded: Collection[str],
) -> bool:
    """True when the validator may stop gathering: past the grace period, or every expected peer
    has uploaded. ``expected`` empty never closes early (nobody is known to be coming)."""
    if now >= gather_close(opened_at, cfg):
        return True
    return bool(expected) and set(expected) <= set(uploaded)


def is_checkpoint_window(window: int, cfg: WindowConfig, last: int = 0) -> bool:
    """True when the parameters that open ``window`` (θ after aggregate ``window − 1``) are
    published as a checkpoint: genesis (window 0), every ``checkpoint_every`` windows after it, and
    ``last`` (> 0), the window a validator stops at (its final θ, what the run trained, is kept)."""
    if window == 0 or window == last:
        return True
    return cfg.checkpoint_every > 0 and window % cfg.checkpoint_every == 0

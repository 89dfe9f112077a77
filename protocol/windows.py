"""The window clock: when a window opens, when uploads are due, when the validator closes it.

Pure functions of the RunSpec's :class:`~protocol.config.WindowConfig` and the validator's signed
``published_at`` time; no global clock, no I/O. Peers and the validator read the same rules:

    opened = aggregate_t_minus_1.published_at            # or the genesis checkpoint's time
    upload_deadline(opened, spec.windows)                # peers must have uploaded by then
    gather_close(opened, spec.windows)                   # validator stops listing (deadline + grace)
    should_close(now, opened, spec.windows, expected=announced, uploaded=seen)

Window ``t`` opens when the signed aggregate of window ``t − 1`` is published (``t = 0``: the
genesis checkpoint). Its uploads are due ``upload_deadline_s`` later. The validator keeps listing for
``gather_grace_s`` more (slow listings, clock skew) and closes early once every expected peer
(announced, not withdrawn, not excluded, and uploaded in the previous window or announced since it
opened) has uploaded, so a run does not wait for the deadline for peers that are not contributing.
"""

from __future__ import annotations

from collections.abc import Collection

from protocol.config import WindowConfig

__all__ = [
    "gather_close",
    "should_close",
    "upload_deadline",
    "is_checkpoint_window",
]


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

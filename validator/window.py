"""What the phases of one window share: the window itself and the clock of its phases.

:class:`Window` is fixed when the window opens (its number, the validator's secret for it and the
commitment to the next one, every peer's standing before it, who is past probation and who is
senior, :func:`validator.reputation.is_senior`); the intake
(:mod:`validator.intake`), the decision (:mod:`validator.decide`) and the commit
(:mod:`validator.commit`) read it and never change it. :class:`PhaseClock` times the phases for
``WindowPublished.seconds``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from protocol.config import ValidatorConfig
from protocol.identity import Identity
from validator import randomness
from validator.reputation import Standing, is_established, is_senior

__all__ = ["PhaseClock", "Window", "open_window"]


@dataclass(frozen=True)
class Window:
    """Window ``t``: its secret (revealed in its aggregate), the commitment to window t + 1's
    secret, the standings before it, who is past probation, and who of those is senior (may
    move the norm reference)."""

    t: int
    secret: bytes
    commitment: str
    standing: Mapping[str, Standing]
    established: frozenset[str]
    senior: frozenset[str] = frozenset()


def open_window(
    t: int, identity: Identity, run_hash: str, standing: Mapping[str, Standing], cfg: ValidatorConfig
) -> Window:
    """Window ``t`` as this validator sees it, from the standings before it."""
    return Window(
        t=t,
        secret=randomness.window_secret(identity, run_hash, t),
        commitment=randomness.commitment(randomness.window_secret(identity, run_hash, t + 1)),
        standing=standing,
        established=frozenset(p for p, s in standing.items() if is_established(s, cfg)),
        senior=frozenset(p for p, s in standing.items() if is_senior(s, cfg)),
    )


class PhaseClock:
    """Seconds spent in each phase of a window, lap by lap."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.monotonic()

    def lap(self, phase: str) -> None:
        now = time.monotonic()
        self.seconds[phase] = round(now - self._last, 3)
        self._last = now

"""Contribution-log rows as the validator's phases read them (:mod:`validator.log`).

The check a row failed first,
whether it shows that the peer itself uploaded (what the intake counts as activity in the previous
window), and every peer's standing folded from the log.
"""

from __future__ import annotations

from collections.abc import Sequence

from protocol.config import ValidatorConfig
from validator.gather import EXCLUDED, OVER_BUDGET
from validator.log import CheckRow, ContributionLog, ContributionRecord
from validator.reputation import LATE, UNATTRIBUTABLE_CHECKS, Standing, standings

__all__ = ["failed_check", "folded", "shows_activity"]


def failed_check(rows: Sequence[CheckRow]) -> str | None:
    """The name of the first check that failed (None: all passed)."""
    return next((c.name for c in rows if not c.passed), None)


def shows_activity(r: ContributionRecord) -> bool:
    """The row says the peer itself uploaded (not a store failure, nor bytes someone else signed)."""
    if r.accepted or r.reason == LATE:
        return True
    return r.reason not in (EXCLUDED, OVER_BUDGET) and failed_check(r.checks) not in UNATTRIBUTABLE_CHECKS


def folded(log: ContributionLog, cfg: ValidatorConfig, t: int) -> dict[str, Standing]:
    """Every peer's standing before window ``t``, folded from the whole log (older state
    directories, diagnostics; the validator otherwise folds one window at a time)."""
    return standings(map(ContributionRecord.outcome, log.rows(windows=(None, t - 1))), cfg, before=t)

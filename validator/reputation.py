"""Per-peer reputation and exclusion, derived from the contribution log by a pure fold.

Reputation is an exponential moving average of an indicator per window:
``+1`` when the peer's update was scored and lowered the loss on its own data more than on random
data (score > 0), ``−1`` when it was scored with score ≤ 0 or rejected by a check; unscored,
accepted windows leave it unchanged (no evidence either way)::

    rep ← decay · rep + (1 − decay) · indicator

``exclude_after_failures`` consecutive rejections exclude the peer for the next
``exclude_windows`` windows; its uploads in those windows are logged with reason ``excluded`` and
neither count as new failures nor extend the exclusion. Only a scored, accepted window clears the
count: an accepted window in which the peer was not scored is no evidence that it behaves, so an
identity that fails whenever it is scored is excluded at its ``exclude_after_failures``-th scored
failure however many unscored windows it slips through in between.

Only what the peer provably did counts against it. Neutral (no evidence either way): late uploads
(``late``), contributions beyond ``max_contributors`` (``over_capacity``) or the window's fetch
budget (``over_budget``), unscored uploads of identities on probation (``probation``), updates
too small to count (``norm_tiny``),
and every failure of the bytes at the peer's key that the peer's signature does not cover: store
errors and timeouts (check ``fetch``), oversized, empty or unparseable envelopes, bad signatures
and objects the peer did not sign for that run and window (``foreign``: forged, overwritten or
replayed by someone else; checks ``size`` through ``window``). On a shared store anyone can write
there.

**Probation.** A peer is *established* once ``probation_passes`` of its updates were scored and
accepted, i.e. lowered the loss on its own data without raising it on held-out data
(``Standing.passes``); until then only its scored, helpful updates count
(validator/window_checks.py, ``probation``), but for a *provisional* identity
(:func:`is_provisional`: a pass and no scored failure since), whose unscored updates count at a
share of the newcomer caps (``probation_partial``). Standing costs work: each pass is a window of
honest training that the validator happened to score, and unscored windows count for nothing.

**Seniority.** ``Standing.tenure`` counts the decided windows a peer uploaded in since it was
established; it is *senior* once that reaches ``reference_seniority``. Only senior peers move
the norm reference (:mod:`validator.limits`), so a group of keys that has just been established
cannot steer it.

The neutral reasons and checks are marked in the table of :mod:`validator.reasons`. An outcome
is a :class:`protocol.outcomes.PeerOutcome` with its ``window`` and ``check`` (a log row's
``ContributionRecord.outcome``).

Because :func:`standings` recomputes everything from the (window, peer) rows, re-deciding a window
after a crash cannot count a failure twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from protocol.config import ValidatorConfig
from protocol.outcomes import PeerOutcome
from validator.reasons import EXCLUDED, FOREIGN, LATE, NEUTRAL, UNATTRIBUTABLE_CHECKS

__all__ = [
    "EXCLUDED",
    "FOREIGN",
    "LATE",
    "NEUTRAL",
    "UNATTRIBUTABLE_CHECKS",
    "Standing",
    "is_established",
    "is_excluded",
    "is_provisional",
    "is_senior",
    "is_neutral",
    "standings",
    "update",
]


def is_neutral(outcome: PeerOutcome) -> bool:
    """Rejected for something that is no evidence against the peer: a neutral reason, or a failed
    check that is not attributable to it (:mod:`validator.reasons`)."""
    return not outcome.accepted and (outcome.reason in NEUTRAL or outcome.check in UNATTRIBUTABLE_CHECKS)


def _window(outcome: PeerOutcome) -> int:
    if outcome.window is None:
        raise ValueError(f"an outcome of peer {outcome.peer} without its window cannot be folded")
    return outcome.window


@dataclass(frozen=True)
class Standing:
    reputation: float = 0.0
    failures: int = 0  # consecutive rejected windows
    excluded_until: int = 0  # excluded for windows < excluded_until
    windows: int = 0
    passes: int = 0  # windows in which an update was scored and accepted
    tenure: int = 0  # decided windows since it was established


def is_excluded(standing: Standing, window: int) -> bool:
    return window < standing.excluded_until


def is_established(standing: Standing | None, cfg: ValidatorConfig) -> bool:
    """Past probation: enough of its updates were scored and helped."""
    return standing is not None and standing.passes >= cfg.probation_passes


def is_provisional(standing: Standing, cfg: ValidatorConfig) -> bool:
    """On probation with a record so far: at least one scored, accepted update and no scored
    failure since the last one. Its unscored updates count at ``probation_partial`` of the newcomer
    caps (:mod:`validator.decide`)."""
    return not is_established(standing, cfg) and standing.passes > 0 and standing.failures == 0


def is_senior(standing: Standing | None, cfg: ValidatorConfig) -> bool:
    """Established for at least ``reference_seniority`` decided windows: may move the reference."""
    return is_established(standing, cfg) and standing is not None and standing.tenure >= cfg.reference_seniority


def update(prev: Standing, outcome: PeerOutcome, cfg: ValidatorConfig) -> Standing:
    """The standing after one more window's outcome (its ``window`` and ``check`` given)."""
    if is_neutral(outcome):
        return prev
    failed = not outcome.accepted
    if failed:
        indicator: float | None = -1.0
    elif outcome.score is not None:
        indicator = 1.0 if outcome.score > 0 else -1.0
    else:
        indicator = None
    rep = prev.reputation
    if indicator is not None:
        rep = cfg.reputation_decay * rep + (1.0 - cfg.reputation_decay) * indicator
    scored = outcome.accepted and outcome.score is not None
    # only a scored, accepted window clears the count: unscored windows are no evidence either way
    failures = prev.failures + 1 if failed else (0 if scored else prev.failures)
    excluded_until = prev.excluded_until
    if cfg.exclude_after_failures > 0 and failures >= cfg.exclude_after_failures:
        excluded_until = _window(outcome) + 1 + cfg.exclude_windows
        failures = 0
    passed = scored  # scored and it helped (not harmful)
    return replace(
        prev,
        reputation=rep,
        failures=failures,
        excluded_until=excluded_until,
        windows=prev.windows + 1,
        passes=prev.passes + int(passed),
        tenure=prev.tenure + int(is_established(prev, cfg)),
    )


def standings(
    history: Iterable[PeerOutcome],
    cfg: ValidatorConfig,
    *,
    before: int | None = None,
    start: Mapping[str, Standing] | None = None,
) -> dict[str, Standing]:
    """Fold outcomes (any order; sorted by window here) into each peer's standing, using only
    windows ``< before`` when given, starting from ``start`` (the standings before the first of
    these windows; the validator folds one window at a time). Neutral outcomes of peers without
    a standing add none: junk does not grow the table."""
    out: dict[str, Standing] = dict(start or {})
    for o in sorted(history, key=lambda o: (_window(o), o.peer)):
        if before is not None and _window(o) >= before:
            continue
        if is_neutral(o) and o.peer not in out:
            continue
        out[o.peer] = update(out.get(o.peer, Standing()), o, cfg)
    return out

"""The checks that need more than one contribution: immutability, norm against the validator's
reference, copies, loss-score harm and effect, probation, capacity, a finite result.

Each takes the window's :class:`~validator.checks.Screened` list and returns it with one more check
row on every contribution still standing (rejected ones pass through untouched). Pure functions.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any

from validator import checks
from validator.copies import CopyRule, assess, settle
from validator.log import CheckRow
from validator.reasons import MUTATED, NON_FINITE_RESULT, OVER_CAPACITY, PROBATION
from validator.reference import NormReference, check_norms
from validator.scoring import LossScore
from validator.significance import verdict
from validator.sketch import global_entries, offsets

__all__ = [
    "MUTATED",
    "NON_FINITE_RESULT",
    "OVER_CAPACITY",
    "PROBATION",
    "capacity",
    "copies",
    "global_entries",
    "immutable",
    "norms",
    "offsets",
    "probation",
    "scores",
    "shared",
    "stable",
]

Screened = checks.Screened


def immutable(screened: Sequence[Screened], first_digest: Mapping[str, str | None]) -> list[Screened]:
    """Reject a contribution whose bytes differ from the ones first fetched at its key (kept by
    the log across restarts). Only objects the peer signed get here, so the change is its own."""
    out = []
    for s in screened:
        if s.reason is None and s.held is not None:
            first = first_digest.get(s.peer)
            if first is not None and first != s.held.digest:
                detail = f"digest {s.held.digest[:16]}, first fetched {first[:16]}"
                s = with_row(s, checks.fail("immutable", MUTATED), detail)
            else:
                s = with_row(s, checks.ok("immutable"))
        out.append(s)
    return out


def norms(
    screened: Sequence[Screened],
    reference: NormReference,
    *,
    max_ratio: float,
    min_ratio: float,
) -> list[Screened]:
    """Reject a tensor norm above ``max_ratio`` × the reference (``norm_outlier``) or an update
    below ``min_ratio`` × it (``norm_tiny``); see :mod:`validator.reference`."""
    out = []
    for s in screened:
        if s.reason is None and s.held is not None:
            row, detail = check_norms(s.held.norms.tensors, reference, max_ratio=max_ratio, min_ratio=min_ratio)
            s = with_row(s, row, detail)
        out.append(s)
    return out


def copies(
    screened: Sequence[Screened],
    read_at: Mapping[str, float],
    rule: CopyRule,
    listed_at: Mapping[str, float] | None = None,
) -> list[Screened]:
    """Reject the later of two near-identical contributions as ``copied`` (see
    :mod:`validator.copies`: ``read_at``, ``listed_at``), compared on their sampled entries
    (:mod:`validator.sketch`), and give a contribution similar to an earlier one a ``weight``
    below 1 (:func:`validator.copies.influence`). A pair whose order is unknown is a tie: neither
    is rejected (the original must never lose one) and a similar pair shares one unit of
    influence; the row says so."""
    entries = {s.peer: s.held.sketch for s in screened if s.reason is None and s.held is not None}
    found = assess(entries, read_at, rule, listed_at)
    verdicts, best = found.verdicts, found.best
    out = []
    for s in screened:
        if s.reason is None:
            v = verdicts.get(s.peer)
            ties = tuple(sorted(found.ties.get(s.peer, {}).items()))
            s = replace(s, overlap=best.get(s.peer), weight=found.weights.get(s.peer, 1.0), ties=ties)
            if v is None:
                s = with_row(s, checks.ok("copy"))
                if s.weight < 1.0:
                    s = replace(s, detail=f"similar to an earlier upload: weight {s.weight:.3f}")
                elif ties:
                    s = replace(s, detail=f"similar to {ties[0][0][:12]}, read in the same poll: they share one unit")
            elif v.tie:
                note = f"near-identical to {v.original[:12]}, read in the same poll: order unknown, neither is a copy"
                s = replace(with_row(s, checks.ok("copy")), detail=note)
            else:
                sim = v.similarity
                detail = f"overlap {sim.overlap:.2f}, rare {sim.rare:.2f}, signs {sim.signs:.2f} with {v.original[:12]}"
                s = with_row(s, checks.fail("copy", "copied"), detail)
        out.append(s)
    return out


def shared(screened: Sequence[Screened]) -> list[Screened]:
    """Settle the weights of the contributions still standing (:func:`validator.copies.settle`):
    a similar pair of unknown order shares one unit only while both stand."""
    live = {s.peer for s in screened if s.reason is None}
    final = settle({s.peer: s.weight for s in screened}, {s.peer: dict(s.ties) for s in screened}, live)
    return [replace(s, weight=final[s.peer]) if s.peer in final else s for s in screened]


def scores(
    screened: Sequence[Screened],
    loss_scores: Mapping[str, LossScore],
    tolerance: float,
    min_gain: float | None = None,
    z: float = 0.0,
    target_tolerance: float | None = None,
) -> list[Screened]:
    """Reject scored contributions whose update does not lower the loss on the peer's own data
    (``harmful``), raises it on held-out data (``harmful_general``), promotes the tokens whose rows it
    moves most (``targeted``, with ``target_tolerance``), or lowers it by less than
    ``min_gain`` (``ineffective``: the validator passes a share of what established peers'
    updates achieve in this window; noise at a plausible norm lowers it a little, by chance) —
    each only by more than ``z`` standard errors of its measurement (:mod:`validator.significance`;
    the detail gives the margin in standard errors)."""
    out = []
    for s in screened:
        sc = loss_scores.get(s.peer)
        if s.reason is None and sc is not None:
            v = verdict(sc, tolerance=tolerance, min_gain=min_gain, z=z, target_tolerance=target_tolerance)
            row = checks.ok("score") if v.reason is None else checks.fail("score", v.reason)
            s = with_row(s, row, v.detail)
        out.append(s)
    return out


def probation(
    screened: Sequence[Screened], established: Collection[str], loss_scores: Mapping[str, LossScore]
) -> list[Screened]:
    """An identity on probation counts only when its update was scored (and passed)."""
    out = []
    for s in screened:
        if s.reason is None:
            if s.peer in established or s.peer in loss_scores:
                s = with_row(s, checks.ok("probation"))
            else:
                s = with_row(s, checks.fail("probation", PROBATION), "new identity, not scored in this window")
        out.append(s)
    return out


def capacity(screened: Sequence[Screened], rank: Callable[[str], Any], max_contributors: int) -> list[Screened]:
    """Keep at most ``max_contributors`` of the contributions still standing, smallest ``rank``
    first; the others are rejected as ``over_capacity`` (not held against them)."""
    live = sorted((s.peer for s in screened if s.reason is None), key=rank)
    keep = set(live[: max(0, max_contributors)])
    out = []
    for s in screened:
        if s.reason is None:
            row = checks.ok("capacity") if s.peer in keep else checks.fail("capacity", OVER_CAPACITY)
            s = with_row(s, row, f"more than {max_contributors} contributions passed the checks")
        out.append(s)
    return out


def stable(screened: Sequence[Screened], dropped: Collection[str]) -> list[Screened]:
    """Reject the contributions without which θ and the validation loss stay finite."""
    out = []
    for s in screened:
        if s.reason is None:
            if s.peer in dropped:
                detail = "the aggregate with this update makes θ or the validation loss non-finite"
                s = with_row(s, checks.fail("stable", NON_FINITE_RESULT), detail)
            else:
                s = with_row(s, checks.ok("stable"))
        out.append(s)
    return out


def with_row(s: Screened, row: CheckRow, detail: str | None = None) -> Screened:
    if row.passed:
        return replace(s, checks=(*s.checks, row))
    return replace(s, checks=(*s.checks, row), reason=row.reason, detail=detail)

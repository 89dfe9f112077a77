"""The checks that need the whole window: norm against the median, copies, loss-score harm, capacity.

Each takes the window's :class:`~validator.checks.Screened` list and returns it with one more check
row on every contribution still standing (rejected ones pass through untouched). Pure functions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

from protocol.aggregate import SparseDict
from validator import checks
from validator.copies import global_indices, scan
from validator.log import CheckRow
from validator.scoring import LossScore

__all__ = ["OVER_CAPACITY", "capacity", "copies", "norms", "offsets", "scores", "total_norm"]

OVER_CAPACITY = "over_capacity"

Screened = checks.Screened


def norms(screened: Sequence[Screened], max_ratio: float) -> list[Screened]:
    """Reject any contribution with a tensor norm above ``max_ratio`` × that tensor's window median."""
    by_peer = {s.peer: checks.tensor_norms(s.sparse) for s in screened if s.reason is None}
    medians = checks.window_medians(list(by_peer.values()))
    out = []
    for s in screened:
        if s.reason is None:
            n = by_peer[s.peer]
            row = checks.check_norm(n, medians, max_ratio)
            worst = max(n, key=lambda name: n[name] / max(medians[name], 1e-30))
            s = with_row(s, row, f"{worst}: norm {n[worst]:.3g}, window median {medians[worst]:.3g}")
        out.append(s)
    return out


def copies(
    screened: Sequence[Screened],
    first_seen: Mapping[str, float],
    schema: Mapping[str, tuple[int, ...]],
    threshold: float,
) -> list[Screened]:
    """Reject the later of two contributions whose Top-k index sets overlap ≥ ``threshold``."""
    offs = offsets(schema)
    indices = {
        s.peer: global_indices({n: i.numpy() for n, (i, _) in s.sparse.items()}, offs)
        for s in screened
        if s.reason is None
    }
    verdicts, best = scan(indices, first_seen, threshold)
    out = []
    for s in screened:
        if s.reason is None:
            v = verdicts.get(s.peer)
            s = replace(s, overlap=best.get(s.peer))
            if v is None:
                s = with_row(s, checks.ok("copy"))
            else:
                how = " (same listing: order unknown)" if v.ambiguous else ""
                s = with_row(s, checks.fail("copy", "copied"), f"overlap {v.overlap:.2f} with {v.original[:12]}{how}")
        out.append(s)
    return out


def scores(screened: Sequence[Screened], loss_scores: Mapping[str, LossScore]) -> list[Screened]:
    """Reject scored contributions whose update does not lower the loss on the peer's own data."""
    out = []
    for s in screened:
        sc = loss_scores.get(s.peer)
        if s.reason is None and sc is not None:
            if sc.harmful:
                detail = f"own loss {sc.loss_own_before:.4f} -> {sc.loss_own_after:.4f}"
                s = with_row(s, checks.fail("score", "harmful"), detail)
            else:
                s = with_row(s, checks.ok("score"))
        out.append(s)
    return out


def capacity(screened: Sequence[Screened], rank: Mapping[str, float], max_contributors: int) -> list[Screened]:
    """Keep at most ``max_contributors`` of the contributions still standing, highest ``rank``
    first (ties by peer id); the others are rejected as ``over_capacity`` (not held against them)."""
    live = sorted((s.peer for s in screened if s.reason is None), key=lambda p: (-rank.get(p, 0.0), p))
    keep = set(live[: max(0, max_contributors)])
    out = []
    for s in screened:
        if s.reason is None:
            row = checks.ok("capacity") if s.peer in keep else checks.fail("capacity", OVER_CAPACITY)
            s = with_row(s, row, f"more than {max_contributors} contributions passed the checks")
        out.append(s)
    return out


def with_row(s: Screened, row: CheckRow, detail: str | None = None) -> Screened:
    if row.passed:
        return replace(s, checks=(*s.checks, row))
    return replace(s, checks=(*s.checks, row), reason=row.reason, detail=detail)


def offsets(schema: Mapping[str, tuple[int, ...]]) -> dict[str, int]:
    """Start of every tensor in one global index space (names sorted)."""
    out, pos = {}, 0
    for name in sorted(schema):
        out[name] = pos
        pos += math.prod(schema[name])
    return out


def total_norm(sparse: SparseDict) -> float:
    return math.sqrt(sum(float((v.double() ** 2).sum()) for _, v in sparse.values()))

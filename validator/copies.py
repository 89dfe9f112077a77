"""Duplicate and near-copy detection in one pass over the window; the later upload is the copier.

Honest peers train on different data, so the positions they keep overlap only partly, and mostly
on *popular* positions many peers select (large gradients everybody sees). A peer that republishes
someone else's contribution (re-signed, perhaps trimmed to its largest values and perturbed)
also shares the original's *rare* positions, the ones few other peers selected. For two
contributions A and B with global index sets I_A, I_B (every tensor's flat indices offset into
one space)::

    overlap(A, B) = |I_A ∩ I_B| / min(|I_A|, |I_B|)
    rare(A, B)    = |rare shared| / min(|rare_A|, |rare_B|)     rare: selected by ≤ m contributions
    signs(A, B)   = share of I_A ∩ I_B where A and B agree in sign

B copies A when ``overlap ≥ copy_overlap_threshold``, or when the window has at least
:data:`MIN_BACKGROUND` contributions (so that popular positions can be told apart) and
``rare × f(signs) ≥ copy_rare_threshold``, where f is 1 when signs agree at least
``copy_sign_agreement`` and falls linearly to 0 at chance agreement (½). Measured on the test
model over batch sizes, inner steps and a small repetitive corpus: honest pairs have rare
similarity mostly 0.1–0.2 and at most 0.28, index overlap mostly 0.15–0.3 and at most 0.56; a copy
of the top 30 % of an upload plus noise 0.3, of the top 55 % 0.4–0.55 — values count too: a copy
keeps the signs.

**Influence falls smoothly.** A hard threshold invites sitting just under it, so a later upload
similar to an earlier one keeps only a share of its weight in the aggregate (:func:`influence`):
1 up to ``copy_overlap_lower`` / ``copy_rare_lower`` (above what honest peers share, measured by
``scripts/bench_copy_similarity.py``), falling linearly to 0 at the copy thresholds, where it is
``copied``. The share is the contribution's weight in the weighted mean of Δ̄, in its log row and
in the aggregate's manifest (:mod:`validator.trial`). Its clip caps are not scaled as well: the
weighted mean already scales its share of Δ̄ (and of every coordinate's divisor, so that a
down-weighted copy does not dilute the others either); scaling both would count the weight twice.
Peers apply the published Δ̄, so they never need to re-derive it from the weights.

**Cost.** All index sets are sorted together once; positions selected by at most ``m`` peers
yield their pairs (at most m − 1 per entry), so counting shared rare positions is linear in the
number of kept values. Only each peer's few best candidates are then compared exactly (one sorted
intersection each). At 1B parameters × 256 peers all pairs would take hours; this takes one sort.

**Order.** A contribution's time is when the validator read its exact bytes (``read_at``,
:mod:`validator.gather`); its key may have been listed earlier (``listed_at``) and the bytes behind
a key can change until they are read. X provably came before Y only when X's bytes were read
before Y's key was even listed: ``read_at[X] < listed_at[Y]``. Peers are taken in reading order;
a peer matching an earlier, not-itself-copied peer that provably came first is the copier. When
neither provably came first (listed in the same poll, say) the pair is a *tie*: neither is a
copier and neither is held to blame; a tied pair that is similar shares one unit of influence,
each keeping (1 + share) / 2 — ½ each for an exact same-poll copy, so that the pair counts as the
original alone would — while both are accepted (:func:`settle`). A copier cannot appear first by
uploading placeholder bytes early and swapping them: the bytes it is judged by are the ones read.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from protocol.config import ValidatorConfig

__all__ = [
    "MIN_BACKGROUND",
    "CopyRule",
    "CopyScan",
    "CopyVerdict",
    "Similarity",
    "assess",
    "influence",
    "rare_evidence",
    "scan",
    "settle",
    "similarity",
]

I64 = npt.NDArray[np.int64]
F32 = npt.NDArray[np.float32]
MIN_BACKGROUND = 4  # contributions in the window before rare positions mean anything
CANDIDATES = 3  # partners per peer compared exactly


@dataclass(frozen=True)
class CopyRule:
    """Thresholds (``validator.copy_*`` of the RunSpec): a copy at ``overlap`` / ``rare`` (with
    ``signs``), full weight up to ``overlap_lower`` / ``rare_lower`` (a lower bound at or above
    its threshold: no partial weight, the hard threshold alone)."""

    overlap: float = 0.6
    rare: float = 0.3
    signs: float = 0.8
    overlap_lower: float = 0.57
    rare_lower: float = 0.28

    @classmethod
    def of(cls, cfg: ValidatorConfig) -> CopyRule:
        """The run's rule, from its ``validator.copy_*`` settings."""
        return cls(
            cfg.copy_overlap_threshold,
            cfg.copy_rare_threshold,
            cfg.copy_sign_agreement,
            cfg.copy_overlap_lower,
            cfg.copy_rare_lower,
        )


@dataclass(frozen=True)
class Similarity:
    overlap: float
    rare: float
    signs: float


@dataclass(frozen=True)
class CopyScan:
    """What one pass found: ``verdicts`` (copiers and ties), each peer's largest index overlap
    with a candidate (``best``), each peer's share of influence after the earlier uploads it
    resembles (``weights``, 1.0 when absent; see :func:`influence`) and, per peer, the similar
    uploads of unknown order with the weight the pair leaves each (``ties``; :func:`settle`)."""

    verdicts: dict[str, CopyVerdict]
    best: dict[str, float]
    weights: dict[str, float]
    ties: dict[str, dict[str, float]]


@dataclass(frozen=True)
class CopyVerdict:
    """``peer`` matches the earlier ``original``; ``tie``: neither provably came first."""

    peer: str
    original: str
    similarity: Similarity
    tie: bool = False


def similarity(a: tuple[I64, F32], b: tuple[I64, F32], rare_shared: int, rare_a: int, rare_b: int) -> Similarity:
    """Exact overlap and sign agreement of two (sorted indices, values) sets; ``rare_shared`` and
    the rare counts come from the window's count structure."""
    (ia, va), (ib, vb) = a, b
    if len(ia) == 0 or len(ib) == 0:
        return Similarity(0.0, 0.0, 0.0)
    common, xa, xb = np.intersect1d(ia, ib, assume_unique=True, return_indices=True)
    signs = float(np.mean(np.sign(va[xa]) == np.sign(vb[xb]))) if len(common) else 0.0
    rare = rare_shared / max(1, min(rare_a, rare_b))
    return Similarity(len(common) / min(len(ia), len(ib)), rare, signs)


def scan(
    entries: Mapping[str, tuple[I64, F32]],
    read_at: Mapping[str, float],
    rule: CopyRule,
    listed_at: Mapping[str, float] | None = None,
) -> tuple[dict[str, CopyVerdict], dict[str, float]]:
    """(verdicts, largest index overlap of each peer with a candidate) of :func:`assess`."""
    found = assess(entries, read_at, rule, listed_at)
    return found.verdicts, found.best


def assess(
    entries: Mapping[str, tuple[I64, F32]],
    read_at: Mapping[str, float],
    rule: CopyRule,
    listed_at: Mapping[str, float] | None = None,
) -> CopyScan:
    """Copiers, ties and every peer's share of influence in one pass. ``entries``: per peer its
    sorted unique global indices and their values; ``read_at`` / ``listed_at``: when its bytes were
    read and its key first listed (default: ``read_at``).

    A verdict with ``tie=False`` names a copier; tied pairs get a verdict each (``tie=True``)."""
    listed = read_at if listed_at is None else listed_at
    peers = sorted(entries, key=lambda p: (read_at.get(p, math.inf), p))
    if len(peers) < 2:
        return CopyScan({}, {p: 0.0 for p in peers}, {}, {})
    shared, rare_of = _rare_pairs(peers, entries)
    sims = _candidates(peers, entries, shared, rare_of)
    best = {p: 0.0 for p in peers}
    for (a, b), s in sims.items():
        best[a], best[b] = max(best[a], s.overlap), max(best[b], s.overlap)
    background = len(peers) >= MIN_BACKGROUND
    verdicts: dict[str, CopyVerdict] = {}
    for i, peer in enumerate(peers):
        matches = [
            (orig, sims[_pair(peer, orig)])
            for orig in peers[:i]
            if _pair(peer, orig) in sims
            and not (orig in verdicts and not verdicts[orig].tie)  # a copier is no original
            and influence(sims[_pair(peer, orig)], rule, background) == 0.0
        ]
        if not matches:
            continue
        orig, sim = max(matches, key=lambda m: (m[1].overlap, m[1].rare))
        tie = not read_at.get(orig, math.inf) < listed.get(peer, -math.inf)
        verdicts[peer] = CopyVerdict(peer, orig, sim, tie=tie)
        if tie:
            verdicts[orig] = CopyVerdict(orig, peer, sim, tie=True)
    copiers = {p for p, v in verdicts.items() if not v.tie}
    weights, ties = _weights(sims, read_at, listed, rule, background, copiers)
    return CopyScan(verdicts, best, weights, ties)


def settle(
    weights: Mapping[str, float], ties: Mapping[str, Mapping[str, float]], accepted: Collection[str]
) -> dict[str, float]:
    """The final weight of each ``accepted`` peer: its own (``weights``), and the share of a
    same-poll pair only while the partner is accepted too — a tie with an upload that was then
    rejected (a copier on probation, say) leaves the other its whole weight, so that re-uploading
    someone's update in the same poll never takes influence from it."""
    return {p: min([weights.get(p, 1.0), *(w for q, w in ties.get(p, {}).items() if q in accepted)]) for p in accepted}


def influence(s: Similarity, rule: CopyRule, background: bool = True) -> float:
    """The share of its influence a later upload keeps given its similarity ``s`` to an earlier
    one: 1 up to the lower bounds, falling linearly to 0 at the copy thresholds, where it is a
    copy. Two routes, the smaller share applying: index overlap (``overlap_lower`` → ``overlap``)
    and, with a background of at least :data:`MIN_BACKGROUND` uploads, rare positions shared with
    agreeing signs (``rare_lower`` → ``rare``) — the rare share counted in full when signs agree
    at least ``rule.signs``, and less in proportion as agreement falls to chance (½), not at all
    below it."""
    share = _ramp(s.overlap, rule.overlap_lower, rule.overlap)
    if background:
        share = min(share, _ramp(rare_evidence(s, rule), rule.rare_lower, rule.rare))
    return share


def rare_evidence(s: Similarity, rule: CopyRule) -> float:
    """The rare share as the rare route weighs it: in full when signs agree at least
    ``rule.signs``, less in proportion as agreement falls to chance (½), not at all below it."""
    return s.rare * _sign_factor(s.signs, rule.signs)


def _ramp(x: float, lower: float, threshold: float) -> float:
    if x >= threshold:
        return 0.0
    if x <= lower or lower >= threshold:
        return 1.0
    return (threshold - x) / (threshold - lower)


def _sign_factor(signs: float, full: float) -> float:
    if full <= 0.5:
        return 1.0 if signs >= full else 0.0
    return min(1.0, max(0.0, (signs - 0.5) / (full - 0.5)))


def _weights(
    sims: Mapping[tuple[str, str], Similarity],
    read_at: Mapping[str, float],
    listed: Mapping[str, float],
    rule: CopyRule,
    background: bool,
    copiers: set[str],
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """(each peer's share of influence, peers at 1.0 left out; the ties). The share is the
    smallest over its compared pairs with a peer not itself a copier; of an ordered pair only the
    later upload loses (its :func:`influence`). A pair whose order is unknown shares one unit
    between them in proportion, each keeping (1 + influence) / 2 — ½ each for a same-poll copy, so
    that the two count as one update (a weighted mean of two equal updates at ½ each is that
    update) — recorded as a tie, applied by :func:`settle` only if both are accepted. Copiers get
    none."""
    out: dict[str, float] = {p: 0.0 for p in copiers}
    ties: dict[str, dict[str, float]] = {}
    for (a, b), s in sorted(sims.items()):
        if a in copiers or b in copiers:
            continue
        share = influence(s, rule, background)
        if share >= 1.0:
            continue
        a_first = read_at.get(a, math.inf) < listed.get(b, -math.inf)
        b_first = read_at.get(b, math.inf) < listed.get(a, -math.inf)
        if a_first:
            out[b] = min(out.get(b, 1.0), share)
        elif b_first:
            out[a] = min(out.get(a, 1.0), share)
        else:
            ties.setdefault(a, {})[b] = ties.setdefault(b, {})[a] = 0.5 * (1.0 + share)
    return out, ties


def _pair(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a < b else (b, a)


def _rare_pairs(peers: list[str], entries: Mapping[str, tuple[I64, F32]]) -> tuple[dict[tuple[int, int], int], I64]:
    """(shared rare positions per pair of peer numbers, rare positions per peer) in one sort."""
    n = len(peers)
    m = min(8, max(2, n // 2))  # "rare": selected by at most m contributions
    idx = np.concatenate([entries[p][0] for p in peers])
    owner = np.concatenate([np.full(len(entries[p][0]), k, dtype=np.int64) for k, p in enumerate(peers)])
    order = np.argsort(idx, kind="stable")
    idx, owner = idx[order], owner[order]
    if len(idx) == 0:
        return {}, np.zeros(n, dtype=np.int64)
    starts = np.flatnonzero(np.concatenate(([True], idx[1:] != idx[:-1])))
    counts = np.diff(np.concatenate((starts, [len(idx)])))
    per_entry = np.repeat(counts, counts)
    rare = per_entry <= m
    rare_of = np.bincount(owner[rare], minlength=n).astype(np.int64)
    keys = []
    for d in range(1, m):
        a = np.arange(len(idx) - d)
        same = (idx[a] == idx[a + d]) & rare[a]
        lo, hi = owner[a[same]], owner[a[same] + d]
        keys.append(np.minimum(lo, hi) * n + np.maximum(lo, hi))
    if not keys:
        return {}, rare_of
    uniq, cnt = np.unique(np.concatenate(keys), return_counts=True)
    return {(int(k // n), int(k % n)): int(c) for k, c in zip(uniq, cnt)}, rare_of


def _candidates(
    peers: list[str],
    entries: Mapping[str, tuple[I64, F32]],
    shared: Mapping[tuple[int, int], int],
    rare_of: I64,
) -> dict[tuple[str, str], Similarity]:
    """Exact similarity of each peer with its few partners sharing the most rare positions."""
    partners: dict[int, list[tuple[int, int]]] = {}
    for (a, b), c in shared.items():
        partners.setdefault(a, []).append((c, b))
        partners.setdefault(b, []).append((c, a))
    out: dict[tuple[str, str], Similarity] = {}
    for a, lst in partners.items():
        for c, b in sorted(lst, reverse=True)[:CANDIDATES]:
            key = _pair(peers[a], peers[b])
            if key not in out:
                out[key] = similarity(entries[peers[a]], entries[peers[b]], c, int(rare_of[a]), int(rare_of[b]))
    return out

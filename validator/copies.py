"""Duplicate and near-copy detection by Top-k index overlap; the later upload is the copier.

Honest peers train on different data, so the sets of positions they keep overlap only partly. A peer
that republishes someone else's contribution (possibly re-signed, lightly perturbed) keeps nearly
the same positions. For two contributions A and B with global index sets I_A, I_B (every tensor's
flat indices offset into one space)::

    overlap(A, B) = |I_A ∩ I_B| / min(|I_A|, |I_B|)

Peers are taken in upload order (the first-seen time the validator recorded); a peer whose overlap
with an earlier, not-itself-copied peer reaches the threshold is the copier. When two such peers
were first seen at the same time the order is unknown and both are flagged (``ambiguous``): a copier
must never be able to win a coin toss against the peer it copied.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

__all__ = ["CopyVerdict", "global_indices", "overlap", "scan"]


@dataclass(frozen=True)
class CopyVerdict:
    peer: str
    original: str
    overlap: float
    ambiguous: bool = False


def global_indices(sparse: Mapping[str, np.ndarray], offsets: Mapping[str, int]) -> np.ndarray:
    """One sorted int64 array of ``offsets[name] + flat index`` over every tensor present."""
    parts = [np.asarray(idx, dtype=np.int64) + offsets[name] for name, idx in sparse.items() if name in offsets]
    if not parts:
        return np.zeros(0, dtype=np.int64)
    return np.sort(np.concatenate(parts))


def overlap(a: np.ndarray, b: np.ndarray) -> float:
    """Share of the smaller index set also present in the other (0 when either is empty)."""
    if len(a) == 0 or len(b) == 0:
        return 0.0
    common = np.intersect1d(a, b, assume_unique=True).size
    return common / min(len(a), len(b))


def scan(
    indices: Mapping[str, np.ndarray], first_seen: Mapping[str, float], threshold: float
) -> tuple[dict[str, CopyVerdict], dict[str, float]]:
    """(copy verdicts, largest overlap of each peer with an earlier original) in one pass."""
    order = sorted(indices, key=lambda p: (first_seen.get(p, float("inf")), p))
    verdicts: dict[str, CopyVerdict] = {}
    best: dict[str, float] = {}
    originals: list[str] = []
    for peer in order:
        best[peer] = 0.0
        for orig in originals:
            ov = overlap(indices[peer], indices[orig])
            best[peer] = max(best[peer], ov)
            if ov < threshold:
                continue
            tie = first_seen.get(peer, float("inf")) == first_seen.get(orig, float("inf"))
            verdicts[peer] = CopyVerdict(peer, orig, ov, ambiguous=tie)
            if tie and orig not in verdicts:
                verdicts[orig] = CopyVerdict(orig, peer, ov, ambiguous=True)
            break
        else:
            originals.append(peer)
    return verdicts, best

"""Agreement of an upload with what established peers sent in the same window: who to score first.

Scoring is the only way a new identity's update comes to count and the only check of an
established peer's update, and its slots are few. Honest updates trained from the same θ_t on
the same distribution agree in sign on the positions they share with the window's established
peers; noise agrees half the time, a sign-flipped (gradient ascent) update almost never, and an
edit nobody else makes (one token's row, say) shares next to nothing. Per tensor T::

    agreement_T(p) = (1 + matching signs) / (2 + shared positions)

over p's positions in T that established peers (other than p) also selected, compared with the
sign of their summed values; ``agreement(p)`` is the smallest over the tensors in which p kept at
least :data:`MIN_POSITIONS` values (1/2 when nothing is shared). This only orders who is scored
(:func:`validator.scoring.plan_sample`): identities on probation that agree most go first, and
half of the established slots go to the peers that agree least. An update that agrees and does
not help still fails its score; one that disagrees is scored, not rejected. One sort of the
established uploads, one lookup per upload: linear in the number of kept values.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import numpy as np

from validator.copies import F32, I64

__all__ = ["agreement"]

NEUTRAL = 0.5  # no shared positions: no evidence either way
MIN_POSITIONS = 16  # tensors where an upload kept fewer values say too little on their own


def agreement(
    entries: Mapping[str, tuple[I64, F32]], established: Collection[str], starts: I64 | None = None
) -> dict[str, float]:
    """``agreement(p)`` for every peer of ``entries`` (sorted global indices and values per peer,
    as :func:`validator.copies.scan` takes them); an established peer is compared with the
    others. ``starts``: the sorted first global index of every tensor (None: one tensor)."""
    known = [p for p in sorted(entries) if p in established]
    if not known:
        return {p: NEUTRAL for p in entries}
    bounds = np.zeros(1, dtype=np.int64) if starts is None else np.asarray(starts, dtype=np.int64)
    idx = np.concatenate([entries[p][0] for p in known])
    vals = np.concatenate([entries[p][1] for p in known]).astype(np.float64)
    uniq, inverse = np.unique(idx, return_inverse=True)
    total = np.bincount(inverse, weights=vals, minlength=len(uniq))
    out = {}
    for p in sorted(entries):
        pidx, pvals = entries[p]
        pos = np.searchsorted(uniq, pidx)
        hit = (pos < len(uniq)) & (uniq[np.minimum(pos, len(uniq) - 1)] == pidx)
        others = np.zeros(len(pidx))
        others[hit] = total[pos[hit]] - (pvals[hit] if p in established else 0.0)  # leave p out
        shared = others != 0
        match = shared & (np.sign(pvals) == np.sign(others))
        tensor = np.searchsorted(bounds, pidx, side="right") - 1
        kept = np.bincount(tensor, minlength=len(bounds))
        n = np.bincount(tensor, weights=shared.astype(np.float64), minlength=len(bounds))
        agree = np.bincount(tensor, weights=match.astype(np.float64), minlength=len(bounds))
        per_tensor = (1.0 + agree) / (2.0 + n)
        enough = kept >= MIN_POSITIONS
        pooled = (1.0 + float(agree.sum())) / (2.0 + float(n.sum()))
        out[p] = float(per_tensor[enough].min()) if enough.any() else pooled
    return out

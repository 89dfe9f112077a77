"""How concentrated a contribution's change is on a few rows, against what the window's established
peers do to those rows: the cheap check every update gets, scored or not.

A targeted edit (one token's output or embedding row moved far along one direction) hides in the
mean loss: the rest of the update is honest, so it still helps and agrees with the others. What
gives it away costs no forward pass: one row of one matrix holds far more of the update's kept
values than established peers put into that row. A row's typical count is the lower median of the
values the window's established contributions keep there (at least the mean count per row over
all of them, and at least one).

* :func:`typical_counts`: that typical count per row of every matrix.
* :func:`row_excess`: a contribution's largest ratio of the values it keeps in a row to the row's
  typical count, as sent, with the tensor and row it was found in.
* :func:`moved_tokens`: the token rows (of the tensors indexed by token: the embedding and the
  output matrix) a contribution is most concentrated on: whose next-token probabilities the
  ``targeted`` verdict measures (:mod:`validator.significance`).
* :func:`concentrated_rows` and :func:`held_back`: for a concentrated contribution the validator
  did not score, its concentrated rows capped at 0 and left out of those coordinates' contributor
  counts.
* :func:`crowded_tokens`: the tokens of those concentrated rows (in the tensors indexed by token),
  every one of which the ``targeted`` verdict measures when the contribution is scored.

A contribution whose excess passes ``validator.row_excess_ratio`` is scored whenever the budget
allows (up to ``eval_peers_per_window`` more units, largest excess first), and an unscored one is
aggregated without its concentrated rows: leaving it unscored never lets it move such a row at
all, where a scored one is measured on the tokens of all those rows (not only of the few it is
most concentrated on: a row's count saturates at the row's length, so an edited row can rank below
rows its honest part fills, such as the embedding rows of the tokens its data holds).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from protocol.aggregate import NormLimit
from validator.reference import Measured

__all__ = ["Excess", "concentrated_rows", "crowded_tokens", "held_back", "moved_tokens", "row_excess", "typical_counts"]

Limits = Mapping[str, NormLimit] | None


@dataclass(frozen=True)
class Excess:
    """The row a contribution is most concentrated on: ``ratio`` of the values it kept there to the
    row's typical count (0: nothing to compare with), in tensor ``name``, row ``row``."""

    ratio: float = 0.0
    name: str = ""
    row: int = -1

    def describe(self) -> str:
        return f"row {self.row} of {self.name}: {self.ratio:.1f} x the values established peers keep there"


Typical = Mapping[str, torch.Tensor]  # per matrix, per row: the typical count of kept values


def typical_counts(established: Sequence[Measured]) -> dict[str, torch.Tensor]:
    """Per matrix, how many values an established contribution typically keeps in each row: the
    lower median over ``established`` (contributions of peers past probation; newcomers never
    move it), at least the mean count per row over all of them and at least one."""
    by_name: dict[str, list[torch.Tensor]] = {}
    for m in established:
        for name, c in m.counts.items():
            by_name.setdefault(name, []).append(c)
    out = {}
    for name, cs in by_name.items():
        stack = torch.stack(cs)
        floor = max(float(stack.mean()), 1.0)
        out[name] = torch.quantile(stack, 0.5, dim=0, interpolation="lower").clamp_min(floor)
    return out


def _ratios(norms: Measured, typical: Typical) -> dict[str, torch.Tensor]:
    out = {}
    for name, counts in norms.counts.items():
        t = typical.get(name)
        if t is not None and t.shape == counts.shape:
            out[name] = counts / t
    return out


def row_excess(norms: Measured, typical: Typical) -> Excess:
    """The row the contribution keeps most values in against its typical count (as sent)."""
    best = Excess()
    for name, ratio in _ratios(norms, typical).items():
        i = int(torch.argmax(ratio))
        if float(ratio[i]) > best.ratio:
            best = Excess(float(ratio[i]), name, i)
    return best


def moved_tokens(norms: Measured, typical: Typical, vocab: int, count: int) -> tuple[int, ...]:
    """Up to ``count`` tokens whose rows (in the tensors with one row per token) the contribution
    is most concentrated on against their typical count, largest first (ties: the larger row
    norm); rows it leaves alone are not named."""
    if count <= 0:
        return ()
    best = torch.zeros(vocab, dtype=torch.float64)
    norm = torch.zeros(vocab, dtype=torch.float64)
    for name, ratio in _ratios(norms, typical).items():
        if ratio.shape == (vocab,):
            best = torch.maximum(best, ratio)
            norm = torch.maximum(norm, norms.rows[name])
    b, n = best.numpy(), norm.numpy()
    order = np.lexsort((np.arange(vocab), -n, -b))[:count]  # the last key sorts first
    return tuple(int(i) for i in order if b[i] > 0.0)


def concentrated_rows(norms: Measured, typical: Typical, ratio: float) -> dict[str, torch.Tensor]:
    """Per matrix, the rows (a boolean mask) the contribution keeps more than ``ratio`` × their
    typical count of values in; only matrices with such a row."""
    out = {}
    for name, r in _ratios(norms, typical).items():
        mask = r > ratio
        if bool(mask.any()):
            out[name] = mask
    return out


def crowded_tokens(norms: Measured, typical: Typical, vocab: int, ratio: float) -> frozenset[int]:
    """The tokens whose row, in a tensor with one row per token, the contribution keeps more than
    ``ratio`` × its typical count of values in (:func:`concentrated_rows`; none when ``ratio`` is 0,
    the check off)."""
    if ratio <= 0:
        return frozenset()
    out: set[int] = set()
    for mask in concentrated_rows(norms, typical, ratio).values():
        if mask.shape == (vocab,):
            out.update(int(i) for i in torch.nonzero(mask).flatten())
    return frozenset(out)


def held_back(limits: Limits, rows: Mapping[str, torch.Tensor], row_lengths: Mapping[str, int]) -> Limits:
    """``limits`` with the per-row caps of the masked ``rows`` at 0: what an unscored contribution
    keeps in the rows it is concentrated on does not count (the aggregate leaves such values out,
    :meth:`validator.trial.Aggregator.clipped`). In a run that does not clip (``limits`` None) only
    those rows are capped. ``row_lengths``: flat positions per row of each matrix."""
    out = dict(limits or {})
    for name, mask in rows.items():
        lim = out.get(name)
        if lim is None and limits is None:
            lim = NormLimit(
                norm=math.inf, row=math.inf, row_len=row_lengths[name], rows=torch.full(mask.shape, math.inf)
            )
        if lim is None or lim.rows is None or lim.rows.shape != mask.shape:
            continue
        out[name] = replace(lim, rows=torch.where(mask, torch.zeros_like(lim.rows), lim.rows))
    return out if out or limits is not None else None

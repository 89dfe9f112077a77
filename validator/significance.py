"""When a loss score is evidence of harm: the score check's verdicts, each with an error bar.

A scored update's gains are means over a few sequences (``eval_sequences``: 16 by default, 8 in
the benchmarks) of *paired* per-sequence differences ``d_i = loss_before_i − loss_after_i``,
measured on the same sequences before and after the update (:func:`validator.scoring.score_update`).
Pairing cancels what the sequences contribute themselves (a hard sequence is hard before and
after); what is left is the noise of the effect, whose mean has the standard error
``se = sd(d) / √n`` (:func:`paired`). A verdict rejects only when the measured effect lies beyond its
threshold by more than ``z = eval_confidence_z`` (3.0) standard errors:

- ``harmful``: the own gain is below ``−z · se_own`` — the update raises the loss on the data
  it was assigned by more than noise explains. An update whose gain is within noise of zero is
  not called harmful; it must still clear the ``ineffective`` bar.
- ``harmful_general``: the held-out loss rises by more than ``eval_harm_tolerance`` × its level
  ``+ z · se_random``.
- ``targeted``: the binary log-loss of "the next token is v", on the held-out sequences, for the
  tokens v whose rows the update moves most against their typical change
  (:func:`validator.concentration.moved_tokens`; the first few, and every one past
  ``row_excess_ratio``, :func:`validator.decide.measured_tokens`), rises by more than ``eval_target_tolerance`` ×
  its level ``+ z · se_target`` (the level at least a fifth of the uniform probability, 0.2 / vocab:
  the binary loss of a token the model has all but ruled out moves by large factors at no cost). A row edit that promotes one token everywhere (a backdoor the
  mean loss barely sees: that token is rarely next) multiplies its probability wherever it is not
  next, and with it that loss; an honest update moves those probabilities by far less.
- ``ineffective``: even the upper confidence bound of the own gain, ``own_gain + z · se_own``,
  is below ``min_gain`` (a share of what established peers achieve in the window).

The rules stay strict where the evidence is exact: an update that changes nothing (every
``d_i = 0``, se = 0) is harmful, as without error bars, and a non-finite loss fails every bar.
z = 0 is the rule without error bars (the point estimates alone). With normal noise, z = 3 wrongly
rejects one borderline update in 740 per bar; at n = 8 sequences the estimated se itself is noisy
(a t distribution with 7 degrees of freedom: one in 100).

**Borderline updates are measured again.** When the point estimate fails a bar that the error
bar does not let it fail (:func:`borderline`), the validator scores that unit once more on
``eval_borderline_sequences`` (64) own and random sequences of the window — the se shrinks by
√(64/16) = 2 at the default 16 — and that second measurement decides. An honest update that only
looked harmful by chance is cleared by it; a weak attack (a held-out rise of 1 %, say) that hid in
the noise of 8 or 16 sequences no longer does. Only the borderline pay for it.

Each verdict carries its **margin**: how far the effect lies past (> 0, rejected) or short of (≤ 0,
accepted) the nearest bar, in standard errors (±inf when se = 0), so a log reader sees whether a
rejection was clear-cut or borderline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:  # scoring computes its error bars with paired(): no import cycle at run time
    from validator.scoring import LossScore

__all__ = ["Verdict", "borderline", "in_se", "paired", "verdict"]


@dataclass(frozen=True)
class Verdict:
    """The score check on one loss score: ``reason`` (None: passed), ``margin`` in standard errors
    past the bar that decided it (> 0 rejected) or of the nearest bar (≤ 0), and a detail line."""

    reason: str | None
    margin: float
    detail: str


def paired(before: Tensor, after: Tensor) -> tuple[float, float]:
    """Mean and standard error of ``before − after`` over paired per-sequence losses (se 0 for
    a single sequence: no spread can be measured)."""
    d = before.double() - after.double()
    n = d.numel()
    if n == 0:
        raise ValueError("paired needs at least one sequence")
    se = float(d.std(correction=1)) / math.sqrt(n) if n > 1 else 0.0
    return float(d.mean()), se


def in_se(excess: float, se: float) -> float:
    """``excess`` in units of ``se`` (±inf when se is 0; NaN stays NaN)."""
    if se > 0:
        return excess / se
    if math.isnan(excess):
        return math.nan
    return math.copysign(math.inf, excess) if excess else 0.0


def verdict(
    sc: LossScore, *, tolerance: float, min_gain: float | None, z: float, target_tolerance: float | None = None
) -> Verdict:
    """The first bar ``sc`` fails (harmful, harmful_general, targeted, ineffective), or a pass with
    the margin of the nearest bar (``targeted`` only with ``target_tolerance`` and measured tokens)."""
    gain, se = sc.own_gain, sc.own_se
    bar = f"(bar {z:g} se)"
    harm = in_se(-gain - z * se, se)
    if not gain > -z * se:
        own = f"own loss {sc.loss_own_before:.4f} -> {sc.loss_own_after:.4f}"
        return Verdict("harmful", harm, f"{own}, gain {gain:+.4f} ± {se:.4f}: {harm:+.1f} se past {bar}")
    limit = sc.loss_random_before * (1.0 + tolerance)
    rse = sc.random_se
    general = in_se(sc.loss_random_after - limit - z * rse, rse)
    if not sc.loss_random_after <= limit + z * rse:
        held = f"held-out loss {sc.loss_random_before:.4f} -> {sc.loss_random_after:.4f} ± {rse:.4f}"
        return Verdict("harmful_general", general, f"{held}, allowed {limit:.4f}: {general:+.1f} se past {bar}")
    margins = [harm, general]
    if target_tolerance is not None and sc.tokens:
        token, targeted, t_limit = _worst_token(sc, target_tolerance, z)
        if targeted > 0 or math.isnan(targeted):
            i = sc.tokens.index(token)
            moved = f"binary loss of token {token} {sc.token_before[i]:.5f} -> {sc.token_after[i]:.5f} ± {sc.token_se[i]:.5f}"
            return Verdict("targeted", targeted, f"{moved}, allowed {t_limit:.5f}: {targeted:+.1f} se past {bar}")
        margins.append(targeted)
    if min_gain is not None:
        short = in_se(min_gain - gain - z * se, se)
        if gain + z * se < min_gain:
            low = f"own loss lowered by {gain:.4f} ± {se:.4f}, less than {min_gain:.4f}"
            return Verdict("ineffective", short, f"{low}: {short:+.1f} se past {bar}")
        margins.append(short)
    nearest = max(margins)
    return Verdict(None, nearest, f"passed, {-nearest:.1f} se short of the nearest bar")


def _worst_token(sc: LossScore, tolerance: float, z: float) -> tuple[int, float, float]:
    """The measured token nearest to (or furthest past) the ``targeted`` bar: (token, margin in
    standard errors, allowed binary loss)."""
    worst: tuple[int, float, float] | None = None
    for token, before, after, se in zip(sc.tokens, sc.token_before, sc.token_after, sc.token_se, strict=True):
        limit = max(before, sc.token_floor) * (1.0 + tolerance)
        margin = in_se(after - limit - z * se, se) if math.isfinite(after) else math.inf
        if worst is None or not margin <= worst[1]:
            worst = (token, margin, limit)
    assert worst is not None
    return worst


def borderline(
    sc: LossScore, *, tolerance: float, min_gain: float | None, z: float, target_tolerance: float | None = None
) -> bool:
    """The point estimate alone fails a bar that the error bar does not let it fail (or fails
    another): a verdict that more sequences can settle (``eval_borderline_sequences``)."""
    exact = verdict(sc, tolerance=tolerance, min_gain=min_gain, z=0.0, target_tolerance=target_tolerance).reason
    bars = verdict(sc, tolerance=tolerance, min_gain=min_gain, z=z, target_tolerance=target_tolerance)
    return exact is not None and exact != bars.reason

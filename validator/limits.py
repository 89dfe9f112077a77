"""A window's clip caps, and the norm reference before and after it (:mod:`validator.reference`).

* :func:`window_limits`: the caps of established peers, from the reference and the window's
  established uploads (None: no reference yet, or the run does not clip, ``outer.clip``).
* :func:`newcomer_limits`: the caps of identities on probation: the window's, but never above the
  reference (no headroom until they have a record).
* :func:`bootstrap`: the first window with no history starts the reference at the scored, accepted
  update that lowered the loss on its own data most (caps at it, without headroom); without one,
  no reference yet, and caps at the accepted updates' lower median.
* :func:`advanced`: the reference after the window, moved towards the updates accepted from
  established peers (all accepted ones when none is established yet).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace

from protocol.aggregate import NormLimit
from protocol.config import RunSpec
from validator import reference
from validator.checks import Screened
from validator.held import Held
from validator.reference import NormReference
from validator.scoring import LossScore

__all__ = ["advanced", "bootstrap", "newcomer_limits", "window_limits"]

Schema = Mapping[str, tuple[int, ...]]


def window_limits(
    spec: RunSpec, ref: NormReference, established: Sequence[Held], schema: Schema
) -> dict[str, NormLimit] | None:
    """The clip caps of this window (None: no reference yet, or the run does not clip)."""
    cfg = spec.validator
    if ref.empty or spec.outer.clip != "median":
        return None
    norms = [h.norms for h in established]
    return reference.clip_limits(ref, norms, schema, headroom=cfg.clip_headroom, rows=cfg.row_clip)


def newcomer_limits(
    spec: RunSpec, limits: Mapping[str, NormLimit] | None, ref: NormReference
) -> dict[str, NormLimit] | None:
    """The caps for identities on probation: ``limits``, but never above the reference."""
    if limits is None:
        return None
    out = {}
    for name, lim in limits.items():
        r = ref.tensors[name]
        rows = None if lim.rows is None else lim.rows / spec.validator.clip_headroom
        out[name] = replace(lim, norm=min(lim.norm, r.norm), row=min(lim.row, r.row), rows=rows)
    return out


def bootstrap(
    spec: RunSpec,
    screened: Sequence[Screened],
    scores: Mapping[str, LossScore],
    live: Mapping[str, Held],
    schema: Schema,
) -> tuple[NormReference, dict[str, NormLimit] | None]:
    """The reference a first window starts (empty: none yet) and the caps of its contributions."""
    standing = [s.peer for s in screened if s.reason is None]
    helped = [p for p in standing if p in scores]
    if helped:
        best = max(helped, key=lambda p: (scores[p].own_gain, p))
        ref = reference.bootstrap(live[best].norms.tensors)
        caps = reference.clip_limits(ref, [live[best].norms], schema, headroom=1.0, rows=spec.validator.row_clip)
        return ref, caps
    if not standing:
        return NormReference(), None
    median = reference.window_value([live[p].norms.tensors for p in standing])
    fallback = NormReference(median)
    return NormReference(), reference.clip_limits(fallback, [], schema, headroom=1.0, rows=False)


def advanced(
    spec: RunSpec, ref: NormReference, screened: Sequence[Screened], established: Collection[str]
) -> NormReference:
    """The reference after the window: moved towards the accepted updates of ``established`` peers
    (all accepted ones when none is established yet); unchanged while empty."""
    accepted = [s for s in screened if s.reason is None]
    known = [s for s in accepted if s.peer in established] or accepted
    if not known or ref.empty:
        return ref
    value = reference.window_value([s.held.norms.tensors for s in known if s.held is not None])
    return reference.advance(ref, value, spec.validator.reference_step)

"""A window's clip caps, and the norm reference before and after it (:mod:`validator.reference`).

* :func:`window_limits`: the caps of established peers, from the reference and the window's
  established uploads (None: no reference yet, or the run does not clip, ``outer.clip``).
* :func:`newcomer_limits`: the caps of identities on probation: the window's, but never above the
  reference (no headroom until they have a record); :func:`partial_limits`: a share of those, for
  an identity on probation counted in a window it was not scored in.
* :func:`bootstrap`: the first window with no history starts the reference at the scored, accepted
  update that lowered the loss on its own data most (caps at it, without headroom); without one,
  no reference yet, and caps at the accepted updates' lower median.
* :func:`advanced`: the reference after the window, moved towards the clipped norms of the
  updates accepted from senior peers (:func:`validator.reputation.is_senior`), within
  ``reference_epoch_factor`` of its long-horizon baseline. Until some peer is senior (the first
  windows of a run), the established ones move it, and until some is established, every
  accepted one; once one is senior, a window without a senior upload leaves it where it is.
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

__all__ = ["advanced", "bootstrap", "newcomer_limits", "partial_limits", "window_limits"]

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


def partial_limits(limits: Mapping[str, NormLimit], share: float) -> dict[str, NormLimit]:
    """``limits`` scaled by ``share`` (in (0, 1]): the caps of an identity on probation counted
    without being scored in the window."""
    out = {}
    for name, lim in limits.items():
        rows = None if lim.rows is None else lim.rows * share
        out[name] = replace(lim, norm=lim.norm * share, row=lim.row * share, rows=rows)
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
    spec: RunSpec,
    ref: NormReference,
    screened: Sequence[Screened],
    established: Collection[str],
    senior: Collection[str],
) -> NormReference:
    """The reference after the window: moved towards the norms of the accepted updates of
    ``senior`` peers, each clipped to ``clip_headroom`` × the reference (the most an update can
    count for in the aggregate); while nobody is senior, of ``established`` ones, and while
    nobody is established either, of all accepted ones. Unchanged while empty."""
    cfg = spec.validator
    accepted = [s for s in screened if s.reason is None and s.held is not None]
    if senior:
        movers = [s for s in accepted if s.peer in senior]
    else:
        movers = [s for s in accepted if s.peer in established] or accepted
    if not movers or ref.empty:
        return ref
    value = reference.window_value([_clipped(s.held.norms.tensors, ref, cfg.clip_headroom) for s in movers if s.held])
    return reference.advance(
        ref, value, cfg.reference_step, factor=cfg.reference_epoch_factor, horizon=cfg.reference_horizon
    )


def _clipped(
    norms: Mapping[str, reference.TensorNorms], ref: NormReference, headroom: float
) -> dict[str, reference.TensorNorms]:
    """A contribution's norms clipped to ``headroom`` × the reference, tensor by tensor."""
    out = {}
    for name, t in norms.items():
        r = ref.tensors.get(name)
        out[name] = (
            t if r is None else reference.TensorNorms(min(t.norm, headroom * r.norm), min(t.row, headroom * r.row))
        )
    return out

"""The norm reference: how large an accepted update is, per tensor, anchored in the validator's history.

Comparing a window's contributions with *that window's* median lets whoever sends most of them
choose the yardstick: enough tiny updates and every honest one looks like an outlier, enough huge
ones and a poisoned update looks normal. The validator therefore keeps, per tensor, the typical
L2 norm of an accepted update and the typical largest row norm (a row: the last dimensions of a
matrix, e.g. one token's embedding or output row), learned from updates it accepted in earlier
windows and persisted in its state file:

* **check** (:func:`check_norms`): a tensor above ``norm_max_ratio`` × its reference norm is an
  outlier; a whole update below ``norm_min_ratio`` × the reference is too small to count.
* **clip** (:func:`clip_limits`): every contribution is scaled down to a cap per tensor and per row
  before it is scored and aggregated. The cap is the lower median of this window's *established*
  contributions (peers past probation), kept between the reference and ``clip_headroom`` × it:
  new identities cannot move it, and established ones only within that band. Each row of a
  matrix is capped by what established peers do to *that* row in the window (a rare token's row
  barely moves), so one contributor cannot spend its norm on one row.
* **advance** (:func:`advance`): after a window, each tensor's reference moves towards the lower
  median of the *clipped* norms of the updates accepted from *senior* peers (established for
  ``reference_seniority`` windows, :func:`validator.reputation.is_senior`), by at most a factor
  ``reference_step``, and never further than ``reference_epoch_factor`` from its *baseline*: a
  geometric moving average of the reference over about ``reference_horizon`` windows, kept per
  tensor next to it (O(1) per tensor, persisted with it). Honest norms grow while error feedback
  fills up and shrink as the learning rate decays, slowly, and the reference follows them; a group
  pushing every window gets it to the edge of the band, after which it drifts only as fast as
  the baseline follows: by at most ``factor ** (1 / horizon)`` per window. An update above the
  clip cap counts as its cap, so however large the pushes, one window moves the reference by at
  most ``clip_headroom``.

The first window has no history: nothing is rejected for its norm, and the reference starts at the
update that lowered the loss on its own data most among those scored and accepted
(:func:`bootstrap`), which clips that window.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from protocol.aggregate import NormLimit, SparseDict
from validator.log import CheckRow

__all__ = [
    "Measured",
    "NormReference",
    "TensorNorms",
    "advance",
    "bootstrap",
    "check_norms",
    "clip_limits",
    "lower_median",
    "measure",
    "measured",
    "row_length",
    "row_norms",
    "window_value",
]


@dataclass(frozen=True)
class TensorNorms:
    """One tensor's L2 norm and largest row norm (0 for a 1-D tensor)."""

    norm: float
    row: float = 0.0


@dataclass(frozen=True)
class NormReference:
    """Per tensor, the typical norms of an accepted update (``tensors``; empty before the first
    window) and their long-horizon ``baseline`` (a tensor without one: its reference is its
    baseline)."""

    tensors: Mapping[str, TensorNorms] = field(default_factory=dict)
    baseline: Mapping[str, TensorNorms] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # one baseline per tensor of the reference, and none for any other
        object.__setattr__(self, "baseline", {n: self.baseline.get(n, t) for n, t in self.tensors.items()})

    @property
    def empty(self) -> bool:
        return not self.tensors

    def base(self, name: str) -> TensorNorms:
        """The baseline of tensor ``name`` (which the reference holds)."""
        return self.baseline[name]

    def to_json(self) -> str:
        """Per tensor ``[norm, row, baseline norm, baseline row]``."""
        out = {n: [t.norm, t.row, self.base(n).norm, self.base(n).row] for n, t in sorted(self.tensors.items())}
        return json.dumps(out, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> NormReference:
        """Raises ValueError unless ``text`` is what :meth:`to_json` writes (finite, non-negative);
        ``[norm, row]`` alone (written before baselines were kept) starts the baseline there."""
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("a norm reference is a JSON object")
        tensors, baseline = {}, {}
        for name, values in raw.items():
            if not (
                isinstance(values, list) and len(values) in (2, 4) and all(isinstance(x, (int, float)) for x in values)
            ):
                raise ValueError(f"norm reference of {name!r} is not [norm, row, baseline norm, baseline row]")
            xs = [float(x) for x in values]
            if not all(math.isfinite(x) and x >= 0.0 for x in xs):
                raise ValueError(f"norm reference of {name!r} is not finite and non-negative")
            tensors[str(name)] = TensorNorms(xs[0], xs[1])
            baseline[str(name)] = TensorNorms(xs[-2], xs[-1])
        return cls(tensors, baseline)


@dataclass(frozen=True, eq=False)
class Measured:
    """What the norm check, the clip caps and the reference need of one contribution, measured
    once when it is screened: per tensor its norms, and per matrix the L2 norm of every row
    (float64, 0 where it kept nothing) and how many values it kept in every row (``counts``,
    float64; :mod:`validator.concentration`)."""

    tensors: Mapping[str, TensorNorms]
    rows: Mapping[str, torch.Tensor]
    counts: Mapping[str, torch.Tensor] = field(default_factory=dict)

    @property
    def total(self) -> float:
        """The L2 norm of the whole contribution."""
        return math.sqrt(sum(t.norm**2 for t in self.tensors.values()))


def measured(sparse: SparseDict, schema: Mapping[str, tuple[int, ...]]) -> Measured:
    """:func:`measure` and :func:`row_norms` of one contribution in one pass over its values."""
    tensors, rows, counts = {}, {}, {}
    for name, (idx, vals) in sparse.items():
        v = vals.double()
        row = 0.0
        row_len = row_length(schema[name])
        if row_len:
            norms = torch.zeros(schema[name][0], dtype=torch.float64)
            kept = torch.zeros(schema[name][0], dtype=torch.float64)
            if len(idx):
                which = torch.div(idx, row_len, rounding_mode="floor")
                norms.index_add_(0, which, v * v)
                kept.index_add_(0, which, torch.ones_like(v))
                row = float(norms.max().sqrt())
            rows[name] = norms.sqrt_()
            counts[name] = kept
        tensors[name] = TensorNorms(float(torch.linalg.vector_norm(v)), row)
    return Measured(tensors, rows, counts)


def row_length(shape: Sequence[int]) -> int:
    """Flat positions per row: the product of all dimensions but the first (0 for a 1-D tensor)."""
    return math.prod(shape[1:]) if len(shape) >= 2 else 0


def measure(sparse: SparseDict, schema: Mapping[str, tuple[int, ...]]) -> dict[str, TensorNorms]:
    """The norms of one contribution, per tensor it sent (float64)."""
    out = {}
    for name, (idx, vals) in sparse.items():
        v = vals.double()
        row = 0.0
        row_len = row_length(schema[name])
        if row_len and len(idx):
            rows = torch.div(idx, row_len, rounding_mode="floor")
            _, inverse = torch.unique(rows, return_inverse=True)
            sums = torch.zeros(int(inverse.max()) + 1, dtype=torch.float64).index_add_(0, inverse, v * v)
            row = float(sums.max().sqrt())
        out[name] = TensorNorms(float(torch.linalg.vector_norm(v)), row)
    return out


def lower_median(xs: Sequence[float]) -> float:
    """The lower median: with two values it is the smaller, so one huge value cannot drag it up."""
    s = sorted(xs)
    return s[(len(s) - 1) // 2]


def window_value(measures: Sequence[Mapping[str, TensorNorms]]) -> dict[str, TensorNorms]:
    """Per tensor, the lower medians of the norms (and row norms) of the contributions that sent it."""
    by_name: dict[str, list[TensorNorms]] = {}
    for m in measures:
        for name, t in m.items():
            by_name.setdefault(name, []).append(t)
    return {
        name: TensorNorms(lower_median([t.norm for t in ts]), lower_median([t.row for t in ts]))
        for name, ts in by_name.items()
    }


def bootstrap(best: Mapping[str, TensorNorms]) -> NormReference:
    """The first reference: the norms of the most helpful accepted update of the first window."""
    return NormReference({n: t for n, t in best.items() if math.isfinite(t.norm) and math.isfinite(t.row)})


def advance(
    ref: NormReference, value: Mapping[str, TensorNorms], step: float, *, factor: float = math.inf, horizon: int = 1
) -> NormReference:
    """Move every tensor's reference towards ``value``, by at most a factor ``step`` and to within
    ``factor`` of its baseline; then move the baseline a ``1 / horizon`` share of the way (in
    log space) to the new reference. A tensor new to the reference takes ``value`` as it is, as
    its baseline too."""
    out, base = dict(ref.tensors), {n: ref.base(n) for n in ref.tensors}
    for name, v in value.items():
        if not (math.isfinite(v.norm) and math.isfinite(v.row)):
            continue
        old = ref.tensors.get(name)
        if old is None:
            out[name] = base[name] = v
            continue
        b = base[name]
        norm = _within(_toward(old.norm, v.norm, step), b.norm, factor)
        row = _within(_toward(old.row, v.row, step), b.row, factor)
        out[name] = TensorNorms(norm, row)
        base[name] = TensorNorms(_follow(b.norm, norm, horizon), _follow(b.row, row, horizon))
    return NormReference(out, base)


def _toward(old: float, new: float, step: float) -> float:
    if old <= 0.0:
        return new
    return min(max(new, old / step), old * step)


def _within(x: float, baseline: float, factor: float) -> float:
    """``x`` kept within ``factor`` of ``baseline`` (a zero baseline bounds nothing)."""
    if baseline <= 0.0 or math.isinf(factor):
        return x
    return min(max(x, baseline / factor), baseline * factor)


def _follow(baseline: float, x: float, horizon: int) -> float:
    """One step of the geometric moving average over about ``horizon`` windows."""
    if baseline <= 0.0 or x <= 0.0:
        return x
    return math.exp(math.log(baseline) + (math.log(x) - math.log(baseline)) / horizon)


def row_norms(sparse: SparseDict, schema: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Per matrix the contribution sent, the L2 norm of each of its rows (float64, 0 where it kept
    nothing)."""
    out = {}
    for name, (idx, vals) in sparse.items():
        row_len = row_length(schema[name])
        if row_len:
            rows = torch.div(idx, row_len, rounding_mode="floor")
            v = vals.double()
            out[name] = torch.zeros(schema[name][0], dtype=torch.float64).index_add_(0, rows, v * v).sqrt()
    return out


def clip_limits(
    ref: NormReference,
    established: Sequence[Measured],
    schema: Mapping[str, tuple[int, ...]],
    *,
    headroom: float,
    rows: bool,
) -> dict[str, NormLimit]:
    """The caps of this window, per tensor of the reference, from the ``established``
    contributions standing in it (peers past probation; newcomers never move a cap):

    * tensor: their lower median norm, kept within [reference, headroom × reference];
    * every row: the same for the largest row norm;
    * each row of a matrix (``rows``): at most headroom × the larger of that row's lower median
      norm among them and the tensor's root-mean-square row (reference norm / √rows). A row that
      established peers barely change this window (a rare token's) cannot be moved much by one
      contributor, however it spends the norm the tensor cap allows.

    With no established contribution for a tensor, the reference alone decides. The
    contributions come :func:`measured`."""
    median = window_value([e.tensors for e in established])
    per_row: dict[str, list[torch.Tensor]] = {}
    if rows:
        for e in established:
            for name, norms in e.rows.items():
                per_row.setdefault(name, []).append(norms)
    out = {}
    for name, r in ref.tensors.items():
        m = median.get(name)
        norm = r.norm if m is None else min(max(m.norm, r.norm), headroom * r.norm)
        row = r.row if m is None else min(max(m.row, r.row), headroom * r.row)
        row_len = row_length(schema[name]) if name in schema else 0
        if not (rows and row_len):
            out[name] = NormLimit(norm=norm)
            continue
        rms = r.norm / math.sqrt(schema[name][0])
        typical = per_row.get(name)
        base = (
            torch.stack(typical).median(dim=0).values if typical else torch.zeros(schema[name][0], dtype=torch.float64)
        )
        out[name] = NormLimit(norm=norm, row=row, row_len=row_len, rows=headroom * base.clamp_min(rms))
    return out


def check_norms(
    norms: Mapping[str, TensorNorms], ref: NormReference, *, max_ratio: float, min_ratio: float
) -> tuple[CheckRow, str | None]:
    """The ``norm`` check of one contribution against the reference: (row, detail).

    ``norm_outlier`` when a tensor's norm is not finite or above ``max_ratio`` × its reference,
    ``norm_tiny`` when the whole update (over the tensors it sent that the reference knows) is
    below ``min_ratio`` × the reference's. An empty reference (first window) passes everything
    finite."""
    for name, t in norms.items():
        r = ref.tensors.get(name)
        if not math.isfinite(t.norm) or (r is not None and t.norm > max_ratio * r.norm):
            limit = "not finite" if r is None else f"reference {r.norm:.3g}"
            return CheckRow("norm", False, "norm_outlier"), f"{name}: norm {t.norm:.3g}, {limit}"
    known = [n for n in norms if n in ref.tensors]
    total = math.sqrt(sum(norms[n].norm ** 2 for n in known))
    expected = math.sqrt(sum(ref.tensors[n].norm ** 2 for n in known))
    if known and total < min_ratio * expected:
        return CheckRow("norm", False, "norm_tiny"), f"norm {total:.3g}, reference {expected:.3g}"
    return CheckRow("norm", True, None), None

"""Sparse aggregation and the outer step (pure; shared by the validator, peers and the simulator).

A contribution is ``{name: (flat_indices, values)}`` as from ``codec.to_sparse``: int64 indices,
strictly increasing, into the flattened tensor, and float32 values. The validator turns accepted
contributions into one sparse Δ̄ and every participant applies it::

    contribs = [sparse_of(enc) for enc in accepted]            # canonical order, e.g. by peer id
    delta = aggregate(contribs, mode="contributors", clip="median")
    apply_outer(params, delta, alpha)                          # θ ← θ − α·Δ̄, in place

The validator passes ``limits`` (:class:`NormLimit` per tensor, from its history of accepted
updates) instead of clipping to the window's median, so that the contributions of one window
cannot choose their own clip, and caps every row as well as every tensor::

    delta = aggregate(contribs, clip="median", limits={"w": NormLimit(norm=2.0, row=0.3, row_len=64)})

Determinism: every reduction runs on CPU in float64 in the order given, then rounds to float32, so
the same inputs give the same bytes everywhere. ``apply_outer`` scales on CPU and performs exactly one
float32 subtraction per touched element on the parameter's device (IEEE-exact on CPU and GPU).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import torch
from torch import Tensor

from protocol.codec import Encoded, to_sparse
from protocol.errors import InvalidIndices, NonFiniteValues, SchemaMismatch

__all__ = [
    "NormLimit",
    "Sparse",
    "SparseDict",
    "SparseSum",
    "aggregate",
    "apply_outer",
    "check_sparse",
    "clip_to_limits",
    "clip_to_median_norm",
    "mean_over_all",
    "mean_over_contributors",
    "sparse_nbytes",
    "sparse_of",
]

Sparse = tuple[Tensor, Tensor]
SparseDict = dict[str, Sparse]

MODES = ("contributors", "all")
CLIPS = ("median", "none")


def sparse_of(encoded: Mapping[str, Encoded]) -> SparseDict:
    """``{name: codec.to_sparse(e)}`` (on CPU) for a contribution's per-tensor ``Encoded`` values."""
    return {name: _as_cpu(to_sparse(e)) for name, e in encoded.items()}


def _as_cpu(sp: tuple[Tensor, Tensor]) -> Sparse:
    idx, vals = sp
    return idx.to("cpu", torch.int64), vals.to("cpu", torch.float32)


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def clip_to_median_norm(contribs: Sequence[SparseDict]) -> list[SparseDict]:
    """Scale each contribution's tensor down (never up) to the median L2 norm of that tensor.

    One outsized update cannot dominate the mean: with ≥ 3 contributors at most half of them
    can move the median.
    """
    names = sorted({n for c in contribs for n in c})
    out: list[SparseDict] = [dict(c) for c in contribs]
    for name in names:
        holders = [i for i, c in enumerate(contribs) if name in c]
        norms = [float(torch.linalg.vector_norm(contribs[i][name][1].double())) for i in holders]
        med = _median(norms)
        for i, norm in zip(holders, norms):
            if norm > med and norm > 0.0:
                idx, vals = contribs[i][name]
                out[i][name] = (idx, (vals.double() * (med / norm)).float())
    return out


@dataclass(frozen=True)
class NormLimit:
    """Caps on one contribution's part of one tensor: the L2 norm of all its values (``norm``) and
    of each row (a row is ``row_len`` consecutive flat positions, the last dimensions of the
    tensor): ``row`` for every row, and ``rows`` (one cap per row, float64) when given, the
    smaller of the two applying. ``row = 0`` or ``row_len = 0``: no row cap."""

    norm: float
    row: float = 0.0
    row_len: int = 0
    rows: Tensor | None = None


def clip_to_limits(contribs: Sequence[SparseDict], limits: Mapping[str, NormLimit]) -> list[SparseDict]:
    """Scale each contribution down (never up): first every row above ``limit.row`` to that norm,
    then the whole tensor above ``limit.norm``. Tensors without a limit are left as they are.

    The row cap bounds what one contributor can do to one row of a matrix (say, the output row of
    one token) however it spends the norm the tensor cap allows it. Float64, deterministic."""
    out: list[SparseDict] = []
    for c in contribs:
        clipped: SparseDict = {}
        for name, (idx, vals) in c.items():
            limit = limits.get(name)
            clipped[name] = (idx, vals) if limit is None else (idx, _clip_values(idx, vals, limit))
        out.append(clipped)
    return out


def _clip_values(idx: Tensor, vals: Tensor, limit: NormLimit) -> Tensor:
    v = vals.double()
    if limit.row > 0.0 and limit.row_len > 0 and len(idx):
        rows = torch.div(idx, limit.row_len, rounding_mode="floor")
        uniq, inverse = torch.unique(rows, return_inverse=True)
        row_norms = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, v * v).sqrt()
        cap = torch.full((len(uniq),), limit.row, dtype=torch.float64)
        if limit.rows is not None:
            cap = torch.minimum(cap, limit.rows.to(torch.float64)[uniq])
        scale = torch.where(row_norms > cap, cap / row_norms.clamp_min(1e-300), 1.0)
        v = v * scale[inverse]
    norm = float(torch.linalg.vector_norm(v))
    if norm > limit.norm >= 0.0 and norm > 0.0:
        v = v * (limit.norm / norm)
    return v.float()


def _sum_by_index(contribs: Sequence[SparseDict], name: str) -> tuple[Tensor, Tensor, Tensor]:
    """(unique sorted indices, float64 sums, contributor counts) for one tensor."""
    parts = [c[name] for c in contribs if name in c]
    idx = torch.cat([p[0].to("cpu", torch.int64) for p in parts])
    vals = torch.cat([p[1].to("cpu", torch.float64) for p in parts])
    uniq, inverse = torch.unique(idx, sorted=True, return_inverse=True)
    sums = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, vals)
    counts = torch.bincount(inverse, minlength=len(uniq))
    return uniq, sums, counts


def mean_over_contributors(contribs: Sequence[SparseDict]) -> SparseDict:
    """Per coordinate, the mean over the contributions that selected it (the production rule)."""
    names = sorted({n for c in contribs for n in c})
    out: SparseDict = {}
    for name in names:
        uniq, sums, counts = _sum_by_index(contribs, name)
        out[name] = (uniq, (sums / counts.double()).float())
    return out


def mean_over_all(contribs: Sequence[SparseDict], n: int | None = None) -> SparseDict:
    """Per coordinate, the sum divided by ``n`` (default: the number of contributions, R)."""
    n = len(contribs) if n is None else n
    if n < 1:
        raise ValueError("mean_over_all needs n >= 1")
    names = sorted({name for c in contribs for name in c})
    out: SparseDict = {}
    for name in names:
        uniq, sums, _ = _sum_by_index(contribs, name)
        out[name] = (uniq, (sums / n).float())
    return out


def aggregate(
    contribs: Sequence[SparseDict],
    mode: str = "contributors",
    clip: str = "median",
    limits: Mapping[str, NormLimit] | None = None,
) -> SparseDict:
    """Δ̄ from accepted contributions: optional clip, then the chosen mean.

    ``mode``: ``contributors`` (mean over the contributors of each coordinate) or ``all`` (mean
    over all R). ``clip``: ``median`` or ``none``; with ``clip="median"``, ``limits`` (a robust
    median the caller keeps, see :func:`clip_to_limits`) replace the median of these contributions.
    No contributions → empty Δ̄.
    """
    if mode not in MODES or clip not in CLIPS:
        raise ValueError(f"aggregate(mode={mode!r}, clip={clip!r}): mode in {MODES}, clip in {CLIPS}")
    if not contribs:
        return {}
    if clip == "median":
        contribs = clip_to_median_norm(contribs) if limits is None else clip_to_limits(contribs, limits)
    return mean_over_contributors(contribs) if mode == "contributors" else mean_over_all(contribs)


class SparseSum:
    """The mean of :func:`aggregate` (``clip="none"``) built one batch of contributions at a time,
    so that they need not all be held: per tensor a float64 sum and a contributor count per
    coordinate, to which contributions are added in the order given — the same additions, in the
    same order, as :func:`mean_over_contributors` / :func:`mean_over_all` make, hence the same
    bytes::

        total = SparseSum(shapes)
        for batch in batches:                   # canonical order, e.g. by peer id
            total.add(batch, pool)              # tensors summed in parallel on ``pool``
        delta = total.mean("contributors")      # == aggregate(all_contribs, "contributors", "none")

    Memory: a dense float64 sum and an int32 count for every tensor any contribution touched
    (12 bytes per parameter), whatever the number of contributions.

    **Weights.** ``add(batch, pool, weights=[…])`` gives each contribution a weight in (0, 1]: its
    values enter the sum times its weight and it counts as ``weight`` contributors, so the mean is
    a weighted mean (per coordinate Σ wᵢvᵢ / Σ wᵢ over its contributors, or over all). A
    contribution at weight 1 takes exactly the unweighted path: contributions all at weight 1 give
    the same bytes as without weights. A weight below 1 adds a float64 *deficit* (1 − w per
    touched coordinate) for the tensors it touches; the divisor is the count minus the deficit."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.shapes = shapes
        self.n = 0
        self.deficit = 0.0  # Σ (1 − w) over the contributions added: "all" divides by n − deficit
        self._sums: dict[str, Tensor] = {}
        self._counts: dict[str, Tensor] = {}
        self._deficits: dict[str, Tensor] = {}

    def add(
        self, contribs: Sequence[SparseDict], pool: Executor | None = None, weights: Sequence[float] | None = None
    ) -> None:
        """Add ``contribs`` in order, each at its weight in (0, 1] (default 1); with ``pool`` every
        tensor is summed on its own thread."""
        ws = [1.0] * len(contribs) if weights is None else [float(w) for w in weights]
        if len(ws) != len(contribs) or not all(0.0 < w <= 1.0 for w in ws):
            raise ValueError(f"one weight in (0, 1] per contribution, got {ws!r} for {len(contribs)}")
        names = sorted({n for c in contribs for n in c})
        for name in names:  # allocated here, so that the threads only add
            if name not in self._sums:
                numel = math.prod(self.shapes[name])
                self._sums[name] = torch.zeros(numel, dtype=torch.float64)
                self._counts[name] = torch.zeros(numel, dtype=torch.int32)
            if name not in self._deficits and any(w < 1.0 and name in c for c, w in zip(contribs, ws)):
                self._deficits[name] = torch.zeros(math.prod(self.shapes[name]), dtype=torch.float64)

        def one(name: str) -> None:
            sums, counts = self._sums[name], self._counts[name]
            for c, w in zip(contribs, ws):
                if name in c:
                    idx, vals = c[name]
                    idx = idx.to("cpu", torch.int64)
                    v = vals.to("cpu", torch.float64)
                    sums.index_add_(0, idx, v if w == 1.0 else v * w)
                    counts.index_add_(0, idx, torch.ones(len(idx), dtype=torch.int32))
                    if w < 1.0:
                        self._deficits[name].index_add_(0, idx, torch.full((len(idx),), 1.0 - w, dtype=torch.float64))

        if pool is None:
            for name in names:
                one(name)
        else:
            list(pool.map(one, names))
        self.n += len(contribs)
        self.deficit += sum(1.0 - w for w in ws)

    def mean(self, mode: str = "contributors") -> SparseDict:
        """Δ̄ so far: per coordinate the (weighted) sum over the contributions that selected it
        divided by their (weighted) number (``contributors``) or by all contributions added
        (``all``)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        out: SparseDict = {}
        for name in sorted(self._sums):
            counts = self._counts[name]
            idx = torch.nonzero(counts).squeeze(1)
            sums = self._sums[name][idx]
            if mode == "contributors":
                div = counts[idx].double()
                if name in self._deficits:
                    div = div - self._deficits[name][idx]
                out[name] = (idx, (sums / div).float())
            else:
                out[name] = (idx, (sums / (float(self.n) - self.deficit if self.deficit else float(self.n))).float())
        return out


def check_sparse(delta: Mapping[str, Sparse], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Raise a ProtocolError unless every entry names a known tensor with valid indices and values."""
    for name, (idx, vals) in delta.items():
        if name not in shapes:
            raise SchemaMismatch(f"unknown tensor {name!r}")
        numel = math.prod(shapes[name])
        if idx.dtype != torch.int64 or idx.ndim != 1 or vals.ndim != 1 or len(idx) != len(vals):
            raise SchemaMismatch(f"{name}: indices/values must be 1-D int64/float of equal length")
        if not vals.is_floating_point():
            raise SchemaMismatch(f"{name}: values must be floating point")
        if len(idx) == 0:
            continue
        if int(idx[0]) < 0 or int(idx[-1]) >= numel:
            raise InvalidIndices(f"{name}: index outside [0, {numel})")
        if len(idx) > 1 and not bool((idx[1:] > idx[:-1]).all()):
            raise InvalidIndices(f"{name}: indices must be strictly increasing")
        if not bool(torch.isfinite(vals).all()):
            raise NonFiniteValues(f"{name}: non-finite value")


@torch.no_grad()
def apply_outer(params: Mapping[str, Tensor], delta: Mapping[str, Sparse], alpha: float) -> None:
    """θ ← θ − α·Δ̄ in place on float32 parameters; validates everything before touching anything."""
    check_sparse(delta, {n: tuple(p.shape) for n, p in params.items()})
    for name, (idx, vals) in delta.items():
        p = params[name]
        if p.dtype != torch.float32 or not p.is_contiguous():
            raise SchemaMismatch(f"{name}: outer step needs contiguous float32 parameters")
        # Scale on CPU so every participant rounds α·v identically, whatever its device.
        step = (vals.to("cpu", torch.float32) * torch.tensor(alpha, dtype=torch.float32)).to(p.device)
        flat = p.view(-1)
        i = idx.to(p.device)
        flat[i] = flat[i] - step


def sparse_nbytes(delta: Mapping[str, Sparse]) -> int:
    """Raw size of a sparse Δ̄ as int64 indices + float32 values (for reporting)."""
    return sum(len(i) * 12 for i, _ in delta.values())

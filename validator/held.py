"""What the validator holds of a contribution between screening it and aggregating the window.

Decoded, a contribution takes 12 bytes per kept value (int64 index, float32 value): ~190 MB at a
1B model, ~48 GB for 256 peers. Signed, it takes ~1.25 bytes per value. So when a contribution has
passed the per-contribution checks (:func:`validator.checks.screen`, on a gather thread) the
validator keeps only a :class:`Held`: the signed bytes, their digest, the norms the window's checks
and caps need (:class:`~validator.reference.Measured`) and a keyed sample of its entries
(:mod:`validator.sketch`) for copy detection and agreement. The values are decoded again, on a
thread pool, only where they are needed whole: the few contributions that are scored, and the
accepted ones, which are clipped and summed batch by batch (:class:`protocol.aggregate.SparseSum`)::

    h = hold(data, digest, sparse, schema, sketcher)      # on the thread that screened it
    sparse = decode(h, schema, codec)                     # the same SparseDict, again
    for peer, sparse in decoded(items, work, pool):       # in order, a few at a time
        ...

Clipping is a positive scale per row and per tensor that follows from the norms alone
(:func:`clip_scales`), so the sample of a clipped contribution is computed without decoding it
(:func:`clipped_entries`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from itertools import islice

import numpy as np
import torch

from protocol.aggregate import NormLimit, SparseDict, sparse_of
from protocol.config import CodecConfig
from protocol.wire import Kind
from protocol.wire.contribution import parse_contribution
from protocol.wire.frame import open_envelope
from validator.reference import Measured, measured, row_length
from validator.sketch import F32, I64, Sketcher

__all__ = ["Held", "clip_scales", "clipped_entries", "decode", "decoded", "hold"]


@dataclass(frozen=True, eq=False)
class Held:
    """A screened contribution: its signed ``data`` (digest ``digest``), ``nnz`` kept values, its
    norms and its sampled entries (sorted global indices, values)."""

    digest: str
    data: bytes
    nnz: int
    norms: Measured
    sketch: tuple[I64, F32]


def hold(data: bytes, digest: str, sparse: SparseDict, schema: Mapping[str, tuple[int, ...]], sk: Sketcher) -> Held:
    """The :class:`Held` form of a decoded, screened contribution (``sparse`` can be dropped)."""
    nnz = sum(len(i) for i, _ in sparse.values())
    return Held(digest, data, nnz, measured(sparse, schema), sk.entries(sparse))


def decode(
    h: Held, schema: Mapping[str, tuple[int, ...]], codec: CodecConfig | Callable[[int], CodecConfig]
) -> SparseDict:
    """The contribution's values again (the bytes passed every check once; decoding is
    deterministic, so this is the same SparseDict). ``codec``: the run's codec, or the codec of a
    window (:meth:`~protocol.config.RunSpec.codec_at`), applied to the contribution's window."""
    env = open_envelope(h.data, max_bytes=len(h.data), run_hash=None, kind=Kind.CONTRIBUTION)
    cfg = codec if isinstance(codec, CodecConfig) else codec(env.window)
    return sparse_of(parse_contribution(env, schema=schema, partial=True, codec_cfg=cfg).value.tensors)


def decoded(
    items: Sequence[tuple[str, Held]], work: Callable[[str, Held], SparseDict], pool: Executor, ahead: int
) -> Iterator[tuple[str, SparseDict]]:
    """``(peer, work(peer, held))`` for every item, in order, computed on ``pool`` with at most
    ``ahead`` of them in memory at once."""
    it = iter(items)
    pending: deque[tuple[str, Future[SparseDict]]] = deque()
    for peer, h in islice(it, max(1, ahead)):
        pending.append((peer, pool.submit(work, peer, h)))
    while pending:
        peer, fut = pending.popleft()
        for nxt, nh in islice(it, 1):
            pending.append((nxt, pool.submit(work, nxt, nh)))
        yield peer, fut.result()


def clip_scales(m: Measured, name: str, limit: NormLimit) -> tuple[torch.Tensor | None, float]:
    """(scale of every row or None, scale of the whole tensor) that
    :func:`protocol.aggregate.clip_to_limits` applies to tensor ``name`` of a contribution with
    norms ``m``: rows above their cap down to it, then the tensor above ``limit.norm`` (up to
    rounding: the clip itself works on the values)."""
    rows = m.rows.get(name)
    scale = None
    if limit.row > 0.0 and limit.row_len > 0 and rows is not None:
        cap = torch.full_like(rows, limit.row)
        if limit.rows is not None:
            cap = torch.minimum(cap, limit.rows.to(torch.float64))
        scale = torch.where(rows > cap, cap / rows.clamp_min(1e-300), 1.0)
        norm = float(torch.linalg.vector_norm(rows * scale))
    else:
        norm = m.tensors[name].norm
    whole = limit.norm / norm if norm > limit.norm >= 0.0 and norm > 0.0 else 1.0
    return scale, whole


def clipped_entries(
    h: Held, limits: Mapping[str, NormLimit] | None, sk: Sketcher, schema: Mapping[str, tuple[int, ...]]
) -> tuple[I64, F32]:
    """The sampled entries of ``h`` as the clip to ``limits`` would leave them (None: not clipped)."""
    idx, vals = h.sketch
    if limits is None or len(idx) == 0:
        return idx, vals
    out = vals.astype(np.float64)
    names = sorted(sk.offsets, key=sk.offsets.__getitem__)
    bounds = np.searchsorted(idx, [sk.offsets[n] for n in names] + [np.iinfo(np.int64).max])
    for k, name in enumerate(names):
        lo, hi = int(bounds[k]), int(bounds[k + 1])
        limit = limits.get(name)
        if lo == hi or limit is None or name not in h.norms.tensors:
            continue
        rows, whole = clip_scales(h.norms, name, limit)
        if rows is not None:
            local = (idx[lo:hi] - sk.offsets[name]) // row_length(schema[name])
            out[lo:hi] *= rows.numpy()[local]
        out[lo:hi] *= whole
    return idx, out.astype(np.float32)

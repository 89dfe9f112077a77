"""Chunk geometry: how a tensor of a given shape is cut into Top-k chunks.

The rule both sides follow (the validator checks counts against it):

* 2-D ``(R, C)``: tiles of ``br × bc`` where ``br`` is the largest divisor of ``R`` that is ≤
  ``cfg.block`` (likewise ``bc`` for ``C``). A 64×64 tile is one chunk of 4096 values; the position
  of an entry inside its tile is ``r * bc + c`` (row-major inside the tile). Tiles are numbered
  row-major over the tile grid.
* 1-D ``(N,)`` and 0-D: contiguous chunks of ``min(N, cfg.chunk_1d)`` values; the last chunk may be
  shorter.
* Rank ≥ 3: viewed as 2-D ``(prod(shape[:-1]), shape[-1])`` (the last dimension is the fastest
  one in memory, like the output dimension of a matrix), then tiled as above.
* When the row count has no divisor in 2..block (one row, or a prime row count such as 1009) the
  tiles would be single rows of ≤ block values holding one kept value each; such tensors are cut
  like 1-D tensors instead (contiguous row-major chunks of ``chunk_1d``): the same density, and
  gap coding is cheaper on long chunks.

``k`` is given per 4096 values and scaled to the chunk size: ``k_c = clamp(round(k·size/4096), 1,
size)`` (round half up).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from protocol.config import CodecConfig

K_REFERENCE = 4096  # ``cfg.k`` is "values kept per this many values"


def largest_divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of ``n`` that is ≤ ``limit`` (1 for n ≤ 1)."""
    if n <= limit:
        return max(n, 1)
    for d in range(limit, 0, -1):
        if n % d == 0:
            return d
    return 1  # pragma: no cover - d = 1 always divides


def chunk_k(size: int, k: int) -> int:
    """Values kept in a chunk of ``size`` values when ``k`` are kept per 4096."""
    scaled = (2 * k * size + K_REFERENCE) // (2 * K_REFERENCE)
    return max(1, min(size, scaled))


@dataclass(frozen=True)
class Geometry:
    """Chunk layout of one tensor shape.

    ``rows × cols`` is the 2-D view (1-D tensors: ``1 × N``); tiles are ``tile_r × tile_c``.
    For 1-D views ``tile_r == 1`` and the last chunk may be short (``last_size``).
    ``chunk_len`` is the padded row length of :meth:`to_chunks`.
    """

    shape: tuple[int, ...]
    rows: int
    cols: int
    tile_r: int
    tile_c: int
    n_chunks: int
    chunk_len: int
    last_size: int
    k_full: int
    k_last: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def nnz(self) -> int:
        """Total number of kept values over all chunks."""
        if self.n_chunks == 0:
            return 0
        return (self.n_chunks - 1) * self.k_full + self.k_last

    @cached_property
    def sizes_np(self) -> npt.NDArray[np.int64]:
        """Real size of each chunk (numpy, cached: the packers need it per tensor)."""
        return self.chunk_sizes().numpy()

    @cached_property
    def ks_np(self) -> npt.NDArray[np.int64]:
        """Values kept in each chunk (numpy, cached)."""
        return self.chunk_ks().numpy()

    def chunk_sizes(self) -> Tensor:
        """int64 (n_chunks,): real (unpadded) size of each chunk."""
        sizes = torch.full((self.n_chunks,), self.chunk_len, dtype=torch.int64)
        if self.n_chunks:
            sizes[-1] = self.last_size
        return sizes

    def chunk_ks(self) -> Tensor:
        """int64 (n_chunks,): values kept in each chunk."""
        ks = torch.full((self.n_chunks,), self.k_full, dtype=torch.int64)
        if self.n_chunks:
            ks[-1] = self.k_last
        return ks

    def to_chunks(self, x: Tensor) -> Tensor:
        """View ``x`` (of ``self.shape``) as ``(n_chunks, chunk_len)``; a short last chunk is zero-padded."""
        flat = x.reshape(self.rows, self.cols)
        if self.tile_r > 1:
            tiles = flat.reshape(self.rows // self.tile_r, self.tile_r, self.cols // self.tile_c, self.tile_c)
            return tiles.permute(0, 2, 1, 3).reshape(self.n_chunks, self.chunk_len)
        flat = flat.reshape(-1)
        padded_len = self.n_chunks * self.chunk_len
        if padded_len != flat.numel():
            flat = torch.cat([flat, flat.new_zeros(padded_len - flat.numel())])
        return flat.reshape(self.n_chunks, self.chunk_len)

    def flat_index(self, chunk: Tensor, local: Tensor) -> Tensor:
        """Map (chunk id, position inside the chunk) to the flat row-major index of the tensor."""
        if self.tile_r == 1:
            return chunk * self.chunk_len + local
        tiles_per_row = self.cols // self.tile_c
        tr, tc = chunk // tiles_per_row, chunk % tiles_per_row
        r, c = local // self.tile_c, local % self.tile_c
        return (tr * self.tile_r + r) * self.cols + tc * self.tile_c + c

    def flat_index_np(self, chunk: npt.NDArray[np.int64], local: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """:meth:`flat_index` on numpy arrays (the CPU decoder's blocks)."""
        if self.tile_r == 1:
            out: npt.NDArray[np.int64] = chunk * self.chunk_len + local
            return out
        tiles_per_row = self.cols // self.tile_c
        tr, tc = np.divmod(chunk, tiles_per_row)
        r, c = np.divmod(local, self.tile_c)
        out = (tr * self.tile_r + r) * self.cols + tc * self.tile_c + c
        return out


def geometry(shape: tuple[int, ...] | torch.Size, cfg: CodecConfig) -> Geometry:
    """The chunk layout of ``shape`` under ``cfg`` (cached: it is pure)."""
    return _geometry(tuple(int(s) for s in shape), cfg.block, cfg.chunk_1d, cfg.k)


@lru_cache(maxsize=4096)
def _geometry(shape: tuple[int, ...], block: int, chunk_1d: int, k: int) -> Geometry:
    if len(shape) >= 2:
        rows, cols = math.prod(shape[:-1]), shape[-1]
    else:
        rows, cols = 1, math.prod(shape)
    if rows == 0 or cols == 0:
        return Geometry(shape, rows, cols, 1, 1, 0, 1, 0, 0, 0)
    if len(shape) >= 2 and rows > 1:
        tr, tc = largest_divisor_at_most(rows, block), largest_divisor_at_most(cols, block)
        if tr > 1:
            size = tr * tc
            kk = chunk_k(size, k)
            return Geometry(shape, rows, cols, tr, tc, (rows // tr) * (cols // tc), size, size, kk, kk)
        # No row divisor in 2..block: 1-row tiles; contiguous chunks keep the density (module doc).
    n = rows * cols
    length = min(n, chunk_1d)
    n_chunks = -(-n // length)
    last = n - (n_chunks - 1) * length
    return Geometry(shape, 1, n, 1, length, n_chunks, length, last, chunk_k(length, k), chunk_k(last, k))

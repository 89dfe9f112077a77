"""A keyed sample of a contribution's positions: what copy detection and agreement compare.

Copy detection (:mod:`validator.copies`) and agreement with the established uploads
(:mod:`validator.consensus`) look at which positions contributions kept and the signs of their
values. At a 1B model a contribution keeps ~16 M values, 256 of them ~4 G: too many to hold or sort
every window. Both compare *shares* of positions, which a uniform sample estimates, so each
contribution is reduced, as soon as it is screened, to the entries at the positions whose keyed
hash is 0 modulo ``every``::

    sk = Sketcher(key=window_secret, every=sample_every(expected_nnz), offsets=offsets(schema))
    idx, vals = sk.entries(sparse)        # sorted global indices and their values, ~nnz / every of them

Every contribution is sampled at the same positions, so an intersection of two samples is the
sample of their intersection, and how many contributions selected a sampled position is known
exactly. ``every`` is a power of two chosen so that a contribution keeps at least
:data:`SKETCH_VALUES` entries (the shares are then estimated to about ±0.005); small models are not
sampled at all (``every = 1``: the exact sets). The key is the window's secret, which peers learn
only once the window is closed: an upload cannot be tuned to the positions that are compared.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from protocol.aggregate import SparseDict
from protocol.codec.chunking import geometry
from protocol.config import CodecConfig

__all__ = ["F32", "I64", "SKETCH_VALUES", "Sketcher", "expected_nnz", "global_entries", "offsets", "sample_every"]

I64 = npt.NDArray[np.int64]
F32 = npt.NDArray[np.float32]
SKETCH_VALUES = 1 << 17  # entries a sampled contribution keeps at least


#: Positions hashed at a time by :meth:`Sketcher.entries` (its temporaries: a few arrays this long).
BLOCK = 1 << 14


def offsets(schema: Mapping[str, tuple[int, ...]]) -> dict[str, int]:
    """Start of every tensor in one global index space (names sorted)."""
    out, pos = {}, 0
    for name in sorted(schema):
        out[name] = pos
        pos += math.prod(schema[name])
    return out


def global_entries(sparse: SparseDict, offs: Mapping[str, int]) -> tuple[I64, F32]:
    """(global indices, values), sorted: tensors are offset in name order and each tensor's
    indices are strictly increasing, so concatenating in name order sorts them."""
    names = sorted(n for n in sparse if n in offs)
    if not names:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
    sizes = [len(sparse[n][0]) for n in names]
    idx = np.empty(sum(sizes), dtype=np.int64)
    vals = np.empty(sum(sizes), dtype=np.float32)
    at = 0
    for name, size in zip(names, sizes):  # written in place: no per-tensor copies to concatenate
        np.add(sparse[name][0].numpy(), offs[name], out=idx[at : at + size], casting="unsafe")
        vals[at : at + size] = sparse[name][1].numpy()
        at += size
    return idx, vals


def expected_nnz(schema: Mapping[str, tuple[int, ...]], codec: CodecConfig) -> int:
    """How many values a contribution of every tensor keeps under ``codec``."""
    return sum(int(geometry(tuple(shape), codec).chunk_ks().sum()) for shape in schema.values())


def sample_every(nnz: int, keep: int = SKETCH_VALUES) -> int:
    """The largest power of two ``every`` with ``nnz / every ≥ keep`` (1: no sampling)."""
    return 1 << max(0, (nnz // max(1, keep)).bit_length() - 1)


@dataclass(frozen=True)
class Sketcher:
    """Samples contributions at the positions whose hash under ``key`` is 0 modulo ``every``."""

    offsets: Mapping[str, int]
    every: int = 1
    key: bytes = b""

    def __post_init__(self) -> None:
        if self.every < 1 or self.every & (self.every - 1):
            raise ValueError(f"a sample keeps 1 in a power of two positions, not 1 in {self.every}")

    def entries(self, sparse: SparseDict) -> tuple[I64, F32]:
        """The sampled (sorted global indices, values) of one contribution. Positions are hashed a
        block at a time (:data:`BLOCK`), so only the sample is ever gathered."""
        if self.every <= 1:
            return global_entries(sparse, self.offsets)
        parts_idx: list[I64] = []
        parts_vals: list[F32] = []
        for name in sorted(n for n in sparse if n in self.offsets):
            idx, vals = sparse[name][0].numpy(), sparse[name][1].numpy()
            for lo in range(0, idx.size, BLOCK):
                block = idx[lo : lo + BLOCK].astype(np.int64) + self.offsets[name]
                keep = self.sampled(block)
                parts_idx.append(block[keep])
                parts_vals.append(vals[lo : lo + BLOCK][keep].astype(np.float32))
        if not parts_idx:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        return np.concatenate(parts_idx), np.concatenate(parts_vals)

    def sampled(self, idx: I64) -> npt.NDArray[np.bool_]:
        """Which global positions are in the sample (a keyed 64-bit mix, splitmix64's finaliser)."""
        k = int.from_bytes(hashlib.sha256(b"sketch|" + self.key).digest()[:8], "little")
        x = idx.astype(np.uint64) ^ np.uint64(k)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
        keep: npt.NDArray[np.bool_] = (x & np.uint64(self.every - 1)) == 0
        return keep

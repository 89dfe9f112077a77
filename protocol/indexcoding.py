"""Coding of the kept positions of each chunk: 12-bit packing (baseline) and Golomb–Rice gaps.

Positions are chunk-local, ascending inside each chunk, chunks concatenated in order; the number of
positions per chunk is known to both sides from the geometry, so no counts are sent.

``packed12``: every position in 12 bits (chunks ≤ 4096 values) — the baseline, 12 bits/index.

``rice`` (compact): position gaps ``g_0 = p_0``, ``g_i = p_i − p_{i−1} − 1`` (≥ 0, so duplicates
and unsorted positions cannot even be expressed) coded with a Golomb code of parameter ``M``
(chosen per tensor for the fewest bits and sent as a u16; a power of two is a Rice code):
``q = g // M`` in unary, ``r = g % M`` in truncated binary. For k = 64 per 4096 this costs
≈ 7.45 bits/index against the 7.36 of the information bound (log2 C(4096, 64) / 64) and 12 for
``packed12``. To stay vectorized the code is written as three separate bit streams instead of
interleaving them (same total size):

  A  the first ``b−1`` bits of each remainder, fixed width (``b = ceil(log2 M)``, ``u = 2^b − M``):
     ``r`` itself when ``r < u``, else ``(r + u) >> 1``; byte-aligned;
  B  one extra bit ``(r + u) & 1`` for each remainder with ``r ≥ u``, in order (the decoder knows
     how many from A), immediately followed by
  U  the quotients in unary: ``q`` zero bits then a one. B·U fill the rest of the payload and its
     last byte must hold the last terminating one (zero bits after it), so the payload has exactly
     one valid length.

Decoding is ``np.flatnonzero`` on the unary stream plus fixed-width unpacking: no per-index loop.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import numpy.typing as npt

from protocol.bitpack import pack_bits, packed_size, unpack_bits
from protocol.errors import InvalidIndices, MalformedPayload

I64 = npt.NDArray[np.int64]
MAX_GOLOMB = 65535


def chunk_starts(ks: I64) -> I64:
    """Offset of each chunk's first position in the concatenated stream."""
    return np.concatenate([[0], np.cumsum(ks)[:-1]]).astype(np.int64) if ks.size else ks


def check_positions(local: I64, ks: I64, sizes: I64) -> None:
    """Raise :class:`InvalidIndices` unless positions ascend strictly per chunk and fit the chunk."""
    if local.size != int(ks.sum()):
        raise InvalidIndices(f"{local.size} positions, geometry expects {int(ks.sum())}")
    if local.size == 0:
        return
    if (local < 0).any() or (local >= np.repeat(sizes, ks)).any():
        raise InvalidIndices("position outside its chunk")
    step = np.diff(local)
    first = np.zeros(local.size, dtype=bool)
    first[chunk_starts(ks)] = True
    if (step[~first[1:]] <= 0).any():
        raise InvalidIndices("positions not strictly ascending inside a chunk (unsorted or duplicate)")


# --------------------------------------------------------------------------- packed12
def pack12(local: I64) -> bytes:
    """Baseline: 12 bits per position."""
    return pack_bits(local, 12)


def unpack12(data: bytes | memoryview, ks: I64, sizes: I64) -> I64:
    local = unpack_bits(data, int(ks.sum()), 12, "packed12 indices")
    check_positions(local, ks, sizes)
    return local


# --------------------------------------------------------------------------- Golomb-Rice
def to_gaps(local: I64, ks: I64) -> npt.NDArray[np.int32]:
    """Gaps (int32) of ascending positions; every chunk starts from position −1."""
    if local.size and (ks == ks[0]).all():  # one k for every chunk: chunk starts are every k-th
        gaps = np.empty(local.size, dtype=np.int32)
        np.subtract(local[1:], local[:-1], out=gaps[1:], casting="unsafe")
        gaps -= 1
        gaps[:: int(ks[0])] = local[:: int(ks[0])]
        return gaps
    gaps = np.empty(local.size, dtype=np.int32)
    if local.size:
        gaps[0] = local[0]
        gaps[1:] = local[1:] - local[:-1] - 1
        starts = chunk_starts(ks)
        gaps[starts] = local[starts]
    return gaps


def from_gaps(gaps: I64, ks: I64) -> I64:
    """Positions from gaps; the running sum restarts at every chunk."""
    if gaps.size == 0:
        return gaps
    run = np.cumsum(gaps + 1)
    starts = chunk_starts(ks)
    before = np.concatenate([[0], run[starts[1:] - 1]]) if starts.size else np.zeros(0, np.int64)
    return run - np.repeat(before, ks) - 1


def _params(m: int) -> tuple[int, int]:
    b = max(m - 1, 0).bit_length()
    return b, (1 << b) - m


def golomb_bits(gaps: I64, m: int) -> int:
    """Bits the index section costs for ``gaps`` with parameter ``m`` (without its u16 header)."""
    n = gaps.size
    if m == 1:
        return n + int(gaps.sum())
    b, u = _params(m)
    return n * b + int((gaps // m).sum()) + int(((gaps % m) >= u).sum())  # unary q+1, b−1 or b


def choose_golomb(gaps: npt.NDArray[np.integer]) -> int:
    """The optimal Golomb parameter for geometric gaps of the same mean as ``gaps``.

    ``ceil(log(2 − p) / −log(1 − p))`` with ``p = 1 / (mean + 1)``. Top-k positions are a uniform
    random subset, so the gaps are close to geometric: on a 25 M-parameter LLaMA-shaped set this
    costs 0.013 % more than the best parameter found by exhaustive search, for no search time.
    """
    if gaps.size == 0:
        return 1
    p = 1.0 / (int(gaps.sum(dtype=np.int64)) / gaps.size + 1.0)
    if p >= 0.5:
        return 1
    return int(min(MAX_GOLOMB, math.ceil(math.log(2.0 - p) / -math.log1p(-p))))


def encode_rice(local: I64, ks: I64, side: npt.NDArray[np.uint8] | None = None, side_bits: int = 0) -> bytes:
    """Golomb-code the gaps of ``local`` (see module doc). Few numpy calls: it runs per tensor.

    ``side``: optional ``side_bits``-wide values, one per position (the 2-bit value codes), carried
    in the low bits of the fixed-width A field so that one packing pass writes both.
    """
    gaps = to_gaps(local, ks)  # int32: numpy's int64 division is several times slower
    m = choose_golomb(gaps)
    q, r = np.divmod(gaps, np.int32(m))
    q += 1
    ends = q.cumsum(dtype=np.int64)  # one past each unary terminator
    b, u = _params(m)
    if m == 1:
        a_field, extra = np.zeros(gaps.size, dtype=np.int32), r[:0]
    else:
        r += np.int32(u)  # r + u from here on
        # A field: the remainder when < u, else (r + u) >> 1 — which is min(remainder, (r + u) >> 1).
        a_field = np.minimum(r - np.int32(u), r >> 1)
        extra = np.compress(r >= 2 * u, r)  # remainders ≥ u take one more bit: the low bit of r + u
    if side_bits:
        a_field = (a_field << side_bits) | side
    width = max(b - 1, 0) + side_bits
    return _U16.pack(m) + pack_bits(a_field, width) + _bitstream(extra, ends)


def _bitstream(extra: npt.NDArray[np.int32], ends: I64) -> bytes:
    """Bit stream B·U: the low bit of each ``extra`` value, then the unary codes ending at ``ends``."""
    n_big = extra.size
    bits = np.zeros(n_big + (int(ends[-1]) if ends.size else 0), dtype=np.uint8)
    bits[:n_big] = extra & 1
    ends += n_big - 1
    bits[ends] = 1
    return np.packbits(bits, bitorder="little").tobytes()


def decode_rice(
    data: bytes | memoryview, ks: I64, sizes: I64, side_bits: int = 0
) -> tuple[I64, I64]:
    """Inverse of :func:`encode_rice`: (positions, side values). ``data`` is exactly the section."""
    n = int(ks.sum())
    if len(data) < 2:
        raise MalformedPayload("rice indices: missing parameter")
    (m,) = _U16.unpack_from(data, 0)
    if m == 0:
        raise MalformedPayload("rice indices: parameter 0")
    b, u = _params(m)
    width = max(b - 1, 0) + side_bits
    size_a = packed_size(n, width)
    if len(data) < 2 + size_a:
        raise MalformedPayload("rice indices: truncated remainders")
    fields = unpack_bits(data[2 : 2 + size_a], n, width, "rice remainders")
    side, f = fields & ((1 << side_bits) - 1), fields >> side_bits
    big = f >= u if m > 1 else np.zeros(n, dtype=bool)
    bits = np.unpackbits(np.frombuffer(data[2 + size_a :], dtype=np.uint8), bitorder="little")
    n_big = int(big.sum())
    if bits.size < n_big:
        raise MalformedPayload("rice indices: truncated remainder bits")
    r = f.copy()
    r[big] = 2 * f[big] + bits[:n_big] - u
    q = _unary(bits, n_big, n)
    gaps = q * m + r
    local = from_gaps(gaps, ks)
    if n and (local >= np.repeat(sizes, ks)).any():
        raise InvalidIndices("position outside its chunk")
    if m != choose_golomb(gaps):  # one byte string per index set: equal content, equal digest
        raise MalformedPayload(f"rice indices: parameter {m} is not the canonical {choose_golomb(gaps)}")
    return local, side


def _unary(bits: npt.NDArray[np.uint8], start: int, n: int) -> I64:
    """Quotients from the unary codes in ``bits[start:]``, which must end in the last byte."""
    ones = np.flatnonzero(bits[start:]) + start
    if ones.size != n:
        raise MalformedPayload(f"rice indices: {ones.size} unary codes, expected {n}")
    last = int(ones[-1]) if n else start - 1
    if last // 8 + 1 != bits.size // 8 and bits.size:
        raise MalformedPayload("rice indices: bytes after the last code")
    return np.diff(ones, prepend=start - 1) - 1


_U16 = struct.Struct("<H")

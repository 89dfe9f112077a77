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
     ``r`` itself when ``r < u``, else ``(r + u) >> 1``; byte-aligned. An optional fixed-width
     side value per position (the codec puts the 2-bit value codes there) fills the low bits of
     each A field, so one packing pass writes both;
  B  one extra bit ``(r + u) & 1`` for each remainder with ``r ≥ u``, in order (the decoder knows
     how many from A), immediately followed by
  U  the quotients in unary: ``q`` zero bits then a one. B·U fill the rest of the payload and its
     last byte must hold the last terminating one (zero bits after it), so the payload has exactly
     one valid length.

Decoding is fixed-width unpacking plus ``np.flatnonzero`` on the unary stream, a block of
:data:`BLOCK` entries at a time and in place: no per-index loop, and no array of one entry per
position besides the result (its peak is ~10 bytes per position plus one byte per bit of B·U).
Encoding looks every per-position quantity (A field, extra bit, unary length) up in tables indexed
by the gap, cached per ``M``: one difference, three lookups, one running sum, one scatter.
"""

from __future__ import annotations

import math
import struct
from functools import lru_cache
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from protocol.codec.bitpack import _group, _weights, pack_bits, packed_size, unpack_bits
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


def choose_golomb(gaps: npt.NDArray[np.integer]) -> int:
    """The optimal Golomb parameter for geometric gaps of the same mean as ``gaps``.

    ``ceil(log(2 − p) / −log(1 − p))`` with ``p = 1 / (mean + 1)``. Top-k positions are a uniform
    random subset, so the gaps are close to geometric: on a 25 M-parameter LLaMA-shaped set this
    costs 0.013 % more than the best parameter found by exhaustive search, for no search time.
    """
    return golomb_param(int(gaps.sum(dtype=np.int64)), gaps.size)


def golomb_param(total: int, n: int) -> int:
    """:func:`choose_golomb` from the sum and count of the gaps (the encoder gets the sum cheaply:
    a chunk's gaps add up to its last position − (k − 1))."""
    if n == 0:
        return 1
    p = 1.0 / (total / n + 1.0)
    if p >= 0.5:
        return 1
    return int(min(MAX_GOLOMB, math.ceil(math.log(2.0 - p) / -math.log1p(-p))))


def rice_nbytes(local: I64, ks: I64) -> int:
    """Bytes :func:`encode_rice` writes for ``local`` (no side values), counted without writing them:
    the u16 parameter, the A fields, the extra bits of long remainders and the unary quotients."""
    gaps = to_gaps(local, ks)
    m = choose_golomb(gaps)
    b, u = _params(m)
    q, r = np.divmod(gaps, np.int32(m))
    n_big = int(np.count_nonzero(r >= u)) if m > 1 else 0
    stream_bits = n_big + int(q.sum(dtype=np.int64)) + gaps.size
    return _U16.size + packed_size(gaps.size, max(b - 1, 0)) + (stream_bits + 7) // 8


def encode_rice(
    local: I64,
    ks: I64,
    side: npt.NDArray[np.uint8] | None = None,
    side_bits: int = 0,
    *,
    uniform: bool | None = None,
    max_len: int | None = None,
) -> bytes:
    """Golomb-code the gaps of ``local`` (see module doc). Few numpy calls: it runs per tensor.

    ``side``: optional ``side_bits``-wide values, one per position (the 2-bit value codes), carried
    in the low bits of the fixed-width A field so that one packing pass writes both; given exactly
    when ``side_bits > 0``.
    ``uniform`` (every chunk keeps ``ks[0]``) and ``max_len`` (no chunk is longer) may be passed by a
    caller that knows them from the geometry, to skip checking them; they are not validated.

    Every per-position quantity is a function of the gap alone once ``M`` is known, so they come
    from lookup tables indexed by ``gap + 1`` (cached per ``M``): no division, no per-element
    arithmetic beyond one difference, one running sum and one scatter. Tiny index sets take a
    plain Python path (numpy's per-call cost dominates there); huge chunks the arithmetic one.
    """
    if (side is None) != (side_bits == 0):
        raise ValueError("side values and side_bits > 0 must be given together")
    n = local.size
    if n <= _SMALL:
        return _encode_small(local, ks, side, side_bits)
    nc = ks.size
    k0 = int(ks[0])
    d = np.empty(n, dtype=np.int64)  # gap + 1 = position step (chunk starts: position + 1)
    np.subtract(local[1:], local[:-1], out=d[1:])
    if uniform is None:
        uniform = n == nc * k0 and bool((ks == k0).all())
    if uniform:  # one k for every chunk: chunk starts are every k-th
        np.add(local[::k0], 1, out=d[::k0])
        lasts = local[k0 - 1 :: k0]
    elif ks.all():
        cum = np.cumsum(ks)
        d[cum[:-1]] = local[cum[:-1]] + 1
        d[0] = local[0] + 1
        lasts = local[cum - 1]
    else:  # empty chunks (not produced by the codec's geometry)
        return _encode_rice_arith(local, ks, side, side_bits)
    m = golomb_param(int(lasts.sum()) + nc - n, n)  # a chunk's gaps sum to its last position − (k − 1)
    top = (int(lasts.max()) if max_len is None else max_len - 1) + 2  # every step is ≤ last position + 1
    if top > _TABLE_MAX:
        return _encode_rice_arith(local, ks, side, side_bits)
    t = _tables(m, side_bits, top if max_len is not None else 1 << (top - 1).bit_length())
    b = t.b.take(d)  # the extra bit of a long remainder, 2 for none
    extra = b.compress(b < 2)
    n_big = extra.size
    unary = t.q1.take(d)  # q + 1
    unary[0] += n_big - 1  # the unary codes start after the n_big extra bits
    ends = unary.cumsum(out=unary)  # B·U positions of the unary terminators
    bits = np.zeros(int(ends[-1]) + 1, dtype=np.uint8)
    bits[:n_big] = extra
    bits[ends] = 1
    return _U16.pack(m) + _pack_a(t, d, side, side_bits) + np.packbits(bits, bitorder="little").tobytes()


def _pack_a(t: _Tables, d: I64, side: npt.NDArray[np.uint8] | None, side_bits: int) -> bytes:
    """The A stream: table lookup straight into the uint64 lanes of :func:`pack_bits`' fast path."""
    n, width = d.size, t.width
    g = _group(width)
    if not g or n % g:
        a_field = t.a.take(d)
        if side is not None:
            np.bitwise_or(a_field, side, out=a_field, casting="unsafe")
        return pack_bits(a_field, width)
    lanes = t.a64.take(d)
    if side is not None:
        np.bitwise_or(lanes, side, out=lanes, casting="unsafe")
    acc = lanes.reshape(-1, g) @ _weights(width, g)
    return acc.view(np.uint8).reshape(-1, 8)[:, : g * width // 8].tobytes()[: packed_size(n, width)]


_SMALL = 40  # index sets up to this size are coded in plain Python (faster below ≈ 48)
_TABLE_MAX = 1 << 13  # longest chunk covered by lookup tables (the default chunks hold ≤ 4096)


class _Tables(NamedTuple):
    q1: I64  # q + 1 (length of the unary code)
    a: npt.NDArray[np.unsignedinteger]  # A field without the side value, shifted by side_bits
    b: npt.NDArray[np.uint8]  # extra bit of a remainder ≥ u, or 2
    width: int  # bits of an A field, side value included
    a64: npt.NDArray[np.uint64]  # ``a`` as uint64 (lanes of the packer)


@lru_cache(maxsize=128)  # M is set by the density k/4096: a handful of values in practice
def _tables(m: int, side_bits: int, size: int) -> _Tables:
    """Per-step lookup tables for parameter ``m``, indexed by ``gap + 1`` in ``[1, size)`` (≤ 80 KiB)."""
    gaps = np.maximum(np.arange(size, dtype=np.int64) - 1, 0)
    q, r = np.divmod(gaps, m)
    b, u = _params(m)
    width = max(b - 1, 0) + side_bits
    if m == 1:
        a, extra = np.zeros(size, dtype=np.int64), np.full(size, 2, dtype=np.int64)
    else:
        a = np.minimum(r, (r + u) >> 1)
        extra = np.where(r >= u, (r + u) & 1, 2)
    a_dtype = np.uint8 if width <= 8 else np.uint16 if width <= 16 else np.uint32
    a <<= side_bits
    tables = _Tables(q + 1, a.astype(a_dtype), extra.astype(np.uint8), width, a.astype(np.uint64))
    for arr in (tables.q1, tables.a, tables.b, tables.a64):
        arr.flags.writeable = False
    return tables


def _encode_small(local: I64, ks: I64, side: npt.NDArray[np.uint8] | None, side_bits: int) -> bytes:
    """:func:`encode_rice` for a few positions, with Python integers (same bytes)."""
    pos = local.tolist()
    steps = []
    i = 0
    for k in ks.tolist():
        prev = -1
        for p in pos[i : i + k]:
            steps.append(p - prev - 1)
            prev = p
        i += k
    n = len(steps)
    m = golomb_param(sum(steps), n)
    b, u = _params(m)
    width = max(b - 1, 0) + side_bits
    sides = side.tolist() if side is not None else [0] * n
    a_acc = extra_acc = n_big = unary_acc = unary_len = 0
    for j, g in enumerate(steps):
        q, r = divmod(g, m)
        if m > 1:
            if r < u:
                f = r
            else:
                f = (r + u) >> 1
                extra_acc |= ((r + u) & 1) << n_big
                n_big += 1
        else:
            f = 0
        a_acc |= ((f << side_bits) | sides[j]) << (j * width)
        unary_len += q + 1
        unary_acc |= 1 << (unary_len - 1)
    total = n_big + unary_len
    stream = extra_acc | (unary_acc << n_big)
    return _U16.pack(m) + a_acc.to_bytes(packed_size(n, width), "little") + stream.to_bytes((total + 7) // 8, "little")


def _encode_rice_arith(local: I64, ks: I64, side: npt.NDArray[np.uint8] | None = None, side_bits: int = 0) -> bytes:
    """:func:`encode_rice` by arithmetic (no tables): for chunks longer than ``_TABLE_MAX``."""
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
    if side is not None:
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


def decode_rice(data: bytes | memoryview, ks: I64, sizes: I64, side_bits: int = 0) -> tuple[I64, npt.NDArray[np.uint8]]:
    """Inverse of :func:`encode_rice`: (positions, side values). ``data`` is exactly the section.

    Memory is the result (8 bytes per position, 1 per side value) plus the unpacked bit stream
    B·U (one byte per bit of the section) and temporaries of at most :data:`BLOCK` entries: the
    remainders are unpacked straight into the positions' array, and the long remainders, the
    unary quotients and the running sums are then worked in place one block at a time. The
    number of unary codes is counted before anything per code is built, so a stream of set bits
    far longer than the positions it should hold is refused up front."""
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
    gaps = unpack_bits(data[2 : 2 + size_a], n, width, "rice remainders")  # the A fields, then gaps, then positions
    side = np.empty(n, dtype=np.uint8)  # side values are ≤ 8 bits (the codec's: 2)
    np.bitwise_and(gaps, (1 << side_bits) - 1, out=side, casting="unsafe")
    gaps >>= side_bits
    n_big = _count_at_least(gaps, u) if m > 1 else 0
    stream = np.frombuffer(data[2 + size_a :], dtype=np.uint8)
    if stream.size * 8 < n_big or _ones(stream) - _ones(stream, n_big) != n:
        raise MalformedPayload(f"rice indices: the unary stream does not hold exactly {n} codes")
    bits = np.unpackbits(stream, bitorder="little")
    if n_big:
        _widen_remainders(gaps, bits[:n_big], u)
    _add_quotients(gaps, bits, n_big, m)
    del bits
    total = int(gaps.sum())
    local = _positions(gaps, ks)
    if n and (local[np.cumsum(ks)[ks > 0] - 1] >= sizes[ks > 0]).any():  # ascending: the last is the largest
        raise InvalidIndices("position outside its chunk")
    if m != golomb_param(total, n):  # one byte string per index set: equal content, equal digest
        raise MalformedPayload(f"rice indices: parameter {m} is not the canonical {golomb_param(total, n)}")
    return local, side


#: Entries per block of the decoder's in-place passes (its temporaries: a few arrays of this many).
BLOCK = 1 << 14


def _count_at_least(values: I64, u: int) -> int:
    """How many of ``values`` are ``≥ u``, a block at a time."""
    return sum(int(np.count_nonzero(values[i : i + BLOCK] >= u)) for i in range(0, values.size, BLOCK))


def _widen_remainders(f: I64, extra: npt.NDArray[np.uint8], u: int) -> None:
    """Remainders in place: an A field ``f ≥ u`` becomes ``2·f + its extra bit − u`` (extra bits in order)."""
    used = 0
    for i in range(0, f.size, BLOCK):
        block = f[i : i + BLOCK]
        big = block >= u
        count = int(np.count_nonzero(big))
        if count:
            block[big] = 2 * block[big] + extra[used : used + count] - u
            used += count


def _add_quotients(r: I64, bits: npt.NDArray[np.uint8], start: int, m: int) -> None:
    """Gaps in place: ``r += m · q`` with the quotients of the unary codes in ``bits[start:]``, which
    must hold exactly ``r.size`` codes and end in the last byte (MalformedPayload otherwise). The
    codes are found a block of bits at a time: ``q_i = one_i − one_{i−1} − 1``."""
    n, done, prev = r.size, 0, start - 1
    for lo in range(start, bits.size, BLOCK):
        ones = np.flatnonzero(bits[lo : lo + BLOCK])
        if not ones.size:
            continue
        if done + ones.size > n:
            raise MalformedPayload(f"rice indices: more than {n} unary codes")
        ones += lo
        last = int(ones[-1])
        ones[1:] -= ones[:-1].copy()
        ones[0] -= prev
        ones -= 1
        ones *= m
        r[done : done + ones.size] += ones
        done += ones.size
        prev = last
    if done != n:
        raise MalformedPayload(f"rice indices: {done} unary codes, expected {n}")
    if bits.size and prev // 8 + 1 != bits.size // 8:
        raise MalformedPayload("rice indices: bytes after the last code")


_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)


def _ones(stream: npt.NDArray[np.uint8], first_bits: int | None = None) -> int:
    """Set bits in ``stream`` (or in its first ``first_bits`` bits), without unpacking it."""
    if first_bits is None:
        return int(_POPCOUNT[stream].sum(dtype=np.int64))
    whole, rest = divmod(first_bits, 8)
    count = int(_POPCOUNT[stream[:whole]].sum(dtype=np.int64))
    if rest:
        count += int(_POPCOUNT[stream[whole] & ((1 << rest) - 1)])
    return count


def _positions(gaps: I64, ks: I64) -> I64:
    """:func:`from_gaps`, overwriting ``gaps``: one running sum, then each chunk less the total
    before it (a broadcast over the chunks of one size, no array of one entry per position)."""
    if gaps.size == 0:
        return gaps
    gaps += 1
    run = np.cumsum(gaps, out=gaps)
    if ks.size > 1:
        cum = np.cumsum(ks)
        before = run[cum[:-1] - 1]  # the running total at the end of every chunk but the last
        k0 = int(ks[0])
        if k0 and bool((ks[:-1] == k0).all()):
            body = run[: (ks.size - 1) * k0].reshape(ks.size - 1, k0)
            body[1:] -= before[:-1, None]
            run[(ks.size - 1) * k0 :] -= before[-1]
        else:  # chunks of several sizes (not produced by the codec's geometry)
            run -= np.repeat(np.concatenate([[0], before]), ks)
    run -= 1
    return run


_U16 = struct.Struct("<H")

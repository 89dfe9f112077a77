"""Fixed-width bit packing of small unsigned integers (vectorized, numpy on the CPU).

Bit order is little-endian throughout: value ``i`` occupies bits ``[i·w, (i+1)·w)`` of the stream,
bit ``j`` of the stream is bit ``j % 8`` of byte ``j // 8``, least significant bit first. Unused
bits of the last byte are zero, and :func:`unpack_bits` rejects streams where they are not, so
every value sequence has exactly one byte representation.
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np
import numpy.typing as npt

from protocol.errors import MalformedPayload

U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]


def packed_size(count: int, width: int) -> int:
    """Bytes taken by ``count`` values of ``width`` bits."""
    return (count * width + 7) // 8


_SHIFTS8 = {w: np.arange(w, dtype=np.uint8) for w in range(1, 9)}


def _group(width: int) -> int:
    """Values per group of whole bytes (``group·width`` is a multiple of 8); 0 if over 64 bits."""
    g = 8 // math.gcd(width, 8)
    return g if g * width <= 64 else 0


def pack_bits(values: npt.NDArray[np.integer], width: int) -> bytes:
    """Pack non-negative integers ``< 2**width`` into ``width`` bits each."""
    if width == 0 or values.size == 0:
        return b""
    if width == 1 or (width <= 8 and values.size <= 1024):  # few numpy calls: fastest when small
        v8 = values.astype(np.uint8, copy=False).reshape(-1, 1)
        bits = v8 if width == 1 else (v8 >> _SHIFTS8[width]) & np.uint8(1)
        return np.packbits(bits, axis=None, bitorder="little").tobytes()
    if 8 % width == 0:  # whole values per byte: OR them together in uint8
        per = 8 // width
        padded = np.zeros(-(-values.size // per) * per, dtype=np.uint8)
        padded[: values.size] = values.reshape(-1)
        v8 = padded.reshape(-1, per)
        acc: U8 = v8[:, 0].copy()
        for j in range(1, per):
            acc |= v8[:, j] << np.uint8(j * width)
        return acc.tobytes()
    g = _group(width)
    if not g:
        v = values.astype(np.uint32, copy=False).reshape(-1, 1)
        bits = ((v >> np.arange(width, dtype=np.uint32)) & 1).astype(np.uint8)
        return np.packbits(bits.reshape(-1), bitorder="little").tobytes()
    # Fast path: ``g`` values make one little-endian uint64 (a matmul with 2^(j·width): the fields
    # do not overlap, so the sum is their OR); keep its ``g·width/8`` low bytes.
    n = values.size
    lanes = np.zeros(-(-n // g) * g, dtype=np.uint64)
    lanes[:n] = values.reshape(-1)
    words = lanes.reshape(-1, g) @ _weights(width, g)
    raw = words.astype("<u8", copy=False).view(np.uint8).reshape(-1, 8)[:, : g * width // 8]
    return raw.tobytes()[: packed_size(n, width)]


@cache
def _weights(width: int, g: int) -> npt.NDArray[np.uint64]:
    weights: npt.NDArray[np.uint64] = np.uint64(1) << (np.arange(g, dtype=np.uint64) * np.uint64(width))
    return weights


def unpack_bits(data: bytes | memoryview, count: int, width: int, what: str = "field") -> I64:
    """Inverse of :func:`pack_bits`; ``data`` must be exactly ``packed_size(count, width)`` bytes."""
    if len(data) != packed_size(count, width):
        raise MalformedPayload(f"{what}: {len(data)} bytes, expected {packed_size(count, width)}")
    if width == 0 or count == 0:
        return np.zeros(count, dtype=np.int64)
    if 8 % width == 0:  # whole values per byte: written straight into the result (no uint64 lanes)
        return _unpack_small(np.frombuffer(data, dtype=np.uint8), count, width, what)
    out = np.empty(count, dtype=np.int64)
    g = _group(width) or 8  # values per whole-byte group (8 when they do not fit one uint64)
    per_block = BLOCK_GROUPS * g
    raw = np.frombuffer(data, dtype=np.uint8)
    for lo in range(0, count, per_block):
        n = min(per_block, count - lo)
        block = raw[lo * width // 8 : -(-(lo + n) * width // 8)]
        out[lo : lo + n] = _unpack_block(block, n, width, g)
    if _padding(raw, count, width):
        raise MalformedPayload(f"{what}: non-zero padding bits")
    return out


#: Groups of values unpacked at a time: the temporaries of :func:`unpack_bits` are this many words.
BLOCK_GROUPS = 1 << 11


def _unpack_block(block: U8, n: int, width: int, g: int) -> I64:
    """``n`` values of ``width`` bits from ``block``, which starts on a group boundary."""
    if _group(width):  # ``g`` values make one little-endian uint64: shift and mask them out
        group_bytes = g * width // 8
        n_groups = -(-n // g)
        lanes = np.zeros((n_groups, 8), dtype=np.uint8)
        flat = np.zeros(n_groups * group_bytes, dtype=np.uint8)
        flat[: block.size] = block
        lanes[:, :group_bytes] = flat.reshape(n_groups, group_bytes)
        shifts = (np.arange(g, dtype=np.uint64) * np.uint64(width)).reshape(1, g)
        words = (lanes.view("<u8").reshape(n_groups, 1) >> shifts) & np.uint64((1 << width) - 1)
        values: I64 = words.reshape(-1)[:n].astype(np.int64)
        return values
    bits = np.unpackbits(block, bitorder="little")[: n * width].reshape(n, width).astype(np.int64)
    values = bits @ (np.int64(1) << np.arange(width, dtype=np.int64))
    return values


def _padding(raw: U8, count: int, width: int) -> bool:
    """Whether the bits after the last of ``count`` values in ``raw`` are not all zero."""
    used = count * width % 8
    return bool(used) and bool(raw[-1] >> used)


def _unpack_small(v8: U8, count: int, width: int, what: str) -> I64:
    """:func:`unpack_bits` for widths 1, 2, 4 and 8: the result is the only large allocation."""
    per = 8 // width
    out = np.empty(v8.size * per, dtype=np.int64)
    mask = np.uint8((1 << width) - 1)
    for j in range(per):
        out[j::per] = (v8 >> np.uint8(j * width)) & mask
    if out[count:].any():
        raise MalformedPayload(f"{what}: non-zero padding bits")
    return out[:count]

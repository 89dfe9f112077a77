"""The tensor sections of a plain aggregate: one coded index set and bfloat16 values per tensor.

A tensor of Δ̄ is a sorted set of flat positions into its shape and one value per position. Its
positions are the union of the contributors' Top-k sets, sparse for a few contributors and dense
for many, so the index set is coded in one of two ways, whichever takes fewer bytes (the Golomb
code on a tie), and every set has exactly one encoding:

* ``RICE`` — the gaps between positions Golomb–Rice coded over the whole tensor as one chunk
  (:func:`protocol.codec.indexcoding.encode_rice`, the code of contribution indices): about
  ``log2(1/d) + 1.5`` bits per position at density ``d``;
* ``BITMAP`` — one bit per element of the tensor, little-endian bit order, zero padding bits: the
  smaller one once the union covers more than about a third of the tensor.

Values are bfloat16, little-endian (the upper half of a float32), which every participant widens
back to float32 exactly: what is signed is what is applied. :func:`round_values` rounds float32 to
them (to nearest, ties to even); :func:`encode_values` refuses values that are not bfloat16
numbers, so the validator cannot sign one Δ̄ and apply another.

    coding, data = encode_index_set(idx, numel)      # idx: sorted unique int64 flat positions
    idx = decode_index_set(coding, data, count, numel, "tok_emb.weight")
    data = encode_values(round_values(values)); values = decode_values(data, "tok_emb.weight")
"""

from __future__ import annotations

import enum

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from protocol.codec.indexcoding import decode_rice, encode_rice, golomb_param, rice_nbytes
from protocol.errors import MalformedPayload, NonFiniteValues

I64 = npt.NDArray[np.int64]
VALUE_BYTES = 2  # bfloat16
RICE_MAX_NUMEL = 2**31 - 1  # the Golomb coder works on int32 gaps; larger tensors use the bitmap


class IndexCoding(enum.IntEnum):
    RICE = 0
    BITMAP = 1


def bitmap_nbytes(numel: int) -> int:
    return (numel + 7) // 8


def _rice_nbytes(idx: I64) -> int:
    """Bytes of the Golomb code of a non-empty set. Dense sets (a mean gap below ~1.6, where the
    bitmap usually wins) get parameter 1: no remainders, each gap in unary — counted from the last
    position alone instead of a pass over the gaps."""
    n = idx.size
    gap_sum = int(idx[-1]) + 1 - n
    if golomb_param(gap_sum, n) == 1:
        return 2 + (n + gap_sum + 7) // 8
    return rice_nbytes(idx, np.array([n], dtype=np.int64))


def encode_index_set(indices: npt.NDArray[np.integer], numel: int) -> tuple[IndexCoding, bytes]:
    """The smaller coding of sorted, unique flat positions ``< numel`` (MalformedPayload otherwise)."""
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if idx.size == 0:
        return IndexCoding.RICE, b""
    if idx[0] < 0 or idx[-1] >= numel or (idx.size > 1 and bool((np.diff(idx) <= 0).any())):
        raise MalformedPayload("indices must be sorted, unique and inside the tensor")
    if numel <= RICE_MAX_NUMEL and _rice_nbytes(idx) <= bitmap_nbytes(numel):
        return IndexCoding.RICE, encode_rice(idx, np.array([idx.size], dtype=np.int64))
    mask = np.zeros(numel, dtype=np.uint8)
    mask[idx] = 1
    return IndexCoding.BITMAP, np.packbits(mask, bitorder="little").tobytes()


def decode_index_set(coding: int, data: bytes | memoryview, count: int, numel: int, what: str) -> I64:
    """Inverse of :func:`encode_index_set`, strict: exactly ``count`` positions ``< numel`` in the
    coding the encoder would have chosen. Raises MalformedPayload / InvalidIndices.

    Memory is proportional to ``data`` and ``count``: a bitmap must be ``numel / 8`` bytes long
    before it is unpacked, and the Golomb decoder reads one position per unary code."""
    if count == 0:
        if coding != IndexCoding.RICE or len(data):
            raise MalformedPayload(f"{what}: index bytes for zero values")
        return np.zeros(0, dtype=np.int64)
    if count > numel:
        raise MalformedPayload(f"{what}: {count} values for {numel} positions")
    size = bitmap_nbytes(numel)
    if coding == IndexCoding.RICE:
        if numel > RICE_MAX_NUMEL or len(data) > size:
            raise MalformedPayload(f"{what}: Golomb-coded indices where the bitmap is the canonical coding")
        local, _ = decode_rice(data, np.array([count], dtype=np.int64), np.array([numel], dtype=np.int64))
        return local
    if coding != IndexCoding.BITMAP:
        raise MalformedPayload(f"{what}: unknown index coding {coding}")
    if len(data) != size:
        raise MalformedPayload(f"{what}: bitmap of {len(data)} bytes for {numel} positions ({size} expected)")
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")
    if bits[numel:].any():
        raise MalformedPayload(f"{what}: non-zero bitmap padding")
    idx = np.flatnonzero(bits[:numel]).astype(np.int64, copy=False)
    if idx.size != count:
        raise MalformedPayload(f"{what}: bitmap holds {idx.size} positions, the table says {count}")
    if numel <= RICE_MAX_NUMEL and _rice_nbytes(idx) <= size:
        raise MalformedPayload(f"{what}: bitmap where the Golomb code is the canonical coding")
    return idx


def round_values(values: Tensor) -> Tensor:
    """float32 values rounded to the nearest bfloat16 number (ties to even), as float32 on the CPU."""
    return values.detach().to("cpu", torch.float32).to(torch.bfloat16).to(torch.float32)


def encode_values(values: Tensor, what: str) -> bytes:
    """Little-endian bfloat16 bytes of finite values that are bfloat16 numbers (MalformedPayload
    for any other: round them with :func:`round_values` and apply the rounded ones)."""
    v = values.detach().to("cpu", torch.float32).reshape(-1).contiguous()
    half = v.to(torch.bfloat16)
    if not bool(torch.isfinite(v).all()) or not torch.equal(half.to(torch.float32), v):
        raise MalformedPayload(f"{what}: values must be finite bfloat16 numbers (see round_values)")
    raw: npt.NDArray[np.int16] = half.view(torch.int16).numpy()
    return raw.astype("<i2").tobytes()


def decode_values(data: bytes | memoryview, what: str) -> Tensor:
    """float32 values of little-endian bfloat16 bytes; NonFiniteValues for NaN or infinity."""
    if len(data) % VALUE_BYTES:
        raise MalformedPayload(f"{what}: {len(data)} value bytes is not a whole number of bfloat16 values")
    wide = np.frombuffer(data, dtype="<u2").astype(np.uint32) << np.uint32(16)
    values = wide.view(np.float32)
    if not np.isfinite(values).all():
        raise NonFiniteValues(f"{what}: non-finite aggregate value")
    return torch.from_numpy(values)

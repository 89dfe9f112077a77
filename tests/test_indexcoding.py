"""Index coding: Golomb-Rice gap streams and the 12-bit baseline."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.codec.bitpack import pack_bits, packed_size, unpack_bits
from protocol.codec.indexcoding import (
    _encode_rice_arith,
    check_positions,
    choose_golomb,
    decode_rice,
    encode_rice,
    from_gaps,
    pack12,
    to_gaps,
    unpack12,
)
from protocol.errors import InvalidIndices, MalformedPayload, ProtocolError


@st.composite
def index_sets(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random chunks: sizes, ks and ascending positions (uniform k or a short last chunk)."""
    n_chunks = draw(st.integers(0, 6))
    size = draw(st.integers(1, 4096))
    sizes = np.full(n_chunks, size, dtype=np.int64)
    if n_chunks and draw(st.booleans()):
        sizes[-1] = draw(st.integers(1, size))
    ks = np.array([draw(st.integers(1, int(s))) for s in sizes], dtype=np.int64)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    local = [np.sort(rng.choice(int(s), int(k), replace=False)) for s, k in zip(sizes, ks)]
    flat = np.concatenate(local).astype(np.int64) if local else np.zeros(0, np.int64)
    return flat, ks, sizes


@settings(max_examples=200, deadline=None)
@given(case=index_sets())
def test_rice_and_packed12_roundtrip(case: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    local, ks, sizes = case
    assert np.array_equal(from_gaps(to_gaps(local, ks).astype(np.int64), ks), local)
    assert np.array_equal(decode_rice(encode_rice(local, ks), ks, sizes)[0], local)
    side = (local % 4).astype(np.uint8)
    back, got = decode_rice(encode_rice(local, ks, side, 2), ks, sizes, 2)
    assert np.array_equal(back, local) and np.array_equal(got, side)
    assert np.array_equal(unpack12(pack12(local), ks, sizes), local)


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.integers(0, 2**16 - 1), max_size=50), width=st.integers(1, 16))
def test_bitpack_roundtrip_little_endian(values: list[int], width: int) -> None:
    v = np.array(values, dtype=np.int64) & ((1 << width) - 1)
    data = pack_bits(v, width)
    assert len(data) == packed_size(v.size, width)
    assert np.array_equal(unpack_bits(data, v.size, width), v)
    as_int = int.from_bytes(data, "little")
    assert all((as_int >> (i * width)) & ((1 << width) - 1) == x for i, x in enumerate(v.tolist()))


def test_bitpack_rejects_padding_and_length() -> None:
    data = pack_bits(np.array([3, 1, 2]), 2)  # 6 bits used of 8
    with pytest.raises(MalformedPayload, match="padding"):
        unpack_bits(bytes([data[0] | 0x80]), 3, 2)
    with pytest.raises(MalformedPayload):
        unpack_bits(data + b"\x00", 3, 2)


def test_rice_bits_per_index_near_the_bound() -> None:
    """k = 64 of 4096: 7.36 bits/index is the bound; the Golomb code must stay within 0.15 of it."""
    rng = np.random.default_rng(0)
    n_chunks = 2000
    local = np.concatenate([np.sort(rng.choice(4096, 64, replace=False)) for _ in range(n_chunks)])
    ks = np.full(n_chunks, 64)
    data = encode_rice(local, ks)
    bits = len(data) * 8 / local.size
    bound = math.log2(math.comb(4096, 64)) / 64
    assert bound == pytest.approx(7.364, abs=1e-3)
    assert bound < bits < bound + 0.15
    assert choose_golomb(to_gaps(local, ks)) in range(40, 48)


def test_rice_is_canonical_and_strict() -> None:
    rng = np.random.default_rng(1)
    local = np.concatenate([np.sort(rng.choice(4096, 64, replace=False)) for _ in range(4)])
    ks, sizes = np.full(4, 64), np.full(4, 4096)
    data = bytearray(encode_rice(local, ks))
    m = int.from_bytes(data[:2], "little")
    other = bytearray(data)
    other[:2] = (m + 1).to_bytes(2, "little")
    with pytest.raises(ProtocolError):
        decode_rice(bytes(other), ks, sizes)
    with pytest.raises(MalformedPayload):
        decode_rice(bytes(data) + b"\x00", ks, sizes)
    with pytest.raises(MalformedPayload):
        decode_rice(bytes(data[:-1]), ks, sizes)
    with pytest.raises(MalformedPayload, match="parameter 0"):
        decode_rice(b"\x00\x00" + bytes(data[2:]), ks, sizes)
    with pytest.raises(InvalidIndices):  # same stream read as chunks of 1000: positions overflow
        decode_rice(bytes(data), ks, np.full(4, 1000))


def test_check_positions_names_the_problem() -> None:
    ks, sizes = np.array([3, 2]), np.array([10, 10])
    check_positions(np.array([0, 4, 9, 0, 9]), ks, sizes)  # restart at a chunk boundary is fine
    for bad in ([0, 4, 4, 0, 9], [0, 5, 4, 0, 9], [0, 4, 10, 0, 9], [0, 4, 9, -1, 9]):
        with pytest.raises(InvalidIndices):
            check_positions(np.array(bad), ks, sizes)
    with pytest.raises(InvalidIndices, match="expects"):
        check_positions(np.array([0, 1]), ks, sizes)


def _golomb_bits(gaps: np.ndarray, m: int) -> int:
    """Bits of the index section for ``gaps`` with parameter ``m > 1`` (without its u16 header)."""
    b = (m - 1).bit_length()
    u = (1 << b) - m
    return gaps.size * b + int((gaps // m).sum()) + int(((gaps % m) >= u).sum())  # unary q+1, b−1 or b


def test_golomb_stream_size_follows_the_code_lengths() -> None:
    rng = np.random.default_rng(2)
    local = np.concatenate([np.sort(rng.choice(2752, 43, replace=False)) for _ in range(50)])
    ks = np.full(50, 43)
    gaps = to_gaps(local, ks).astype(np.int64)
    m = choose_golomb(gaps)
    assert m > 1
    a_bits = (m - 1).bit_length() - 1
    predicted = _golomb_bits(gaps, m)
    # u16 parameter + byte-aligned A stream + B·U stream rounded up to a byte.
    size = 2 + -(-local.size * a_bits // 8) + -(-(predicted - local.size * a_bits) // 8)
    assert len(encode_rice(local, ks)) == size


@settings(max_examples=200, deadline=None)
@given(case=index_sets(), side_bits=st.sampled_from([0, 2]), hint=st.booleans())
def test_rice_table_path_matches_the_arithmetic_coder(
    case: tuple[np.ndarray, np.ndarray, np.ndarray], side_bits: int, hint: bool
) -> None:
    """The table-driven encoder (and its small-set Python path) writes the same bytes as the
    arithmetic one, with or without the geometry hints the codec passes."""
    local, ks, sizes = case
    side = (local * 7 % 4).astype(np.uint8) if side_bits else None
    kw = {"uniform": bool(ks.size and (ks == ks[0]).all()), "max_len": int(sizes.max())} if hint and ks.size else {}
    assert encode_rice(local, ks, side, side_bits, **kw) == _encode_rice_arith(local, ks, side, side_bits)


def test_rice_paths_agree_on_codec_shapes_and_edge_parameters() -> None:
    rng = np.random.default_rng(3)
    cases = [
        (2752, 43, 256),  # 43×64 tiles of a 1376-row matrix
        (4096, 64, 64),
        (4096, 4000, 3),  # dense: Golomb parameter 1, no remainder bits
        (4096, 1, 50),  # sparse: wide remainders (A field over 8 bits)
        (20000, 300, 4),  # chunks longer than the lookup tables: arithmetic fallback
        (512, 8, 1),  # small set: Python path
    ]
    for size, k, n_chunks in cases:
        local = np.concatenate([np.sort(rng.choice(size, k, replace=False)) for _ in range(n_chunks)])
        ks, sizes = np.full(n_chunks, k), np.full(n_chunks, size)
        side = rng.integers(0, 4, local.size).astype(np.uint8)
        for args in ((local, ks), (local, ks, side, 2)):
            data = encode_rice(*args)
            assert data == _encode_rice_arith(*args)
            back, got = decode_rice(data, ks, sizes, 2 if len(args) > 2 else 0)
            assert np.array_equal(back, local)
            if len(args) > 2:
                assert np.array_equal(got, side)
    uneven = np.array([50, 0, 30])  # an empty chunk (not made by the codec): arithmetic path
    local = np.concatenate([np.sort(rng.choice(4096, 50, replace=False)), np.sort(rng.choice(4096, 30, replace=False))])
    assert encode_rice(local, uneven) == _encode_rice_arith(local, uneven)
    assert np.array_equal(decode_rice(encode_rice(local, uneven), uneven, np.full(3, 4096))[0], local)

"""unpack is strict: every malformed payload raises a ProtocolError subclass, never anything else."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.codec import decode, encode, pack, unpack
from protocol.config import CodecConfig
from protocol.errors import InvalidIndices, MalformedPayload, NonFiniteValues, ProtocolError, UnsupportedVersion

CONFIGS = [CodecConfig(index_coding=c) for c in ("rice", "packed12")]
SHAPE = (128, 96)


def payload(cfg: CodecConfig, seed: int = 0) -> bytes:
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))
    return pack(encode(x, cfg))


@pytest.fixture(scope="module")
def blobs() -> dict[int, bytes]:
    return {i: payload(cfg) for i, cfg in enumerate(CONFIGS)}


def accept_or_reject(data: bytes, cfg: CodecConfig) -> None:
    """A payload either fails with a ProtocolError or is canonical (re-packs to the same bytes)."""
    try:
        e = unpack(data, SHAPE, cfg)
    except ProtocolError:
        return
    assert pack(e) == data
    assert torch.isfinite(decode(e)).all()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.integers(0, len(CONFIGS) - 1), data=st.data())
def test_mutations_are_rejected_or_canonical(blobs: dict[int, bytes], which: int, data: st.DataObject) -> None:
    blob = bytearray(blobs[which])
    op = data.draw(st.sampled_from(["flip", "truncate", "extend", "byte"]))
    if op == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            bit = data.draw(st.integers(0, len(blob) * 8 - 1))
            blob[bit // 8] ^= 1 << (bit % 8)
    elif op == "truncate":
        blob = blob[: data.draw(st.integers(0, len(blob) - 1))]
    elif op == "extend":
        blob += data.draw(st.binary(min_size=1, max_size=16))
    else:
        blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.integers(0, 255))
    accept_or_reject(bytes(blob), CONFIGS[which])


@settings(max_examples=150, deadline=None)
@given(garbage=st.binary(max_size=2000), which=st.integers(0, len(CONFIGS) - 1))
def test_garbage_bytes_raise_protocol_error(garbage: bytes, which: int) -> None:
    accept_or_reject(garbage, CONFIGS[which])


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.index_coding)
def test_truncation_and_extension_are_malformed(cfg: CodecConfig) -> None:
    blob = payload(cfg)
    with pytest.raises(MalformedPayload):
        unpack(blob[:-1], SHAPE, cfg)
    with pytest.raises(MalformedPayload):
        unpack(blob + b"\x00", SHAPE, cfg)
    with pytest.raises(MalformedPayload):
        unpack(b"", SHAPE, cfg)


def test_payload_of_another_config_or_shape_is_rejected() -> None:
    blob = payload(CodecConfig())
    with pytest.raises(MalformedPayload, match="tag"):
        unpack(blob, SHAPE, CodecConfig(index_coding="packed12"))
    # (96, 128) has the same chunk counts and would parse: shapes are checked by the wire schema.
    with pytest.raises(ProtocolError):
        unpack(blob, (128, 64), CodecConfig())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_scale_is_rejected(bad: float) -> None:
    blob = bytearray(payload(CodecConfig()))
    struct.pack_into("<f", blob, 1, bad)
    with pytest.raises(NonFiniteValues):
        unpack(bytes(blob), SHAPE, CodecConfig())


def test_negative_scale_is_malformed() -> None:
    blob = bytearray(payload(CodecConfig()))
    struct.pack_into("<f", blob, 1, -1.0)
    with pytest.raises(MalformedPayload, match="negative"):
        unpack(bytes(blob), SHAPE, CodecConfig())


@pytest.mark.parametrize("mode", [1, 2, 3])  # 1 and 2 were 8-bit and fp16 values; 3 never existed
def test_other_value_modes_are_unsupported(mode: int) -> None:
    for cfg in CONFIGS:
        blob = bytearray(payload(cfg))
        blob[0] |= mode  # the tag's low two bits: value mode
        with pytest.raises(UnsupportedVersion, match=f"value mode {mode}"):
            unpack(bytes(blob), SHAPE, cfg)


def test_other_payload_format_is_unsupported() -> None:
    blob = bytearray(payload(CodecConfig()))
    blob[0] = (2 << 4) | (blob[0] & 0x0F)
    with pytest.raises(UnsupportedVersion, match="format 2"):
        unpack(bytes(blob), SHAPE, CodecConfig())


def _packed12_blob(positions: np.ndarray) -> tuple[bytes, CodecConfig, tuple[int, ...]]:
    """A valid 1-chunk packed12 payload whose positions are then replaced."""
    cfg = CodecConfig(index_coding="packed12", k=256)  # 4 kept in a chunk of 64
    shape = (64,)
    blob = pack(encode(torch.randn(shape), cfg))
    head = blob[: len(blob) - 6]
    p = positions.astype(np.uint32)
    pairs = p[0::2] | (p[1::2] << 12)
    tail = b"".join(int(v).to_bytes(3, "little") for v in pairs)
    return head + tail, cfg, shape


@pytest.mark.parametrize(
    "positions,what",
    [
        ([1, 5, 5, 9], "duplicate"),
        ([1, 9, 5, 20], "unsorted"),
        ([1, 5, 9, 64], "outside"),
        ([1, 5, 9, 4095], "outside"),
    ],
)
def test_packed12_bad_positions_are_invalid_indices(positions: list[int], what: str) -> None:
    blob, cfg, shape = _packed12_blob(np.array(positions))
    with pytest.raises(InvalidIndices):
        unpack(blob, shape, cfg)
    good, cfg, shape = _packed12_blob(np.array([1, 5, 9, 63]))
    assert unpack(good, shape, cfg).indices.tolist() == [1, 5, 9, 63]


def test_rice_position_past_the_chunk_is_invalid_indices() -> None:
    cfg = CodecConfig(k=256)
    blob = bytearray(pack(encode(torch.randn(64, generator=torch.Generator().manual_seed(3)), cfg)))
    # Append zero quotient bits before the final terminator: the last gap grows past the chunk end.
    last = len(blob) - 1
    assert blob[last] != 0
    blob[last:] = b"\x00" * 2 + bytes([blob[last]])
    with pytest.raises(InvalidIndices):
        unpack(bytes(blob), (64,), cfg)


def test_huge_or_negative_shapes_fail_before_allocating() -> None:
    blob = payload(CodecConfig())
    with pytest.raises(MalformedPayload, match="shorter than its fixed part"):
        unpack(blob, (1 << 20, 1 << 20), CodecConfig())  # 2^40 values: needs ~2^28 bytes of scales
    with pytest.raises(MalformedPayload, match="negative"):
        unpack(blob, (-128, 96), CodecConfig())

"""The aggregate's bytes (format version 2): coded index sets, bfloat16 values, re-compressed Δ̄.

Every index set has one encoding (the smaller coding, checked on decoding), values are exactly what
every participant applies, a re-compressed aggregate carries codec payloads that decode to the
validator's own Δ̂, and mutated objects of either encoding are refused with a ProtocolError.
"""

from __future__ import annotations

import hashlib
import random
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_wire_fuzz import RAW_MUTATIONS, _run
from wire_samples import BASE, CODEC, PUBLISHED_AT, RUN, SCHEMA, VALIDATOR, aggregate, resign

from protocol import codec
from protocol.broadcast import applied
from protocol.chain import delta_of
from protocol.codec.indexcoding import encode_rice
from protocol.config import CodecConfig
from protocol.errors import MalformedPayload, NonFiniteValues, UnsupportedVersion
from protocol.identity import SIGNATURE_BYTES
from protocol.wire import Aggregate, Encoding, SparseDelta, decode_aggregate, decode_object, encode_aggregate
from protocol.wire.delta import (
    IndexCoding,
    bitmap_nbytes,
    decode_index_set,
    decode_values,
    encode_index_set,
    encode_values,
    round_values,
)
from protocol.wire.fields import TensorEntry, Writer, write_base, write_metadata, write_table
from protocol.wire.frame import FIXED_HEADER_BYTES, Kind, peek_kind

CAP = 1 << 22


def dec(blob: bytes, **kw):  # type: ignore[no-untyped-def]
    kw.setdefault("allowed_signers", [VALIDATOR.public_key])
    return decode_aggregate(blob, run_hash=RUN, max_bytes=CAP, **kw)


def recompressed(seed: int = 0, cfg: CodecConfig = CODEC) -> Aggregate:
    g = torch.Generator().manual_seed(seed)
    tensors = {name: codec.encode(torch.randn(shape, generator=g), cfg) for name, shape in SCHEMA.items()}
    return Aggregate(RUN, 7, BASE, 1.0, "f" * 64, aggregate().manifest, tensors, PUBLISHED_AT)


def random_set(rng: np.random.Generator, numel: int, density: float) -> np.ndarray:
    return np.flatnonzero(rng.random(numel) < density).astype(np.int64)


# ------------------------------------------------------------------------------ index sets
@settings(max_examples=80, deadline=None)
@given(st.integers(1, 6000).flatmap(lambda n: st.tuples(st.just(n), st.sets(st.integers(0, n - 1)))))
def test_index_sets_roundtrip_in_the_smaller_coding(case) -> None:  # type: ignore[no-untyped-def]
    numel, chosen = case
    idx = np.array(sorted(chosen), dtype=np.int64)
    coding, data = encode_index_set(idx, numel)
    assert np.array_equal(decode_index_set(coding, data, idx.size, numel, "t"), idx)
    assert len(data) <= bitmap_nbytes(numel)  # never more than one bit per element


@pytest.mark.parametrize("density", [0.01, 0.2, 0.6])
def test_codings_follow_the_density(density: float) -> None:
    """Sparse unions take the Golomb code, within 6 % of the entropy of the set; dense ones the
    bitmap, one bit per element."""
    numel = 1 << 20
    idx = random_set(np.random.default_rng(1), numel, density)
    coding, data = encode_index_set(idx, numel)
    if density < 0.3:
        d = idx.size / numel
        entropy_bytes = numel * -(d * np.log2(d) + (1 - d) * np.log2(1 - d)) / 8
        assert coding == IndexCoding.RICE and len(data) < 1.06 * entropy_bytes
    else:
        assert coding == IndexCoding.BITMAP and len(data) == bitmap_nbytes(numel)


def test_each_index_set_has_one_encoding() -> None:
    rng = np.random.default_rng(2)
    numel = 10_000
    sparse, dense = random_set(rng, numel, 0.05), random_set(rng, numel, 0.7)
    rice_of_dense = encode_rice(dense, np.array([dense.size]))
    with pytest.raises(MalformedPayload, match="canonical"):
        decode_index_set(IndexCoding.RICE, rice_of_dense, dense.size, numel, "t")
    mask = np.zeros(numel, dtype=np.uint8)
    mask[sparse] = 1
    bitmap_of_sparse = np.packbits(mask, bitorder="little").tobytes()
    with pytest.raises(MalformedPayload, match="canonical"):
        decode_index_set(IndexCoding.BITMAP, bitmap_of_sparse, sparse.size, numel, "t")


def test_bitmaps_are_strict() -> None:
    numel = 1001  # 126 bytes, 7 padding bits
    idx = np.arange(0, numel, 2, dtype=np.int64)
    coding, data = encode_index_set(idx, numel)
    assert coding == IndexCoding.BITMAP
    padded = bytearray(data)
    padded[-1] |= 0x80
    with pytest.raises(MalformedPayload, match="padding"):
        decode_index_set(coding, bytes(padded), idx.size, numel, "t")
    with pytest.raises(MalformedPayload, match="table says"):
        decode_index_set(coding, data, idx.size - 1, numel, "t")
    with pytest.raises(MalformedPayload, match="expected"):
        decode_index_set(coding, data[:-1], idx.size, numel, "t")
    with pytest.raises(MalformedPayload, match="zero values"):
        decode_index_set(IndexCoding.RICE, b"\x01\x00", 0, numel, "t")
    with pytest.raises(MalformedPayload, match="unknown index coding"):
        decode_index_set(5, data, idx.size, numel, "t")


def test_encoder_refuses_unsorted_duplicate_or_outside_indices() -> None:
    for bad in ([3, 2], [2, 2], [-1, 4], [4, 10]):
        with pytest.raises(MalformedPayload, match="sorted, unique"):
            encode_index_set(np.array(bad), 10)


# ------------------------------------------------------------------------------ values
def test_values_are_bfloat16_rounded_to_nearest_and_widened_exactly() -> None:
    x = torch.tensor([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-9, -3.3e-7, 0.0, -0.0, 3.0e38])
    r = round_values(x)
    assert r.tolist()[:3] == [1.0, 1.0, 1.0 + 2**-7]  # ties to even, then up
    assert torch.equal(round_values(r), r)
    back = decode_values(encode_values(r, "t"), "t")
    assert torch.equal(back, r) and torch.equal(torch.signbit(back), torch.signbit(r))
    with pytest.raises(MalformedPayload, match="bfloat16"):
        encode_values(torch.tensor([0.1]), "t")
    with pytest.raises(MalformedPayload, match="bfloat16"):
        encode_values(torch.tensor([float("inf")]), "t")
    with pytest.raises(NonFiniteValues):
        decode_values(struct.pack("<H", 0x7FC0), "t")  # bfloat16 NaN
    with pytest.raises(MalformedPayload, match="whole number"):
        decode_values(b"\x00", "t")


def test_plain_aggregate_costs_about_two_bytes_per_kept_value_when_dense() -> None:
    numel = 512 * 1024
    idx = torch.from_numpy(random_set(np.random.default_rng(3), numel, 0.5))
    vals = round_values(torch.randn(idx.numel()))
    a = Aggregate(RUN, 1, BASE, 1.0, "f" * 64, (), {"w": SparseDelta((512, 1024), idx, vals)}, PUBLISHED_AT)
    blob = encode_aggregate(a, VALIDATOR)
    assert len(blob) < 2 * idx.numel() + numel / 8 + 400  # bfloat16 values + one bit per element
    d = dec(blob).value.tensors["w"]
    assert isinstance(d, SparseDelta) and torch.equal(d.indices, idx) and torch.equal(d.values, vals)


# ------------------------------------------------------------------------------ the object
def test_aggregates_are_format_version_two_and_version_one_is_refused() -> None:
    blob = encode_aggregate(aggregate(), VALIDATOR)
    assert blob[4] == 2 and peek_kind(blob) == Kind.AGGREGATE
    old = bytearray(blob)
    old[4] = 1
    with pytest.raises(UnsupportedVersion, match="aggregate format version 1"):
        dec(bytes(old))
    assert dec(blob).value.codec is None


def test_recompressed_aggregate_roundtrips_to_the_validators_own_delta() -> None:
    a = recompressed(cfg=CodecConfig(k=32))
    blob = encode_aggregate(a, VALIDATOR)
    v = dec(blob, window=7, schema=SCHEMA)
    d = v.value
    assert d.codec == CodecConfig(k=32) and d.manifest == a.manifest and d.nnz == a.nnz
    assert all(isinstance(t, codec.Encoded) for t in d.tensors.values())
    mine, theirs = applied(a.tensors), delta_of(d)
    for name in SCHEMA:
        assert torch.equal(mine[name][0], theirs[name][0]) and torch.equal(mine[name][1], theirs[name][1])
    assert encode_aggregate(a, VALIDATOR) == blob and v.digest == hashlib.sha256(blob).hexdigest()
    # A contribution-sized object: the codec payloads plus the same headers as a plain aggregate.
    payload = sum(len(codec.pack(t)) for t in a.tensors.values() if isinstance(t, codec.Encoded))
    assert len(blob) - payload < 700


def test_recompressed_tensors_need_one_codec_config() -> None:
    a = recompressed()
    mixed = dict(a.tensors)
    name = sorted(mixed)[0]
    mixed[name] = codec.encode(torch.randn(SCHEMA[name]), CodecConfig(k=16))
    with pytest.raises(MalformedPayload, match="one codec config"):
        encode_aggregate(Aggregate(**{**a.__dict__, "tensors": mixed}), VALIDATOR)


def _body(encoding: int) -> bytes:
    """An aggregate body without manifest with one empty tensor, in ``encoding``."""
    w = Writer()
    write_base(w, BASE)
    w.f64(1.0)
    w.text("f" * 64, 128)
    write_metadata(w, {"published_at": 5.0})
    w.varint(0)
    w.u8(encoding)
    write_table(w, [TensorEntry("t", (100,), 0, (0, 0, 0))])
    return w.getvalue()


def test_unknown_encoding_is_malformed() -> None:
    blob = encode_aggregate(aggregate(), VALIDATOR)
    assert dec(resign(blob, VALIDATOR, body=_body(Encoding.SPARSE), payload=b"")).value.nnz == 0
    with pytest.raises(MalformedPayload, match="encoding 9"):
        dec(resign(blob, VALIDATOR, body=_body(9), payload=b""))


def test_mutated_recompressed_aggregates_are_rejected() -> None:
    original = encode_aggregate(recompressed(), VALIDATOR)
    rng = random.Random(5)
    raw = []
    while len(raw) < 600:
        mutated = rng.choice(RAW_MUTATIONS)(rng, original)
        if mutated != original:
            raw.append(mutated)
    outcomes = _run(raw, allow_valid=False)
    assert {"bad_signature", "malformed"} <= set(outcomes), outcomes
    body_len = struct.unpack_from("<I", original, 78)[0]
    body = original[FIXED_HEADER_BYTES : FIXED_HEADER_BYTES + body_len]
    payload = original[FIXED_HEADER_BYTES + body_len : len(original) - SIGNATURE_BYTES]
    resigned = []
    for _ in range(300):
        part = rng.choice(RAW_MUTATIONS[:5])
        if rng.random() < 0.5:
            resigned.append(resign(original, VALIDATOR, payload=part(rng, payload)))
        else:
            resigned.append(resign(original, VALIDATOR, body=part(rng, body) or b"\0"))
    outcomes = _run(resigned, allow_valid=True)
    assert "bad_signature" not in outcomes and sum(n for r, n in outcomes.items() if r != "valid") > 150


def test_inspect_path_decodes_both_encodings() -> None:
    for a in (aggregate(), recompressed()):
        obj = decode_object(encode_aggregate(a, VALIDATOR), max_bytes=CAP, allowed_signers=None).value
        assert isinstance(obj, Aggregate) and obj.nnz == a.nnz

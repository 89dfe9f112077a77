"""Signed objects: round trips, every rejection reason, compactness of the contribution header."""

from __future__ import annotations

import dataclasses
import hashlib
import struct

import numpy as np
import pytest
import torch
from wire_samples import (
    BASE,
    CODEC,
    PEER,
    PUBLISHED_AT,
    RUN,
    SCHEMA,
    VALIDATOR,
    aggregate,
    announcement,
    blobs,
    checkpoint,
    contribution,
    resign,
)

from protocol import codec
from protocol.config import CodecConfig, RunSpec, model_config
from protocol.errors import (
    BadSignature,
    InvalidIndices,
    MalformedPayload,
    NonFiniteValues,
    PayloadTooLarge,
    ProtocolError,
    SchemaMismatch,
    StaleBase,
    UnknownSigner,
    UnsupportedVersion,
    WrongRun,
    WrongWindow,
)
from protocol.identity import Identity
from protocol.wire import (
    GENESIS,
    CheckpointFile,
    Contribution,
    ManifestEntry,
    SparseDelta,
    decode_aggregate,
    decode_announcement,
    decode_checkpoint,
    decode_contribution,
    decode_object,
    encode_aggregate,
    encode_announcement,
    encode_checkpoint,
    encode_contribution,
)
from protocol.wire.delta import encode_index_set, round_values
from protocol.wire.fields import (
    Reader,
    Scalar,
    TensorEntry,
    Writer,
    read_metadata,
    write_base,
    write_codec,
    write_metadata,
    write_table,
)
from protocol.wire.frame import ENVELOPE_OVERHEAD, Kind, peek_kind, seal

CAP = 1 << 20
OTHER_RUN = RunSpec.default().replace(seed=99).hash()


def dec_contrib(data: bytes, **kw):
    return decode_contribution(data, run_hash=kw.pop("run_hash", RUN), max_bytes=kw.pop("max_bytes", CAP), **kw)


def dec_agg(data: bytes, **kw):
    kw.setdefault("allowed_signers", [VALIDATOR.public_key])
    return decode_aggregate(data, run_hash=kw.pop("run_hash", RUN), max_bytes=CAP, **kw)


# ------------------------------------------------------------------------------ round trips
def test_contribution_roundtrip_is_exact_and_signed_by_the_peer() -> None:
    c = contribution()
    blob = encode_contribution(c, PEER)
    v = dec_contrib(blob, window=7, sender=PEER.peer_id, base=BASE, schema=SCHEMA, codec_cfg=CODEC)
    assert v.digest == hashlib.sha256(blob).hexdigest() and v.size == len(blob)
    assert v.sender == PEER.peer_id and v.public_key == PEER.public_key
    d = v.value
    assert (d.run_hash, d.window, d.base, d.codec, dict(d.metadata)) == (RUN, 7, BASE, CODEC, dict(c.metadata))
    assert d.metadata["stage"] == -1 and isinstance(d.metadata["tokens"], int)
    for name in SCHEMA:
        assert torch.equal(codec.decode(d.tensors[name]), codec.decode(c.tensors[name]))
    assert encode_contribution(c, PEER) == blob  # deterministic bytes, deterministic digest


def test_genesis_base_roundtrips() -> None:
    d = dec_contrib(encode_contribution(contribution(base=GENESIS), PEER), base=GENESIS)
    assert d.value.base == GENESIS


def test_aggregate_roundtrip() -> None:
    a = aggregate()
    v = dec_agg(encode_aggregate(a, VALIDATOR), window=7, schema=SCHEMA)
    d = v.value
    assert v.sender == VALIDATOR.peer_id and d.manifest == a.manifest
    assert (d.alpha, d.fingerprint, d.base, dict(d.metadata)) == (a.alpha, a.fingerprint, a.base, dict(a.metadata))
    assert d.published_at == PUBLISHED_AT and "published_at" not in d.metadata
    for name, t in a.tensors.items():
        assert torch.equal(d.tensors[name].indices, t.indices)
        assert torch.equal(d.tensors[name].values, t.values.float())
        assert d.tensors[name].shape == t.shape
    conv = d.tensors["conv.weight"]
    assert conv.shape == (3, 5, 7) and conv.nnz == (3 * 5 * 7) // 10


def test_aggregate_accepts_hex_signer_list() -> None:
    d = dec_agg(encode_aggregate(aggregate(), VALIDATOR), allowed_signers=[VALIDATOR.public_key_hex])
    assert d.sender == VALIDATOR.peer_id


def test_checkpoint_and_announcement_roundtrip() -> None:
    m = checkpoint()
    blobs_ = blobs()
    vm = decode_checkpoint(
        blobs_[Kind.CHECKPOINT], run_hash=RUN, max_bytes=CAP, allowed_signers=[VALIDATOR.public_key], window=10
    )
    dm = vm.value
    assert (dm.files, dm.aggregate, dm.fingerprint, dict(dm.metadata)) == (
        m.files,
        m.aggregate,
        m.fingerprint,
        dict(m.metadata),
    )
    assert dm.published_at == PUBLISHED_AT and vm.sender == VALIDATOR.peer_id
    an = announcement()
    va = decode_announcement(blobs_[Kind.ANNOUNCEMENT], run_hash=RUN, max_bytes=CAP, sender=PEER.peer_id)
    da = va.value
    assert va.sender == PEER.peer_id and va.size == len(blobs_[Kind.ANNOUNCEMENT])
    assert (da.client_version, da.hardware, da.role, dict(da.metadata)) == (
        an.client_version,
        an.hardware,
        an.role,
        dict(an.metadata),
    )
    assert not da.withdrawn


def test_withdrawn_announcement_roundtrip_and_unknown_flags() -> None:
    """A withdrawal is an announcement with the withdrawn flag (with or without a pipeline role);
    flags this version does not know are malformed."""
    for role in (announcement().role, None):
        an = dataclasses.replace(announcement(), role=role, withdrawn=True)
        back = decode_announcement(encode_announcement(an, PEER), run_hash=RUN, max_bytes=CAP, sender=PEER.peer_id)
        assert back.value.withdrawn and back.value.role == role
    plain = dataclasses.replace(announcement(), role=None)
    blob = encode_announcement(plain, PEER)
    body = Writer()
    body.text(plain.client_version, 64)
    body.text(plain.hardware, 1024)
    body.u8(4)  # an unknown flag bit
    write_metadata(body, plain.metadata)
    forged = seal(Kind.ANNOUNCEMENT, RUN, plain.window, PEER, body.getvalue(), b"")
    assert len(forged) == len(blob)
    with pytest.raises(MalformedPayload, match="flags"):
        decode_announcement(forged, run_hash=RUN, max_bytes=CAP, sender=PEER.peer_id)


def test_decode_object_dispatches_on_kind() -> None:
    for kind, blob in blobs().items():
        assert peek_kind(blob) == kind
        assert decode_object(blob, max_bytes=CAP).digest == hashlib.sha256(blob).hexdigest()


# ------------------------------------------------------------------------------ rejections
def test_rejects_wrong_run_window_base_and_sender() -> None:
    blob = encode_contribution(contribution(), PEER)
    with pytest.raises(WrongRun):
        dec_contrib(blob, run_hash=OTHER_RUN)
    with pytest.raises(WrongWindow):
        dec_contrib(blob, window=8)
    with pytest.raises(StaleBase):
        dec_contrib(blob, base=GENESIS)
    with pytest.raises(BadSignature):
        dec_contrib(blob, sender=VALIDATOR.peer_id)


def test_rejects_oversized_objects_before_parsing() -> None:
    blob = encode_contribution(contribution(), PEER)
    with pytest.raises(PayloadTooLarge):
        dec_contrib(blob, max_bytes=len(blob) - 1)
    assert dec_contrib(blob, max_bytes=len(blob)).size == len(blob)


def test_rejects_unknown_magic_version_and_kind() -> None:
    blob = encode_contribution(contribution(), PEER)
    for pos, value in ((0, ord("X")), (4, 2), (5, 9), (5, 0)):
        bad = bytearray(blob)
        bad[pos] = value
        with pytest.raises(UnsupportedVersion):
            dec_contrib(bytes(bad))
    with pytest.raises(UnsupportedVersion, match="expected kind aggregate, found contribution"):
        dec_agg(blob)


def test_rejects_aggregate_signed_by_an_unknown_key() -> None:
    blob = encode_aggregate(aggregate(), PEER)
    with pytest.raises(UnknownSigner):
        dec_agg(blob)
    with pytest.raises(UnknownSigner):
        decode_checkpoint(
            resign(blobs()[Kind.CHECKPOINT], PEER), run_hash=RUN, max_bytes=CAP, allowed_signers=[VALIDATOR.public_key]
        )


def test_rejects_forged_signature_and_substituted_key() -> None:
    blob = bytearray(encode_contribution(contribution(), PEER))
    blob[-1] ^= 0x01
    with pytest.raises(BadSignature):
        dec_contrib(bytes(blob))
    blob = bytearray(encode_contribution(contribution(), PEER))
    blob[46:78] = VALIDATOR.public_key  # claim to be someone else
    with pytest.raises(BadSignature):
        dec_contrib(bytes(blob))


@pytest.mark.parametrize(
    "schema",
    [
        {k: v for k, v in SCHEMA.items() if k != "conv.weight"},  # unknown tensor
        {**SCHEMA, "extra.weight": (4,)},  # missing tensor
        {**SCHEMA, "conv.weight": (3, 7, 5)},  # shape mismatch
    ],
)
def test_schema_mismatch(schema) -> None:
    with pytest.raises(SchemaMismatch):
        dec_contrib(encode_contribution(contribution(), PEER), schema=schema)
    with pytest.raises(SchemaMismatch):
        dec_agg(encode_aggregate(aggregate(), VALIDATOR), schema=schema, partial=False)


def test_aggregates_may_cover_a_subset_of_the_schema_by_default() -> None:
    blob = encode_aggregate(aggregate(), VALIDATOR)
    assert set(dec_agg(blob, schema={**SCHEMA, "extra.weight": (4,)}).value.tensors) == set(SCHEMA)
    empty = encode_aggregate(type(aggregate())(**{**aggregate().__dict__, "tensors": {}}), VALIDATOR)
    assert dec_agg(empty, schema=SCHEMA).value.nnz == 0  # a window nobody contributed to
    for schema in ({k: v for k, v in SCHEMA.items() if k != "conv.weight"}, {**SCHEMA, "conv.weight": (3, 7, 5)}):
        with pytest.raises(SchemaMismatch):
            dec_agg(blob, schema=schema)  # unknown tensor, wrong shape


def test_codec_parameters_must_match_the_run() -> None:
    with pytest.raises(SchemaMismatch) as err:
        dec_contrib(encode_contribution(contribution(), PEER), codec_cfg=CodecConfig(k=128))
    assert err.value.reason == "wrong_codec"


def _contrib_body(rows: list[tuple[int, bytes, tuple[int, ...], int, int]]) -> bytes:
    """A contribution body with a hand-written tensor table: (shared head, middle, shape, dtype, length)."""
    w = Writer()
    write_base(w, BASE)
    write_codec(w, CODEC)
    write_metadata(w, {})
    w.varint(len(rows))
    for shared, suffix, shape, dtype, length in rows:
        w.varint(shared)
        w.varint(0)  # shared tail
        w.varint(len(suffix))
        w.raw(suffix)
        w.u8(len(shape))
        for d in shape:
            w.varint(d)
        w.u8(dtype)
        w.varint(length)
    return w.getvalue()


def test_duplicate_tensor_is_a_schema_mismatch_and_disorder_is_malformed() -> None:
    one = codec.pack(codec.encode(torch.randn(100), CODEC))
    base = encode_contribution(contribution(), PEER)
    dup = _contrib_body([(0, b"a", (100,), 0, len(one)), (0, b"a", (100,), 0, len(one))])
    with pytest.raises(SchemaMismatch, match="duplicate"):
        dec_contrib(resign(base, PEER, body=dup, payload=one + one))
    unsorted = _contrib_body([(0, b"b", (100,), 0, len(one)), (0, b"a", (100,), 0, len(one))])
    with pytest.raises(MalformedPayload, match="sorted"):
        dec_contrib(resign(base, PEER, body=unsorted, payload=one + one))
    ok = _contrib_body([(0, b"a", (100,), 0, len(one)), (0, b"b", (100,), 0, len(one))])
    assert set(dec_contrib(resign(base, PEER, body=ok, payload=one + one)).value.tensors) == {"a", "b"}
    noncanonical = _contrib_body([(0, b"ab", (100,), 0, len(one)), (0, b"ac", (100,), 0, len(one))])
    with pytest.raises(MalformedPayload, match="canonical"):
        dec_contrib(resign(base, PEER, body=noncanonical, payload=one + one))
    bad_dtype = _contrib_body([(0, b"a", (100,), 7, len(one))])
    with pytest.raises(MalformedPayload, match="dtype"):
        dec_contrib(resign(base, PEER, body=bad_dtype, payload=one))


def test_payload_lengths_must_add_up() -> None:
    one = codec.pack(codec.encode(torch.randn(100), CODEC))
    base = encode_contribution(contribution(), PEER)
    for declared, actual in ((len(one) + 1, one), (len(one), one + b"\0")):
        with pytest.raises(MalformedPayload):
            dec_contrib(resign(base, PEER, body=_contrib_body([(0, b"a", (100,), 0, declared)]), payload=actual))


def test_shape_far_larger_than_its_payload_is_rejected_without_building_it() -> None:
    one = codec.pack(codec.encode(torch.randn(100), CODEC))
    body = _contrib_body([(0, b"a", (2**31, 2**8), 0, len(one))])
    with pytest.raises(MalformedPayload, match="cannot fit"):
        dec_contrib(resign(encode_contribution(contribution(), PEER), PEER, body=body, payload=one))


def test_codec_errors_name_the_tensor() -> None:
    blob = encode_contribution(contribution(), PEER)
    payload = bytearray(blob[-64 - sum(len(codec.pack(e)) for e in contribution().tensors.values()) : -64])
    payload[0] ^= 0xFF  # the first tensor's codec tag
    with pytest.raises(ProtocolError, match="tensor blocks.0.attn.wq.weight"):
        dec_contrib(resign(blob, PEER, payload=bytes(payload)))


def _agg_blob(shape: tuple[int, ...], idx_bytes: bytes, nnz: int, values: bytes, coding: int = 0) -> bytes:
    w = Writer()
    write_base(w, BASE)
    w.f64(1.0)
    w.text("f" * 64, 128)
    write_metadata(w, {"published_at": 5.0})
    w.varint(0)
    w.u8(0)  # encoding: sparse, bfloat16 values
    write_table(w, [TensorEntry("t", shape, 0, (nnz, coding, len(idx_bytes)))])
    return resign(encode_aggregate(aggregate(), VALIDATOR), VALIDATOR, body=w.getvalue(), payload=idx_bytes + values)


def _bf16(*values: float) -> bytes:
    return (np.array(values, dtype="<f4").view("<u4") >> 16).astype("<u2").tobytes()


def test_aggregate_indices_and_values_are_checked() -> None:
    vals = _bf16(1.0, 1.0)
    coding, good = encode_index_set(np.array([5, 99]), 100)
    assert dec_agg(_agg_blob((100,), good, 2, vals, coding)).value.tensors["t"].indices.tolist() == [5, 99]
    with pytest.raises(InvalidIndices):
        dec_agg(_agg_blob((50,), good, 2, vals, coding))
    with pytest.raises(MalformedPayload):
        dec_agg(_agg_blob((100,), good, 3, vals + vals[:2], coding))
    with pytest.raises(NonFiniteValues):
        dec_agg(_agg_blob((100,), good, 2, _bf16(1.0, float("nan")), coding))
    with pytest.raises(MalformedPayload):
        dec_agg(_agg_blob((1,), b"", 2, vals))  # more values than positions
    with pytest.raises(MalformedPayload, match="index coding"):
        dec_agg(_agg_blob((100,), good, 2, vals, 7))


def test_encoders_refuse_bad_input() -> None:
    with pytest.raises(MalformedPayload):
        encode_contribution(contribution(base="not-a-digest"), PEER)
    a = aggregate()
    bad = ManifestEntry("../etc", BASE, 1.0)
    with pytest.raises(MalformedPayload):
        encode_aggregate(type(a)(**{**a.__dict__, "manifest": (bad,)}), VALIDATOR)
    t = SparseDelta((10,), torch.tensor([3, 3]), torch.ones(2))
    with pytest.raises(MalformedPayload):
        encode_aggregate(type(a)(**{**a.__dict__, "tensors": {"x": t}}), VALIDATOR)
    unrounded = SparseDelta((10,), torch.tensor([3]), torch.tensor([0.1]))  # signed ≠ applied
    with pytest.raises(MalformedPayload, match="bfloat16"):
        encode_aggregate(type(a)(**{**a.__dict__, "tensors": {"x": unrounded}}), VALIDATOR)
    rounded = SparseDelta((10,), torch.tensor([3]), round_values(torch.tensor([0.1])))
    assert dec_agg(encode_aggregate(type(a)(**{**a.__dict__, "tensors": {"x": rounded}}), VALIDATOR)).value.nnz == 1
    mixed_agg = {"x": rounded, "y": codec.encode(torch.randn(10), CODEC)}
    with pytest.raises(MalformedPayload, match="all sparse deltas or all encoded"):
        encode_aggregate(type(a)(**{**a.__dict__, "tensors": mixed_agg}), VALIDATOR)
    c = contribution()
    mixed = {**c.tensors, "z": codec.encode(torch.randn(10), CodecConfig(k=128))}
    with pytest.raises(MalformedPayload, match="another codec config"):
        encode_contribution(Contribution(RUN, 1, BASE, CODEC, mixed), PEER)


# ------------------------------------------------------------------------------ size
def test_contribution_header_is_tiny_for_a_llama_model() -> None:
    """The header of a 75-tensor model must stay near 0.001 bits/param of a 10M-param model."""
    from protocol.model import param_schema

    schema = param_schema(model_config("tiny", n_layers=8, dim=128, ffn_dim=344))  # 75 tensors
    assert len(schema) >= 70
    tensors = {n: codec.encode(torch.randn(s), CODEC) for n, s in schema.items()}
    blob = encode_contribution(Contribution(RUN, 12345, BASE, CODEC, tensors, {"loss": 2.0}), PEER)
    overhead = len(blob) - sum(len(codec.pack(e)) for e in tensors.values())
    assert ENVELOPE_OVERHEAD < overhead < 1600  # measured: ~1.4 KB
    assert overhead * 8 / 10e6 < 0.0013


def test_fixed_header_layout_is_stable() -> None:
    blob = blobs()[Kind.ANNOUNCEMENT]
    magic, version, kind, run_raw, window = struct.unpack_from("<4sBB32sQ", blob)
    assert (magic, version, kind, run_raw.hex(), window) == (b"SLoC", 1, 4, RUN, 3)
    assert blob[46:78] == PEER.public_key


def test_identity_of_signer_is_not_taken_from_metadata() -> None:
    other = Identity.generate()
    blob = resign(encode_contribution(contribution(), PEER), other)
    assert dec_contrib(blob).sender == other.peer_id


def test_large_manifest_without_tensors_roundtrips() -> None:
    a = aggregate()
    peers = [Identity.from_seed(i.to_bytes(2, "big") * 16).peer_id for i in range(300)]
    entries = tuple(ManifestEntry(p, BASE, i / 7) for i, p in enumerate(peers))
    blob = encode_aggregate(type(a)(**{**a.__dict__, "manifest": entries, "tensors": {}}), VALIDATOR)
    d = dec_agg(blob).value
    assert d.manifest == entries and d.tensors == {}


def test_checkpoint_files_must_be_keys_of_that_checkpoint() -> None:
    m = checkpoint(window=10)
    prefix = f"{RUN[:16]}/checkpoint/00000010/"
    bad_keys = ("model.safetensors", prefix + "../x", prefix + ".hidden", "", f"{RUN[:16]}/checkpoint/00000011/model")
    for bad in bad_keys:
        files = (CheckpointFile(bad, BASE, 1),)
        blob = encode_checkpoint(type(m)(**{**m.__dict__, "files": files}), VALIDATOR)
        with pytest.raises(MalformedPayload):
            decode_checkpoint(blob, run_hash=RUN, max_bytes=CAP, allowed_signers=None)


def test_manifest_lists_each_peer_once() -> None:
    a = aggregate()
    twice = (a.manifest[0], a.manifest[0])
    with pytest.raises(MalformedPayload, match="twice"):
        dec_agg(encode_aggregate(type(a)(**{**a.__dict__, "manifest": twice}), VALIDATOR))


def test_partial_schema_accepts_a_subset_but_not_strangers() -> None:
    blob = encode_contribution(contribution(), PEER)
    bigger = {**SCHEMA, "blocks.1.attn.wq.weight": (64, 96)}
    assert set(dec_contrib(blob, schema=bigger, partial=True).value.tensors) == set(SCHEMA)
    with pytest.raises(SchemaMismatch):
        dec_contrib(blob, schema=bigger)
    with pytest.raises(SchemaMismatch):
        dec_contrib(blob, schema={"conv.weight": (3, 5, 7)}, partial=True)
    agg = encode_aggregate(aggregate(), VALIDATOR)
    assert dec_agg(agg, schema=bigger, partial=True).value.nnz > 0


def test_checkpoint_metadata_is_signed_and_bounded() -> None:
    m = checkpoint()
    blob = encode_checkpoint(m, VALIDATOR)
    bare = encode_checkpoint(type(m)(**{**m.__dict__, "metadata": {}}), VALIDATOR)
    assert decode_checkpoint(bare, run_hash=RUN, max_bytes=CAP, allowed_signers=None).value.metadata == {}
    assert blob != bare  # the metadata is covered by the signature
    with pytest.raises(MalformedPayload):
        encode_checkpoint(type(m)(**{**m.__dict__, "metadata": {f"k{i}": i for i in range(65)}}), VALIDATOR)


def _with_published_at(blob: bytes, value: Scalar | None, signer: Identity) -> bytes:
    """``blob`` (a checkpoint manifest or an aggregate) re-signed with ``published_at`` replaced by
    ``value`` in its metadata, or dropped when ``value`` is None."""
    body_len = struct.unpack_from("<I", blob, 78)[0]
    body = blob[90 : 90 + body_len]
    r = Reader(body)
    kind = peek_kind(blob)
    r.take(32)  # base / aggregate digest
    if kind == Kind.AGGREGATE:
        r.f64()  # alpha
    else:
        r.take(32)  # launch
    r.text(128)  # fingerprint
    start = len(body) - r.remaining
    meta = read_metadata(r)
    end = len(body) - r.remaining
    meta.pop("published_at")
    if value is not None:
        meta["published_at"] = value
    w = Writer()
    write_metadata(w, meta)
    return resign(blob, signer, body=body[:start] + w.getvalue() + body[end:])


@pytest.mark.parametrize("kind", [Kind.AGGREGATE, Kind.CHECKPOINT], ids=lambda k: k.label)
@pytest.mark.parametrize("value", [None, 3, True, "now", -1.0], ids=["missing", "int", "bool", "text", "negative"])
def test_validator_objects_must_carry_published_at(kind: Kind, value: Scalar | None) -> None:
    blob = blobs()[kind]
    assert _with_published_at(blob, PUBLISHED_AT, VALIDATOR) == blob  # the surgery itself is exact
    with pytest.raises(MalformedPayload, match="published_at"):
        decode_object(_with_published_at(blob, value, VALIDATOR), max_bytes=CAP)


def test_published_at_is_not_metadata_when_encoding() -> None:
    m, a = checkpoint(), aggregate()
    with pytest.raises(MalformedPayload, match="published_at"):
        encode_checkpoint(type(m)(**{**m.__dict__, "metadata": {"published_at": 1.0}}), VALIDATOR)
    with pytest.raises(MalformedPayload, match="not a time"):
        encode_aggregate(type(a)(**{**a.__dict__, "published_at": float("nan")}), VALIDATOR)

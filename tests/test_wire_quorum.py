"""The objects of several validators (protocol.wire.quorum): proposals, endorsements, objections
and certificates round trip; the clip caps a proposal carries clip exactly as the leader's did;
a certificate counts m distinct endorsements of its own aggregate and nothing else; hostile bytes
fail with a ProtocolError and nothing else."""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from wire_samples import RUN, SCHEMA, aggregate, resign

from protocol.aggregate import NormLimit, clip_to_limits
from protocol.errors import (
    BadSignature,
    MalformedPayload,
    PayloadTooLarge,
    ProtocolError,
    UnknownSigner,
    UnsupportedVersion,
    WrongWindow,
)
from protocol.identity import Identity
from protocol.wire import decode_object, encode_aggregate
from protocol.wire.fields import Writer, write_peer_id
from protocol.wire.frame import FIXED_HEADER_BYTES
from protocol.wire.quorum import (
    MAX_DETAIL_BYTES,
    MAX_ENDORSEMENT_BYTES,
    MAX_LABEL_BYTES,
    MAX_OBJECTION_BYTES,
    MAX_REASONS,
    Endorsement,
    NoQuorum,
    Objection,
    Reason,
    TensorCaps,
    caps_of,
    certificate_bytes,
    decode_certificate,
    decode_endorsement,
    decode_objection,
    decode_proposal,
    encode_certificate,
    encode_endorsement,
    encode_objection,
    encode_proposal,
    limits_of,
)

VALIDATORS = [Identity.from_seed(bytes([65 + i]) * 32) for i in range(4)]  # A, B, C, D
A, B, C, D = VALIDATORS
KEYS = [v.public_key for v in VALIDATORS]
STRANGER = Identity.from_seed(b"s" * 32)
OTHER_RUN = hashlib.sha256(b"another run").hexdigest()
W = 7
M = 3  # 3 of 4
CAP = 1 << 22
PEERS = [Identity.from_seed(bytes([97 + i]) * 32).peer_id for i in range(4)]


def agg_blob(identity: Identity = A, window: int = W, seed: int = 0) -> bytes:
    return encode_aggregate(aggregate(window, seed), identity)


def digest(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


def endorse(identity: Identity, of: bytes, *, window: int = W, run: str = RUN, view: int = 0) -> bytes:
    return encode_endorsement(Endorsement(run, window, view, A.peer_id, digest(of)), identity)


def certificate(endorsers: list[Identity], *, agg: bytes | None = None, writer: Identity = A) -> bytes:
    agg = agg_blob() if agg is None else agg
    return encode_certificate(agg, [endorse(v, agg) for v in endorsers], W, RUN, writer)


def dec_cert(blob: bytes, quorum: int = M, **kw):  # type: ignore[no-untyped-def]
    kw.setdefault("run_hash", RUN)
    kw.setdefault("allowed_signers", KEYS)
    return decode_certificate(blob, max_bytes=certificate_bytes(CAP, len(KEYS)), quorum=quorum, **kw)


def dec_proposal(blob: bytes, **kw):  # type: ignore[no-untyped-def]
    kw.setdefault("allowed_signers", KEYS)
    return decode_proposal(blob, run_hash=RUN, max_bytes=CAP, **kw)


def body_of(blob: bytes) -> bytes:
    (body_len,) = struct.unpack_from("<I", blob, 78)
    return blob[FIXED_HEADER_BYTES : FIXED_HEADER_BYTES + body_len]


def sample_caps() -> dict[str, dict[str, TensorCaps] | None]:
    return {
        PEERS[0]: {
            "blocks.0.attn.wq.weight": TensorCaps(2.5, 0.75, 96, ((0, 0.0), (5, 0.25), (63, 0.5))),
            "blocks.0.norm.weight": TensorCaps(0.125, 0.0, 0),
        },
        PEERS[1]: None,  # not clipped
        PEERS[2]: {"blocks.0.attn.wq.weight": TensorCaps(math.inf, math.inf, 96, ((3, 0.0),))},  # held back only
    }


# ------------------------------------------------------------------------------ round trips
def test_proposal_round_trips_with_its_aggregate_and_caps() -> None:
    agg = agg_blob()
    blob = encode_proposal(2, sample_caps(), agg, W, RUN, A)
    p = dec_proposal(blob, window=W, schema=SCHEMA)
    assert p.sender == A.peer_id and p.value.view == 2
    assert p.value.caps == sample_caps()
    assert p.value.aggregate.digest == digest(agg) and p.value.aggregate.value.manifest == aggregate().manifest
    assert encode_proposal(2, dict(reversed(sample_caps().items())), agg, W, RUN, A) == blob  # one encoding
    with pytest.raises(WrongWindow):
        dec_proposal(blob, window=W + 1)


def test_endorsement_round_trips() -> None:
    e = Endorsement(RUN, W, 3, A.peer_id, digest(b"x"))
    blob = encode_endorsement(e, B)
    v = decode_endorsement(blob, run_hash=RUN, allowed_signers=KEYS, window=W, sender=B.peer_id)
    assert v.value == e and v.sender == B.peer_id and len(blob) <= MAX_ENDORSEMENT_BYTES
    with pytest.raises(UnknownSigner):
        decode_endorsement(blob, run_hash=RUN, allowed_signers=[A.public_key])
    with pytest.raises(ProtocolError):
        decode_endorsement(blob, run_hash=RUN, allowed_signers=KEYS, sender=C.peer_id)


def test_objection_round_trips_and_clips_long_reasons_to_its_cap() -> None:
    o = Objection(
        RUN, W, 1, A.peer_id, digest(b"x"), (Reason("norm", PEERS[0], "‖Δ‖ = 3.5 > 2.0"), Reason("x", "", ""))
    )
    blob = encode_objection(o, C)
    assert decode_objection(blob, run_hash=RUN, allowed_signers=KEYS, window=W, sender=C.peer_id).value == o
    # The longest objection: more reasons than kept, multi-byte text longer than the fields hold.
    long = Reason("ü" * 100, "ß" * 100, "Δ" * 1000)
    huge = Objection(RUN, W, 1, A.peer_id, digest(b"x"), (long,) * (MAX_REASONS + 5))
    blob = encode_objection(huge, C)
    assert len(blob) <= MAX_OBJECTION_BYTES
    got = decode_objection(blob, run_hash=RUN, allowed_signers=KEYS).value.reasons
    assert len(got) == MAX_REASONS
    r = got[0]
    assert r.check.endswith("…") and r.detail.endswith("…") and r.peer.endswith("…")
    assert len(r.check.encode()) <= MAX_LABEL_BYTES and len(r.detail.encode()) <= MAX_DETAIL_BYTES
    assert r.detail[:-1] == "Δ" * (len(r.detail) - 1) and len(r.detail.encode()) > MAX_DETAIL_BYTES - 5


def test_certificate_round_trips() -> None:
    agg = agg_blob()
    blob = certificate([C, A, B], agg=agg, writer=D)  # any validator may write it
    cert = dec_cert(blob, window=W, schema=SCHEMA)
    assert cert.sender == D.peer_id
    assert cert.value.signers == tuple(sorted(v.peer_id for v in (A, B, C)))
    assert cert.value.aggregate.digest == digest(agg) and cert.value.aggregate.sender == A.peer_id
    assert len(blob) <= certificate_bytes(len(agg), len(KEYS))


# ------------------------------------------------------------------------------ the caps clip alike
def _limits(g: torch.Generator) -> dict[str, dict[str, NormLimit] | None]:
    rows, cols = SCHEMA["blocks.0.attn.wq.weight"]
    per_row = torch.rand(rows, generator=g, dtype=torch.float64) * 1.5  # some below the row cap, some above
    held = torch.rand(rows, generator=g) < 0.2
    with_rows = NormLimit(4.0, 0.8, cols, torch.where(held, torch.zeros_like(per_row), per_row))
    unclipped = torch.full((rows,), math.inf, dtype=torch.float64)
    return {
        PEERS[0]: {"blocks.0.attn.wq.weight": with_rows, "blocks.0.norm.weight": NormLimit(0.5)},
        # a run that does not clip, rows held back (validator.concentration.held_back)
        PEERS[1]: {"blocks.0.attn.wq.weight": NormLimit(math.inf, math.inf, cols, torch.where(held, 0.0, unclipped))},
        # no row cap: the per-row caps do not apply (protocol.aggregate.clip_to_limits)
        PEERS[2]: {"blocks.0.attn.wq.weight": NormLimit(3.0, 0.0, cols, torch.where(held, 0.0, per_row))},
        PEERS[3]: None,
    }


def _contribution(g: torch.Generator) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    out = {}
    for name, shape in SCHEMA.items():
        numel = math.prod(shape)
        idx = torch.randperm(numel, generator=g)[: numel // 4].sort().values
        out[name] = (idx, torch.randn(idx.numel(), generator=g) * 0.3)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_the_caps_of_a_proposal_clip_bit_for_bit_as_the_leaders(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    limits = _limits(g)
    blob = encode_proposal(0, caps_of(limits), agg_blob(), W, RUN, A)
    rebuilt = limits_of(dec_proposal(blob).value.caps, SCHEMA)
    assert set(rebuilt) == set(limits) and rebuilt[PEERS[3]] is None
    changed = 0
    for peer, lim in limits.items():
        if lim is None:
            continue
        c = _contribution(g)
        (theirs,) = clip_to_limits([c], lim)
        (ours,) = clip_to_limits([c], rebuilt[peer] or {})
        for name in theirs:
            assert torch.equal(theirs[name][0], ours[name][0])
            assert torch.equal(theirs[name][1], ours[name][1]), (peer, name)
            changed += int(not torch.equal(theirs[name][1], c[name][1].float()))
    assert changed >= 2  # the caps did clip: the comparison is not between two no-ops
    # rows held back are left out under a row cap, kept without one
    rows_held = limits[PEERS[1]]["blocks.0.attn.wq.weight"].rows  # type: ignore[index]
    assert rows_held is not None and bool((rows_held == 0).any())


def test_caps_on_tensors_or_rows_outside_the_schema_are_refused() -> None:
    with pytest.raises(MalformedPayload, match="not a parameter"):
        limits_of({PEERS[0]: {"nope": TensorCaps(1.0, 0.0, 0)}}, SCHEMA)
    with pytest.raises(MalformedPayload, match="row 64 of 64"):
        limits_of({PEERS[0]: {"blocks.0.attn.wq.weight": TensorCaps(1.0, 1.0, 96, ((64, 0.0),))}}, SCHEMA)
    with pytest.raises(MalformedPayload, match="row length"):
        limits_of({PEERS[0]: {"blocks.0.attn.wq.weight": TensorCaps(1.0, 1.0, 95, ((1, 0.0),))}}, SCHEMA)


def test_caps_that_are_no_numbers_are_not_encoded() -> None:
    for bad in (TensorCaps(math.nan, 0.0, 0), TensorCaps(-1.0, 0.0, 0), TensorCaps(1.0, -0.5, 4)):
        with pytest.raises(MalformedPayload, match="caps must be"):
            encode_proposal(0, {PEERS[0]: {"blocks.0.norm.weight": bad}}, agg_blob(), W, RUN, A)


# ------------------------------------------------------------------------------ hostile proposals
def _tensor(
    name: str, flags: int = 0, norm: float = 1.0, row: float = 0.5, rows: tuple[tuple[int, float], ...] = ()
) -> bytes:
    w = Writer()
    w.text(name)
    w.u8(flags)
    for bit, cap in ((1, norm), (2, row)):
        if not flags & bit:
            w.f64(cap)
    w.varint(96)
    w.varint(len(rows))
    for i, cap in rows:
        w.varint(i)
        w.f64(cap)
    return w.getvalue()


def _peer(peer: str, tensors: list[bytes] | None, flag: int | None = None) -> bytes:
    w = Writer()
    write_peer_id(w, peer)
    w.u8((0 if tensors is None else 1) if flag is None else flag)
    if tensors is not None:
        w.varint(len(tensors))
        for t in tensors:
            w.raw(t)
    return w.getvalue()


def _caps_body(*peers: bytes, view: int = 0, reference: bool = True) -> bytes:
    """A proposal body: the view, the caps of ``peers`` and (``reference``) an empty reference."""
    w = Writer()
    w.varint(view)
    w.varint(len(peers))
    for p in peers:
        w.raw(p)
    if reference:
        w.varint(0)
    return w.getvalue()


P0, P1 = sorted(PEERS[:2])
GOOD_TENSOR = _tensor("a", rows=((1, 0.0), (4, 0.25)))


@pytest.mark.parametrize(
    "body, fragment",
    [
        (_caps_body(_peer(P0, None), _peer(P0, None)), "out of order or twice"),  # duplicate caps
        (_caps_body(_peer(P1, None), _peer(P0, None)), "out of order"),
        (_caps_body(_peer(P0, [GOOD_TENSOR, GOOD_TENSOR])), "out of order or twice"),  # a tensor twice
        (_caps_body(_peer(P0, [_tensor("b"), _tensor("a")])), "out of order"),
        (_caps_body(_peer(P0, [_tensor("a", rows=((4, 0.0), (1, 0.0)))])), "sorted and unique"),
        (_caps_body(_peer(P0, [_tensor("a", rows=((4, 0.0), (4, 0.0)))])), "sorted and unique"),
        (_caps_body(_peer(P0, None, flag=2)), "flag 2"),
        (_caps_body(_peer(P0, [_tensor("a", flags=4)])), "flags 4"),
        (_caps_body(_peer(P0, [_tensor("a", norm=-1.0)])), "negative cap"),
        (_caps_body(_peer(P0, [_tensor("a", rows=((1, -0.5),))])), "negative cap"),
        (_caps_body(_peer(P0, None)) + b"\0", "trailing"),  # extra bytes
        (_caps_body(_peer(P0, None), reference=False)[:-1], "cannot fit"),  # truncated
        (_caps_body(_peer(P0, [GOOD_TENSOR]), reference=False)[:-1], "cannot fit"),
        (_caps_body(_peer(P0, [_tensor("a")]), reference=False)[:-2], "needs"),
        (_caps_body(_peer(P0, None), reference=False), "needs"),
        (_caps_body(_peer(P0, None), reference=False) + b"\x80\x80\x80\x04", "exceeds"),  # a reference > 4 MiB
        (_caps_body(view=1 << 21), "exceeds"),
    ],
)
def test_hostile_proposal_bodies_are_malformed(body: bytes, fragment: str) -> None:
    blob = encode_proposal(0, {}, agg_blob(), W, RUN, A)
    control = _caps_body(_peer(P0, [GOOD_TENSOR, _tensor("b", flags=3)]), _peer(P1, None))
    caps = dec_proposal(resign(blob, A, body=control)).value.caps
    assert caps == {
        P0: {"a": TensorCaps(1.0, 0.5, 96, ((1, 0.0), (4, 0.25))), "b": TensorCaps(math.inf, math.inf, 96)},
        P1: None,
    }
    with pytest.raises(MalformedPayload, match=fragment):
        dec_proposal(resign(blob, A, body=body))


def test_a_proposal_must_carry_its_own_signers_aggregate() -> None:
    blob = encode_proposal(0, {}, agg_blob(B), W, RUN, A)
    with pytest.raises(MalformedPayload, match="carries an aggregate by"):
        dec_proposal(blob)
    with pytest.raises(UnknownSigner):  # an aggregate by a stranger, inside a validator's proposal
        dec_proposal(encode_proposal(0, {}, agg_blob(STRANGER), W, RUN, A))
    with pytest.raises(WrongWindow):  # an aggregate of another window
        dec_proposal(encode_proposal(0, {}, agg_blob(window=W + 1), W, RUN, A))
    with pytest.raises(UnknownSigner):
        dec_proposal(encode_proposal(0, {}, agg_blob(STRANGER), W, RUN, STRANGER))


def _samples() -> dict[str, bytes]:
    agg = agg_blob()
    return {
        "proposal": encode_proposal(0, sample_caps(), agg, W, RUN, A),
        "endorsement": endorse(B, agg),
        "objection": encode_objection(Objection(RUN, W, 0, A.peer_id, digest(agg), (Reason("n", "", "1 > 0"),)), C),
        "certificate": certificate([A, B, C], agg=agg),
    }


SIGNER = {"proposal": A, "endorsement": B, "objection": C, "certificate": A}
DECODERS: dict[str, Callable[[bytes], object]] = {
    "proposal": lambda b: dec_proposal(b),
    "endorsement": lambda b: decode_endorsement(b, run_hash=RUN, allowed_signers=KEYS),
    "objection": lambda b: decode_objection(b, run_hash=RUN, allowed_signers=KEYS),
    "certificate": lambda b: dec_cert(b),
}


@pytest.mark.parametrize("kind", list(DECODERS))
def test_truncated_extended_and_misdirected_objects_are_refused(kind: str) -> None:
    samples = _samples()
    blob, decode = samples[kind], DECODERS[kind]
    decode(blob)
    for bad in (blob[:-1], blob[: FIXED_HEADER_BYTES + 3], blob + b"\0", b""):
        with pytest.raises((MalformedPayload, BadSignature, PayloadTooLarge, UnsupportedVersion)):
            decode(bad)
    with pytest.raises(MalformedPayload, match="trailing"):
        decode(resign(blob, SIGNER[kind], body=body_of(blob) + b"\0"))
    for other, wrong in samples.items():
        if other != kind:
            with pytest.raises((UnsupportedVersion, PayloadTooLarge)) as err:  # the size is checked first
                decode(wrong)
            assert isinstance(err.value, PayloadTooLarge) or f"expected kind {kind}" in str(err.value)


def test_endorsements_carry_no_payload() -> None:
    with pytest.raises(MalformedPayload, match="no payload"):
        decode_endorsement(resign(endorse(B, b"x"), B, payload=b"x"), run_hash=RUN, allowed_signers=KEYS)


# ------------------------------------------------------------------------------ certificates
def test_a_certificate_needs_m_distinct_endorsements_of_its_digest() -> None:
    assert dec_cert(certificate([A, B, C])).value.signers == tuple(sorted(v.peer_id for v in (A, B, C)))
    assert len(dec_cert(certificate(VALIDATORS), quorum=4).value.signers) == 4
    with pytest.raises(NoQuorum, match="2 of 3"):
        dec_cert(certificate([A, B]))
    with pytest.raises(NoQuorum, match="2 of 3"):  # the same signer twice counts once
        dec_cert(certificate([A, B, B]))
    assert len(dec_cert(certificate([A, B, B, C])).value.signers) == 3


@pytest.mark.parametrize(
    "odd",
    [
        lambda agg: endorse(C, agg_blob(seed=1)),  # another aggregate's digest
        lambda agg: endorse(C, agg, window=W + 1),  # the same digest, another window
        lambda agg: endorse(C, agg, run=OTHER_RUN),  # another run
        lambda agg: endorse(STRANGER, agg),  # not a validator of the run
        lambda agg: endorse(C, agg)[:-1],  # broken
        lambda agg: resign(endorse(C, agg), STRANGER),  # C's body signed by someone else
    ],
)
def test_endorsements_of_anything_else_are_not_counted(odd) -> None:  # type: ignore[no-untyped-def]
    agg = agg_blob()
    good = [endorse(A, agg), endorse(B, agg)]
    blob = encode_certificate(agg, [*good, odd(agg)], W, RUN, A)
    with pytest.raises(NoQuorum, match="2 of 3"):
        dec_cert(blob)
    with pytest.raises(NoQuorum):
        dec_cert(blob, run_hash=None)  # a reader that does not check the run still counts per run
    assert dec_cert(encode_certificate(agg, [*good, odd(agg), endorse(C, agg)], W, RUN, A)).value.signers


def test_a_certificate_or_its_aggregate_by_a_stranger_is_refused() -> None:
    with pytest.raises(UnknownSigner):
        dec_cert(certificate([A, B, C], writer=STRANGER))
    with pytest.raises(UnknownSigner):
        dec_cert(certificate([A, B, C], agg=agg_blob(STRANGER)))
    with pytest.raises(WrongWindow):
        dec_cert(certificate([A, B, C]), window=W + 1)
    with pytest.raises(MalformedPayload, match="cannot fit"):  # an empty endorsement: not even a frame
        dec_cert(encode_certificate(agg_blob(), [b"", b"", b""], W, RUN, A))
    # more endorsements than a run can have, or one longer than an endorsement may be
    agg = agg_blob()
    w = Writer()
    w.varint(1 << 11)
    with pytest.raises(MalformedPayload):
        dec_cert(resign(certificate([A]), A, body=w.getvalue()))
    w = Writer()
    w.varint(1)
    w.varint(MAX_ENDORSEMENT_BYTES + 1)
    w.raw(bytes(MAX_ENDORSEMENT_BYTES + 1))
    with pytest.raises(MalformedPayload, match="exceeds"):
        dec_cert(resign(certificate([A], agg=agg), A, body=w.getvalue()))


# ------------------------------------------------------------------------------ fuzz


def _only_protocol_errors(kind: str, data: bytes) -> None:
    try:
        DECODERS[kind](data)
    except ProtocolError:
        pass


@settings(max_examples=150, deadline=None)
@given(
    kind=st.sampled_from(sorted(DECODERS)),
    data=st.binary(max_size=600),
    where=st.sampled_from(["raw", "body", "payload", "tail"]),
)
def test_random_bytes_only_ever_raise_protocol_errors(kind: str, data: bytes, where: str) -> None:
    sample = _samples()[kind]
    if where == "raw":
        crafted = data
    elif where == "tail":  # a valid header, then anything
        crafted = sample[:FIXED_HEADER_BYTES] + data
    else:  # signed again around random bytes: reaches the body and payload parsers
        crafted = resign(sample, SIGNER[kind], **{where: data})
    _only_protocol_errors(kind, crafted)


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(sorted(DECODERS)), at=st.integers(0, 1 << 16), value=st.integers(0, 255), cut=st.booleans())
def test_edited_bodies_signed_again_only_ever_raise_protocol_errors(kind: str, at: int, value: int, cut: bool) -> None:
    sample = _samples()[kind]
    body = bytearray(body_of(sample))
    i = at % len(body)
    if cut:
        del body[i:]
    else:
        body[i] = value
    _only_protocol_errors(kind, resign(sample, SIGNER[kind], body=bytes(body)))


def test_the_generic_decoder_refuses_these_kinds_by_name() -> None:
    """``decode_object`` (what ``sparseloco inspect`` shows) knows the five kinds of one validator:
    the objects of several are refused as an unexpected kind, never misread or crashed on."""
    for kind, blob in _samples().items():
        with pytest.raises(UnsupportedVersion, match=f"found {kind}"):
            decode_object(blob, max_bytes=CAP)

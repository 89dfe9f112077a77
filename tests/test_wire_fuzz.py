"""Fuzzing the parser: mutated objects are rejected with ProtocolError, fast and without big allocations.

Two families of mutations:

* **raw** — bit flips, byte edits, truncations, extensions, length-field and header-field edits of a
  valid object. The signature covers every byte, so *every* such mutation must be rejected; none may
  be accepted, crash with another exception, hang, or allocate much.
* **re-signed** — the body or payload is mutated and the object signed again (what a malicious peer
  can send). These reach the body parsers and the codec; each must be rejected with ProtocolError or
  parse into a valid object — never anything else.
"""

from __future__ import annotations

import random
import resource
import struct
import time
import tracemalloc
from collections.abc import Callable

import pytest
from wire_samples import PEER, VALIDATOR, all_blobs, decode_any, resign, sign_raw

from protocol.config import CodecConfig
from protocol.errors import MalformedPayload, PayloadTooLarge, ProtocolError, UnsupportedVersion
from protocol.identity import SIGNATURE_BYTES
from protocol.wire.fields import MAX_TENSORS, Writer, write_codec, write_metadata
from protocol.wire.frame import FIXED_HEADER_BYTES, Kind

CAP = 1 << 20
RAW_PER_KIND = 3000
RESIGNED_PER_KIND = 600
PEAK_LIMIT = 32 << 20  # bytes traced by tracemalloc (numpy and Python allocations)
RSS_GROWTH_LIMIT = 256 << 20
# CPU seconds of the slowest decode: a bound on runaway work (a loop driven by a crafted
# length), not a speed figure; CPU time so that a busy machine does not trip it.
SLOWEST_CPU_LIMIT_S = 5.0
SIGNERS = {
    Kind.CONTRIBUTION: PEER,
    Kind.AGGREGATE: VALIDATOR,
    Kind.CHECKPOINT: VALIDATOR,
    Kind.ANNOUNCEMENT: PEER,
    Kind.DATASET: VALIDATOR,
    Kind.PROPOSAL: VALIDATOR,
    Kind.ENDORSEMENT: VALIDATOR,
    Kind.OBJECTION: VALIDATOR,
    Kind.CERTIFICATE: VALIDATOR,
}
# Kinds whose payload is another signed object (an aggregate): a payload changed and signed again
# fails that object's own signature, which the re-signed family below is not about.
SIGNED_PAYLOAD = (Kind.PROPOSAL, Kind.CERTIFICATE)
Mutation = Callable[[random.Random, bytes], bytes]


def _flip_bits(rng: random.Random, b: bytes) -> bytes:
    out = bytearray(b)
    for _ in range(rng.choice((1, 1, 2, 8))):
        out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
    return bytes(out)


def _set_byte(rng: random.Random, b: bytes) -> bytes:
    out = bytearray(b)
    i = rng.randrange(len(out))
    out[i] = rng.choice((0, 0x7F, 0x80, 0xFF, rng.randrange(256)) if out[i] else (1, 0xFF))
    return bytes(out)


def _truncate(rng: random.Random, b: bytes) -> bytes:
    return b[: rng.randrange(len(b))]


def _extend(rng: random.Random, b: bytes) -> bytes:
    return b + rng.randbytes(rng.choice((1, 4, 64, 1000)))


def _splice(rng: random.Random, b: bytes) -> bytes:
    i = rng.randrange(len(b))
    return b[:i] + rng.randbytes(rng.randrange(1, 16)) + b[i + rng.randrange(0, 16) :]


_HUGE = (0, 1, 2**31, 2**32 - 1, 2**40, 2**63, 2**64 - 1)


def _edit_lengths(rng: random.Random, b: bytes) -> bytes:
    out = bytearray(b)
    if rng.random() < 0.5:
        struct.pack_into("<I", out, 78, rng.choice(_HUGE[:4] + (rng.randrange(2**32),)))
    else:
        struct.pack_into("<Q", out, 82, rng.choice(_HUGE + (rng.randrange(2**64),)))
    return bytes(out)


def _edit_header(rng: random.Random, b: bytes) -> bytes:
    out = bytearray(b)
    field = rng.choice(("version", "kind", "window", "run", "key"))
    if field == "version":
        out[4] = rng.choice((0, 2, 255))
    elif field == "kind":
        out[5] = rng.choice([k for k in range(256) if k != out[5]][:8] + [255])
    elif field == "window":
        struct.pack_into("<Q", out, 38, rng.choice(_HUGE))
    elif field == "run":
        out[6 + rng.randrange(32)] ^= 0x55
    else:
        out[46 + rng.randrange(32)] ^= 0x01
    if bytes(out) == b:  # e.g. window already 0: force a difference
        out[38] ^= 1
    return bytes(out)


RAW_MUTATIONS: list[Mutation] = [_flip_bits, _set_byte, _truncate, _extend, _splice, _edit_lengths, _edit_header]


def _decode(data: bytes) -> object:
    return decode_any(data, max_bytes=CAP)


def _run(cases: list[bytes], allow_valid: bool) -> dict[str, int]:
    """Decode every case under tracemalloc; return counts by outcome (reason or 'valid')."""
    outcomes: dict[str, int] = {}
    slowest = 0.0
    # tracemalloc sees Python and numpy allocations; the process peak RSS also catches torch's.
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tracemalloc.start()
    try:
        for data in cases:
            t0 = time.process_time()
            try:
                _decode(data)
                outcome = "valid"
            except ProtocolError as exc:
                outcome = exc.reason
            slowest = max(slowest, time.process_time() - t0)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < PEAK_LIMIT, f"peak traced allocation {peak / 2**20:.1f} MiB"
    rss_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    assert rss_growth < RSS_GROWTH_LIMIT, f"peak RSS grew by {rss_growth / 2**20:.0f} MiB"
    assert slowest < SLOWEST_CPU_LIMIT_S, f"slowest decode took {slowest:.3f} CPU s"
    if not allow_valid:
        assert "valid" not in outcomes, outcomes
    return outcomes


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.label)
def test_raw_mutations_are_all_rejected(kind: Kind) -> None:
    rng = random.Random(1000 + int(kind))
    original = all_blobs()[kind]
    cases = []
    while len(cases) < RAW_PER_KIND:
        mutated = rng.choice(RAW_MUTATIONS)(rng, original)
        if mutated != original:
            cases.append(mutated)
    outcomes = _run(cases, allow_valid=False)
    print(kind.label, outcomes)
    # Each family of checks must actually have fired, not only the signature.
    assert {"bad_signature", "malformed", "unsupported_version"} <= set(outcomes), outcomes


def _body_and_payload(blob: bytes) -> tuple[int, int]:
    body_len, payload_len = struct.unpack_from("<IQ", blob, 78)
    return body_len, payload_len


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.label)
def test_resigned_mutations_never_crash(kind: Kind) -> None:
    rng = random.Random(2000 + int(kind))
    original = all_blobs()[kind]
    signer = SIGNERS[kind]
    body_len, payload_len = _body_and_payload(original)
    body = original[FIXED_HEADER_BYTES : FIXED_HEADER_BYTES + body_len]
    payload = original[FIXED_HEADER_BYTES + body_len : len(original) - SIGNATURE_BYTES]
    mutations: list[Mutation] = [_flip_bits, _set_byte, _truncate, _extend, _splice]
    cases = []
    for _ in range(RESIGNED_PER_KIND):
        if payload and kind not in SIGNED_PAYLOAD and rng.random() < 0.4:
            new_payload = rng.choice(mutations)(rng, payload)
            cases.append(resign(original, signer, payload=new_payload))
        else:
            cases.append(resign(original, signer, body=rng.choice(mutations)(rng, body) or b"\0"))
    outcomes = _run(cases, allow_valid=True)
    print(kind.label, outcomes)
    assert sum(n for reason, n in outcomes.items() if reason != "valid") > RESIGNED_PER_KIND // 2, outcomes
    assert "bad_signature" not in outcomes  # the re-signing is right, so rejections come from parsing


def _crafted(kind: Kind, body: bytes, payload: bytes = b"") -> bytes:
    return resign(all_blobs()[kind], SIGNERS[kind], body=body, payload=payload)


def _varints(*values: int) -> bytes:
    w = Writer()
    for v in values:
        w.varint(v)
    return w.getvalue()


def _published_metadata() -> bytes:
    w = Writer()
    write_metadata(w, {"published_at": 1.0})
    return w.getvalue()


def _codec_and_metadata() -> bytes:
    w = Writer()
    write_codec(w, CodecConfig())
    write_metadata(w, {})
    return w.getvalue()


HOSTILE = {
    # counts that would make a naive parser loop or allocate for a long time
    "tensor count": (Kind.CONTRIBUTION, bytes(32) + _codec_and_metadata() + _varints(MAX_TENSORS)),
    "tensor count over max": (Kind.CONTRIBUTION, bytes(32) + _codec_and_metadata() + _varints(2**62)),
    "manifest count": (Kind.AGGREGATE, bytes(32) + bytes(8) + _varints(0) + _published_metadata() + _varints(2**20)),
    "file count": (Kind.CHECKPOINT, bytes(32) + _varints(0) + _published_metadata() + _varints(2**16)),
    "metadata count": (Kind.CHECKPOINT, bytes(32) + _varints(0, 2**16)),
    "string length": (Kind.ANNOUNCEMENT, _varints(2**40)),
    "endless varint": (Kind.ANNOUNCEMENT, b"\xff" * 4096),
    "empty body": (Kind.AGGREGATE, b""),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_signed_bodies_fail_fast(name: str) -> None:
    kind, body = HOSTILE[name]
    outcomes = _run([_crafted(kind, body)], allow_valid=False)
    assert set(outcomes) <= {"malformed", "too_large"}, outcomes


def test_declared_lengths_are_checked_before_reading_or_allocating() -> None:
    original = all_blobs()[Kind.AGGREGATE]
    for body_len, payload_len in ((2**32 - 1, 0), (0, 2**64 - 1), (10, 2**63)):
        header = bytearray(original[:FIXED_HEADER_BYTES])
        struct.pack_into("<IQ", header, 78, body_len, payload_len)
        forged = sign_raw(bytes(header) + original[FIXED_HEADER_BYTES:-SIGNATURE_BYTES], VALIDATOR)
        with pytest.raises(MalformedPayload, match="declared lengths"):
            _decode(forged)


def test_garbage_of_every_small_length_is_rejected() -> None:
    rng = random.Random(7)
    for n in range(0, 300):
        with pytest.raises((MalformedPayload, UnsupportedVersion)):
            _decode(rng.randbytes(n))
        with pytest.raises((MalformedPayload, UnsupportedVersion)):
            _decode(b"SLoC\x01\x01" + rng.randbytes(n))
    with pytest.raises(PayloadTooLarge):
        _decode(bytes(CAP + 1))

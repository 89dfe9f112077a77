"""Fuzz targets for every parser of network bytes: each parses its input or raises ProtocolError,
in bounded time and with allocation proportional to its input.

Targets: the envelope (frame), every object kind (mutated and signed again, so the body and
payload parsers are reached), codec payloads, DHT piece manifests, signed DHT records (object
manifests, pieces, directory entries) and the node validator that checks them, the validator's
per-contribution checks on raw bytes, the published outcomes (:mod:`protocol.outcomes`),
``inspect`` on raw bytes, the grant desk's request parser and a peer's parses of the grant
server's answers (a grant, a refusal, the run info); and the densest valid contribution (16,384,000 values in ~101 KiB) on
every decode path, under the same allocation bound. Each starts from the committed seed corpus
(``tests/fuzz_corpus``, see ``tests/fuzz_seeds.py``) and mutates it with hypothesis.

CI runs a derandomized profile with a modest number of examples (seconds per target); set
``SPARSELOCO_FUZZ_EXAMPLES`` for a longer local run, e.g. ``SPARSELOCO_FUZZ_EXAMPLES=20000``.
"""

from __future__ import annotations

import dataclasses
import os
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from fuzz_seeds import CODEC_INPUTS, load
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wire_samples import BASE, CODEC, PEER, RUN, SCHEMA, VALIDATOR, decode_any, resign

from protocol.codec import unpack
from protocol.config import CodecConfig
from protocol.errors import ProtocolError
from protocol.identity import Identity
from protocol.store.dht.pieces import decode_manifest
from protocol.store.dht.policy import WritePolicy
from protocol.store.dht.records import open_record, seal_record
from protocol.wire.frame import FIXED_HEADER_BYTES, Kind, open_envelope, peek_kind
from validator import checks

EXAMPLES = int(os.environ.get("SPARSELOCO_FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
CAP = 8 << 20
# CPU seconds per input under tracemalloc: a bound against decompression bombs and quadratic paths
# (those take minutes), not a benchmark; CPU time, so that a loaded machine does not trip it.
SLOWEST_S = 5.0
#: Allocation bounds: peak ≤ PER_BYTE × input + ALLOC_BASE. Codec payloads decode to int64 positions
#: (8 bytes for every ~1 to 9 input bits), which sets their factor; everything else is far below.
CODEC_PER_BYTE, OTHER_PER_BYTE = 96, 32
ALLOC_BASE = 1 << 20
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
POLICY = WritePolicy("sparseloco", [VALIDATOR.public_key])


def bounded(parse: Callable[[bytes], Any], data: bytes, per_byte: int = OTHER_PER_BYTE) -> Any:
    """``parse(data)`` must return or raise ProtocolError, fast and within the allocation bound."""
    tracemalloc.start()
    start = time.process_time()
    try:
        result = parse(data)
    except ProtocolError as exc:
        result = exc
    finally:
        elapsed = time.process_time() - start
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert elapsed < SLOWEST_S, f"{elapsed:.2f} CPU s for {len(data)} bytes"
    assert peak <= per_byte * len(data) + ALLOC_BASE, f"peak {peak} bytes for an input of {len(data)}"
    return result


# ---------------------------------------------------------------------------------------- mutations
Edit = tuple[str, int, int]
EDITS = st.tuples(
    st.sampled_from(["flip", "set", "truncate", "insert", "delete", "duplicate"]),
    st.integers(0, 1 << 20),
    st.integers(0, 255),
)


def mutate(data: bytes, edits: list[Edit]) -> bytes:
    out = bytearray(data)
    for op, where, value in edits:
        i = where % (len(out) + 1)
        if op == "flip" and out:
            out[i % len(out)] ^= 1 << (value % 8)
        elif op == "set" and out:
            out[i % len(out)] = value
        elif op == "truncate":
            del out[i:]
        elif op == "insert":
            out[i:i] = bytes([value]) * (1 + value % 9)
        elif op == "delete":
            del out[i : i + 1 + value % 9]
        elif op == "duplicate":
            out[i:i] = out[i : i + 1 + value]
    return bytes(out)


def mutated(seeds: dict[str, bytes]) -> st.SearchStrategy[bytes]:
    """Seeds with a few edits, the seeds themselves, and some plain random bytes."""
    pool = sorted(seeds.values())
    return (
        st.builds(mutate, st.sampled_from(pool), st.lists(EDITS, min_size=1, max_size=6))
        | st.sampled_from(pool)
        | st.binary(max_size=600)
    )


def test_the_corpus_holds_valid_seeds_for_every_target() -> None:
    objects = load("objects")
    for kind in Kind:
        assert not isinstance(bounded(_decode, objects[f"ok-{kind.label}"]), ProtocolError), kind
    for name, (shape, cfg) in CODEC_INPUTS.items():
        result = bounded(lambda d, s=shape, c=cfg: unpack(d, s, c), load("codec")[name], CODEC_PER_BYTE)
        assert isinstance(result, ProtocolError) == name.startswith("unary"), name
    assert not isinstance(bounded(lambda d: decode_manifest(d, key="k"), load("manifests")["ok-manifest"]), Exception)
    for raw in load("records").values():
        POLICY.check(open_record(raw))


def test_the_seeds_that_once_broke_a_parser_are_rejected() -> None:
    """Regressions: each raised something else than ProtocolError, hung, or allocated far more
    than its size (see tests/fuzz_seeds.py)."""
    for name, data in load("objects").items():
        if not name.startswith("ok-"):
            assert isinstance(bounded(_decode, data, CODEC_PER_BYTE), ProtocolError), name
    assert isinstance(bounded(lambda d: decode_manifest(d, key="k"), load("manifests")["deep-json"]), ProtocolError)


# ---------------------------------------------------------------------------------------- envelope and objects
def _decode(data: bytes) -> Any:
    return decode_any(data, max_bytes=CAP)


@FUZZ
@given(data=mutated(load("objects")))
def test_fuzz_envelope(data: bytes) -> None:
    bounded(lambda d: open_envelope(d, max_bytes=CAP, run_hash=None), data)


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.label)
def test_fuzz_each_object_kind_signed_again(kind: Kind) -> None:
    """Body and payload mutated and signed again (what a hostile signer can send)."""
    seeds = {n: b for n, b in load("objects").items() if peek_kind(b) == kind}

    @FUZZ
    @given(
        seed=st.sampled_from(sorted(seeds.values())), edits=st.lists(EDITS, min_size=1, max_size=6), part=st.booleans()
    )
    def run(seed: bytes, edits: list[Edit], part: bool) -> None:
        body_len = int.from_bytes(seed[78:82], "little")
        body = seed[FIXED_HEADER_BYTES : FIXED_HEADER_BYTES + body_len]
        payload = seed[FIXED_HEADER_BYTES + body_len : -64]
        if part and payload:
            crafted = resign(seed, SIGNERS[kind], payload=mutate(payload, edits))
        else:
            crafted = resign(seed, SIGNERS[kind], body=mutate(body, edits))
        bounded(_decode, crafted, CODEC_PER_BYTE if kind == Kind.CONTRIBUTION else OTHER_PER_BYTE)

    run()


# ---------------------------------------------------------------------------------------- codec payloads
CODECS = st.builds(
    CodecConfig,
    block=st.sampled_from([1, 2, 7, 64, 128, 1024]),
    chunk_1d=st.sampled_from([1, 100, 4096, 1 << 20]),
    k=st.sampled_from([1, 64, 4096]),
    index_coding=st.sampled_from(["rice", "packed12"]),
)
SHAPES = st.lists(st.integers(0, 300), min_size=0, max_size=3).map(tuple)


@FUZZ
@given(
    seed=st.sampled_from(sorted(CODEC_INPUTS)),
    edits=st.lists(EDITS, max_size=6),
    other=st.none() | st.tuples(SHAPES, CODECS),
)
def test_fuzz_codec_payload(seed: str, edits: list[Edit], other: tuple[tuple[int, ...], CodecConfig] | None) -> None:
    shape, cfg = other or CODEC_INPUTS[seed]
    bounded(lambda d: unpack(d, shape, cfg), mutate(load("codec")[seed], edits), CODEC_PER_BYTE)


# ---------------------------------------------------------------------------------------- DHT
@FUZZ
@given(data=mutated(load("manifests")))
def test_fuzz_dht_piece_manifest(data: bytes) -> None:
    bounded(lambda d: decode_manifest(d, key="k"), data)


def _check_record(raw: bytes) -> None:
    POLICY.check(open_record(raw))


@FUZZ
@given(data=mutated(load("records")))
def test_fuzz_dht_records(data: bytes) -> None:
    bounded(_check_record, data)


KEYS = st.sampled_from(["sparseloco:obj:", "sparseloco:piece:", "sparseloco:dir:", "other:obj:", ""]).flatmap(
    lambda ns: st.text(max_size=80).map(lambda rest: ns + rest)
)


@FUZZ
@given(key=KEYS, subkey=st.text(max_size=60), content=st.binary(max_size=300), who=st.sampled_from([PEER, VALIDATOR]))
def test_fuzz_signed_records_of_any_shape(key: str, subkey: str, content: bytes, who: Identity) -> None:
    """Validly signed records with arbitrary keys, subkeys and contents: the policy decides, never crashes."""
    try:
        raw = seal_record(who, key=key, subkey=subkey, expiration=1.0, content=content)
    except ValueError:
        return  # not encodable (empty key, too long): nothing a writer could send
    bounded(_check_record, raw)


@FUZZ
@given(value=mutated(load("records")), key=st.binary(min_size=20, max_size=20), subkey=st.binary(max_size=40))
def test_fuzz_the_node_validator(value: bytes, key: bytes, subkey: bytes) -> None:
    """What hivemind hands the node's validator (any bytes in any field) yields a bool, never an error."""
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils.serializer import MSGPackSerializer

    from protocol.store.dht.auth import SignedRecordValidator

    validator = SignedRecordValidator(POLICY)
    for v in (value, MSGPackSerializer.dumps(value)):
        result = bounded(lambda d: validator.validate(DHTRecord(key, subkey, d, 1.0)), v)
        assert result is False or result is True


# ---------------------------------------------------------------------------------------- the validator's checks
CTX = checks.Context(
    run_hash=RUN,
    window=7,
    expected_base=BASE,
    codec=CODEC,
    schema=SCHEMA,
    max_bytes=CAP,
    registered=frozenset({PEER.peer_id}),
)


@FUZZ
@given(data=mutated(load("objects")), edits=st.lists(EDITS, max_size=4), signed=st.booleans())
def test_fuzz_validator_checks_on_raw_bytes(data: bytes, edits: list[Edit], signed: bool) -> None:
    """``checks.screen`` on whatever lies at a peer's key: a verdict with a named reason, never an error."""
    if signed and data[:4] == b"SLoC" and len(data) > FIXED_HEADER_BYTES + 64:
        body_len = min(int.from_bytes(data[78:82], "little"), len(data) - FIXED_HEADER_BYTES - 64)
        body = data[FIXED_HEADER_BYTES : FIXED_HEADER_BYTES + body_len]
        try:
            data = resign(data, PEER, body=mutate(body, edits))
        except (ValueError, ProtocolError):
            pass  # a header that cannot be signed again (unknown kind, window out of range)
    screened = bounded(lambda d: checks.screen(PEER.peer_id, d, CTX), data, CODEC_PER_BYTE)
    assert isinstance(screened, checks.Screened) and (screened.reason is None) == all(c.passed for c in screened.checks)


# ---------------------------------------------------------------------------------------- DHT directory records
# A directory record (``<ns>:dir:<folder>``) off the wire: hivemind's msgpack of a dictionary value,
# every entry checked by the node's validator, then chosen and verified by the reader
# (protocol.store.dht.listing). Seeds: a record holding file, folder and deleted entries of a peer
# and of a validator.
DIR_KEY = "sparseloco:dir:run/contrib/00000007"
DIR_EXPIRATION = 4e9  # hivemind drops expired entries when it reads a dictionary value


def _directory_seeds() -> dict[str, bytes]:
    from hivemind.dht.storage import DictionaryDHTValue
    from hivemind.utils.serializer import MSGPackSerializer

    from protocol.store.dht.policy import DELETED, FILE, entry_subkey

    value = DictionaryDHTValue()
    for who, marker in ((PEER, FILE), (VALIDATOR, DELETED)):
        subkey = entry_subkey(who.peer_id, who.peer_id)
        raw = seal_record(who, key=DIR_KEY, subkey=subkey, expiration=DIR_EXPIRATION, content=marker)
        value.store(subkey, MSGPackSerializer.dumps(raw), DIR_EXPIRATION)
    return {"directory": MSGPackSerializer.dumps(value), "empty": MSGPackSerializer.dumps(DictionaryDHTValue())}


def _read_directory_off_the_wire(raw: bytes) -> Any:
    """What a node and then a reader do with a directory record's bytes; a hivemind deserializer
    failure is how hivemind refuses the answer (a ProtocolError here)."""
    import hashlib
    import random

    from hivemind.dht.storage import DictionaryDHTValue
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils.serializer import MSGPackSerializer
    from hivemind.utils.timed_storage import ValueWithExpiration

    from protocol.errors import MalformedPayload
    from protocol.store.dht.auth import SignedRecordValidator
    from protocol.store.dht.listing import choose, read_directory

    try:
        value = MSGPackSerializer.loads(raw)
        if not isinstance(value, DictionaryDHTValue):
            raise MalformedPayload("not a dictionary value")
        validator = SignedRecordValidator(POLICY)
        key_id = hashlib.sha1(MSGPackSerializer.dumps(DIR_KEY)).digest()  # the DHT id of DIR_KEY
        entries: dict[object, object] = {}
        checked = []
        for subkey, (value_bytes, expiration) in value.items():
            checked.append(
                validator.validate(DHTRecord(key_id, MSGPackSerializer.dumps(subkey), value_bytes, expiration))
            )
            entries[subkey] = ValueWithExpiration(MSGPackSerializer.loads(value_bytes), expiration)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack's own errors: hivemind drops such an answer
        raise MalformedPayload(f"hivemind cannot read it: {type(exc).__name__}") from None
    rng = random.Random(0)
    choice = choose(entries, partial="", writers=None, trusted=POLICY.validator_ids, max_entries=64, rng=rng)
    return read_directory(POLICY, DIR_KEY, entries, choice), checked


def test_the_directory_seed_reads_back() -> None:
    from protocol.store.dht.policy import DELETED, FILE

    listing, checked = bounded(_read_directory_off_the_wire, _directory_seeds()["directory"])
    assert checked == [True, True]  # what the node's validator said of each entry
    assert listing.markers == {PEER.peer_id: {FILE}, VALIDATOR.peer_id: {DELETED}}
    assert listing.trusted_names == {VALIDATOR.peer_id} and listing.stats.malformed == 0


@FUZZ
@given(data=mutated(_directory_seeds()))
def test_fuzz_dht_directory_records(data: bytes) -> None:
    bounded(_read_directory_off_the_wire, data)


@FUZZ
@given(
    items=st.dictionaries(
        st.one_of(st.text(max_size=60), st.binary(max_size=20), st.integers()),
        st.tuples(
            mutated(load("records")) | st.none() | st.integers(),
            st.one_of(st.floats(allow_nan=True), st.none(), st.text(max_size=4), st.booleans()),
        ),
        max_size=12,
    ),
    writers=st.none() | st.frozensets(st.sampled_from([PEER.peer_id, "x", ""])),
    cap=st.integers(1, 8),
)
def test_fuzz_directory_entries_of_any_shape(
    items: dict[object, tuple[object, object]], writers: frozenset[str] | None, cap: int
) -> None:
    """Any subkeys with any values and expirations: chosen and verified, counted, never an error."""
    import random
    from types import SimpleNamespace

    from protocol.store.dht.listing import choose, read_directory

    entries = {k: SimpleNamespace(value=v, expiration_time=e) for k, (v, e) in items.items()}
    size = sum(len(v) for v, _ in items.values() if isinstance(v, bytes)) + 64 * len(items)

    def read(_: bytes) -> Any:
        rng = random.Random(0)
        choice = choose(entries, partial="", writers=writers, trusted=(), max_entries=cap, rng=rng)
        return read_directory(POLICY, "sparseloco:dir:run/contrib/00000007", entries, choice)

    listing = bounded(read, b"\0" * size)
    s = listing.stats
    assert s.entries == len(entries) and s.decoded <= cap and s.malformed <= len(entries)


# ---------------------------------------------------------------------------------------- decode allocation, outcomes
# A valid contribution of ~101 KiB: one tensor of 16,384,000 values, every chunk keeping positions
# 0–63 (the densest index stream there is: 3 bits per value). Its decoders once allocated 65× its
# size (the validator's screen ~280× in torch temporaries), and inspect reads files up to 1 GiB.
CRAFTED_NUMEL = 16_384_000


def crafted_contribution(shape: tuple[int, ...]) -> bytes:
    from protocol.codec import Encoded
    from protocol.codec.chunking import geometry
    from protocol.wire import Contribution, encode_contribution

    g = geometry(shape, CODEC)
    assert g.k_full == g.k_last == 64
    idx = torch.arange(64).repeat(g.n_chunks)
    codes = torch.arange(g.nnz, dtype=torch.int64).remainder(4).to(torch.uint8)
    scales = torch.full((g.n_chunks, 2), 200, dtype=torch.uint8)
    enc = Encoded(shape, CODEC, idx, codes, scales, 1.0)
    return encode_contribution(Contribution(RUN, 7, BASE, CODEC, {"w": enc}, {}), PEER)


@pytest.mark.parametrize("shape", [(CRAFTED_NUMEL,), (8000, 2048)], ids=["vector", "tiled"])
def test_the_densest_valid_contribution_decodes_within_the_bound_on_every_path(shape: tuple[int, ...]) -> None:
    from client.inspect import inspect_bytes
    from protocol.codec import to_sparse

    data = crafted_contribution(shape)
    assert 100 << 10 < len(data) < 110 << 10
    decoded = bounded(_decode, data, CODEC_PER_BYTE)
    assert not isinstance(decoded, ProtocolError)
    enc = decoded.value.tensors["w"]
    idx, vals = bounded(lambda _: to_sparse(enc), data, CODEC_PER_BYTE)
    assert idx.numel() == 256_000 and bool((idx[1:] > idx[:-1]).all()) and bool(torch.isfinite(vals).all())
    ctx = dataclasses.replace(CTX, schema={"w": shape})
    screened = bounded(lambda d: checks.screen(PEER.peer_id, d, ctx), data, CODEC_PER_BYTE)
    assert screened.reason is None
    assert bounded(inspect_bytes, data, CODEC_PER_BYTE).ok


def test_inspect_refuses_what_a_header_declares_beyond_its_memory_cap(tmp_path: Path) -> None:
    """The header of the crafted contribution declares ~3 MB of decoded tensors: refused from its
    header under a 1 MiB cap (the payload is not read), decoded under the default."""
    from client.inspect import inspect_file
    from protocol.wire.footprint import declared_bytes

    data = crafted_contribution((CRAFTED_NUMEL,))
    need = declared_bytes(data)
    assert 256_000 * 9 < need < 96 * len(data)
    path = tmp_path / "crafted"
    path.write_bytes(data)
    refused = inspect_file(path, max_memory=1 << 20)
    assert not refused.ok and refused.reason == "too_large" and "--max-memory" in refused.line
    assert inspect_file(path).ok


def test_a_plain_aggregate_of_half_a_tensor_decodes_within_the_bound() -> None:
    from wire_samples import aggregate

    from protocol.wire import SparseDelta, encode_aggregate
    from protocol.wire.delta import round_values

    idx = torch.arange(0, 1_638_400, 2)
    tensors = {"w": SparseDelta((1_638_400,), idx, round_values(torch.full((idx.numel(),), 0.5)))}
    data = encode_aggregate(dataclasses.replace(aggregate(), tensors=tensors), VALIDATOR)
    assert not isinstance(bounded(_decode, data), ProtocolError)


def _outcomes_seeds() -> dict[str, bytes]:
    from protocol.outcomes import PeerOutcome, encode_outcomes

    rows = [
        PeerOutcome(PEER.peer_id, True, None, 0.0125, 0.19),
        PeerOutcome(VALIDATOR.peer_id, False, "copy", None, 0.0),
    ]
    return {
        "ok": encode_outcomes(RUN, 7, rows),
        "empty": encode_outcomes(RUN, 7, []),
        "deep": b"[" * 20_000,
        "many-empty-objects": b'{"outcomes":['
        + b"{}," * 50_000
        + b'{}],"run_hash":"'
        + RUN.encode()
        + b'","window":7}',
    }


def _outcomes(data: bytes) -> Any:
    from protocol.outcomes import decode_outcomes, outcomes_digest

    return decode_outcomes(data, digest=outcomes_digest(data), run_hash=RUN, window=7)


def test_the_outcomes_seeds_parse_or_are_refused() -> None:
    seeds = _outcomes_seeds()
    assert len(bounded(_outcomes, seeds["ok"]).rows) == 2
    for name in ("deep", "many-empty-objects"):
        assert isinstance(bounded(_outcomes, seeds[name]), ProtocolError), name


@FUZZ
@given(data=mutated(_outcomes_seeds()))
def test_fuzz_outcomes(data: bytes) -> None:
    """The published outcomes, as a validator's signature vouches for them (the digest matches
    whatever the bytes are): parsed or refused with a ProtocolError, within the bound."""
    bounded(_outcomes, data)


@FUZZ
@given(data=mutated(load("objects")))
def test_fuzz_inspect_bytes(data: bytes) -> None:
    """``inspect`` on any bytes: one result line, the header's declared footprint read first."""
    from client.inspect import inspect_bytes

    result = bounded(inspect_bytes, data, CODEC_PER_BYTE)
    assert result.line.startswith("OK " if result.ok else "INVALID ")


# ---------------------------------------------------------------------------------------- grants
def _grant_seeds() -> dict[str, bytes]:
    from protocol.store.grants import GrantRefused, GrantRequest, encode_grant, encode_refusal, encode_request
    from protocol.store.presign import Presigned

    run_hash = "ab" * 32
    put, _ = encode_request(
        GrantRequest.put(run_hash, f"{RUN}/contrib/00000003/{PEER.peer_id}", 100, if_absent=True), PEER
    )
    listing, _ = encode_request(GrantRequest.listing(run_hash, f"{RUN}/peers/", "tok"), PEER)
    grant = encode_grant(Presigned("PUT", "https://s3.example/k?X-Amz-Signature=00", 1.7e9, {"Content-Length": "100"}))
    return {
        "put": put,
        "list": listing,
        "grant": grant,
        "refusal": encode_refusal(GrantRefused("rate_limited", "slow down", retry_after_s=2)),
        "info": b'{"run_id": "r", "run_hash": "' + run_hash.encode() + b'", "window": 3, "upload_deadline": 1.7e9}',
        "deep": b"[" * 4000,
        "deep-in-object": b'{"a":' * 2000,
    }


def _grant_request(data: bytes) -> Any:
    """A request as the validator reads it, signed again so that its fields are checked too."""
    from protocol.store.grants import DOMAIN, read_request

    return read_request(data, PEER.sign(DOMAIN + data).hex())


def _grant_answers(data: bytes) -> Any:
    """Every parse a peer makes of a grant server's answers (a hostile desk is possible too)."""
    from protocol.store.grants import GrantRefused, decode_grant, decode_info, decode_refusal

    for status in (400, 429, 503):
        assert isinstance(decode_refusal(status, data, retry_after="1e999"), GrantRefused)
    for decode in (decode_grant, decode_info):
        try:
            decode(data)
        except GrantRefused:
            pass
    return None


def test_the_grant_seeds_parse_or_are_refused() -> None:
    seeds = _grant_seeds()
    assert bounded(_grant_request, seeds["put"]).peer_id == PEER.peer_id
    for name in ("deep", "deep-in-object", "grant"):
        assert isinstance(bounded(_grant_request, seeds[name]), ProtocolError), name
    for data in seeds.values():
        bounded(_grant_answers, data)


@FUZZ
@given(data=mutated(_grant_seeds()))
def test_fuzz_grant_requests(data: bytes) -> None:
    """The grant desk's parse of a request body (with a signature that verifies): a request or a
    ``malformed`` refusal, within the bound."""
    bounded(_grant_request, data)


@FUZZ
@given(data=mutated(_grant_seeds()))
def test_fuzz_grant_answers(data: bytes) -> None:
    """A peer's parses of a grant, a refusal and the run info, on any bytes, within the bound."""
    bounded(_grant_answers, data)

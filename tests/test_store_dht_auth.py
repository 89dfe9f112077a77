"""Write authorization on the DHT: signed records, the run's write rules, and the nodes enforcing them.

The pure part checks the record format, the write policy and the hivemind validator on hand-made
records. The DHT part runs honest nodes as separate OS processes (a bootstrap/reader node, the
validator's node, an honest peer's node) and an attacker in this process whose own node runs no
validators: every overwrite, hide, squat and flood it sends straight to the honest nodes is refused
by each of them, and honest reads (in another process, and through the attacker's node) still
return the honest objects.
"""

from __future__ import annotations

import hashlib
import os
import random
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from servers_dht import DHTProcess

from protocol.errors import BadSignature, DigestMismatch, MalformedPayload, ProtocolError, UnknownSigner
from protocol.identity import Identity
from protocol.store.dht.pieces import encode_manifest, split, tombstone
from protocol.store.dht.policy import DELETED, FILE, FOLDER, WritePolicy, entry_subkey
from protocol.store.dht.records import open_record, seal_record
from protocol.store.dht.serve import payload
from protocol.store.dht.store import DHTStore

VALIDATOR = Identity.from_seed(b"v" * 32)
PEER = Identity.from_seed(b"p" * 32)
MALLORY = Identity.from_seed(b"m" * 32)
NS = "sparseloco"
POLICY = WritePolicy(NS, [VALIDATOR.public_key])
RUN = "0123456789abcdef"
EXP = 1_900_000_000.5


def obj(key: str) -> str:
    return f"{NS}:obj:{key}"


def folder(path: str) -> str:
    return f"{NS}:dir:{path}"


def manifest_record(signer: Identity, key: str, data: bytes = b"x", expiration: float = EXP) -> bytes:
    return seal_record(signer, key=obj(key), subkey="", expiration=expiration, content=encode_manifest(split(data)[0]))


def entry_record(signer: Identity, path: str, name: str, marker: bytes = FILE, owner: str | None = None) -> bytes:
    subkey = entry_subkey(owner or signer.peer_id, name)
    return seal_record(signer, key=folder(path), subkey=subkey, expiration=EXP, content=marker)


def allowed(raw: bytes) -> bool:
    try:
        POLICY.check(open_record(raw))
    except ProtocolError:
        return False
    return True


# ---------------------------------------------------------------------------------------- records
def test_record_round_trip_and_binding() -> None:
    raw = manifest_record(PEER, f"{RUN}/peers/{PEER.peer_id}")
    rec = open_record(raw)
    assert rec.public_key == PEER.public_key and rec.expiration == EXP
    assert rec.matches(key=obj(f"{RUN}/peers/{PEER.peer_id}"), subkey="", expiration=EXP)
    assert not rec.matches(key=obj(f"{RUN}/peers/x"), subkey="")
    assert not rec.matches(key=rec.key, subkey="", expiration=EXP + 1)  # a copy cannot live longer


def test_every_changed_byte_breaks_a_record() -> None:
    raw = manifest_record(PEER, f"{RUN}/peers/{PEER.peer_id}")
    for i in range(len(raw)):
        bad = bytearray(raw)
        bad[i] ^= 0x01
        with pytest.raises(ProtocolError):
            open_record(bytes(bad))
    for n in range(len(raw)):
        with pytest.raises(ProtocolError):
            open_record(raw[:n])
    with pytest.raises(MalformedPayload):
        open_record(raw + b"\0")
    with pytest.raises(BadSignature):  # a valid record re-signed by someone else is still found out
        open_record(raw[:13] + MALLORY.public_key + raw[45:])


@settings(max_examples=300, deadline=None, derandomize=True)
@given(raw=st.binary(max_size=400) | st.binary(max_size=200).map(lambda b: b"SLdr\x01" + b))
def test_record_parser_never_crashes(raw: bytes) -> None:
    try:
        open_record(raw)
    except ProtocolError:
        return
    raise AssertionError("random bytes passed as a signed record")


# ---------------------------------------------------------------------------------------- policy
@pytest.mark.parametrize(
    "signer, key, ok",
    [
        (PEER, f"{RUN}/contrib/00000003/{PEER.peer_id}", True),
        (PEER, f"{RUN}/peers/{PEER.peer_id}", True),
        (MALLORY, f"{RUN}/contrib/00000003/{PEER.peer_id}", False),  # another peer's contribution
        (MALLORY, f"{RUN}/peers/{PEER.peer_id}", False),
        (VALIDATOR, f"{RUN}/contrib/00000003/{PEER.peer_id}", False),  # not even a validator
        (VALIDATOR, f"{RUN}/aggregate/00000003", True),
        (VALIDATOR, f"{RUN}/checkpoint/00000000/manifest", True),
        (VALIDATOR, f"{RUN}/data/shard-0", True),
        (PEER, f"{RUN}/aggregate/00000003", False),  # chain keys: validator keys only
        (PEER, f"{RUN}/checkpoint/00000000/manifest", False),
        (PEER, f"{RUN}/data/shard-0", False),
        (PEER, f"{RUN}/contrib/3/{PEER.peer_id}", False),  # not the layout: nobody
        (PEER, f"{RUN}/contrib/00000003/{PEER.peer_id}/x", False),
    ],
)
def test_who_may_write_which_object(signer: Identity, key: str, ok: bool) -> None:
    assert allowed(manifest_record(signer, key)) is ok


SECOND = Identity.from_seed(b"w" * 32)  # a second validator of a run with several
SEVERAL = WritePolicy(NS, [VALIDATOR.public_key, SECOND.public_key])
V, V2 = VALIDATOR.peer_id, SECOND.peer_id


def allowed_by(policy: WritePolicy, raw: bytes) -> bool:
    try:
        policy.check(open_record(raw))
    except ProtocolError:
        return False
    return True


@pytest.mark.parametrize(
    "signer, key, ok",
    [
        (VALIDATOR, f"{RUN}/proposal/00000003/{V}", True),  # its own
        (VALIDATOR, f"{RUN}/endorsement/00000003/{V}", True),
        (VALIDATOR, f"{RUN}/objection/00000003/{V}/{V2}", True),
        (VALIDATOR, f"{RUN}/objection/00000003/{V}/{V}", True),
        (VALIDATOR, f"{RUN}/proposal/00000003/{V2}", False),  # another validator's
        (VALIDATOR, f"{RUN}/endorsement/00000003/{V2}", False),
        (VALIDATOR, f"{RUN}/objection/00000003/{V2}/{V}", False),
        (SECOND, f"{RUN}/endorsement/00000003/{V2}", True),
        (SECOND, f"{RUN}/endorsement/00000003/{V}", False),
        (PEER, f"{RUN}/proposal/00000003/{PEER.peer_id}", False),  # a peer writes none, not even under its id
        (PEER, f"{RUN}/endorsement/00000003/{PEER.peer_id}", False),
        (PEER, f"{RUN}/objection/00000003/{PEER.peer_id}/{V}", False),
        (PEER, f"{RUN}/endorsement/00000003/{V}", False),
        (VALIDATOR, f"{RUN}/endorsement/3/{V}", False),  # not the layout: nobody
        (VALIDATOR, f"{RUN}/objection/00000003/{V}", False),
        (VALIDATOR, f"{RUN}/endorsement/00000003/{V}/x", False),
        (SECOND, f"{RUN}/aggregate/00000003", True),  # a certificate: any validator writes it
        (SECOND, f"{RUN}/checkpoint/00000000/manifest", True),
    ],
)
def test_each_validator_writes_only_its_own_proposals_endorsements_and_objections(
    signer: Identity, key: str, ok: bool
) -> None:
    assert allowed_by(SEVERAL, manifest_record(signer, key)) is ok


@pytest.mark.parametrize(
    "signer, path, name, marker, ok",
    [
        (VALIDATOR, f"{RUN}/endorsement/00000003", V, FILE, True),
        (VALIDATOR, f"{RUN}/endorsement/00000003", V2, FILE, False),  # listing another's endorsement
        (VALIDATOR, f"{RUN}/objection/00000003/{V}", V2, FILE, True),
        (VALIDATOR, f"{RUN}/objection/00000003/{V2}", V, FILE, False),
        (VALIDATOR, f"{RUN}/objection/00000003", f"{V}/", FOLDER, True),
        (VALIDATOR, f"{RUN}/proposal", "00000003/", FOLDER, True),
        (PEER, f"{RUN}/proposal", "00000003/", FOLDER, False),  # below it only validators write
        (PEER, f"{RUN}/endorsement/00000003", PEER.peer_id, FILE, False),
        (PEER, RUN, "endorsement/", FOLDER, False),
    ],
)
def test_directory_entries_of_validator_objects(
    signer: Identity, path: str, name: str, marker: bytes, ok: bool
) -> None:
    assert allowed_by(SEVERAL, entry_record(signer, path, name, marker)) is ok


@pytest.mark.parametrize(
    "signer, path, name, marker, owner, ok",
    [
        (PEER, f"{RUN}/contrib/00000003", PEER.peer_id, FILE, None, True),
        (PEER, f"{RUN}/contrib/00000003", PEER.peer_id, DELETED, None, True),
        (PEER, f"{RUN}/contrib", "00000003/", FOLDER, None, True),
        (PEER, RUN, "contrib/", FOLDER, None, True),
        (PEER, "", f"{RUN}/", FOLDER, None, True),
        (PEER, RUN, "aggregate/", FOLDER, None, False),  # below it only validators write
        (PEER, f"{RUN}/contrib", "3/", FOLDER, None, False),  # not a window
        (MALLORY, f"{RUN}/contrib/00000003", PEER.peer_id, FILE, None, False),  # a fake listing entry
        (MALLORY, f"{RUN}/contrib/00000003", PEER.peer_id, DELETED, PEER.peer_id, False),  # hiding P's entry
        (VALIDATOR, f"{RUN}/aggregate", "00000003", FILE, None, True),
        (VALIDATOR, f"{RUN}/aggregate", "00000003", FOLDER, None, False),  # marker and name disagree
        (VALIDATOR, f"{RUN}/aggregate", "a/b", FILE, None, False),
    ],
)
def test_directory_entries_are_owned_by_their_writer(
    signer: Identity, path: str, name: str, marker: bytes, owner: str | None, ok: bool
) -> None:
    assert allowed(entry_record(signer, path, name, marker, owner)) is ok


def test_pieces_are_content_addressed_and_keys_of_other_namespaces_refused() -> None:
    data = os.urandom(100)
    name = hashlib.sha256(data).hexdigest()
    piece = seal_record(MALLORY, key=f"{NS}:piece:{name}", subkey="", expiration=EXP, content=data)
    assert allowed(piece)  # anyone may store the right bytes under their hash
    forged = seal_record(MALLORY, key=f"{NS}:piece:{name}", subkey="", expiration=EXP, content=data[:-1] + b"!")
    with pytest.raises(DigestMismatch):
        POLICY.check(open_record(forged))
    other = seal_record(VALIDATOR, key=f"other:obj:{RUN}/aggregate/00000000", subkey="", expiration=EXP, content=b"")
    with pytest.raises(MalformedPayload):
        POLICY.check(open_record(other))
    junk_manifest = seal_record(
        VALIDATOR, key=obj(f"{RUN}/aggregate/00000000"), subkey="", expiration=EXP, content=b"[" * 999
    )
    with pytest.raises(MalformedPayload):
        POLICY.check(open_record(junk_manifest))
    with pytest.raises(UnknownSigner):
        POLICY.check(open_record(manifest_record(MALLORY, f"{RUN}/aggregate/00000000")))


# ---------------------------------------------------------------------------------------- hivemind validator
def hivemind_record(dht_key: str, subkey: str, raw: bytes, expiration: float = EXP) -> Any:
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils.serializer import MSGPackSerializer

    sub = MSGPackSerializer.dumps(subkey) if subkey else MSGPackSerializer.dumps(None)
    return DHTRecord(DHTID.generate(source=dht_key).to_bytes(), sub, MSGPackSerializer.dumps(raw), expiration)


def test_the_node_validator_checks_what_hivemind_hands_it() -> None:
    from protocol.store.dht.auth import SignedRecordValidator, unwrap_bin

    v = SignedRecordValidator(POLICY)
    key = f"{RUN}/peers/{PEER.peer_id}"
    good = manifest_record(PEER, key)
    assert v.validate(hivemind_record(obj(key), "", good))
    assert not v.validate(hivemind_record(obj(f"{RUN}/peers/{MALLORY.peer_id}"), "", good))  # moved key
    assert not v.validate(hivemind_record(obj(key), "", good, EXP + 60))  # extended expiration
    assert not v.validate(hivemind_record(obj(key), "sub", good))  # as a directory entry
    assert not v.validate(hivemind_record(obj(key), "", manifest_record(MALLORY, key)))
    assert not v.validate(replace(hivemind_record(obj(key), "", good), value=b"\x92\x01\x02"))  # not bytes
    entry = entry_record(PEER, f"{RUN}/peers", PEER.peer_id)
    assert v.validate(hivemind_record(folder(f"{RUN}/peers"), entry_subkey(PEER.peer_id, PEER.peer_id), entry))
    assert v.merge_with(SignedRecordValidator(WritePolicy(NS, [VALIDATOR.public_key])))
    assert not v.merge_with(SignedRecordValidator(WritePolicy(NS, [])))
    for bad in (b"", b"\xc4", b"\xc4\x05abc", b"\xc5\x00\x01ab", b"\xa3abc"):
        with pytest.raises(MalformedPayload):
            unwrap_bin(bad)
    assert unwrap_bin(b"\xc4\x03abc") == b"abc"


# ---------------------------------------------------------------------------------------- the DHT
class RogueStore(DHTStore):
    """A node that runs no validators: it keeps and serves whatever it is given."""

    async def _create_node(self) -> Any:
        from hivemind.dht.node import DHTNode

        return await DHTNode.create(
            initial_peers=self.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False
        )


@dataclass
class Network:
    run: str
    reader: DHTProcess  # the bootstrap node, no key: reads only
    validator: DHTProcess
    peer: DHTProcess
    rogue: RogueStore
    honest: DHTStore  # an in-process reader whose node validates
    peer_payload: tuple[int, int]  # (bytes, seed) of the peer's contribution


def _pem(tmp: Path, ident: Identity, name: str) -> Path:
    path = tmp / f"{name}.pem"
    ident.save(path)
    return path


@pytest.fixture(scope="module")
def network(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Network]:
    tmp = tmp_path_factory.mktemp("dht-auth")
    keys = [VALIDATOR.public_key]
    run = f"run-{uuid.uuid4().hex[:8]}"
    with ExitStack() as stack:
        reader = DHTProcess(validator_keys=keys)
        stack.callback(reader.close)
        validator = DHTProcess(reader.maddrs, key_path=_pem(tmp, VALIDATOR, "v"), validator_keys=keys)
        stack.callback(validator.close)
        peer = DHTProcess(reader.maddrs, key_path=_pem(tmp, PEER, "p"), validator_keys=keys)
        stack.callback(peer.close)
        everyone = reader.maddrs + validator.maddrs + peer.maddrs
        rogue = stack.enter_context(RogueStore(everyone, identity=MALLORY, validator_keys=keys))
        honest = stack.enter_context(DHTStore(everyone, validator_keys=keys))
        size, seed = 300_000, 5
        for proc, command in (
            (peer, f"put {run}/contrib/00000000/{PEER.peer_id} {size} {seed}"),
            (peer, f"put {run}/peers/{PEER.peer_id} 100 6"),
            (validator, f"put {run}/aggregate/00000000 1000 7"),
            (validator, f"put {run}/checkpoint/00000000/manifest 200 8"),
        ):
            assert proc.call(command).startswith("OK"), command
        yield Network(run, reader, validator, peer, rogue, honest, (size, seed))


def _peer_id(proc: DHTProcess) -> Any:
    from hivemind.p2p import PeerID

    return PeerID.from_base58(proc.maddrs[0].rsplit("/p2p/", 1)[1])


Attempt = tuple[str, str | None, bytes, float]  # DHT key, subkey, value (a record or anything), expiration


def send(rogue: RogueStore, proc: DHTProcess, attempts: list[Attempt]) -> list[bool]:
    """Send ``attempts`` in one store RPC straight to ``proc``'s node; its answer per record."""
    from hivemind.dht.routing import DHTID
    from hivemind.utils.serializer import MSGPackSerializer

    keys = [DHTID.generate(source=key) for key, _, _, _ in attempts]
    values = [MSGPackSerializer.dumps(value) for _, _, value, _ in attempts]
    call = rogue._node.protocol.call_store(
        _peer_id(proc),
        keys=keys,
        values=values,
        expiration_time=[exp for _, _, _, exp in attempts],
        subkeys=[sub for _, sub, _, _ in attempts],
    )
    answer = rogue._run(call, "store RPC")
    assert answer is not None, "the honest node did not answer"
    return list(answer)


def _attacks(net: Network) -> dict[str, list[Attempt]]:
    from hivemind.utils.timed_storage import get_dht_time

    later = get_dht_time() + 10 * 3600.0  # later than anything honest: it would win, were it kept
    run, p, m = net.run, PEER.peer_id, MALLORY.peer_id
    contrib = f"{run}/contrib/00000000/{p}"
    found = net.rogue._run(net.rogue._node.get(obj(contrib), latest=True), "get")
    assert found is not None
    honest_record, honest_exp = found.value, found.expiration_time  # signed by the peer

    def sealed(signer: Identity, key: str, sub: str, content: bytes, exp: float = later) -> Attempt:
        return key, sub or None, seal_record(signer, key=key, subkey=sub, expiration=exp, content=content), exp

    evil = encode_manifest(split(b"evil")[0])
    dead = encode_manifest(tombstone())
    fake_ids = [Identity.from_seed(random.Random(i).randbytes(32)).peer_id for i in range(40)]
    piece = hashlib.sha256(b"honest piece").hexdigest()
    return {
        "overwrite a contribution": [sealed(MALLORY, obj(contrib), "", evil)],
        "overwrite an announcement": [sealed(MALLORY, obj(f"{run}/peers/{p}"), "", evil)],
        "replay the peer's record under another window": [
            (obj(f"{run}/contrib/00000001/{p}"), None, honest_record, honest_exp)
        ],
        "replay the peer's record with a later expiration": [(obj(contrib), None, honest_record, later)],
        "hide a contribution behind a tombstone": [sealed(MALLORY, obj(contrib), "", dead)],
        "hide the peer's listing entry": [
            sealed(MALLORY, folder(f"{run}/contrib/00000000"), entry_subkey(p, p), DELETED),
            sealed(MALLORY, folder(f"{run}/contrib/00000000"), entry_subkey(m, p), DELETED),
        ],
        "hide a listing behind a plain value": [sealed(MALLORY, folder(f"{run}/contrib/00000000"), "", FILE)],
        "squat the next aggregate": [
            sealed(MALLORY, obj(f"{run}/aggregate/00000001"), "", evil),
            sealed(MALLORY, folder(f"{run}/aggregate"), entry_subkey(m, "00000001"), FILE),
        ],
        "overwrite the published aggregate": [sealed(MALLORY, obj(f"{run}/aggregate/00000000"), "", evil)],
        "squat the genesis checkpoint": [sealed(MALLORY, obj(f"{run}/checkpoint/00000000/manifest"), "", evil)],
        "forge a validator's listing entry": [
            sealed(MALLORY, folder(f"{run}/aggregate"), entry_subkey(VALIDATOR.peer_id, "00000001"), FILE)
        ],
        "flood a listing (one RPC)": [
            sealed(MALLORY, folder(f"{run}/contrib/00000000"), entry_subkey(owner, fake), FILE)
            for owner in (m, *fake_ids[:20])
            for fake in fake_ids
        ],
        "a piece that does not hash to its name": [sealed(MALLORY, f"{NS}:piece:{piece}", "", b"other bytes")],
        "unsigned bytes": [(obj(contrib), None, b"not a record", later)],
        "a record of another namespace": [sealed(MALLORY, f"other:obj:{run}/peers/{m}", "", evil)],
    }


@pytest.mark.integration
def test_every_unauthorized_write_is_refused_by_every_honest_node(network: Network) -> None:
    from hivemind.utils.timed_storage import get_dht_time

    attacks = _attacks(network)
    assert len(attacks["flood a listing (one RPC)"]) > 800
    for proc in (network.reader, network.validator, network.peer):
        for name, attempts in attacks.items():
            assert send(network.rogue, proc, attempts) == [False] * len(attempts), (name, proc.maddrs[0])
        # control: the same RPC path accepts what the attacker's key may write (its own announcement)
        exp = get_dht_time() + 600
        own = f"{network.run}/peers/{MALLORY.peer_id}"
        mine = seal_record(
            MALLORY, key=obj(own), subkey="", expiration=exp, content=encode_manifest(split(b"hello")[0])
        )
        assert send(network.rogue, proc, [(obj(own), None, mine, exp)]) == [True]


@pytest.mark.integration
def test_honest_reads_survive_a_node_that_serves_junk(network: Network) -> None:
    run, p = network.run, PEER.peer_id
    # The attacker's node has no validators: it keeps all of it and serves it to whoever asks.
    for attempts in _attacks(network).values():
        keys = [key for key, _, _, _ in attempts]
        values = [value for _, _, value, _ in attempts]
        network.rogue._run(
            network.rogue._node.store_many(
                keys, values, [exp for *_, exp in attempts], subkeys=[sub for _, sub, _, _ in attempts]
            ),
            "store",
        )
    size, seed = network.peer_payload
    contrib = f"{run}/contrib/00000000/{p}"
    want = hashlib.sha256(payload(size, seed)).hexdigest()
    # a reader in another process, and one in this process whose queries also reach the rogue node
    assert network.reader.call(f"list {run}/contrib/00000000/").split() == ["OK", contrib]
    assert network.reader.call(f"get {contrib}").split()[:3] == ["OK", want, str(size)]
    assert network.reader.call(f"list {run}/aggregate/").split() == ["OK", f"{run}/aggregate/00000000"]
    assert network.reader.call(f"get {run}/aggregate/00000001").startswith("ERR not_found")
    assert network.reader.call(f"get {run}/aggregate/00000000").split()[:2] == [
        "OK",
        hashlib.sha256(payload(1000, 7)).hexdigest(),
    ]
    start = time.monotonic()
    assert network.honest.list(f"{run}/contrib/00000000/") == [contrib]
    assert hashlib.sha256(network.honest.get(contrib)).hexdigest() == want
    assert not network.honest.exists(f"{run}/aggregate/00000001")
    assert network.honest.get(f"{run}/checkpoint/00000000/manifest") == payload(200, 8)
    assert time.monotonic() - start < 60

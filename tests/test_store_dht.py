"""DHT object store: piece/manifest logic (pure) and a real hivemind DHT on 127.0.0.1.

The DHT part starts two bootstrap nodes, a writer, a reader and a peer in this process and one
node in a separate OS process, once for the module. Writer, reader and the child process sign
with the run's validator key (so they may write any key that is not a peer's own); the peer
writes its own keys. Attacks on the write rules are in test_store_dht_auth.py.
"""

from __future__ import annotations

import hashlib
import os
import signal
import struct
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from servers_dht import DHTProcess, start_dht_nodes

from protocol.errors import (
    AccessDenied,
    ConfigError,
    DigestMismatch,
    InvalidKey,
    MalformedPayload,
    ObjectExists,
    ObjectNotFound,
    PayloadTooLarge,
    RangeNotSatisfiable,
    StoreError,
    UnsupportedVersion,
)
from protocol.identity import Identity
from protocol.store.dht.pieces import (
    MAX_MANIFEST_BYTES,
    assemble,
    check_piece,
    decode_manifest,
    encode_manifest,
    split,
    tombstone,
)
from protocol.store.dht.records import seal_record
from protocol.store.dht.serve import payload
from protocol.store.dht.store import DHTStore, IncompleteObject, _ancestry

PIECE = 256 << 10  # small pieces so that modest payloads span several records
VALIDATOR = Identity.from_seed(b"V" * 32)  # a validator key of the run: may write every non-peer key
PEER = Identity.from_seed(b"P" * 32)
KEYS = [VALIDATOR.public_key]


# ---------------------------------------------------------------------------------------- pure
@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=3000), piece_size=st.integers(1, 1100))
def test_split_assemble_roundtrip(data: bytes, piece_size: int) -> None:
    manifest, pieces = split(data, piece_size)
    assert manifest.n_pieces == -(-len(data) // piece_size)
    assert all(len(p) == manifest.piece_length(i) for i, p in enumerate(pieces))
    again = decode_manifest(encode_manifest(manifest), key="k")
    assert again == manifest
    assert assemble(again, pieces, key="k") == data


def test_piece_boundaries() -> None:
    for size, count in ((0, 0), (1, 1), (PIECE, 1), (PIECE + 1, 2), (3 * PIECE, 3)):
        manifest, pieces = split(b"x" * size, PIECE)
        assert (manifest.n_pieces, len(pieces)) == (count, count)
    with pytest.raises(ValueError):
        split(b"x", 4 << 20)  # a piece must stay under the 4 MiB RPC cap


def test_check_piece_names_the_bad_piece() -> None:
    manifest, pieces = split(os.urandom(3 * 100), 100)
    with pytest.raises(DigestMismatch, match="piece 1/3"):
        check_piece(manifest, 1, bytes(100), key="k")
    with pytest.raises(DigestMismatch, match="piece 2/3"):
        check_piece(manifest, 2, pieces[2] + b"!", key="k")
    with pytest.raises(MalformedPayload):
        check_piece(manifest, 0, "text", key="k")


def test_assemble_rejects_forged_manifest() -> None:
    manifest, pieces = split(b"a" * 10 + b"b" * 10, 10)
    swapped = manifest.__class__(20, 10, manifest.sha256, manifest.piece_hashes[::-1])
    with pytest.raises(DigestMismatch):
        assemble(swapped, pieces[::-1], key="k")


def _manifest_bytes(**change: object) -> bytes:
    """The binary manifest of 25 bytes in pieces of 10, with header fields replaced."""
    raw = encode_manifest(split(b"z" * 25, 10)[0])
    head = dict(zip(("v", "flags", "size", "piece_size", "sha256"), struct.unpack_from("<BBQI32s", raw)))
    head.update(change)
    return struct.pack("<BBQI32s", *head.values()) + raw[46:]


@pytest.mark.parametrize(
    "raw",
    [
        "not bytes",
        b"",
        b"\x02" * 45,  # shorter than the header
        _manifest_bytes() + b"\0",  # not a whole number of piece hashes
        _manifest_bytes()[:-32],  # 2 piece hashes for 3 pieces
        _manifest_bytes(size=31),  # 31 bytes need 4 pieces of 10, the manifest lists 3
        _manifest_bytes(piece_size=0),
        _manifest_bytes(piece_size=4 << 20),
        _manifest_bytes(flags=2),
        _manifest_bytes(flags=1),  # a tombstone holds no bytes
        b"[" * 100_000,
        b" " * (MAX_MANIFEST_BYTES + 1),
    ],
)
def test_decode_manifest_rejects(raw: object) -> None:
    with pytest.raises(MalformedPayload):
        decode_manifest(raw, key="k")


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    raw=st.binary(max_size=300)
    | st.builds(lambda b, tail: _manifest_bytes()[:b] + tail, st.integers(0, 200), st.binary(max_size=70))
)
def test_decode_manifest_never_crashes(raw: bytes) -> None:
    try:
        manifest = decode_manifest(raw, key="k")
    except (MalformedPayload, UnsupportedVersion):
        return
    assert manifest.n_pieces == -(-manifest.size // manifest.piece_size)  # accepted => consistent


def test_decode_manifest_version_and_tombstone() -> None:
    with pytest.raises(UnsupportedVersion):
        decode_manifest(_manifest_bytes(v=1), key="k")
    assert decode_manifest(encode_manifest(tombstone()), key="k").deleted


def test_ancestry_builds_the_folder_tree() -> None:
    assert _ancestry("a/b/c") == [("", "a/"), ("a", "b/"), ("a/b", "c")]
    assert _ancestry("top") == [("", "top")]


# ---------------------------------------------------------------------------------------- DHT
@dataclass
class Swarm:
    bootstrap: list[str]  # two in-process bootstrap nodes
    writer: DHTStore  # signs with the validator key
    reader: DHTStore  # the same key (deletes what the writer wrote)
    peer: DHTStore  # signs with PEER's key: writes only its own keys
    child: DHTProcess  # a node in a separate OS process, signing with the validator key
    key_file: Path


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    key_file = tmp_path_factory.mktemp("dht") / "validator.pem"
    VALIDATOR.save(key_file)
    with ExitStack() as stack:
        bootstrap = stack.enter_context(start_dht_nodes(2, validator_keys=KEYS))
        writer = stack.enter_context(DHTStore(bootstrap, piece_size=PIECE, identity=VALIDATOR, validator_keys=KEYS))
        reader = stack.enter_context(DHTStore(bootstrap, piece_size=PIECE, identity=VALIDATOR, validator_keys=KEYS))
        peer = stack.enter_context(DHTStore(bootstrap, piece_size=PIECE, identity=PEER, validator_keys=KEYS))
        child = DHTProcess(bootstrap, key_path=key_file, validator_keys=KEYS)
        stack.callback(child.close)
        yield Swarm(bootstrap, writer, reader, peer, child, key_file)


def _prefix() -> str:
    return f"run-{uuid.uuid4().hex[:8]}"


@pytest.mark.integration
@pytest.mark.parametrize("size", [0, 1, PIECE, 3 * PIECE + 17])
def test_roundtrip_between_nodes(swarm: Swarm, size: int) -> None:
    key, data = f"{_prefix()}/blob", os.urandom(size)
    swarm.writer.put(key, data)
    assert swarm.reader.get(key) == data
    assert swarm.reader.size(key) == size and swarm.reader.exists(key)


@pytest.mark.integration
def test_six_mib_between_processes(swarm: Swarm) -> None:
    """The uvloop pipe trap of hivemind.DHT: several MiB must cross a process boundary both ways."""
    run, n = _prefix(), 6 << 20
    answer = swarm.child.call(f"put {run}/from-child {n} 7").split()
    assert answer[0] == "OK", answer
    assert swarm.reader.get(f"{run}/from-child", max_bytes=n) == payload(n, 7)

    mine = os.urandom(n)
    swarm.writer.put(f"{run}/from-parent", mine)
    assert swarm.child.call(f"get {run}/from-parent").split()[:3] == ["OK", hashlib.sha256(mine).hexdigest(), str(n)]


@pytest.mark.integration
def test_list_across_nodes_and_processes(swarm: Swarm) -> None:
    run, p1, p2 = _prefix(), PEER.peer_id, VALIDATOR.peer_id  # a validator key owns its own peer keys too
    assert swarm.child.call(f"put {run}/contrib/00000003/{p2} 10 1").startswith("OK")
    swarm.peer.put(f"{run}/contrib/00000003/{p1}", b"y")
    swarm.peer.put(f"{run}/contrib/00000004/{p1}", b"x")
    swarm.peer.put(f"{run}/peers/{p1}", b"announcement")
    first, second = sorted([f"{run}/contrib/00000003/{p1}", f"{run}/contrib/00000003/{p2}"])
    assert swarm.reader.list(f"{run}/contrib/00000003/") == [first, second]
    assert swarm.reader.list(f"{run}/contrib/0000000") == [first, second, f"{run}/contrib/00000004/{p1}"]
    assert swarm.reader.list(f"{run}/peers/") == [f"{run}/peers/{p1}"]  # the announcement index
    assert len(swarm.reader.list(f"{run}/")) == 4 and swarm.reader.list(f"{run}/nothing/") == []
    assert swarm.child.call(f"list {run}/peers/").split() == ["OK", f"{run}/peers/{p1}"]


@pytest.mark.integration
def test_a_store_writes_only_what_its_key_may(swarm: Swarm) -> None:
    run = _prefix()
    with pytest.raises(AccessDenied):
        swarm.peer.put(f"{run}/aggregate/00000000", b"x")  # a chain key: validators only
    with pytest.raises(AccessDenied):
        swarm.writer.put(f"{run}/contrib/00000000/{PEER.peer_id}", b"x")  # a peer's own key
    with pytest.raises(AccessDenied):
        DHTStore(start=False, validator_keys=KEYS).put(f"{run}/aggregate/00000000", b"x")  # no key: read-only


@pytest.mark.integration
def test_delete_is_a_tombstone_and_put_revives(swarm: Swarm) -> None:
    key = f"{_prefix()}/aggregate/00000001"
    swarm.writer.put(key, b"one")
    swarm.reader.delete(key)
    assert not swarm.writer.exists(key) and swarm.writer.list(key.rsplit("/", 1)[0] + "/") == []
    with pytest.raises(ObjectNotFound):
        swarm.writer.get(key)
    swarm.reader.delete(key)  # deleting a missing key is not an error
    swarm.writer.put(key, b"two", if_absent=True)
    assert swarm.reader.get(key) == b"two" and swarm.reader.list(key) == [key]


@pytest.mark.integration
def test_if_absent_is_best_effort(swarm: Swarm) -> None:
    key = f"{_prefix()}/c"
    swarm.writer.put(key, b"first", if_absent=True)
    with pytest.raises(ObjectExists):
        swarm.reader.put(key, b"second", if_absent=True)
    assert swarm.reader.get(key) == b"first" and DHTStore.atomic_create is False
    swarm.reader.put(key, b"third")  # a plain put overwrites: the later expiration wins
    assert swarm.writer.get(key) == b"third"


def _raw_store(store: DHTStore, dht_key: str, content: bytes, extra_s: float = 60.0) -> bool:
    """Write one record signed with the validator key directly with the node, later-expiring than
    anything the stores wrote; whether the DHT acknowledged it."""
    from hivemind.utils.timed_storage import get_dht_time

    expiration = get_dht_time() + store.expiration_s + extra_s
    record = seal_record(VALIDATOR, key=dht_key, subkey="", expiration=expiration, content=content)
    return bool(store._run(store._node.store(dht_key, record, expiration), "raw store"))


@pytest.mark.integration
def test_corrupted_piece_is_refused_and_reads_stay_right(swarm: Swarm) -> None:
    key, data = f"{_prefix()}/blob", os.urandom(3 * PIECE)
    swarm.writer.put(key, data)
    manifest = swarm.writer.manifest(key)
    bad = bytearray(data[PIECE : 2 * PIECE])
    bad[5] ^= 1
    # Signed by a key of the run, but the bytes do not hash to the piece's name: every node refuses.
    assert not _raw_store(swarm.writer, swarm.writer._piece_key(manifest, 1), bytes(bad))
    assert not _raw_store(swarm.writer, swarm.writer._piece_key(manifest, 1), bytes(bad[:-1]), extra_s=120)
    assert swarm.reader.get(key) == data
    with pytest.raises(DigestMismatch, match="piece 1/3"):  # what a reader does if a piece is off anyway
        check_piece(manifest, 1, bytes(bad), key=key)


@pytest.mark.integration
def test_missing_piece_and_malformed_manifest(swarm: Swarm) -> None:
    key = f"{_prefix()}/blob"
    manifest, pieces = split(os.urandom(3 * PIECE), PIECE)
    for index in (0, 2):  # piece 1 is never written
        assert _raw_store(swarm.writer, swarm.writer._piece_key(manifest, index), pieces[index])
    assert _raw_store(swarm.writer, swarm.writer._obj_key(key), encode_manifest(manifest))
    with pytest.raises(IncompleteObject, match="piece 1/3") as err:
        swarm.reader.get(key)
    assert isinstance(err.value, ObjectNotFound) and err.value.reason == "incomplete"

    # a manifest that does not parse is refused by every node: the last good one stays
    assert not _raw_store(swarm.writer, swarm.writer._obj_key(key), b"[" * 1000, extra_s=120)
    with pytest.raises(IncompleteObject):
        swarm.reader.get(key)


@pytest.mark.integration
def test_a_ranged_read_fetches_only_the_pieces_it_covers(swarm: Swarm) -> None:
    key, data = f"{_prefix()}/shard", os.urandom(3 * PIECE + 17)
    manifest, pieces = split(data, PIECE)
    for index in (0, 2, 3):  # piece 1 is never written: a range that needs it cannot be read
        assert _raw_store(swarm.writer, swarm.writer._piece_key(manifest, index), pieces[index])
    assert _raw_store(swarm.writer, swarm.writer._obj_key(key), encode_manifest(manifest))
    for start, length in [(0, 1), (100, PIECE - 100), (2 * PIECE, 1000), (2 * PIECE, PIECE + 17)]:
        assert swarm.reader.get_range(key, start, length) == data[start : start + length]
    assert swarm.reader.get_range(key, len(data) - 1, 1) == data[-1:]
    for start, length in [(PIECE - 1, 2), (PIECE + 5, 10), (0, len(data))]:
        with pytest.raises(IncompleteObject, match="piece 1/4"):
            swarm.reader.get_range(key, start, length)
    with pytest.raises(RangeNotSatisfiable):  # refused on the manifest's size, no piece fetched
        swarm.reader.get_range(key, len(data) - 1, 2)
    with pytest.raises(ObjectNotFound):
        swarm.reader.get_range(f"{key}-missing", 0, 1)


@pytest.mark.integration
def test_max_bytes_refused_before_fetching_pieces(swarm: Swarm) -> None:
    key = f"{_prefix()}/huge"
    manifest, _ = split(bytes(10 << 20), 1 << 20)  # manifest only: no piece exists anywhere
    _raw_store(swarm.writer, swarm.writer._obj_key(key), encode_manifest(manifest))
    with pytest.raises(PayloadTooLarge):
        swarm.reader.get(key, max_bytes=1 << 20)
    assert swarm.reader.size(key) == 10 << 20
    with pytest.raises(IncompleteObject, match=r"piece \d/10"):  # had it fetched, this is what it met
        swarm.reader.get(key, max_bytes=20 << 20)


@pytest.mark.integration
def test_records_expire(swarm: Swarm) -> None:
    run = _prefix()
    with DHTStore(
        swarm.bootstrap, expiration_s=3.0, piece_size=PIECE, identity=VALIDATOR, validator_keys=KEYS
    ) as short:
        written = time.time()
        short.put(f"{run}/a", os.urandom(PIECE + 1))
        assert swarm.reader.get(f"{run}/a") and swarm.reader.list(f"{run}/") == [f"{run}/a"]
        time.sleep(max(0.0, written + 3.5 - time.time()))
        with pytest.raises(ObjectNotFound):
            swarm.reader.get(f"{run}/a")
        assert swarm.reader.list(f"{run}/") == []


@pytest.mark.integration
def test_closed_store_and_bad_bootstrap() -> None:
    store = DHTStore(start=False, identity=VALIDATOR, validator_keys=KEYS)
    with pytest.raises(StoreError, match="closed"):
        store.get("a/b")
    store.start()
    pid = store._node.p2p._child.pid
    store.close()
    store.close()  # idempotent
    with pytest.raises(StoreError, match="closed"):
        store.put("a/b", b"")
    assert _gone(pid)
    with pytest.raises(InvalidKey):
        DHTStore(start=False).put("/abs", b"")
    for bad in ("garbage", "/ip4/127.0.0.1/tcp/9"):  # no peer id: hivemind could not even ping it
        with pytest.raises(ConfigError):
            DHTStore([bad])
    dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWPkqMe71z8v3ekfQht6RRNN5rhzKCWkJb18ZkauxiV1KU"
    with pytest.raises(StoreError, match="could not start"):
        DHTStore([dead], timeout_s=20)


def _gone(pid: int, wait_s: float = 5.0) -> bool:
    """True once ``pid`` no longer runs (a zombie waiting for a reaper counts as gone)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def _group(pgid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.integration
def test_killed_process_leaves_no_p2pd(swarm: Swarm) -> None:
    """A peer SIGKILLed after its upload: its object lives on, and its p2pd dies with it (PDEATHSIG)."""
    proc = DHTProcess(swarm.bootstrap, key_path=swarm.key_file, validator_keys=KEYS)
    sockets, key = [], f"{_prefix()}/contrib/00000001/{VALIDATOR.peer_id}"
    try:
        assert proc.call(f"put {key} {2 << 20} 11").startswith("OK")
        daemons = [pid for pid in _group(proc.proc.pid) if pid != proc.proc.pid]
        assert daemons, "expected a p2pd daemon in the node's process group"
        sockets = [path for pid in daemons for path in _unix_sockets(pid)]
        os.kill(proc.proc.pid, signal.SIGKILL)  # only the Python parent, not its group
        proc.proc.wait(10)
        assert all(_gone(pid) for pid in daemons)
        assert swarm.reader.get(key) == payload(2 << 20, 11)  # replicated before the peer died
    finally:
        proc.close()
        for path in sockets:  # a SIGKILLed p2pd cannot remove its control socket itself
            if os.path.exists(path):
                os.remove(path)


def _unix_sockets(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        args = f.read().decode().split("\0")
    return [arg.split("/unix", 1)[1] for arg in args if arg.startswith("-listen=/unix/")]


@pytest.mark.integration
def test_identity_keeps_the_peer_id(tmp_path: Path) -> None:
    """A bootstrap node restarted with its key file keeps the address written into RunSpecs."""
    key_file = str(tmp_path / "dht.key")
    with DHTStore(identity_path=key_file) as first:
        peer_id = first.visible_maddrs()[0].rsplit("/p2p/", 1)[1]
    with DHTStore(identity_path=key_file) as again:
        assert again.visible_maddrs()[0].endswith(f"/p2p/{peer_id}")

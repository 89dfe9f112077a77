"""DHT object store: piece/manifest logic (pure) and a real hivemind DHT on 127.0.0.1.

The DHT part starts two bootstrap nodes, a writer and a reader in this process and one node in a
separate OS process, once for the module.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
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
    ConfigError,
    DigestMismatch,
    InvalidKey,
    MalformedPayload,
    ObjectExists,
    ObjectNotFound,
    PayloadTooLarge,
    StoreError,
    UnsupportedVersion,
)
from protocol.store.dht.pieces import (
    MAX_MANIFEST_BYTES,
    assemble,
    check_piece,
    decode_manifest,
    encode_manifest,
    split,
    tombstone,
)
from protocol.store.dht.serve import payload
from protocol.store.dht.store import DHTStore, IncompleteObject, _ancestry

PIECE = 256 << 10  # small pieces so that modest payloads span several records


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


def _manifest_json(**change: object) -> bytes:
    body = json.loads(encode_manifest(split(b"z" * 25, 10)[0]))
    body.update(change)
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    "raw",
    [
        "not bytes",
        b"\xff\xfe",
        b"[1, 2]",
        _manifest_json(extra=1),
        _manifest_json(size=31),  # 31 bytes need 4 pieces of 10, the manifest lists 3
        _manifest_json(size=-1),
        _manifest_json(size=True),
        _manifest_json(piece_size=0),
        _manifest_json(pieces=["ab"] * 3),
        _manifest_json(sha256="A" * 64),
        _manifest_json(deleted="no"),
        b" " * (MAX_MANIFEST_BYTES + 1),
    ],
)
def test_decode_manifest_rejects(raw: object) -> None:
    with pytest.raises(MalformedPayload):
        decode_manifest(raw, key="k")


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=70),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
FIELDS = ("v", "size", "piece_size", "sha256", "pieces", "deleted")
MANIFEST_LIKE = st.fixed_dictionaries({name: st.just(1) | JSON for name in FIELDS}, optional={"x": JSON})


@settings(max_examples=150, deadline=None)
@given(raw=st.binary(max_size=300) | MANIFEST_LIKE.map(lambda body: json.dumps(body).encode()))
def test_decode_manifest_never_crashes(raw: bytes) -> None:
    try:
        manifest = decode_manifest(raw, key="k")
    except (MalformedPayload, UnsupportedVersion):
        return
    assert manifest.n_pieces == -(-manifest.size // manifest.piece_size)  # accepted => consistent


def test_decode_manifest_version_and_tombstone() -> None:
    with pytest.raises(UnsupportedVersion):
        decode_manifest(_manifest_json(v=2), key="k")
    assert decode_manifest(encode_manifest(tombstone()), key="k").deleted


def test_ancestry_builds_the_folder_tree() -> None:
    assert _ancestry("a/b/c") == [("", "a/"), ("a", "b/"), ("a/b", "c")]
    assert _ancestry("top") == [("", "top")]


# ---------------------------------------------------------------------------------------- DHT
@dataclass
class Swarm:
    bootstrap: list[str]  # two in-process bootstrap nodes
    writer: DHTStore
    reader: DHTStore
    child: DHTProcess  # a node in a separate OS process


@pytest.fixture(scope="module")
def swarm() -> Iterator[Swarm]:
    with ExitStack() as stack:
        bootstrap = stack.enter_context(start_dht_nodes(2))
        writer = stack.enter_context(DHTStore(bootstrap, piece_size=PIECE))
        reader = stack.enter_context(DHTStore(bootstrap, piece_size=PIECE))
        child = DHTProcess(bootstrap)
        stack.callback(child.close)
        yield Swarm(bootstrap, writer, reader, child)


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
    run = _prefix()
    for peer in ("p2", "p1"):
        assert swarm.child.call(f"put {run}/contrib/00000003/{peer} 10 1").startswith("OK")
    swarm.writer.put(f"{run}/contrib/00000004/p1", b"x")
    swarm.writer.put(f"{run}/peers/p1", b"announcement")
    assert swarm.reader.list(f"{run}/contrib/00000003/") == [f"{run}/contrib/00000003/p1", f"{run}/contrib/00000003/p2"]
    assert swarm.reader.list(f"{run}/contrib/0000000") == [
        f"{run}/contrib/00000003/p1",
        f"{run}/contrib/00000003/p2",
        f"{run}/contrib/00000004/p1",
    ]
    assert swarm.reader.list(f"{run}/peers/") == [f"{run}/peers/p1"]  # the announcement index
    assert len(swarm.reader.list(f"{run}/")) == 4 and swarm.reader.list(f"{run}/nothing/") == []
    assert swarm.child.call(f"list {run}/peers/").split() == ["OK", f"{run}/peers/p1"]


@pytest.mark.integration
def test_delete_is_a_tombstone_and_put_revives(swarm: Swarm) -> None:
    key = f"{_prefix()}/contrib/1/p"
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


def _raw_store(store: DHTStore, dht_key: str, value: object, extra_s: float = 60.0) -> None:
    """Write a record directly with the node, later-expiring than anything the stores wrote."""
    from hivemind.utils.timed_storage import get_dht_time

    store._run(store._node.store(dht_key, value, get_dht_time() + store.expiration_s + extra_s), "raw store")


@pytest.mark.integration
def test_corrupted_piece_is_detected(swarm: Swarm) -> None:
    key, data = f"{_prefix()}/blob", os.urandom(3 * PIECE)
    swarm.writer.put(key, data)
    manifest = swarm.writer.manifest(key)
    bad = bytearray(data[PIECE : 2 * PIECE])
    bad[5] ^= 1
    _raw_store(swarm.writer, swarm.writer._piece_key(manifest, 1), bytes(bad))
    with pytest.raises(DigestMismatch, match="piece 1/3"):
        swarm.reader.get(key)
    _raw_store(swarm.writer, swarm.writer._piece_key(manifest, 1), bytes(bad[:-1]), extra_s=120)
    with pytest.raises(DigestMismatch, match="piece 1/3"):
        swarm.writer.get(key)


@pytest.mark.integration
def test_missing_piece_and_malformed_manifest(swarm: Swarm) -> None:
    key = f"{_prefix()}/blob"
    manifest, pieces = split(os.urandom(3 * PIECE), PIECE)
    for index in (0, 2):  # piece 1 is never written
        _raw_store(swarm.writer, swarm.writer._piece_key(manifest, index), pieces[index])
    _raw_store(swarm.writer, swarm.writer._obj_key(key), encode_manifest(manifest))
    with pytest.raises(IncompleteObject, match="piece 1/3") as err:
        swarm.reader.get(key)
    assert isinstance(err.value, ObjectNotFound) and err.value.reason == "incomplete"

    _raw_store(swarm.writer, swarm.writer._obj_key(key), b"{not json", extra_s=120)
    with pytest.raises(MalformedPayload):
        swarm.reader.get(key)


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
    with DHTStore(swarm.bootstrap, expiration_s=3.0, piece_size=PIECE) as short:
        written = time.time()
        short.put(f"{run}/a", os.urandom(PIECE + 1))
        assert swarm.reader.get(f"{run}/a") and swarm.reader.list(f"{run}/") == [f"{run}/a"]
        time.sleep(max(0.0, written + 3.5 - time.time()))
        with pytest.raises(ObjectNotFound):
            swarm.reader.get(f"{run}/a")
        assert swarm.reader.list(f"{run}/") == []


@pytest.mark.integration
def test_closed_store_and_bad_bootstrap() -> None:
    store = DHTStore(start=False)
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
    proc, sockets, key = DHTProcess(swarm.bootstrap), [], f"{_prefix()}/contrib/1/dead-peer"
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

"""One behavioural suite for every ObjectStore backend: memory, local directory, S3 and DHT.

S3 runs against a real SeaweedFS on 127.0.0.1 and the DHT against real hivemind nodes, each
started once for the module; every test gets its own key root so tests cannot see each other.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import protocol.store
from protocol.errors import (
    AccessDenied,
    ConfigError,
    InvalidKey,
    InvalidRange,
    ObjectExists,
    ObjectNotFound,
    PayloadTooLarge,
    RangeNotSatisfiable,
    StoreError,
)
from protocol.identity import Identity
from protocol.settings import StoreSettings
from protocol.store import (
    MAX_RANGE_BYTES,
    LocalStore,
    MemoryStore,
    ObjectStore,
    open_from_settings,
    open_store,
    put_once,
)

HAVE_DHT = importlib.util.find_spec("protocol.store.dht.store") is not None
DHT_WRITER = Identity.from_seed(b"w" * 32)  # a validator key of the DHT suite's run
BACKENDS = [
    "memory",
    "local",
    pytest.param("s3", marks=pytest.mark.integration),
    pytest.param("dht", marks=pytest.mark.integration),
]


class Servers:
    """Real servers started lazily, once for the module, only for the backends that run."""

    def __init__(self) -> None:
        self._stack = ExitStack()
        self.s3: Any = None
        self.dht_peers: list[str] | None = None
        self.dht_store: ObjectStore | None = None
        self.s3_store: ObjectStore | None = None

    def seaweed(self) -> Any:
        if self.s3 is None:
            from servers import SeaweedS3

            self.s3 = self._stack.enter_context(SeaweedS3())
        return self.s3

    def s3_admin(self) -> ObjectStore:
        # One client for the module: building a boto3 client costs ~0.3 s on a busy machine.
        if self.s3_store is None:
            self.s3_store = self._stack.enter_context(self.seaweed().store())
        return self.s3_store

    def dht(self) -> ObjectStore:
        if self.dht_store is None:
            if not HAVE_DHT:
                pytest.skip("the DHT backend (protocol/store/dht) is not installed")
            from servers_dht import start_dht_nodes

            from protocol.store.dht.store import DHTStore

            # The suite's keys are not peers' own keys: the store writes as a validator of the run.
            self.dht_peers = self._stack.enter_context(start_dht_nodes(2, validator_keys=[DHT_WRITER.public_key]))
            self.dht_store = self._stack.enter_context(
                DHTStore(self.dht_peers, identity=DHT_WRITER, validator_keys=[DHT_WRITER.public_key])
            )
        return self.dht_store

    def close(self) -> None:
        self._stack.close()


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    started = Servers()
    yield started
    started.close()


@dataclass
class Case:
    """A store and the key root this test owns (``k("a/b")`` -> ``<root>/a/b``)."""

    name: str
    store: ObjectStore
    root: str

    def k(self, rest: str = "") -> str:
        return f"{self.root}/{rest}" if rest else self.root


@pytest.fixture(params=BACKENDS)
def case(request: pytest.FixtureRequest, servers: Servers, tmp_path: Path) -> Iterator[Case]:
    root = f"t{uuid.uuid4().hex[:12]}"
    name = request.param
    if name == "memory":
        store: ObjectStore = MemoryStore()
    elif name == "local":
        store = LocalStore(tmp_path / "store")
    elif name == "s3":
        yield Case(name, servers.s3_admin(), root)  # shared client: closed with the module
        return
    else:
        yield Case(name, servers.dht(), root)  # shared node: closed with the module
        return
    with store:
        yield Case(name, store, root)


def test_round_trip_binary_and_empty(case: Case) -> None:
    every_byte = bytes(range(256)) * 3
    case.store.put(case.k("a/bin"), every_byte)
    case.store.put(case.k("a/empty"), b"")
    assert case.store.get(case.k("a/bin")) == every_byte
    assert case.store.get(case.k("a/empty")) == b""
    assert case.store.size(case.k("a/bin")) == len(every_byte)
    assert case.store.size(case.k("a/empty")) == 0


def test_accepts_bytearray_and_memoryview(case: Case) -> None:
    case.store.put(case.k("ba"), bytearray(b"abc"))
    case.store.put(case.k("mv"), memoryview(b"xyz"))
    assert case.store.get(case.k("ba")) == b"abc"
    assert case.store.get(case.k("mv")) == b"xyz"


def test_one_mebibyte_round_trip(case: Case) -> None:
    data = os.urandom(1 << 20)
    case.store.put(case.k("big"), data)
    assert case.store.get(case.k("big"), max_bytes=1 << 20) == data


def test_overwrite_replaces(case: Case) -> None:
    case.store.put(case.k("x"), b"first")
    case.store.put(case.k("x"), b"second, longer")
    assert case.store.get(case.k("x")) == b"second, longer"
    assert case.store.size(case.k("x")) == len(b"second, longer")


def test_missing_key(case: Case) -> None:
    with pytest.raises(ObjectNotFound):
        case.store.get(case.k("nope"))
    with pytest.raises(ObjectNotFound):
        case.store.size(case.k("nope"))
    assert not case.store.exists(case.k("nope"))


def test_a_prefix_is_not_an_object(case: Case) -> None:
    case.store.put(case.k("dir/file"), b"1")
    with pytest.raises(ObjectNotFound):
        case.store.get(case.k("dir"))
    assert not case.store.exists(case.k("dir"))


def test_conditional_create(case: Case) -> None:
    case.store.put(case.k("once"), b"winner", if_absent=True)
    with pytest.raises(ObjectExists):
        case.store.put(case.k("once"), b"loser", if_absent=True)
    assert case.store.get(case.k("once")) == b"winner"


def test_put_once_accepts_only_the_same_bytes(case: Case) -> None:
    key = case.k("published")
    assert put_once(case.store, key, b"signed manifest")
    assert not put_once(case.store, key, b"signed manifest")  # a restarted writer republishing
    with pytest.raises(ObjectExists):
        put_once(case.store, key, b"signed manifesT")
    with pytest.raises(ObjectExists):
        put_once(case.store, key, b"signed")  # the larger existing object is not read in full
    assert case.store.get(key) == b"signed manifest"


def test_conditional_create_race_has_one_winner(case: Case) -> None:
    if not case.store.atomic_create:
        pytest.skip(f"{case.name}: if_absent is best-effort (atomic_create is False)")
    outcomes: list[str] = []
    barrier = threading.Barrier(6)

    def contend(i: int) -> None:
        barrier.wait()
        try:
            case.store.put(case.k("race"), f"writer {i}".encode(), if_absent=True)
            outcomes.append(f"won {i}")
        except ObjectExists:
            outcomes.append("lost")

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [o for o in outcomes if o.startswith("won")]
    assert len(outcomes) == 6 and len(winners) == 1
    assert case.store.get(case.k("race")) == f"writer {winners[0].split()[1]}".encode()


def test_size_cap(case: Case) -> None:
    case.store.put(case.k("capped"), b"x" * 1000)
    assert case.store.get(case.k("capped"), max_bytes=1000) == b"x" * 1000
    with pytest.raises(PayloadTooLarge):
        case.store.get(case.k("capped"), max_bytes=999)


def test_get_range_reads_exactly_the_bytes_asked(case: Case) -> None:
    data = os.urandom((1 << 20) + 3000)  # past a DHT piece boundary (1 MiB pieces)
    n = len(data)
    case.store.put(case.k("ranged"), data)
    ranges = [(0, 1), (1000, 777), (n - 1, 1), (0, n), ((1 << 20) - 50, 100), (n - 3000, 3000)]
    for start, length in ranges:  # first byte, middle, last byte, all of it, across a piece, the tail
        assert case.store.get_range(case.k("ranged"), start, length) == data[start : start + length]


def test_get_range_past_the_end_and_of_a_missing_key(case: Case) -> None:
    case.store.put(case.k("ten"), b"0123456789")
    case.store.put(case.k("empty"), b"")
    case.store.put(case.k("dir/file"), b"1")
    for start, length in [(0, 11), (9, 2), (10, 1), (1000, 5)]:
        with pytest.raises(RangeNotSatisfiable):
            case.store.get_range(case.k("ten"), start, length)
    with pytest.raises(RangeNotSatisfiable):
        case.store.get_range(case.k("empty"), 0, 1)
    for missing in ("nope", "dir"):
        with pytest.raises(ObjectNotFound):
            case.store.get_range(case.k(missing), 0, 1)
    assert case.store.get_range(case.k("ten"), 9, 1) == b"9"


@pytest.mark.parametrize("start, length", [(-1, 1), (0, 0), (0, -5), (0, MAX_RANGE_BYTES + 1), (True, 1), (0, 1.0)])
def test_get_range_refuses_what_is_not_a_range(case: Case, start: Any, length: Any) -> None:
    case.store.put(case.k("x"), b"0123456789")
    with pytest.raises(InvalidRange) as err:
        case.store.get_range(case.k("x"), start, length)
    assert isinstance(err.value, ValueError) and isinstance(err.value, StoreError)


def test_list_is_sorted_and_prefix_exact(case: Case) -> None:
    keys = ["w/1/b", "w/1/a", "w/10/a", "w/2/c", "w/1/sub/deep", "other/x"]
    for key in keys:
        case.store.put(case.k(key), key.encode())
    assert case.store.list(case.k("w/1/")) == [case.k(k) for k in ["w/1/a", "w/1/b", "w/1/sub/deep"]]
    assert case.store.list(case.k("w/1")) == [case.k(k) for k in ["w/1/a", "w/1/b", "w/1/sub/deep", "w/10/a"]]
    assert case.store.list(case.k("")) == sorted(case.k(k) for k in keys)
    assert case.store.list(case.k("missing/")) == []


def test_list_of_everything_includes_our_keys(case: Case) -> None:
    case.store.put(case.k("top"), b"1")
    assert case.k("top") in case.store.list("")


def test_delete(case: Case) -> None:
    case.store.put(case.k("d/x"), b"1")
    case.store.put(case.k("d/y"), b"2")
    case.store.delete(case.k("d/x"))
    assert not case.store.exists(case.k("d/x"))
    assert case.store.list(case.k("d/")) == [case.k("d/y")]
    case.store.delete(case.k("d/x"))  # missing: not an error
    case.store.delete(case.k("never"))
    case.store.put(case.k("d/x"), b"again", if_absent=True)  # deleted keys can be recreated
    assert case.store.get(case.k("d/x")) == b"again"


BAD_KEYS = [
    "",
    "/abs",
    "a//b",
    "a/../b",
    "..",
    "../x",
    "a/",
    "a/./b",
    ".hidden",
    "a\x00b",
    "a\\b",
    "sp ace",
    "x" * 1025,
]


@pytest.mark.parametrize("bad", BAD_KEYS)
def test_bad_keys_rejected(case: Case, bad: str) -> None:
    for call in (
        lambda: case.store.put(bad, b"1"),
        lambda: case.store.put(bad, b"1", if_absent=True),
        lambda: case.store.get(bad),
        lambda: case.store.get_range(bad, 0, 1),
        lambda: case.store.size(bad),
        lambda: case.store.delete(bad),
    ):
        with pytest.raises(InvalidKey):
            call()


@pytest.mark.parametrize("bad", ["/etc/", "a//", "../", "a/../b/", "a\\b"])
def test_bad_prefix_rejected(case: Case, bad: str) -> None:
    with pytest.raises(InvalidKey):
        case.store.list(bad)


def test_close_is_idempotent(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.close()
    store.close()


# ---------------------------------------------------------------------- open_store


def test_open_store_memory_shares_by_name() -> None:
    MemoryStore.forget("suite")
    a, b = open_store("memory://suite"), open_store("memory://suite")
    a.put("k", b"shared")
    assert b.get("k") == b"shared"
    assert not open_store("memory://").exists("k")


def test_open_store_file(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}/objs")
    assert isinstance(store, LocalStore)
    store.put("a/b", b"1")
    assert (tmp_path / "objs" / "a" / "b").read_bytes() == b"1"


def test_open_store_relative_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    store = open_store("file://./swarm")
    store.put("k", b"1")
    assert (tmp_path / "swarm" / "k").exists()


def test_open_store_rejects_unknown_options(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="fsynk"):
        open_store(f"file://{tmp_path}", fsynk=False)
    with pytest.raises(ConfigError):
        open_store("memory://x", colour="blue")


def test_open_from_settings_passes_what_the_settings_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with open_from_settings(StoreSettings(url=f"file://{tmp_path}/cli")) as store:
        assert isinstance(store, LocalStore) and store.root == (tmp_path / "cli").resolve()
    seen: list[tuple[str, dict[str, object]]] = []
    monkeypatch.setattr(protocol.store, "open_store", lambda url, **o: seen.append((url, o)) or MemoryStore())
    open_from_settings(StoreSettings(url="dht://", dht_bootstrap=("/ip4/10.0.0.2/tcp/1/p2p/QmCli",)))
    open_from_settings(StoreSettings(url="s3://b/p?endpoint=http://h:1&profile=x", s3_endpoint="http://other:2"))
    dht_options = {"initial_peers": ["/ip4/10.0.0.2/tcp/1/p2p/QmCli"], "identity": None, "validator_keys": []}
    assert seen[0] == ("dht://", dht_options)
    # the URL's endpoint is a setting and wins; other parameters stay in the URL
    assert seen[1] == ("s3://b/p?profile=x", {"endpoint_url": "http://h:1", "region": "auto"})


@pytest.mark.integration
def test_open_store_s3_and_config(servers: Servers) -> None:
    s3 = servers.seaweed()
    url = f"{s3.url('viaurl')}?endpoint={s3.endpoint_url}&region=us-east-1"
    with open_store(url, **s3.admin.options()) as store:
        store.put("k", b"via url")
    with s3.store() as admin:
        assert admin.get("viaurl/k") == b"via url"
    cfg = StoreSettings(url=s3.url("viacfg"), s3_endpoint=s3.endpoint_url, s3_region="us-east-1")
    with open_from_settings(cfg, **s3.admin.options()) as store:
        store.put("k", b"via config")
        assert store.list("") == ["k"]


@pytest.mark.parametrize(
    "url", ["nothing", "ftp://x", "file://", "s3://", "s3://Bad_Bucket/x", "s3://ok-bucket?secret=1"]
)
def test_open_store_rejects_bad_urls(url: str) -> None:
    with pytest.raises(ConfigError):
        open_store(url, access_key="a", secret_key="b")


@pytest.mark.integration
def test_open_store_dht(servers: Servers) -> None:
    if not HAVE_DHT:
        with pytest.raises(ConfigError):
            open_store("dht://")
        return
    writer = servers.dht()
    key = f"t{uuid.uuid4().hex[:12]}/via-url"
    writer.put(key, b"over the DHT")
    assert servers.dht_peers
    url = "dht://?peers=" + ",".join(servers.dht_peers[:1])
    keys = [DHT_WRITER.public_key]
    with open_store(url, initial_peers=servers.dht_peers[1:], validator_keys=keys) as reader:
        assert reader.get(key) == b"over the DHT"
    cfg = StoreSettings(url="dht://", dht_bootstrap=tuple(servers.dht_peers))
    with open_from_settings(cfg, validator_keys=keys) as reader:
        assert reader.get(key) == b"over the DHT"


# ---------------------------------------------------------------------- local directory specifics


def test_local_refuses_a_symlink_out_of_the_root(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    store = LocalStore(tmp_path / "root")
    (tmp_path / "root" / "link").symlink_to(outside)
    with pytest.raises(AccessDenied):
        store.put("link/x", b"escape")
    with pytest.raises(AccessDenied):
        store.get("link/x")
    assert list(outside.iterdir()) == []


def test_local_ignores_temp_files_of_a_crashed_writer(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put("run/contrib/1/a", b"done")
    (tmp_path / "run" / "contrib" / "1" / ".tmp-deadbeef").write_bytes(b"half an upl")
    assert store.list("run/") == ["run/contrib/1/a"]
    assert [p.name for p in (tmp_path / "run" / "contrib" / "1").iterdir() if p.name[0] != "."] == ["a"]


def test_local_put_leaves_no_temp_files(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put("a/b", b"1")
    store.put("a/b", b"2")
    with pytest.raises(ObjectExists):
        store.put("a/b", b"3", if_absent=True)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["b"]


def test_local_key_and_prefix_collision_is_a_store_error(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put("a", b"object")
    with pytest.raises(StoreError):
        store.put("a/b", b"under an object")
    assert store.get("a") == b"object"


def test_local_delete_prunes_empty_directories(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put("run/contrib/7/a", b"1")
    store.put("run/keep", b"1")
    store.delete("run/contrib/7/a")
    assert not (tmp_path / "run" / "contrib").exists()
    assert (tmp_path / "run" / "keep").exists()


def test_local_readers_never_see_a_torn_object(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, fsync=False)
    versions = [bytes([i]) * (2 << 20) for i in range(4)]
    store.put("hot", versions[0])
    stop = threading.Event()

    def writer() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            store.put("hot", versions[i % 4])

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for _ in range(30):
            assert store.get("hot") in versions
    finally:
        stop.set()
        thread.join()


def test_no_s3_credentials_names_the_settings_not_arguments(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A volunteer without a credential reads which setting gives access, in the user's words."""
    from protocol.settings import env_name

    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.aws
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(ConfigError) as err:
        open_store("s3://bucket/runs?endpoint=http://127.0.0.1:9&region=us-east-1")
    text = str(err.value)
    for wanted in ("store.grant_url", "[local.store]", env_name("store.grant_url"), "AWS_ACCESS_KEY_ID", "checkpoints"):
        assert wanted in text, wanted
    for internal in ("access_key/secret_key", "anonymous=True", "pass them"):
        assert internal not in text, internal

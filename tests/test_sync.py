"""client.peer.sync against objects the validator's publishing code writes: schema checks on aggregates
at decode time and the window-0 open time from the signed genesis manifest."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest
import torch

from client.peer.sync import Sync
from protocol import layout
from protocol.broadcast import plain
from protocol.config import RunSpec
from protocol.errors import SchemaMismatch
from protocol.events import Event, describe, read_events
from protocol.identity import Identity
from protocol.model import build_model, fingerprint, param_schema
from protocol.quorum import Signatures
from protocol.store import open_store
from protocol.store.base import ObjectStore
from protocol.store.memory import MemoryStore
from protocol.wire import GENESIS
from protocol.wire.quorum import Endorsement, encode_endorsement
from validator.publish import encode_window_aggregate, publish_checkpoint

TINY = {"preset": "tiny", "dim": 32, "n_layers": 1, "n_heads": 2, "ffn_dim": 64, "max_seq_len": 32}
VALIDATOR = Identity.from_seed(bytes(range(32)))
GENESIS_AT = 1_767_225_600.5


@pytest.fixture
def run() -> Iterator[tuple[RunSpec, ObjectStore, str]]:
    spec = RunSpec.from_dict({"model": TINY, "validator": {"public_keys": [VALIDATOR.public_key_hex]}})
    store = open_store(f"memory://sync-schema-{time.time_ns()}")
    params = {n: p.detach().clone() for n, p in build_model(spec.model).named_parameters()}
    launch = publish_checkpoint(
        store,
        layout.run_id(spec.hash()),
        spec.hash(),
        0,
        aggregate=GENESIS,
        params=params,
        identity=VALIDATOR,
        published_at=GENESIS_AT,
    ).digest  # the base of window 0
    yield spec, store, launch
    store.close()


def publish(spec: RunSpec, store: ObjectStore, launch: str, tensors: dict[str, tuple[tuple[int, ...], int]]) -> None:
    """Aggregate 0 with one value at flat index ``i`` of each named tensor of the given shape."""
    delta = {n: (torch.tensor([i]), torch.tensor([1e-3])) for n, (_, i) in tensors.items()}
    blob = encode_window_aggregate(
        run_hash=spec.hash(),
        window=0,
        base=launch,
        alpha=1.0,
        tensors=plain(delta, {n: s for n, (s, _) in tensors.items()}),
        manifest=[],
        fingerprint_next="0" * 64,
        published_at=GENESIS_AT + 1,
        metadata={},
        identity=VALIDATOR,
    )
    store.put(layout.aggregate_key(layout.run_id(spec.hash()), 0), blob)


def test_window_zero_deadline_comes_from_the_signed_genesis_manifest(run) -> None:  # type: ignore[no-untyped-def]
    spec, store, launch = run
    params: dict[str, torch.Tensor] = {}
    pos = Sync(spec, store).resync(params)
    assert pos.window == 0 and pos.opened_at == GENESIS_AT and pos.fingerprint == fingerprint(params)
    assert pos.base == launch  # the genesis manifest's digest roots the chain


def test_aggregate_covering_a_subset_of_theta_is_accepted(run) -> None:  # type: ignore[no-untyped-def]
    spec, store, launch = run
    name, shape = sorted(param_schema(spec.model).items())[0]
    publish(spec, store, launch, {name: (shape, 0)})
    agg = Sync(spec, store).fetch_aggregate(0)
    assert agg is not None and set(agg.value.tensors) == {name} and agg.value.window == 0


@pytest.mark.parametrize("kind", ["unknown tensor", "wrong shape"])
def test_aggregate_with_unknown_tensor_or_wrong_shape_is_rejected(run, kind: str) -> None:  # type: ignore[no-untyped-def]
    spec, store, launch = run
    name, shape = sorted(param_schema(spec.model).items())[0]
    bad = {"not.a.parameter": ((8,), 0)} if kind == "unknown tensor" else {name: ((shape[0] + 1, *shape[1:]), 0)}
    publish(spec, store, launch, bad)
    with pytest.raises(SchemaMismatch):
        Sync(spec, store).fetch_aggregate(0)


# ------------------------------------------------------------------------------ several validators
FOUR = [Identity.from_seed(bytes([i + 1]) * 32) for i in range(4)]


class CountingStore(MemoryStore):
    """A memory store that counts its listings and reads (what reading the endorsements costs)."""

    def __init__(self) -> None:
        super().__init__()
        self.listings: list[str] = []
        self.reads: list[str] = []

    def list(self, prefix: str) -> list[str]:
        self.listings.append(prefix)
        return super().list(prefix)

    def get(self, key: str, *, max_bytes: int = 1 << 30) -> bytes:
        self.reads.append(key)
        return super().get(key, max_bytes=max_bytes)


def endorse(spec: RunSpec, store: ObjectStore, window: int, who: Identity, digest: str) -> None:
    e = Endorsement(spec.hash(), window, 0, FOUR[0].peer_id, digest)
    store.put(layout.endorsement_key(layout.run_id(spec.hash()), window, who.peer_id), encode_endorsement(e, who))


def test_a_waiting_peer_reads_how_many_validators_signed() -> None:
    spec = RunSpec.from_dict(
        {"model": TINY, "validator": {"public_keys": [i.public_key_hex for i in FOUR], "quorum": 3}}
    )
    store = CountingStore()
    run = layout.run_id(spec.hash())
    sync = Sync(spec, store, poll_interval_s=0.001)
    assert sync.chain.signatures(7) == Signatures(window=7, m=3, n=4, endorsements=0, endorsed=0)
    endorse(spec, store, 7, FOUR[0], "a" * 64)
    endorse(spec, store, 7, FOUR[1], "a" * 64)
    endorse(spec, store, 7, FOUR[2], "b" * 64)  # a validator that endorsed another digest
    store.put(layout.endorsement_key(run, 7, FOUR[3].peer_id), b"junk")  # does not verify: no endorsement
    endorse(spec, store, 6, FOUR[3], "a" * 64)  # another window's
    found = sync.chain.signatures(7)
    assert found == Signatures(window=7, m=3, n=4, endorsements=2, endorsed=3)
    assert found.describe() == (
        "waiting for 3 of 4 validators to sign aggregate 7 (2 endorsements so far, 3 validators endorsed different digests)"
    )
    assert describe(found.event()) == found.describe()
    # 4 validators: each one's endorsement key is read (a GET, a 404 for one not there), no LIST
    assert not any("endorsement" in p for p in store.listings)
    assert sum("endorsement" in k for k in store.reads) == 2 * 4  # two readings so far
    store.listings.clear()
    store.reads.clear()

    # every poll checks the aggregate; the endorsements are read only every signatures_every_s
    polls, heard = [0], []

    def stop_after(n: int) -> Callable[[], bool]:
        def should_stop() -> bool:
            polls[0] += 1
            return polls[0] > n

        return should_stop

    assert not sync.wait_until_published(
        7, should_stop=stop_after(20), on_waiting=heard.append, signatures_every_s=3600
    )
    assert heard == [] and not any("endorsement" in k for k in [*store.listings, *store.reads])
    polls[0] = 0
    assert not sync.wait_until_published(7, should_stop=stop_after(3), on_waiting=heard.append, signatures_every_s=0)
    assert heard == [found] * 3 and sum("endorsement" in k for k in store.reads) == 3 * 4


def test_one_validator_reads_no_endorsement() -> None:
    spec = RunSpec.from_dict({"model": TINY, "validator": {"public_keys": [VALIDATOR.public_key_hex]}})
    store = CountingStore()
    sync = Sync(spec, store, poll_interval_s=0.001)
    heard: list[Signatures] = []
    polls = iter(range(5))
    sync.wait_until_published(
        0, should_stop=lambda: next(polls, None) is None, on_waiting=heard.append, signatures_every_s=0
    )
    assert sync.chain.signatures(0) is None and heard == []
    assert not any("endorsement" in p for p in store.listings)


def test_the_peer_shows_what_it_waits_for_and_reports_each_change() -> None:
    from client.peer.position import CatchUp

    class Display:
        def __init__(self) -> None:
            self.phases: list[str] = []
            self.events: list[Event] = []

        def update(self, **fields: object) -> None:
            self.phases.append(str(fields["phase"]))

        def emit(self, event: Event) -> None:
            self.events.append(event)

    display = Display()
    catch_up = CatchUp(SimpleNamespace(display=display), None, None)  # type: ignore[arg-type]
    one = Signatures(window=7, m=3, n=4, endorsements=1, endorsed=1)
    two = Signatures(window=7, m=3, n=4, endorsements=2, endorsed=2)
    for found in (one, one, two, two):
        catch_up._awaiting(found)
    assert display.phases[-1] == "waiting for 3 of 4 validators to sign aggregate 7 (2 endorsements so far)"
    assert len(display.phases) == 4 and [untimed(e) for e in display.events] == [
        untimed(one.event()),
        untimed(two.event()),
    ]
    line = json.dumps(display.events[1].to_dict())
    assert [untimed(e) for e in read_events([line])] == [
        untimed(display.events[1])
    ]  # the JSON line a program reads back


def untimed(event: Event) -> dict[str, object]:
    """An event's fields without the time it was made (two events made a millisecond apart compare equal)."""
    return {k: v for k, v in event.to_dict().items() if k != "time"}


def test_polls_back_off_to_the_schedules_cap() -> None:
    from itertools import islice

    from protocol.config import WindowConfig
    from protocol.windows import MAX_POLL_S, max_poll_s, poll_delays

    demo = WindowConfig(upload_deadline_s=120.0)
    assert list(islice(poll_delays(0.05, demo), 7)) == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.8, 1.2, 1.2])
    assert max_poll_s(1.0, WindowConfig(upload_deadline_s=1200.0)) == MAX_POLL_S  # 12 s would be too late
    assert max_poll_s(0.001, WindowConfig(upload_deadline_s=1200.0)) == pytest.approx(0.032)  # 32 × poll_s
    assert max_poll_s(30.0, demo) == 30.0  # never more often than asked


def test_a_waiting_peer_backs_off_until_the_aggregate_is_due_then_polls_every_poll_s() -> None:
    spec = RunSpec.from_dict(
        {"model": TINY, "validator": {"public_keys": [VALIDATOR.public_key_hex]}, "windows": {"upload_deadline_s": 2.0}}
    )
    reads: list[str] = []

    class Reads(MemoryStore):
        def get(self, key: str, *, max_bytes: int = 1 << 30) -> bytes:
            reads.append(key)
            return super().get(key, max_bytes=max_bytes)

    sync = Sync(spec, Reads(), poll_interval_s=0.001)
    started = time.monotonic()
    assert not sync.wait_until_published(0, base="b" * 64, stop_at=time.time() + 0.3, due_at=time.time() + 60)
    # not due: 0.001, 0.002 … 0.016, then every 0.02 s (upload_deadline_s / 100): ~20 looks in 0.3 s, not 300
    assert 5 <= len(reads) <= 25 and set(reads) == {layout.aggregate_key(layout.run_id(spec.hash()), 0)}
    assert time.monotonic() - started < 1.0
    reads.clear()
    assert not sync.wait_until_published(0, base="b" * 64, stop_at=time.time() + 0.3, due_at=time.time())
    assert len(reads) > 40  # due: one look every poll_s (a waiting peer idles; a GET costs less)


def test_the_next_aggregate_is_due_after_most_of_the_last_windows_length() -> None:
    from client.peer.position import DUE_SHARE, Theta
    from protocol.replay import Position

    spec = RunSpec.from_dict({"model": TINY, "validator": {"public_keys": [VALIDATOR.public_key_hex]}})
    theta = Theta(spec, MemoryStore(), poll_interval_s=0.1)
    assert theta.due_at() is None  # nothing known yet: no back-off
    theta.pos = Position(3, "b" * 64, "f" * 64, opened_at=1000.0)
    assert theta.due_at() is None
    theta.window_s = 100.0
    assert theta.due_at() == pytest.approx(1000.0 + DUE_SHARE * 100.0)

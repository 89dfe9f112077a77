"""Volume on the DHT: a listing floods of valid, self-signed directory entries cannot inflate.

The write policy stops forgery, not volume: anyone may sign entries of their own. Here one
``store_many`` RPC carries 10,000 entries of ``contrib/<window>/``, each signed by a fresh key for
its own peer id, and 300 fake ``contrib/<window>/`` folders are listed by fresh keys. The work of a
listing is counted (``DHTStore.last_listing``: directory records read, entries decoded), never
timed: the validator's listing of a window (:meth:`DHTStore.list_written_by` with the announced
peers) decodes no more than it did before the flood and misses no honest contribution; a plain
``list`` decodes at most its cap. The selection itself (:func:`protocol.store.dht.listing.choose`)
is tested without a DHT.
"""

from __future__ import annotations

import hashlib
import random
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import pytest
from servers_dht import start_dht_nodes

from protocol.identity import Identity
from protocol.store.dht.listing import Choice, ListBounds, ListStats, choose, read_directory
from protocol.store.dht.policy import FILE, FOLDER, WritePolicy, entry_subkey
from protocol.store.dht.records import seal_record
from protocol.store.dht.store import DHTStore

VALIDATOR = Identity.from_seed(b"F" * 32)
KEYS = [VALIDATOR.public_key]
HONEST = [Identity.from_seed(hashlib.sha256(b"honest %d" % i).digest()) for i in range(5)]
FLOOD, FAKE_FOLDERS = 10_000, 300
BOUNDS = ListBounds(max_entries=256, max_folders=16)


def _fresh(n: int, tag: bytes) -> list[Identity]:
    return [Identity.from_seed(hashlib.sha256(tag + i.to_bytes(4, "little")).digest()) for i in range(n)]


# ---------------------------------------------------------------------------------------- pure
def test_choose_keeps_trusted_and_named_writers_and_caps_the_rest() -> None:
    trusted, known = "V" * 20, "K" * 20
    subkeys: list[object] = [entry_subkey(trusted, f"t{i}") for i in range(5)]
    subkeys += [entry_subkey(known, "a"), entry_subkey(known, "b")]
    subkeys += [entry_subkey(f"x{i}", "c") for i in range(100)] + [7, b"raw"]
    rng = random.Random(1)
    named = choose(subkeys, partial="", writers={known}, trusted={trusted}, max_entries=1, rng=rng)
    assert sorted(named.subkeys) == sorted([*subkeys[:5], entry_subkey(known, "a")])  # trusted: uncapped
    assert (named.stats.unlisted, named.stats.over_cap, named.stats.malformed) == (100, 1, 2)
    capped = choose(subkeys, partial="", writers=None, trusted={trusted}, max_entries=10, rng=rng)
    assert len(capped.subkeys) == 15 and capped.stats.over_cap == 92
    assert choose(subkeys, partial="t", writers=None, trusted=(), max_entries=3, rng=rng).stats.over_cap == 2


def test_choose_is_round_robin_over_writers() -> None:
    """A writer with many entries cannot crowd out the others: every writer's first entry comes first."""
    greedy = [entry_subkey("G" * 20, f"n{i}") for i in range(1000)]
    others = [entry_subkey(f"w{i}", "n") for i in range(20)]
    chosen = choose(greedy + others, partial="", writers=None, trusted=(), max_entries=21, rng=random.Random(2))
    assert set(others) <= set(chosen.subkeys) and chosen.stats.over_cap == 999


def test_read_directory_counts_what_does_not_verify() -> None:
    policy = WritePolicy("sparseloco", KEYS)
    dht_key = "sparseloco:dir:run/contrib/00000001"

    @dataclass
    class Item:
        value: Any
        expiration_time: Any

    peer = HONEST[0]
    good = entry_subkey(peer.peer_id, peer.peer_id)
    entries: dict[object, object] = {
        good: Item(seal_record(peer, key=dht_key, subkey=good, expiration=9.0, content=FILE), 9.0),
        "a/b": Item(b"junk", 9.0),
        "c/d": Item(None, None),
        "e/f": Item(seal_record(peer, key=dht_key, subkey=good, expiration=9.0, content=FILE), 9.0),  # moved
    }
    listing = read_directory(policy, dht_key, entries, Choice(list(entries), ListStats(records=1)))  # type: ignore[arg-type]
    assert listing.markers == {peer.peer_id: {FILE}} and listing.trusted_names == frozenset()
    assert (listing.stats.decoded, listing.stats.malformed) == (4, 3)


def test_bounds_follow_the_run() -> None:
    assert ListBounds.for_run(64) == ListBounds(1024, 256)
    assert ListBounds.for_run(500) == ListBounds(8000, 2000)
    with pytest.raises(ValueError):
        ListBounds(max_entries=0)


# ---------------------------------------------------------------------------------------- the DHT
@dataclass
class Flooded:
    run: str
    window: str  # the window folder the flood went to
    validator: DHTStore
    honest_keys: list[str]
    before: dict[str, ListStats]  # what the listings decoded before the flood
    checks_before: int  # full record checks the validator's node made for one listing before it


def _entries(signers: list[Identity], dht_key: str, names: list[str], marker: bytes, exp: float) -> Any:
    subkeys = [entry_subkey(s.peer_id, n) for s, n in zip(signers, names)]
    values = [seal_record(s, key=dht_key, subkey=k, expiration=exp, content=marker) for s, k in zip(signers, subkeys)]
    return [dht_key] * len(subkeys), values, subkeys


def _checks(store: DHTStore) -> int:
    """Full signature and policy checks the node of ``store`` has made (hivemind checks every
    entry of a directory record it receives; one seen before costs a hash)."""
    return int(store._node.protocol.record_validator.verifications)


def _listed(store: DHTStore, prefix: str, writers: list[str] | None) -> tuple[list[str], ListStats]:
    keys = store.list(prefix) if writers is None else store.list_written_by(prefix, writers)
    return keys, store.last_listing


@pytest.fixture(scope="module")
def flooded() -> Iterator[Flooded]:
    from hivemind.utils.timed_storage import get_dht_time

    run = f"run-{uuid.uuid4().hex[:8]}"
    window = f"{run}/contrib/00000003"
    with ExitStack() as stack:
        boot = stack.enter_context(start_dht_nodes(2, validator_keys=KEYS))
        validator = stack.enter_context(DHTStore(boot, identity=VALIDATOR, validator_keys=KEYS, list_bounds=BOUNDS))
        attacker = stack.enter_context(DHTStore(boot, validator_keys=KEYS))
        keys = []
        for ident in HONEST:
            with DHTStore(boot, identity=ident, validator_keys=KEYS) as peer:
                keys.append(f"{window}/{ident.peer_id}")
                peer.put(keys[-1], b"contribution of " + ident.peer_id.encode())
        ids = [i.peer_id for i in HONEST]
        checks = _checks(validator)
        _listed(validator, f"{window}/", ids)
        checks_before = _checks(validator) - checks
        before = {
            "window": _listed(validator, f"{window}/", ids)[1],
            "contrib": _listed(validator, f"{run}/contrib/", ids)[1],
        }
        assert validator.list(f"{window}/") == sorted(keys)
        # One store RPC per node holding the record: 10,000 self-signed file entries, a fresh key each...
        exp = get_dht_time() + 600
        flood = _fresh(FLOOD, b"flood")
        dht_keys, values, subkeys = _entries(
            flood, validator.policy.dht_key("dir", window), [f.peer_id for f in flood], FILE, exp
        )
        # ...and fake window folders, listed by fresh keys, each holding a fake contribution entry
        fakes = _fresh(FAKE_FOLDERS, b"folder")
        names = [f"{10_000 + i:08d}/" for i in range(FAKE_FOLDERS)]
        more = _entries(fakes, validator.policy.dht_key("dir", f"{run}/contrib"), names, FOLDER, exp)
        inner = [
            _entries([f], validator.policy.dht_key("dir", f"{run}/contrib/{n[:-1]}"), [f.peer_id], FILE, exp)
            for f, n in zip(fakes, names)
        ]
        for batch in [(dht_keys, values, subkeys), more, *inner]:
            attacker._run(attacker._node.store_many(*batch[:2], exp, subkeys=batch[2]), "flood")
        yield Flooded(run, window, validator, keys, before, checks_before)


@pytest.mark.integration
def test_a_flooded_window_lists_as_cheaply_as_before(flooded: Flooded) -> None:
    ids = [i.peer_id for i in HONEST]
    keys, stats = _listed(flooded.validator, f"{flooded.window}/", ids)
    assert keys == sorted(flooded.honest_keys)  # no honest contribution missed
    assert stats.entries >= FLOOD  # the flood is there...
    assert stats.decoded <= 2 * flooded.before["window"].decoded  # ...and decoded no more than before
    assert stats.unlisted == FLOOD and stats.over_cap == 0
    # hivemind checks every entry it receives; a second listing re-checks far fewer than the flood
    # (the record cache), though a record the node refreshed in between is checked again
    checks = _checks(flooded.validator)
    _listed(flooded.validator, f"{flooded.window}/", ids)
    assert _checks(flooded.validator) - checks < FLOOD // 2


@pytest.mark.integration
def test_a_plain_listing_of_a_flooded_window_decodes_at_most_its_cap(flooded: Flooded) -> None:
    keys, stats = _listed(flooded.validator, f"{flooded.window}/", None)
    assert stats.decoded == BOUNDS.max_entries and stats.over_cap == FLOOD + len(HONEST) - BOUNDS.max_entries
    assert len(keys) == BOUNDS.max_entries


@pytest.mark.integration
def test_fake_folders_are_not_walked(flooded: Flooded) -> None:
    ids = [i.peer_id for i in HONEST]
    keys, stats = _listed(flooded.validator, f"{flooded.run}/contrib/", ids)
    assert keys == sorted(flooded.honest_keys)
    before = flooded.before["contrib"]
    assert stats.records <= 2 * before.records and stats.decoded <= 2 * before.decoded
    assert stats.unlisted >= FAKE_FOLDERS
    # without a writers filter: at most max_folders of them are followed, the rest counted
    keys, stats = _listed(flooded.validator, f"{flooded.run}/contrib/", None)
    assert stats.records == 1 + BOUNDS.max_folders
    # the 301 folder names (the honest window too) hold 305 entries: beyond the entry cap or the folder cap
    assert stats.folders_ignored > 0 and stats.folders_ignored + stats.over_cap >= FAKE_FOLDERS + 1 - BOUNDS.max_folders

"""Reading one DHT directory record within a bound: which entries are decoded, and what is ignored.

A directory record (``<ns>:dir:<folder>``, :mod:`protocol.store.dht.store`) is one hivemind
dictionary whose subkeys are ``<writer peer id>/<name>``. The write policy makes every entry
unforgeable, but anyone may add entries of their own: one ``store_many`` RPC with 10,000 entries,
each signed by a fresh key, is 10,000 valid entries (about 3 MB, under hivemind's 4 MiB message
cap). Verifying an entry costs an Ed25519 signature check and the policy's key parsing (about
0.1 ms), so a reader bounds that work *before* any of it, with only string operations on the
subkeys::

    chosen = choose(entries, partial="", writers=announced, trusted=policy.validator_ids,
                    max_entries=bounds.max_entries, rng=rng)
    listing = read_directory(policy, dht_key, entries, chosen)   # verified entries, counts

What :func:`choose` keeps, in this order:

1. Entries of a **trusted** writer (a validator key of the run): always, uncapped.
2. When ``writers`` is given (the writers the reader has reason to read: the announced peers, for
   the validator's listing of a window), entries of those writers; the entries of every other
   writer are counted (``unlisted``) and never decoded.
3. Of the rest, at most ``max_entries``, taken round-robin over writers in a random order (each
   writer's first entry, then each one's second, ...), so a writer with many entries cannot crowd
   out the others and a flood of fresh keys leaves each honest writer a fair chance on every
   listing. Everything beyond is counted (``over_cap``).

:func:`read_directory` then verifies exactly the chosen entries; one that does not verify is a
named :class:`~protocol.errors.ProtocolError`, counted (``malformed``) and skipped. A walk over
sub-folders follows every folder a trusted writer listed and at most ``max_folders`` others
(``folders_ignored`` counts the rest). The defaults follow the run (:meth:`ListBounds.for_run`):
``max_entries`` = max(1,024, 16 × ``validator.max_contributors``), ``max_folders`` = max(256,
4 × ``validator.max_contributors``): 1,024 and 256 at the default of 64 contributors.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field, fields
from itertools import chain, zip_longest

from protocol.errors import MalformedPayload, ProtocolError
from protocol.store.dht.policy import DirEntry, WritePolicy
from protocol.store.dht.records import open_record

#: Entries of untrusted writers one directory record yields at most, and folders one walk follows.
DEFAULT_MAX_ENTRIES, DEFAULT_MAX_FOLDERS = 1024, 256
ENTRIES_PER_CONTRIBUTOR, FOLDERS_PER_CONTRIBUTOR = 16, 4


@dataclass(frozen=True)
class ListBounds:
    """How much one listing of a DHT directory may decode (module doc)."""

    max_entries: int = DEFAULT_MAX_ENTRIES
    max_folders: int = DEFAULT_MAX_FOLDERS

    def __post_init__(self) -> None:
        if self.max_entries < 1 or self.max_folders < 0:
            raise ValueError("max_entries must be >= 1 and max_folders >= 0")

    @classmethod
    def for_run(cls, max_contributors: int) -> ListBounds:
        """The bounds of a run whose validator keeps at most ``max_contributors`` per window."""
        n = max(1, max_contributors)
        return cls(
            max(DEFAULT_MAX_ENTRIES, ENTRIES_PER_CONTRIBUTOR * n), max(DEFAULT_MAX_FOLDERS, FOLDERS_PER_CONTRIBUTOR * n)
        )


@dataclass
class ListStats:
    """What one listing read and what it ignored; summed over every directory record of a walk."""

    records: int = 0  # directory records read
    entries: int = 0  # entries those records held
    decoded: int = 0  # entries parsed and verified
    unlisted: int = 0  # entries of writers outside ``writers``, never decoded
    over_cap: int = 0  # entries beyond ``max_entries``, never decoded
    malformed: int = 0  # entries that did not verify (or a subkey that is not text)
    folders_ignored: int = 0  # sub-folders beyond ``max_folders``, never read

    def add(self, other: ListStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def ignored(self) -> int:
        return self.unlisted + self.over_cap + self.malformed + self.folders_ignored


@dataclass(frozen=True)
class Choice:
    """The subkeys of one directory record to decode, and the counts of those left out."""

    subkeys: list[str]
    stats: ListStats = field(default_factory=ListStats)


def choose(
    subkeys: Iterable[object],
    *,
    partial: str,
    writers: Collection[str] | None,
    trusted: Collection[str],
    max_entries: int,
    rng: random.Random,
) -> Choice:
    """The subkeys to decode (module doc), by string operations only; ``partial``: the entry name
    must start with it (entries that do not are not counted as ignored: they were not asked for)."""
    stats = ListStats(records=1)
    kept: list[str] = []
    by_writer: dict[str, list[str]] = {}
    for subkey in subkeys:
        stats.entries += 1
        if not isinstance(subkey, str):
            stats.malformed += 1
            continue
        writer, _, name = subkey.partition("/")
        if not name.startswith(partial):
            continue
        if writer in trusted:
            kept.append(subkey)
        elif writers is not None and writer not in writers:
            stats.unlisted += 1
        else:
            by_writer.setdefault(writer, []).append(subkey)
    order = list(by_writer)
    rng.shuffle(order)
    rounds = zip_longest(*(by_writer[w] for w in order))
    others = [s for s in chain.from_iterable(rounds) if s is not None]
    stats.over_cap = max(0, len(others) - max_entries)
    return Choice(kept + others[:max_entries], stats)


@dataclass(frozen=True)
class DirListing:
    """The verified entries of one directory record: per name the markers its writers gave it,
    and the names a trusted writer listed."""

    markers: dict[str, set[bytes]]
    trusted_names: frozenset[str]
    stats: ListStats


def read_directory(policy: WritePolicy, dht_key: str, entries: Mapping[object, object], choice: Choice) -> DirListing:
    """Verify the chosen entries of the directory record ``dht_key``: ``entries`` maps a subkey to
    hivemind's ``ValueWithExpiration`` (or any object with ``value`` and ``expiration_time``)."""
    stats = choice.stats
    markers: dict[str, set[bytes]] = {}
    trusted: set[str] = set()
    for subkey in choice.subkeys:
        stats.decoded += 1
        try:
            entry = open_entry(policy, dht_key, subkey, entries[subkey])
        except ProtocolError:
            stats.malformed += 1
            continue
        markers.setdefault(entry.name, set()).add(entry.marker)
        if entry.owner in policy.validator_ids:
            trusted.add(entry.name)
    return DirListing(markers, frozenset(trusted), stats)


def open_entry(policy: WritePolicy, dht_key: str, subkey: str, item: object) -> DirEntry:
    """One directory entry as hivemind returned it, verified: bound to ``dht_key``/``subkey`` and
    its expiration, signed, and permitted; a ``ProtocolError`` otherwise."""
    value, expiration = getattr(item, "value", None), getattr(item, "expiration_time", None)
    if not isinstance(expiration, float | int) or isinstance(expiration, bool):
        raise MalformedPayload(f"directory entry {subkey[:80]!r} has no expiration")
    record = open_record(value)
    if not record.matches(key=dht_key, subkey=subkey, expiration=float(expiration)):
        raise MalformedPayload(f"record signed for {record.key[:80]!r}/{record.subkey[:80]!r} found elsewhere")
    return policy.check_entry(record)

"""A dataset as the batch code reads it: two token streams made of shards, loaded on demand.

A :class:`TokenDataset` has a ``train`` and a ``val`` :class:`TokenSplit`. A split is the
concatenation of its shards; it knows every shard's length up front (from a local ``index.json``
or the run's signed dataset manifest) and reads a shard's tokens only when a read reaches it,
through a loader. Where the tokens come from is the dataset's :class:`ShardAccess`: memory-mapped
files for a local shard directory (:mod:`protocol.data.shards`), or the run's store with a verified
local cache for a run's dataset (:mod:`protocol.data.run_data`)::

    ds.train.shards_of(starts, span)      # which shards a set of sequences touches
    ds.need("train", shards)               # have them local before reading (hits and misses)
    ds.prefetch("train", later_shards)     # fetch in the background
    ds.train.read(start, length)           # tokens, possibly across a shard boundary
    ds.usage()                             # bytes fetched, cache hits and misses so far
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

__all__ = ["DataUsage", "LocalAccess", "ShardAccess", "TokenDataset", "TokenSplit"]


class TokenSplit:
    """One split as a virtual concatenation of shards; shard ``i`` comes from ``load(i)``."""

    def __init__(self, lengths: Sequence[int], load: Callable[[int], np.ndarray]) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.starts = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(self.lengths)])
        self._load = load

    @classmethod
    def of_arrays(cls, arrays: Sequence[np.ndarray]) -> TokenSplit:
        """A split over arrays already in memory (or memory-mapped)."""
        held = list(arrays)
        return cls([len(a) for a in held], held.__getitem__)

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def n_shards(self) -> int:
        return len(self.lengths)

    def shards_of(self, starts: np.ndarray | Sequence[int], length: int) -> list[int]:
        """The shards that the reads ``[s, s + length)`` for ``s`` in ``starts`` touch, sorted."""
        s = np.asarray(starts, dtype=np.int64)
        if s.size == 0:
            return []
        first = np.searchsorted(self.starts, s, side="right") - 1
        last = np.searchsorted(self.starts, s + length - 1, side="right") - 1
        touched = set(first.tolist()) | set(last.tolist())
        for a, b in zip(first.tolist(), last.tolist()):
            touched.update(range(a + 1, b))  # a read longer than a whole shard
        return sorted(touched)

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` (may cross shard boundaries)."""
        if start < 0 or start + length > len(self):
            raise IndexError(f"read [{start}, {start + length}) outside split of {len(self)} tokens")
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        parts, pos = [], start
        while pos < start + length:
            a, off = self._load(i), pos - int(self.starts[i])
            take = min(len(a) - off, start + length - pos)
            parts.append(a[off : off + take])
            pos, i = pos + take, i + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


@dataclass(frozen=True)
class DataUsage:
    """What reaching the data cost a process: bytes fetched from the store, and of the shards
    reads needed, how many were already local (``hits``: cached, or prefetched in time) and how
    many had to be fetched while the reader waited (``misses``)."""

    fetched_bytes: int = 0
    hits: int = 0
    misses: int = 0

    def __sub__(self, other: DataUsage) -> DataUsage:
        return DataUsage(self.fetched_bytes - other.fetched_bytes, self.hits - other.hits, self.misses - other.misses)


class ShardAccess(Protocol):
    """How a dataset's shards reach this process."""

    def need(self, split: str, shards: Collection[int]) -> None:
        """Make ``shards`` of ``split`` local before they are read (each counted a hit or a miss);
        raises :class:`~protocol.errors.DataUnavailable` when one cannot be had intact."""
        ...

    def prefetch(self, split: str, shards: Collection[int]) -> None:
        """Start fetching ``shards`` in the background (failures are left for :meth:`need`)."""
        ...

    def usage(self) -> DataUsage:
        """Totals since the dataset was opened."""
        ...


class LocalAccess:
    """Shards that are local already (memory-mapped files): nothing to fetch, nothing to count."""

    def need(self, split: str, shards: Collection[int]) -> None:
        return None

    def prefetch(self, split: str, shards: Collection[int]) -> None:
        return None

    def usage(self) -> DataUsage:
        return DataUsage()


@dataclass(frozen=True)
class TokenDataset:
    """A dataset: ``train`` and ``val`` splits, ``vocab_size``, ``tokenizer`` (its name),
    ``digest`` (what names it: the sha256 of a local ``index.json`` or of the run's dataset
    manifest body) and ``path``, where its shards lie on this machine."""

    path: Path
    train: TokenSplit
    val: TokenSplit
    vocab_size: int
    tokenizer: str
    digest: str
    access: ShardAccess = field(default_factory=LocalAccess)

    def split(self, name: str) -> TokenSplit:
        if name not in ("train", "val"):
            raise ValueError(f"no split {name!r}")
        return self.train if name == "train" else self.val

    def need(self, split: str, shards: Collection[int]) -> None:
        self.access.need(split, shards)

    def prefetch(self, split: str, shards: Collection[int]) -> None:
        self.access.prefetch(split, shards)

    def usage(self) -> DataUsage:
        return self.access.usage()

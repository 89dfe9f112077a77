"""A dataset as the batch code reads it: two token streams made of shards, read on demand.

A :class:`TokenDataset` has a ``train`` and a ``val`` :class:`TokenSplit`. A split is the
concatenation of its shards; it knows every shard's length up front (from a local ``index.json``
or the run's signed dataset manifest) and reads tokens only when a read reaches them, through a
reader of ``(shard, offset, length)``. Where the tokens come from is the dataset's
:class:`TokenAccess`: memory-mapped files for a local shard directory (:mod:`protocol.data.shards`),
or verified blocks of the run's store with a local cache for a run's dataset
(:mod:`protocol.data.run_data`). Both are asked for token ranges, never for whole shards::

    ds.need("train", [(start, length), ...])       # have these ranges local before reading
    ds.prefetch("train", later_ranges)               # fetch them in the background
    ds.train.read(start, length)                     # tokens, possibly across a shard boundary
    ds.usage()                                       # bytes and requests so far, hits and misses
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

__all__ = ["DataUsage", "LocalAccess", "Span", "TokenAccess", "TokenDataset", "TokenSplit"]

Span = tuple[int, int]  # (start, length): a range of tokens in a split
Reader = Callable[[int, int, int], np.ndarray]  # (shard, offset in it, length) -> those tokens


class TokenSplit:
    """One split as a virtual concatenation of shards; ``read(i, offset, length)`` reads shard ``i``."""

    def __init__(self, lengths: Sequence[int], read: Reader) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.starts = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(self.lengths)])
        self._read = read

    @classmethod
    def of_arrays(cls, arrays: Sequence[np.ndarray]) -> TokenSplit:
        """A split over arrays already in memory (or memory-mapped)."""
        held = list(arrays)
        return cls([len(a) for a in held], lambda i, offset, length: held[i][offset : offset + length])

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def n_shards(self) -> int:
        return len(self.lengths)

    def pieces(self, start: int, length: int) -> Iterator[tuple[int, int, int]]:
        """``(shard, offset, length)`` of each shard the tokens ``[start, start + length)`` lie in."""
        if start < 0 or length < 0 or start + length > len(self):
            raise IndexError(f"read [{start}, {start + length}) outside split of {len(self)} tokens")
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        pos, end = start, start + length
        while pos < end:
            while pos >= self.starts[i + 1]:  # skip empty shards
                i += 1
            take = min(int(self.starts[i + 1]) - pos, end - pos)
            yield i, pos - int(self.starts[i]), take
            pos += take

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` (may cross shard boundaries)."""
        parts = [self._read(i, offset, n) for i, offset, n in self.pieces(start, length)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


@dataclass(frozen=True)
class DataUsage:
    """What reaching the data cost a process: bytes fetched from the store and the ranged reads
    that fetched them (``requests``), and of the blocks reads needed, how many were already local
    (``hits``: cached, or prefetched in time) and how many had to be fetched while the reader
    waited (``misses``)."""

    fetched_bytes: int = 0
    hits: int = 0
    misses: int = 0
    requests: int = 0

    def __sub__(self, other: DataUsage) -> DataUsage:
        return DataUsage(
            self.fetched_bytes - other.fetched_bytes,
            self.hits - other.hits,
            self.misses - other.misses,
            self.requests - other.requests,
        )


class TokenAccess(Protocol):
    """How a dataset's tokens reach this process."""

    def need(self, split: str, spans: Collection[Span]) -> None:
        """Make the token ranges ``spans`` of ``split`` local before they are read; raises
        :class:`~protocol.errors.DataUnavailable` when one cannot be had intact."""
        ...

    def prefetch(self, split: str, spans: Collection[Span]) -> None:
        """Start fetching ``spans`` in the background (failures are left for :meth:`need`)."""
        ...

    def usage(self) -> DataUsage:
        """Totals since the dataset was opened."""
        ...


class LocalAccess:
    """Tokens that are local already (memory-mapped files): nothing to fetch, nothing to count."""

    def need(self, split: str, spans: Collection[Span]) -> None:
        return None

    def prefetch(self, split: str, spans: Collection[Span]) -> None:
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
    access: TokenAccess = field(default_factory=LocalAccess)

    def split(self, name: str) -> TokenSplit:
        if name not in ("train", "val"):
            raise ValueError(f"no split {name!r}")
        return self.train if name == "train" else self.val

    def need(self, split: str, spans: Collection[Span]) -> None:
        self.access.need(split, spans)

    def prefetch(self, split: str, spans: Collection[Span]) -> None:
        self.access.prefetch(split, spans)

    def usage(self) -> DataUsage:
        return self.access.usage()

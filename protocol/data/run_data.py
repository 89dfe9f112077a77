"""The run's dataset as it lies in the run's store: a signed manifest, then shards fetched on demand.

``sparseloco-validator init`` tokenizes the corpus once and puts, beside the run's other objects
(:mod:`protocol.layout`)::

    <run>/data/manifest            the signed DatasetManifest; its body's digest is data.dataset
    <run>/data/shard/<sha256>      every shard, named by the sha256 of its bytes
    <run>/data/tokenizer/<sha256>  the tokenizer.json of an ``hf:<sha256>`` tokenizer

Peers and the validator open it the same way and fetch only the shards their batches touch::

    ds = open_run_dataset(spec, store, settings.data)   # the manifest, verified; no shard yet
    batches = assigned_batches(ds, ...)                  # fetches, verifies and caches what they need
    ds.prefetch("train", assigned_shards(ds, ..., window + 1, ...))   # in the background
    ds.usage()                                           # bytes fetched, cache hits and misses
    tok = run_tokenizer(spec, store, settings.data)

Opening checks that the manifest is signed by a validator key of the run, that its body hashes to
the RunSpec's ``data.dataset`` and names the RunSpec's tokenizer, and that its vocabulary fits the
model. A shard is trusted only when its bytes hash to the sha256 the manifest gives: a damaged one
is fetched again (``FETCH_ATTEMPTS`` times in all), and if it is still damaged the read raises
:class:`~protocol.errors.DataUnavailable`. Nothing is ever trained or scored on unverified bytes,
and since a damaged shard is never cached, the next read fetches it again: a repaired store is
picked up by itself. Verified shards go to this machine's cache (:mod:`protocol.data.cache`).
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from pathlib import Path

import numpy as np

from protocol import layout
from protocol.config import RunSpec
from protocol.data.assignment import open_dataset
from protocol.data.cache import SHARDS, TOKENIZERS, ShardCache, cache_dir
from protocol.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, tokenizer_digest
from protocol.data.tokens import DataUsage, TokenDataset, TokenSplit
from protocol.errors import ConfigError, DataUnavailable, DigestMismatch, ObjectNotFound, ProtocolError, StoreError
from protocol.files import atomic_write
from protocol.settings import DataSettings
from protocol.store.base import ObjectStore
from protocol.wire import DatasetManifest, decode_dataset

__all__ = [
    "FETCH_ATTEMPTS",
    "dataset_of",
    "MAX_MANIFEST_BYTES",
    "MAX_TOKENIZER_BYTES",
    "StoreShards",
    "open_run_dataset",
    "read_dataset_manifest",
    "run_tokenizer",
]

MAX_MANIFEST_BYTES = 256 << 20  # 4 M shards at ~36 bytes each, with room
MAX_TOKENIZER_BYTES = 64 << 20
FETCH_ATTEMPTS = 2  # a shard whose bytes do not verify is fetched once more before the read fails
MAX_OPEN = 64  # shards a process holds open (memory-mapped from the cache, or in memory)

Key = tuple[str, int]  # (split, shard index)


def read_dataset_manifest(store: ObjectStore, spec: RunSpec, run: str | None = None) -> DatasetManifest:
    """The run's dataset manifest, verified against the RunSpec (see the module docstring).
    ``ObjectNotFound`` when the store has none; ConfigError when the RunSpec names no dataset or
    disagrees with the signed manifest."""
    if not spec.data.dataset:
        raise ConfigError(
            "the RunSpec names no dataset (data.dataset): create the run with `sparseloco-validator init`"
        )
    run = run or layout.run_id(spec.hash())
    blob = store.get(layout.dataset_manifest_key(run), max_bytes=MAX_MANIFEST_BYTES)
    m = decode_dataset(
        blob,
        run_hash=spec.hash(),
        max_bytes=MAX_MANIFEST_BYTES,
        allowed_signers=spec.validator.public_keys,
        digest=spec.data.dataset,
    ).value
    if m.tokenizer != spec.data.tokenizer:
        raise ConfigError(
            f"the run's dataset is tokenized with {m.tokenizer!r}, its RunSpec names {spec.data.tokenizer!r}"
        )
    if m.vocab_size > spec.model.vocab_size:
        raise ConfigError(
            f"the run's dataset has a vocabulary of {m.vocab_size}, model.vocab_size is {spec.model.vocab_size}"
        )
    return m


def open_run_dataset(
    spec: RunSpec, store: ObjectStore, local: DataSettings | None = None, *, run: str | None = None
) -> TokenDataset:
    """The run's dataset from ``store``: its manifest now, its shards as reads need them, cached
    in ``local``'s cache directory under its size cap. ``run``: the key prefix (default: the run id)."""
    local = local or DataSettings()
    run = run or layout.run_id(spec.hash())
    manifest = read_dataset_manifest(store, spec, run)
    cache = ShardCache(cache_dir(local) / SHARDS, local.cache_max_bytes)
    access = StoreShards(store, run, manifest, cache)
    splits = {
        name: TokenSplit([s.tokens for s in manifest.split(name)], access.loader(name)) for name in ("train", "val")
    }
    return TokenDataset(
        cache.root, splits["train"], splits["val"], manifest.vocab_size, manifest.tokenizer, spec.data.dataset, access
    )


def run_tokenizer(spec: RunSpec, store: ObjectStore, local: DataSettings | None = None) -> ByteTokenizer | HFTokenizer:
    """The run's tokenizer: ``bytes``, or its tokenizer.json fetched from the store (verified
    against the sha256 the RunSpec names) into the cache directory, where it stays."""
    digest = tokenizer_digest(spec.data.tokenizer)
    if digest is None:
        return load_tokenizer(spec.data.tokenizer)
    folder = cache_dir(local) / TOKENIZERS
    path = folder / f"{digest}.json"
    if not (path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == digest):
        data = store.get(layout.tokenizer_key(layout.run_id(spec.hash()), digest), max_bytes=MAX_TOKENIZER_BYTES)
        if hashlib.sha256(data).hexdigest() != digest:
            raise DigestMismatch(f"the run's tokenizer.json in the store does not hash to {digest[:16]}…")
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(path, data)
    return load_tokenizer(spec.data.tokenizer, cache=folder)


class StoreShards:
    """A :class:`~protocol.data.tokens.ShardAccess` over the store: fetch, verify, cache, prefetch, count."""

    def __init__(self, store: ObjectStore, run: str, manifest: DatasetManifest, cache: ShardCache) -> None:
        self.store, self.run, self.manifest, self.cache = store, run, manifest, cache
        self._splits = {name: manifest.split(name) for name in ("train", "val")}
        self._dtype = np.dtype(manifest.dtype).newbyteorder("<")
        self._lock = threading.Lock()
        self._open: OrderedDict[Key, np.ndarray] = OrderedDict()  # what reads use, most recent last
        self._ready: OrderedDict[Key, np.ndarray] = OrderedDict()  # prefetched, too large to cache
        self._inflight: dict[Key, threading.Event] = {}
        self._queue: queue.Queue[Key] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._fetched = self._hits = self._misses = 0

    # ------------------------------------------------------------------ ShardAccess
    def need(self, split: str, shards: Collection[int]) -> None:
        for i in shards:
            self._acquire((split, i))

    def prefetch(self, split: str, shards: Collection[int]) -> None:
        with self._lock:
            for i in shards:
                key = (split, i)
                if key in self._open or key in self._ready or key in self._inflight:
                    continue
                self._inflight[key] = threading.Event()
                self._queue.put(key)
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._prefetch_loop, name="shard-prefetch", daemon=True)
                self._worker.start()

    def usage(self) -> DataUsage:
        with self._lock:
            return DataUsage(self._fetched, self._hits, self._misses)

    def wait_prefetched(self, timeout: float | None = None) -> bool:
        """Wait until every prefetch started so far has finished; False if ``timeout`` passed first."""
        with self._lock:
            pending = list(self._inflight.values())
        deadline = None if timeout is None else time.monotonic() + timeout
        for event in pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not event.wait(left):
                return False
        return True

    def loader(self, split: str) -> Callable[[int], np.ndarray]:
        """What a :class:`~protocol.data.tokens.TokenSplit` of ``split`` reads its shards with."""
        return lambda i: self.load(split, i)

    def load(self, split: str, i: int) -> np.ndarray:
        """Shard ``i`` of ``split`` for a read (fetched and counted unless :meth:`need` had it)."""
        with self._lock:
            arr = self._open.get((split, i))
            if arr is not None:
                self._open.move_to_end((split, i))
                return arr
        return self._acquire((split, i))

    # ------------------------------------------------------------------ internals
    def _acquire(self, key: Key) -> np.ndarray:
        with self._lock:
            arr = self._open.get(key)
            if arr is not None:
                self._open.move_to_end(key)
                self._hits += 1
                return arr
            pending = self._inflight.get(key)
        waited = pending is not None and not pending.is_set()
        if pending is not None:
            pending.wait()  # a prefetch of this shard is under way: do not fetch it twice
        arr = self._local(key)
        hit = arr is not None and not waited
        if arr is None:
            arr = self._fetch(key)
        with self._lock:
            if hit:
                self._hits += 1
            else:
                self._misses += 1
            self._open[key] = arr
            while len(self._open) > MAX_OPEN:
                self._open.popitem(last=False)
        return arr

    def _shard(self, key: Key) -> tuple[str, int]:
        split, i = key
        s = self._splits[split][i]
        return s.sha256, self.manifest.shard_bytes(s)

    def _local(self, key: Key) -> np.ndarray | None:
        """The shard if this machine has it: prefetched into memory, or in the cache."""
        with self._lock:
            arr = self._ready.pop(key, None)
        if arr is not None:
            return arr
        sha, size = self._shard(key)
        path = self.cache.get(sha, size)
        return None if path is None else self._map(path)

    def _fetch(self, key: Key) -> np.ndarray:
        """Fetch, verify (fetching again once on a mismatch) and keep the shard."""
        sha, size = self._shard(key)
        where = f"shard {sha[:16]}… ({key[0]} {key[1]})"
        last: Exception | None = None
        for _ in range(FETCH_ATTEMPTS):
            try:
                data = self.store.get(layout.shard_key(self.run, sha), max_bytes=size)
            except ObjectNotFound as exc:
                raise DataUnavailable(f"{where} is not in the store: {exc}") from exc
            except (StoreError, ProtocolError) as exc:  # a failing store, or an oversized object
                last = exc
                continue
            with self._lock:
                self._fetched += len(data)
            if len(data) == size and hashlib.sha256(data).hexdigest() == sha:
                return self._keep(sha, data)
            last = DigestMismatch(f"{len(data)} bytes that do not hash to the name the signed manifest gives")
        raise DataUnavailable(f"{where}: {last}") from last

    def _keep(self, sha: str, data: bytes) -> np.ndarray:
        path = self.cache.put(sha, data)
        return self._map(path) if path is not None else np.frombuffer(data, dtype=self._dtype)

    def _map(self, path: Path) -> np.ndarray:
        return np.memmap(path, dtype=self._dtype, mode="r")

    def _prefetch_loop(self) -> None:
        while True:
            key = self._queue.get()
            try:
                sha, size = self._shard(key)
                if self.cache.get(sha, size) is None:
                    arr = self._fetch(key)
                    if not isinstance(arr, np.memmap):  # too large for the cache: hold it for the reader
                        with self._lock:
                            self._ready[key] = arr
                            while len(self._ready) > MAX_OPEN:
                                self._ready.popitem(last=False)
            except (StoreError, ProtocolError):
                pass  # the reader fetches it again and reports what went wrong
            finally:
                with self._lock:
                    done = self._inflight.pop(key, None)
                if done is not None:
                    done.set()


def dataset_of(spec: RunSpec, store: ObjectStore, local: DataSettings | None = None) -> TokenDataset:
    """The dataset a RunSpec trains on: its store's (:func:`open_run_dataset`) when it names one —
    every run the commands start, since they refuse a RunSpec without — else the local built-in
    corpus of an in-process run (the simulator, tests: :func:`protocol.data.assignment.open_dataset`)."""
    if spec.data.dataset:
        return open_run_dataset(spec, store, local)
    return open_dataset(spec.data, local=local)

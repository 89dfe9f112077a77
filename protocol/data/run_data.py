"""The run's dataset as it lies in the run's store: a signed manifest, then blocks fetched on demand.

``sparseloco-validator init`` tokenizes the corpus once and puts, beside the run's other objects
(:mod:`protocol.layout`)::

    <run>/data/manifest            the signed DatasetManifest; its body's digest is data.dataset
    <run>/data/shard/<sha256>      every shard, named by the sha256 of its bytes
    <run>/data/tokenizer/<sha256>  the tokenizer.json of an ``hf:<sha256>`` tokenizer

Peers and the validator open it the same way and fetch only the blocks their batches touch
(:mod:`protocol.wire.dataset`: ``block_tokens`` consecutive tokens of a shard, each with its own
sha256 in the manifest), one ranged read of the shard object per run of consecutive blocks::

    ds = open_run_dataset(spec, store, settings.data)   # the manifest, verified; no block yet
    batches = assigned_batches(ds, ...)                  # fetches, verifies and caches what they need
    ds.prefetch("train", assigned_spans(ds, ..., window + 1, ...))   # in the background
    ds.usage()                                           # bytes and reads fetched, cache hits and misses
    tok = run_tokenizer(spec, store, settings.data)

Opening checks that the manifest is signed by a validator key of the run, that its body hashes to
the RunSpec's ``data.dataset`` and names the RunSpec's tokenizer, and that its vocabulary fits the
model. A block is trusted only when its bytes hash to the sha256 the manifest gives: a damaged one
is fetched again (``FETCH_ATTEMPTS`` times in all), and if it is still damaged the read raises
:class:`~protocol.errors.DataUnavailable`. A read that fails without an answer (a link or store
that is down) is tried again with backoff for ``patience_s`` (a peer: its upload deadline, so that an
outage shorter than a window does not cost the window its data) before it counts as failed. Nothing is ever trained or scored on unverified bytes,
and since a damaged block is never cached, the next read fetches it again: a repaired store is
picked up by itself. Verified blocks go to this machine's cache (:mod:`protocol.data.cache`) and
stay in memory up to ``MAX_HELD_BYTES``.
"""

from __future__ import annotations

import functools
import hashlib
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import replace

import numpy as np

from protocol import layout
from protocol.config import RunSpec
from protocol.data.assignment import open_dataset
from protocol.data.cache import BLOCKS, TOKENIZERS, BlockCache, cache_dir
from protocol.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, tokenizer_digest
from protocol.data.tokens import DataUsage, Span, TokenDataset, TokenSplit
from protocol.errors import ConfigError, DataUnavailable, DigestMismatch, ObjectNotFound, ProtocolError, StoreError
from protocol.files import atomic_write
from protocol.settings import DataSettings
from protocol.store.base import ObjectStore
from protocol.store.fetch import BACKOFF_S, Retry
from protocol.wire import DatasetManifest, decode_dataset
from protocol.wire.dataset import SPLITS, DatasetShard

__all__ = [
    "FETCH_ATTEMPTS",
    "dataset_of",
    "MAX_MANIFEST_BYTES",
    "MAX_TOKENIZER_BYTES",
    "StoreBlocks",
    "open_run_dataset",
    "read_dataset_manifest",
    "run_tokenizer",
]

MAX_MANIFEST_BYTES = 256 << 20  # 4 M shards at ~36 bytes each, with room
MAX_TOKENIZER_BYTES = 64 << 20
FETCH_ATTEMPTS = 2  # a shard whose bytes do not verify is fetched once more before the read fails
MAX_HELD_BYTES = 256 << 20  # blocks a process holds in memory (a window of a 1B run reads ~8 MiB)

Block = tuple[str, int, int]  # (split, shard index, block index in the shard)


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
    spec: RunSpec,
    store: ObjectStore,
    local: DataSettings | None = None,
    *,
    run: str | None = None,
    patience_s: float = 0.0,
) -> TokenDataset:
    """The run's dataset from ``store``: its manifest now, its shards as reads need them, cached
    in ``local``'s cache directory under its size cap. ``run``: the key prefix (default: the run id).
    ``patience_s``: how long a block's read that fails without a refusal (a link or store that is
    down) is tried again, with backoff, before the read fails (0: once)."""
    local = local or DataSettings()
    run = run or layout.run_id(spec.hash())
    manifest = read_dataset_manifest(store, spec, run)
    cache = BlockCache(cache_dir(local) / BLOCKS, local.cache_max_bytes)
    access = StoreBlocks(store, run, manifest, cache, patience_s=patience_s)
    train, val = access.splits["train"], access.splits["val"]
    return TokenDataset(cache.root, train, val, manifest.vocab_size, manifest.tokenizer, spec.data.dataset, access)


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


class StoreBlocks:
    """A :class:`~protocol.data.tokens.TokenAccess` over the store: ranged reads of verified blocks,
    cached, prefetched, counted. ``splits`` are the dataset's two :class:`TokenSplit` over it."""

    def __init__(
        self, store: ObjectStore, run: str, manifest: DatasetManifest, cache: BlockCache, *, patience_s: float = 0.0
    ) -> None:
        self.store, self.run, self.manifest, self.cache = store, run, manifest, cache
        self._retry = Retry(None, BACKOFF_S, patience_s) if patience_s > 0 else None
        self._shards = {name: manifest.split(name) for name in SPLITS}
        self.splits = {
            name: TokenSplit([s.tokens for s in shards], self._reader(name)) for name, shards in self._shards.items()
        }
        self._dtype = np.dtype(manifest.dtype).newbyteorder("<")
        self._lock = threading.Lock()
        self._held: OrderedDict[Block, np.ndarray] = OrderedDict()  # what reads use, most recent last
        self._held_bytes = 0
        self._inflight: dict[Block, threading.Event] = {}
        self._queue: queue.Queue[list[Block]] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._usage = DataUsage()

    # ------------------------------------------------------------------ TokenAccess
    def need(self, split: str, spans: Collection[Span]) -> None:
        self._acquire(self._blocks_of(split, spans))

    def prefetch(self, split: str, spans: Collection[Span]) -> None:
        with self._lock:
            todo = [b for b in self._blocks_of(split, spans) if b not in self._held and b not in self._inflight]
            for b in todo:
                self._inflight[b] = threading.Event()
            if not todo:
                return
            self._queue.put(todo)
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._prefetch_loop, name="data-prefetch", daemon=True)
                self._worker.start()

    def usage(self) -> DataUsage:
        with self._lock:
            return self._usage

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

    # ------------------------------------------------------------------ reading
    def _reader(self, split: str) -> Callable[[int, int, int], np.ndarray]:
        bt = self.manifest.block_tokens

        def read(shard: int, offset: int, length: int) -> np.ndarray:
            blocks = [(split, shard, b) for b in _covering(offset, length, bt)]
            held = self._acquire(blocks, count=False)  # need() counted them
            tokens = held[0] if len(held) == 1 else np.concatenate(held)
            first = blocks[0][2] * bt
            return tokens[offset - first : offset - first + length]

        return read

    def _blocks_of(self, split: str, spans: Collection[Span]) -> list[Block]:
        """The blocks the token ranges ``spans`` of ``split`` lie in, sorted, each once."""
        bt, tokens = self.manifest.block_tokens, self.splits[split]
        out: set[Block] = set()
        for start, length in spans:
            for shard, offset, n in tokens.pieces(start, length):
                out.update((split, shard, b) for b in _covering(offset, n, bt))
        return sorted(out)

    def _acquire(self, blocks: list[Block], *, count: bool = True) -> list[np.ndarray]:
        """The tokens of ``blocks``: held, then prefetched or cached (hits), then fetched (misses).
        With ``count`` off (a read after :meth:`need` counted its blocks) only what still had to be
        fetched is counted, as misses."""
        found: dict[Block, np.ndarray] = {}
        with self._lock:
            for b in blocks:
                arr = self._held.get(b)
                if arr is not None:
                    self._held.move_to_end(b)
                    found[b] = arr
            waits = [(b, e) for b in blocks if b not in found and (e := self._inflight.get(b)) is not None]
        waited = {b for b, e in waits if not e.is_set()}
        for _, event in waits:
            event.wait()  # a prefetch of this block is under way: do not fetch it twice
        rest = [b for b in blocks if b not in found]
        found.update(self._local(rest))
        missing = [b for b in blocks if b not in found]
        for run in _runs(missing):
            found.update(self._fetch(run))
        late = len(missing) + (len(waited - set(missing)) if count else 0)
        hits = len(blocks) - late if count else 0
        with self._lock:
            self._usage = replace(self._usage, hits=self._usage.hits + hits, misses=self._usage.misses + late)
        return [found[b] for b in blocks]

    def _local(self, blocks: list[Block]) -> dict[Block, np.ndarray]:
        """Those of ``blocks`` this machine has: held (prefetched meanwhile) or in the cache."""
        out = {}
        for b in blocks:
            with self._lock:
                arr = self._held.get(b)
            if arr is None:
                sha, size = self._block(b)
                data = self.cache.get(sha, size)
                if data is None:
                    continue
                arr = self._hold(b, data)
            out[b] = arr
        return out

    # ------------------------------------------------------------------ fetching
    def _block(self, b: Block) -> tuple[str, int]:
        """The sha256 hex and byte size of block ``b``."""
        split, shard, index = b
        s, bb = self._shards[split][shard], self.manifest.block_bytes
        return s.block(index).hex(), min(bb, self.manifest.shard_bytes(s) - index * bb)

    def _fetch(self, run: list[Block]) -> dict[Block, np.ndarray]:
        """Fetch consecutive blocks of one shard with ranged reads, verify each (fetching what
        failed once more), keep them; DataUnavailable when one cannot be had intact."""
        split, shard, _ = run[0]
        s = self._shards[split][shard]
        where = f"shard {s.sha256[:16]}… ({split} {shard})"
        out: dict[Block, np.ndarray] = {}
        last: Exception | None = None
        for _ in range(FETCH_ATTEMPTS):
            todo = [b for b in run if b not in out]
            if not todo:
                break
            try:
                read = functools.partial(self._fetch_range, s, todo)
                out.update(read() if self._retry is None else self._retry.run(read))
            except ObjectNotFound as exc:
                raise DataUnavailable(f"{where} is not in the store: {exc}") from exc
            except (StoreError, ProtocolError) as exc:  # a failing store, or a short or oversized answer
                last = exc
        bad = [b for b in run if b not in out]
        if bad:
            last = last or DigestMismatch(
                f"block {bad[0][2]}: bytes that do not hash to what the signed manifest gives"
            )
            raise DataUnavailable(f"{where}: {last}") from last
        return out

    def _fetch_range(self, s: DatasetShard, blocks: list[Block]) -> dict[Block, np.ndarray]:
        """One ranged read covering ``blocks``; the blocks whose bytes verify."""
        sizes = [self._block(b) for b in blocks]
        start = blocks[0][2] * self.manifest.block_bytes
        length = (blocks[-1][2] - blocks[0][2]) * self.manifest.block_bytes + sizes[-1][1]
        data = self.store.get_range(layout.shard_key(self.run, s.sha256), start, length)
        with self._lock:
            self._usage = replace(
                self._usage, fetched_bytes=self._usage.fetched_bytes + len(data), requests=self._usage.requests + 1
            )
        out, view = {}, memoryview(data)
        for b, (sha, size) in zip(blocks, sizes):
            at = (b[2] - blocks[0][2]) * self.manifest.block_bytes
            part = bytes(view[at : at + size])
            if len(part) == size and hashlib.sha256(part).hexdigest() == sha:
                self.cache.put(sha, part)
                out[b] = self._hold(b, part)
        return out

    def _hold(self, b: Block, data: bytes) -> np.ndarray:
        arr = np.frombuffer(data, dtype=self._dtype)
        with self._lock:
            if b not in self._held:
                self._held[b] = arr
                self._held_bytes += len(data)
            self._held.move_to_end(b)
            while self._held_bytes > MAX_HELD_BYTES and len(self._held) > 1:
                _, old = self._held.popitem(last=False)
                self._held_bytes -= old.nbytes
            return self._held[b]

    def _prefetch_loop(self) -> None:
        while True:
            blocks = self._queue.get()
            try:
                local = self._local(blocks)
                for run in _runs([b for b in blocks if b not in local]):
                    try:
                        self._fetch(run)
                    except (StoreError, ProtocolError):
                        pass  # the reader fetches it again and reports what went wrong
            finally:
                with self._lock:
                    done = [self._inflight.pop(b, None) for b in blocks]
                for event in done:
                    if event is not None:
                        event.set()


def _covering(offset: int, length: int, block_tokens: int) -> range:
    """The indices of the blocks that tokens ``[offset, offset + length)`` of a shard lie in."""
    return range(offset // block_tokens, (offset + length - 1) // block_tokens + 1)


def _runs(blocks: list[Block]) -> list[list[Block]]:
    """Sorted blocks cut into runs of consecutive blocks of one shard (one ranged read each)."""
    out: list[list[Block]] = []
    for b in blocks:
        if out and out[-1][-1][:2] == b[:2] and out[-1][-1][2] + 1 == b[2]:
            out[-1].append(b)
        else:
            out.append([b])
    return out


def dataset_of(spec: RunSpec, store: ObjectStore, local: DataSettings | None = None) -> TokenDataset:
    """The dataset a RunSpec trains on: its store's (:func:`open_run_dataset`) when it names one —
    every run the commands start, since they refuse a RunSpec without — else the local built-in
    corpus of an in-process run (the simulator, tests: :func:`protocol.data.assignment.open_dataset`)."""
    if spec.data.dataset:
        return open_run_dataset(spec, store, local)
    return open_dataset(spec.data, local=local)

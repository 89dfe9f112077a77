"""Fetching one large object: byte ranges read in parallel, each retried alone, verified as they land.

A late joiner reads a checkpoint of several GB (θ of a 1B-parameter model is 4 GiB) over a home
link that drops now and then. One ``get`` holds the whole transfer on one connection and starts
over after a drop. :func:`fetch` cuts the object into ranges of ``part_bytes``, reads up to
``parallel`` of them at once (each one ``get_range``, on threads), and retries a range that failed
— that range only, with backoff — until ``give_up_at``: a drop costs the ranges in flight, never
what was already read::

    data = fetch(store, f.key, size=f.size, sha256=f.sha256, progress=show)   # show(done, total)
    blob = fetch_capped(store, key, max_bytes=cap)     # size unknown: one GET when it is small

**Checked as it streams.** The sha256 is fed in order as the contiguous prefix of the object
completes (no second pass over GBs); another digest than ``sha256`` is a ``DigestMismatch`` that
names the key. An object of another size than ``size`` is a :class:`SizeMismatch` (one ``size``
query before the ranges; a range past the object's end says the same). ``size`` is the only cap:
the caller's signed manifest entry, or the run's aggregate cap (:mod:`protocol.caps`), so the
transfer scales with the model and no fixed limit breaks at 1B parameters.

**Small objects** (under ``part_bytes``) are one ``get`` capped at ``size``, as they always were,
with the backend's own retries only and no progress reports.

**Which failures are retried**: a ``StoreError`` that says nothing about the object (network,
5xx, a cut-off body, a grant desk that is down) and ``OSError`` (connection resets). Not retried:
the object is absent (``ObjectNotFound``, e.g. removed by retention meanwhile), access is refused,
the arguments are wrong, the object is shorter than ``size``. With ``give_up_at`` None a range is
given up after failing for ``patience_s``; then its last error is raised and the other ranges stop.

``progress(done, total)`` is called on the calling thread after every range, with ``done``
growing to ``total`` (= ``size``) on success.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TypeVar

from protocol.errors import (
    AccessDenied,
    DigestMismatch,
    InvalidKey,
    InvalidRange,
    ObjectNotFound,
    PayloadTooLarge,
    RangeNotSatisfiable,
    StoreError,
)
from protocol.store.base import MAX_RANGE_BYTES, ObjectStore

__all__ = [
    "BACKOFF_S",
    "FINAL",
    "MAX_BACKOFF_S",
    "PARALLEL",
    "PART_BYTES",
    "PATIENCE_S",
    "Progress",
    "Retry",
    "SizeMismatch",
    "Watch",
    "fetch",
    "fetch_capped",
]

#: Bytes per range: about 1.3 s at 50 Mbit/s, so a drop re-reads little.
PART_BYTES = 8 << 20
#: Ranges in flight at once.
PARALLEL = 4
#: The first wait before a failed range is read again; it doubles up to :data:`MAX_BACKOFF_S`.
BACKOFF_S = 0.5
MAX_BACKOFF_S = 15.0
#: With no ``give_up_at``, how long one range may keep failing before the fetch gives up.
PATIENCE_S = 120.0

T = TypeVar("T")

Progress = Callable[[int, int], None]
"""``progress(done, total)``: bytes of the object read so far, of ``total``."""

Watch = Callable[[str], Progress]
"""What a reader that shows its downloads passes down: a :data:`Progress` for a labelled transfer
(``watch("checkpoint 120")``); it is called only for objects fetched in ranges."""

# Failures that say the object cannot be had this way, however often it is asked for.
FINAL: tuple[type[StoreError], ...] = (ObjectNotFound, AccessDenied, InvalidKey, InvalidRange)


class SizeMismatch(DigestMismatch):
    """An object is not the size its manifest entry (or the reader's expectation) says."""

    reason = "size_mismatch"


class _Stopped(Exception):
    """Another range failed for good: this one is abandoned."""


def fetch(
    store: ObjectStore,
    key: str,
    *,
    size: int,
    sha256: str | None = None,
    part_bytes: int = PART_BYTES,
    parallel: int = PARALLEL,
    progress: Progress | None = None,
    give_up_at: float | None = None,
    backoff_s: float = BACKOFF_S,
    patience_s: float = PATIENCE_S,
) -> bytes:
    """The ``size`` bytes of ``key``, read in ranges and verified (module docstring).

    ``give_up_at``: a ``time.time()`` after which a failing range is not tried again.
    """
    if size < 0:
        raise SizeMismatch(f"{key!r}: an object cannot be {size} bytes")
    part = max(1, min(part_bytes, MAX_RANGE_BYTES))
    if size < part:
        data = _whole(store, key, size)
        if sha256 is not None:
            _check_digest(key, hashlib.sha256(data).hexdigest(), sha256)
        return data
    retry = Retry(give_up_at, backoff_s, patience_s)
    data, digest = _ranged(store, key, size, part, max(1, parallel), progress, retry)
    if sha256 is not None:
        _check_digest(key, digest, sha256)
    return data


def fetch_capped(
    store: ObjectStore,
    key: str,
    *,
    max_bytes: int,
    part_bytes: int = PART_BYTES,
    parallel: int = PARALLEL,
    progress: Progress | None = None,
    give_up_at: float | None = None,
) -> bytes:
    """``key``, whose size is not known beforehand, at most ``max_bytes`` of it (an aggregate).

    First one ``get`` capped at ``min(max_bytes, part_bytes)``: a small object comes back whole,
    as before; a larger one is refused before its body is read, then its size is asked and it is
    :func:`fetch` ed in ranges (``PayloadTooLarge`` past ``max_bytes``). A small object costs one
    request, a large one two more than its ranges.
    """
    try:
        return store.get(key, max_bytes=max(1, min(max_bytes, part_bytes)))
    except PayloadTooLarge:
        if max_bytes <= part_bytes:
            raise
    size = store.size(key)
    if size > max_bytes:
        raise PayloadTooLarge(f"{key!r} is {size} bytes, cap is {max_bytes}")
    part = max(1, min(part_bytes, MAX_RANGE_BYTES))
    if size < part:  # it shrank since the refused get
        return _whole(store, key, size)
    retry = Retry(give_up_at, BACKOFF_S, PATIENCE_S)
    return _ranged(store, key, size, part, max(1, parallel), progress, retry, size_known=True)[0]


def _check_digest(key: str, got: str, expected: str) -> None:
    if got != expected:
        raise DigestMismatch(f"{key!r} hashes to {got[:16]}, expected {expected[:16]}")


def _whole(store: ObjectStore, key: str, size: int) -> bytes:
    """A small object in one ``get`` capped at its size."""
    try:
        data = store.get(key, max_bytes=max(size, 1))
    except PayloadTooLarge as exc:
        raise SizeMismatch(f"{key!r} is larger than the {size} bytes expected") from exc
    if len(data) != size:
        raise SizeMismatch(f"{key!r} is {len(data)} bytes, expected {size}")
    return data


class Retry:
    """When a failed read is tried again: backoff doubling from ``backoff_s``, until ``give_up_at``
    (or ``patience_s`` after the read first failed); the waits end at once when ``stop`` is set.
    Only what may pass is retried (module docstring); ``run(read)`` returns ``read()``'s value
    or raises its last error."""

    def __init__(self, give_up_at: float | None, backoff_s: float, patience_s: float) -> None:
        self.give_up_at, self.backoff_s, self.patience_s = give_up_at, backoff_s, patience_s
        self.stop = threading.Event()

    def run(self, read: Callable[[], T]) -> T:
        deadline = self.give_up_at
        attempt = 0
        while True:
            if self.stop.is_set():
                raise _Stopped
            try:
                return read()
            except FINAL:
                raise
            except (StoreError, OSError):
                now = time.time()
                if deadline is None:
                    deadline = now + self.patience_s
                wait_s = min(self.backoff_s * 2**attempt, MAX_BACKOFF_S)
                if now + wait_s > deadline:
                    raise
            attempt += 1
            if self.stop.wait(wait_s):
                raise _Stopped


def _read_range(store: ObjectStore, key: str, start: int, length: int) -> bytes:
    try:
        data = store.get_range(key, start, length)
    except RangeNotSatisfiable as exc:
        raise SizeMismatch(f"{key!r} ends before byte {start + length}: {exc}") from exc
    if len(data) != length:
        raise SizeMismatch(f"{key!r}: bytes [{start}, {start + length}) came back as {len(data)} bytes")
    return data


def _ranged(
    store: ObjectStore,
    key: str,
    size: int,
    part: int,
    parallel: int,
    progress: Progress | None,
    retry: Retry,
    *,
    size_known: bool = False,
) -> tuple[bytes, str]:
    """The object and its sha256, read ``parallel`` ranges at a time; each range is hashed once
    every range before it has arrived. ``size_known``: the caller has just asked the store."""
    actual = size if size_known else retry.run(lambda: store.size(key))
    if actual != size:
        raise SizeMismatch(f"{key!r} is {actual} bytes, expected {size}")
    hasher = hashlib.sha256()
    parts: dict[int, bytes] = {}  # start -> bytes, every range read so far
    hashed = 0  # the contiguous prefix fed to the hasher
    done = 0
    starts = iter(range(0, size, part))
    pending: dict[Future[bytes], int] = {}
    with ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="fetch") as pool:

        def submit() -> None:
            start = next(starts, None)
            if start is not None:
                length = min(part, size - start)
                pending[pool.submit(retry.run, lambda: _read_range(store, key, start, length))] = start

        try:
            for _ in range(parallel):
                submit()
            while pending:
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in finished:
                    start = pending.pop(future)
                    parts[start] = future.result()
                    submit()  # the next range is read while this one is hashed
                    done += len(parts[start])
                    while hashed in parts and hashed < size:
                        hasher.update(parts[hashed])
                        hashed += len(parts[hashed])
                    if progress is not None:
                        progress(done, size)
        except BaseException:
            retry.stop.set()
            for future in pending:
                future.cancel()
            raise
    return b"".join(parts[s] for s in sorted(parts)), hasher.hexdigest()

"""The one storage interface every backend implements (local directory, S3, DHT, in-memory).

Keys are ``/``-separated strings without a leading slash (see ``protocol.layout``). Values are
bytes. Every read takes a ``max_bytes`` cap so that one huge object cannot stall or exhaust a
reader; the cap is checked against the object's size before the body is transferred where the
backend allows it. ``get_range`` reads a byte range of an object (at most
:data:`MAX_RANGE_BYTES`) and, in every backend here, transfers only that range.

    store = open_store("file:///tmp/swarm")        # protocol.store.open_store
    store.put("run/contrib/3/abc", blob, if_absent=True)
    blob = store.get("run/contrib/3/abc", max_bytes=64 << 20)
    part = store.get_range("run/data/shard/9f2c", start=4096, length=512)   # bytes [4096, 4608)
    keys = store.list("run/contrib/3/")
    keys = store.list_written_by("run/contrib/3/", announced)   # the DHT decodes only their entries
    put_once(store, "run/aggregate/3", blob)        # create; the same bytes already there are fine
    with deadline(time.time() + 40):               # this thread's store calls end by then
        put_once(store, "run/contrib/3/abc", blob)

A :func:`deadline` bounds a caller's store calls on its thread (a context variable): a backend
that retries or waits on the network (the granted store) stops retrying and clips its timeouts
to the time left (:func:`seconds_left`), so a window's upload deadline holds however the link
behaves. Backends without network waits ignore it.
"""

from __future__ import annotations

import builtins  # list() shadows the builtin in ObjectStore
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING

from protocol.errors import (
    InvalidKey,
    InvalidRange,
    ObjectExists,
    ObjectNotFound,
    PayloadTooLarge,
    RangeNotSatisfiable,
    StoreError,
)

if TYPE_CHECKING:
    from protocol.store.traffic import WireCounter

DEFAULT_MAX_BYTES = 64 * 1024 * 1024

#: Longest byte range one ``get_range`` returns: the default cap of a whole read.
MAX_RANGE_BYTES = DEFAULT_MAX_BYTES

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")

# How often the default get_range looks again at an object replaced by a larger one mid-read.
_RANGE_READ_ATTEMPTS = 3

_DEADLINE: ContextVar[float | None] = ContextVar("store_deadline", default=None)

#: Longest key in UTF-8 bytes (S3's own limit).
MAX_KEY_BYTES = 1024

#: A reader that would LIST a prefix for a few known keys GETs them one by one up to this many: a
#: LIST costs what 12.5 GETs cost on R2 (class A $4.50/M, class B $0.36/M) and on S3 alike ($0.005
#: and $0.0004 per 1000), and a GET of a key that is there reads it too.
EXACT_READS = 12

# One path segment: portable on every file system and URL-safe in S3 without escaping. A leading
# dot is refused so that "." / ".." cannot traverse and so backends may keep hidden temp files.
_SEGMENT = re.compile(r"[A-Za-z0-9_~=+@,-][A-Za-z0-9._~=+@,-]*")


def check_key(key: str) -> str:
    """Return ``key`` if it is a valid object key, else raise :class:`InvalidKey`.

    A key is 1-1024 bytes of ``/``-separated segments, no leading or trailing ``/``, no empty
    segment, no segment starting with ``.``, characters ``A-Z a-z 0-9 . _ ~ = + @ , -`` only.
    Keys may come from the network (manifests list keys), so this is enforced by every backend.
    """
    if not isinstance(key, str):
        raise InvalidKey(f"key must be str, got {type(key).__name__}")
    if not key or len(key.encode()) > MAX_KEY_BYTES:
        raise InvalidKey(f"key must be 1..{MAX_KEY_BYTES} bytes, got {len(key.encode())}")
    for segment in key.split("/"):
        if not _SEGMENT.fullmatch(segment):
            raise InvalidKey(f"bad key {key!r}: segment {segment!r} is empty or not allowed")
    return key


def check_prefix(prefix: str) -> str:
    """Return ``prefix`` if it is ``""`` or a valid key optionally followed by one ``/``."""
    if not isinstance(prefix, str):
        raise InvalidKey(f"prefix must be str, got {type(prefix).__name__}")
    if prefix:
        check_key(prefix[:-1] if prefix.endswith("/") else prefix)
    return prefix


def check_range(key: str, start: int, length: int) -> int:
    """Check the arguments of :meth:`ObjectStore.get_range`; return the range's end.

    ``key`` must pass :func:`check_key`; ``start`` is an int >= 0 and ``length`` an int in
    ``1..MAX_RANGE_BYTES``, else :class:`InvalidRange`.
    """
    check_key(key)
    for name, value in (("start", start), ("length", length)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidRange(f"{name} must be an int, got {type(value).__name__}")
    if start < 0:
        raise InvalidRange(f"a range starts at byte 0 or later, not {start}")
    if not 1 <= length <= MAX_RANGE_BYTES:
        raise InvalidRange(f"a range is 1..{MAX_RANGE_BYTES} bytes long, not {length}")
    return start + length


def range_past_end(key: str, start: int, length: int, size: int) -> RangeNotSatisfiable:
    """The error for bytes ``[start, start + length)`` of ``key``, an object of ``size`` bytes."""
    return RangeNotSatisfiable(f"{key!r} is {size} bytes: it has no bytes [{start}, {start + length})")


def check_range_answer(
    key: str, start: int, length: int, status: int, content_range: str | None, content_length: int | None
) -> None:
    """Check the head of an HTTP answer to ``Range: bytes=<start>-<start + length - 1>`` before
    its body is read (the S3 and granted stores).

    Right answers: ``206`` with ``Content-Range: bytes <start>-<end - 1>/<size>``, or ``200`` (a
    server that ignores ``Range`` sends the whole object) when the whole object is the range. A
    ``Content-Length`` other than ``length`` is wrong either way. When a wrong answer shows the
    object is too short (S3 cuts a range at the object's end; a ``200`` tells the size), raise
    :class:`RangeNotSatisfiable`, else :class:`StoreError`.
    """
    end = start + length
    answered = _CONTENT_RANGE.fullmatch((content_range or "").strip())
    if status == 206:
        size = int(answered[3]) if answered and answered[3].isdigit() else None
        right = answered is not None and (int(answered[1]), int(answered[2])) == (start, end - 1)
    else:
        size, right = content_length, status == 200 and start == 0
    if content_length is not None and content_length != length:
        right = False
    if right:
        return
    if size is not None and size < end:
        raise range_past_end(key, start, length, size)
    shown = content_range or f"{content_length} bytes"
    raise StoreError(f"{key!r}: asked for bytes {start}-{end - 1}, the store answered {status} ({shown})")


class ObjectStore(ABC):
    """Put/get/list/exists/delete over bytes.

    ``put(..., if_absent=True)`` is a conditional create: it raises ``ObjectExists`` when the key is
    already there. Backends without an atomic primitive emulate it best-effort and say so in
    ``atomic_create``. Missing keys raise ``ObjectNotFound``; oversized ones ``PayloadTooLarge``;
    permission failures ``AccessDenied``; keys that break :func:`check_key` ``InvalidKey``; byte
    ranges that break :func:`check_range` ``InvalidRange``, ranges past an object's end
    ``RangeNotSatisfiable``; anything else a ``StoreError``.
    """

    #: True when ``put(if_absent=True)`` is atomic against concurrent writers.
    atomic_create: bool = False
    #: The bytes this store's sockets sent and received (HTTP backends); None where it opens none
    #: of its own (a directory, memory) or does not count them (the DHT's node).
    wire: WireCounter | None = None

    @abstractmethod
    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None: ...

    @abstractmethod
    def get(self, key: str, *, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes: ...

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """Bytes ``[start, start + length)`` of ``key``: exactly ``length`` of them.

        ``ObjectNotFound`` when the key is absent; :class:`~protocol.errors.RangeNotSatisfiable`
        when the object is shorter than ``start + length`` (no partial range is returned);
        :class:`~protocol.errors.InvalidRange` for arguments :func:`check_range` refuses.

        This default is correct for any backend but not cheap: it asks ``size`` (a range past the
        end is refused without reading anything), then reads the whole object with ``get``, capped
        at that size, and slices. The cap is the size just seen, not ``start + length``: ``get``
        refuses an object larger than its cap rather than returning a prefix. An object replaced by
        a larger one between the two calls makes ``get`` refuse; it is looked at again, a few
        times. Backends override this to transfer only the range.
        """
        end = check_range(key, start, length)
        for _ in range(_RANGE_READ_ATTEMPTS):
            size = self.size(key)
            if size < end:
                raise range_past_end(key, start, length, size)
            try:
                data = self.get(key, max_bytes=size)
            except PayloadTooLarge:
                continue  # it grew since size(): look again
            if len(data) < end:  # it shrank since size(): this is the object now
                raise range_past_end(key, start, length, len(data))
            return data[start:end]
        raise StoreError(f"{key!r} kept growing while its bytes [{start}, {end}) were read")

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Keys starting with ``prefix``, sorted."""

    def list_written_by(self, prefix: str, writers: Collection[str]) -> builtins.list[str]:
        """``list(prefix)``, where a backend that records who wrote each listing entry (the DHT)
        may leave out the entries of writers other than ``writers`` (peer ids) and the run's
        validators before any per-entry work. This default returns ``list(prefix)``: the caller
        still checks every key it gets."""
        return self.list(prefix)

    @abstractmethod
    def size(self, key: str) -> int:
        """Size in bytes; raises ``ObjectNotFound``."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove a key; deleting a missing key is not an error."""

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except ObjectNotFound:
            return False
        return True

    def close(self) -> None:  # noqa: B027 - a no-op by default: most stores hold nothing to release
        """Release connections / background processes. Idempotent."""

    def __enter__(self) -> ObjectStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def put_once(store: ObjectStore, key: str, data: bytes) -> bool:
    """Create ``key`` holding ``data``; ``True`` when this call created it.

    Finding exactly ``data`` already there is success (``False``): a restarted writer, or a retried
    put whose first attempt landed, republishes the same bytes. A different object under ``key``
    raises :class:`~protocol.errors.ObjectExists`; the existing object is read back only up to
    ``len(data)`` bytes, so a larger one is never transferred.
    """
    try:
        store.put(key, data, if_absent=True)
    except ObjectExists:
        try:
            existing = store.get(key, max_bytes=len(data))
        except PayloadTooLarge:
            raise ObjectExists(f"{key!r} already holds a different, larger object") from None
        if existing != data:
            raise
        return False
    return True


@contextmanager
def deadline(at: float | None) -> Iterator[None]:
    """Store calls made in this block, on this thread, should end by ``at`` (Unix time; ``None``:
    no bound). An enclosing earlier deadline still holds."""
    outer = _DEADLINE.get()
    token = _DEADLINE.set(at if outer is None else outer if at is None else min(at, outer))
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def seconds_left() -> float | None:
    """Seconds until this thread's :func:`deadline` (negative once past), or ``None`` without one."""
    at = _DEADLINE.get()
    return None if at is None else at - time.time()

"""The one storage interface every backend implements (local directory, S3, DHT, in-memory).

Keys are ``/``-separated strings without a leading slash (see ``protocol.layout``). Values are
bytes. Every read takes a ``max_bytes`` cap so that one huge object cannot stall or exhaust a
reader; the cap is checked against the object's size before the body is transferred where the
backend allows it.

    store = open_store("file:///tmp/swarm")        # protocol.store.open_store
    store.put("run/contrib/3/abc", blob, if_absent=True)
    blob = store.get("run/contrib/3/abc", max_bytes=64 << 20)
    keys = store.list("run/contrib/3/")
    put_once(store, "run/aggregate/3", blob)        # create; the same bytes already there are fine
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod

from protocol.errors import InvalidKey, ObjectExists, ObjectNotFound, PayloadTooLarge

DEFAULT_MAX_BYTES = 64 * 1024 * 1024

#: Longest key in UTF-8 bytes (S3's own limit).
MAX_KEY_BYTES = 1024

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


class ObjectStore(ABC):
    """Put/get/list/exists/delete over bytes.

    ``put(..., if_absent=True)`` is a conditional create: it raises ``ObjectExists`` when the key is
    already there. Backends without an atomic primitive emulate it best-effort and say so in
    ``atomic_create``. Missing keys raise ``ObjectNotFound``; oversized ones ``PayloadTooLarge``;
    permission failures ``AccessDenied``; keys that break :func:`check_key` ``InvalidKey``;
    anything else a ``StoreError``.
    """

    #: True when ``put(if_absent=True)`` is atomic against concurrent writers.
    atomic_create: bool = False

    @abstractmethod
    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None: ...

    @abstractmethod
    def get(self, key: str, *, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes: ...

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Keys starting with ``prefix``, sorted."""

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

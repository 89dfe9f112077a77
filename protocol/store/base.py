"""The one storage interface every backend implements (local directory, S3, DHT, in-memory).

Keys are ``/``-separated strings without a leading slash (see ``protocol.layout``). Values are
bytes. Every read takes a ``max_bytes`` cap so that one huge object cannot stall or exhaust a
reader; the cap is checked against the object's size before the body is transferred where the
backend allows it.

    store = open_store("file:///tmp/swarm")        # protocol.store.open_store
    store.put("run/contrib/3/abc", blob, if_absent=True)
    blob = store.get("run/contrib/3/abc", max_bytes=64 << 20)
    keys = store.list("run/contrib/3/")
"""

from __future__ import annotations

from abc import ABC, abstractmethod

DEFAULT_MAX_BYTES = 64 * 1024 * 1024


class ObjectStore(ABC):
    """Put/get/list/exists/delete over bytes.

    ``put(..., if_absent=True)`` is a conditional create: it raises ``ObjectExists`` when the key is
    already there. Backends without an atomic primitive emulate it best-effort and say so in
    ``atomic_create``. Missing keys raise ``ObjectNotFound``; oversized ones ``PayloadTooLarge``;
    permission failures ``AccessDenied``; anything else a ``StoreError``.
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
        from protocol.errors import ObjectNotFound

        try:
            self.size(key)
        except ObjectNotFound:
            return False
        return True

    def close(self) -> None:
        """Release connections / background processes. Idempotent."""

    def __enter__(self) -> "ObjectStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

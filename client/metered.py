"""A store that counts what a participant moves through it: object bytes, and bytes on the wire.

    store = MeteredStore(open_from_settings(settings.store))
    ...
    store.get_range(key, start, length)   # ranges count too: the bytes returned
    store.bytes_read            # bytes of every object and range fetched so far (aggregates, checkpoints, data)
    store.bytes_written         # bytes of every object put so far (contributions, announcements)
    store.wire_sent, store.wire_received   # what the wrapped store's sockets moved, headers and all
    store.requests()            # {"GET": n, "HEAD": n, "LIST": n, "PUT": n} sent to the bucket so far

The peer reads everything it needs from the run through one of these (its reports carry the bytes
fetched per window, ``sparseloco demo`` the mean per peer and window). ``bytes_read`` and
``bytes_written`` are payload sizes; listings, size queries, grant requests, HTTP headers and
retries are not in them. ``wire_sent`` and ``wire_received`` are: they read the wrapped store's
:class:`~protocol.store.traffic.WireCounter`, which counts every connection that store opens, also
for callers that use it directly (the peer's data feed does), so they are what the peer's store
traffic put on its link. A store without sockets of its own (a directory, memory, the DHT's node)
reports 0.

:meth:`MeteredStore.requests` is what the bucket bills: the requests the wrapped store sent to it
by kind, counted where they are sent (a :class:`~protocol.store.granted.GrantedStore` counts every
attempt and every listing page, and every reader of the process that shares it — the data feed
too). A store that does not count its requests (a directory, a credential's own S3 client)
reports none.
"""

from __future__ import annotations

import threading

from protocol.store.base import DEFAULT_MAX_BYTES, ObjectStore
from protocol.store.granted import GrantStats

__all__ = ["MeteredStore"]


class MeteredStore(ObjectStore):
    """Delegates to ``inner``; :attr:`bytes_read` sums the sizes of the objects ``get`` and the
    ranges ``get_range`` returned, :attr:`bytes_written` those ``put`` stored; :attr:`wire_sent`
    and :attr:`wire_received` are ``inner``'s socket counters."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.atomic_create = inner.atomic_create
        self.wire = inner.wire
        self._lock = threading.Lock()  # the peer reads from its main thread and its lane at once
        self._read = 0
        self._written = 0

    @property
    def bytes_read(self) -> int:
        return self._read

    @property
    def bytes_written(self) -> int:
        return self._written

    @property
    def wire_sent(self) -> int:
        """Bytes the wrapped store's sockets sent (0 without any)."""
        return self.wire.sent if self.wire is not None else 0

    @property
    def wire_received(self) -> int:
        """Bytes the wrapped store's sockets received (0 without any)."""
        return self.wire.received if self.wire is not None else 0

    def requests(self) -> dict[str, int]:
        """Requests the wrapped store sent to the bucket so far, by kind ({} when it does not count)."""
        stats = getattr(self.inner, "stats", None)
        return dict(stats.requests) if isinstance(stats, GrantStats) else {}

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        self.inner.put(key, data, if_absent=if_absent)
        with self._lock:
            self._written += len(data)

    def get(self, key: str, *, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
        data = self.inner.get(key, max_bytes=max_bytes)
        with self._lock:
            self._read += len(data)
        return data

    def get_range(self, key: str, start: int, length: int) -> bytes:
        data = self.inner.get_range(key, start, length)
        with self._lock:
            self._read += len(data)
        return data

    def list(self, prefix: str) -> list[str]:
        return self.inner.list(prefix)

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def close(self) -> None:
        self.inner.close()

"""This machine's cache of the run's data: verified blocks by content address, under a size cap.

The cache directory (``[local.data] cache_dir``, else ``$SPARSELOCO_CACHE``, else
``~/.cache/sparseloco``) holds::

    blocks/<sha256>          a block of a token shard exactly as the store holds it (its bytes hash to the name)
    tokenizers/<sha256>.json a run's tokenizer.json, likewise

Files are evicted least recently used first: a file's modification time is its last use, and a
:meth:`BlockCache.put` that would take the cache past ``max_bytes`` removes the least recently used
first (down to 90 % of the cap, so that a full cache does not evict on every put). A file larger
than the whole cap is not written at all (its reader keeps it in memory). Names are content
addresses, so runs and processes that share a cache directory share its blocks, and a concurrent
writer of the same name writes the same bytes. A file is trusted only after its hash was checked
once by this process::

    cache = BlockCache(cache_dir(settings.data) / BLOCKS, max_bytes=settings.data.cache_max_bytes)
    data = cache.get(sha256, size)        # verified bytes, marked used, or None
    cache.put(sha256, data)               # written (evicting others), False when it cannot fit

The cache lists its directory once, when a put first needs the total, and keeps the total
itself from then on; files that other processes add meanwhile are counted when a later eviction
lists the directory again.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

from protocol.files import atomic_write
from protocol.settings import DataSettings

__all__ = ["BLOCKS", "TOKENIZERS", "BlockCache", "cache_dir"]

BLOCKS = "blocks"
TOKENIZERS = "tokenizers"
EVICT_TO = 0.9  # an eviction frees room down to this share of the cap


def cache_dir(local: DataSettings | None = None) -> Path:
    """``local.cache_dir``, else ``$SPARSELOCO_CACHE``, else ``~/.cache/sparseloco``."""
    if local is not None and local.cache_dir:
        return Path(local.cache_dir).expanduser()
    env = os.environ.get("SPARSELOCO_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "sparseloco"


class BlockCache:
    """Files named by the sha256 of their bytes in ``root``, at most ``max_bytes`` in all (0: no cap)."""

    def __init__(self, root: str | Path, max_bytes: int = 0) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.root, self.max_bytes = Path(root), max_bytes
        self._verified: set[str] = set()  # names whose bytes this process has hashed
        self._total: int | None = None  # bytes in the directory, once listed
        self._lock = threading.Lock()  # the prefetch thread and readers share one cache

    def path(self, sha256: str) -> Path:
        return self.root / sha256

    def get(self, sha256: str, size: int) -> bytes | None:
        """The bytes of ``sha256`` if they are here, ``size`` long and hash to the name (a damaged
        file is removed); its use time becomes now."""
        p = self.path(sha256)
        with self._lock:
            try:
                data = p.read_bytes()
                if len(data) != size or (sha256 not in self._verified and hashlib.sha256(data).hexdigest() != sha256):
                    self._drop(p, len(data))
                    return None
                self._verified.add(sha256)
                os.utime(p)
            except FileNotFoundError:  # never there, or evicted by another process meanwhile
                self._verified.discard(sha256)
                return None
        return data

    def put(self, sha256: str, data: bytes) -> bool:
        """Keep verified ``data`` (its sha256 is ``sha256``) as a file, evicting the least recently
        used if the cap needs it; False when it is larger than the whole cap."""
        if self.max_bytes and len(data) > self.max_bytes:
            return False
        with self._lock:
            self.root.mkdir(parents=True, exist_ok=True)
            if self.max_bytes:
                total = self._listed_total()
                if total + len(data) > self.max_bytes:
                    self._evict(room=len(data), keep=sha256)
            atomic_write(self.path(sha256), data, durable=False)  # a torn cache file fails its hash
            self._verified.add(sha256)
            if self._total is not None:
                self._total += len(data)
        return True

    def total_bytes(self) -> int:
        return sum(size for _, size, _ in self._entries())

    def _listed_total(self) -> int:
        if self._total is None:
            self._total = self.total_bytes()
        return self._total

    def _drop(self, p: Path, size: int) -> None:
        p.unlink(missing_ok=True)
        self._verified.discard(p.name)
        if self._total is not None:
            self._total = max(0, self._total - size)

    def _entries(self) -> list[tuple[float, int, Path]]:
        """(last use, size, path) of every cached file (temporary files excluded)."""
        out = []
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        for name in names:
            if name.startswith("."):
                continue
            p = self.root / name
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            out.append((st.st_mtime, st.st_size, p))
        return out

    def _evict(self, *, room: int, keep: str) -> None:
        entries = sorted(e for e in self._entries() if e[2].name != keep)
        total = sum(size for _, size, _ in entries)
        target = int(self.max_bytes * EVICT_TO)
        for _, size, p in entries:
            if total + room <= target:
                break
            p.unlink(missing_ok=True)
            self._verified.discard(p.name)
            total -= size
        self._total = total

"""This machine's cache of the run's data: verified shards by content address, under a size cap.

The cache directory (``[local.data] cache_dir``, else ``$SPARSELOCO_CACHE``, else
``~/.cache/sparseloco``) holds::

    shards/<sha256>          a token shard exactly as the store holds it (its bytes hash to the name)
    tokenizers/<sha256>.json a run's tokenizer.json, likewise

Shards are used least-recently-first evicted: a file's modification time is its last use, and a
:meth:`ShardCache.put` that would take the shards past ``max_bytes`` removes the least recently
used first. A shard larger than the whole cap is not written at all (its reader keeps it in
memory). Names are content addresses, so runs and processes that share a cache directory share
its shards, and a concurrent writer of the same name writes the same bytes. A file is trusted only
after its hash was checked once by this process::

    cache = ShardCache(cache_dir(settings.data) / "shards", max_bytes=settings.data.cache_max_bytes)
    path = cache.get(sha256, size)        # verified and marked used, or None
    path = cache.put(sha256, data)        # written (evicting others), or None when it cannot fit
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

from protocol.files import atomic_write
from protocol.settings import DataSettings

__all__ = ["SHARDS", "TOKENIZERS", "ShardCache", "cache_dir"]

SHARDS = "shards"
TOKENIZERS = "tokenizers"


def cache_dir(local: DataSettings | None = None) -> Path:
    """``local.cache_dir``, else ``$SPARSELOCO_CACHE``, else ``~/.cache/sparseloco``."""
    if local is not None and local.cache_dir:
        return Path(local.cache_dir).expanduser()
    env = os.environ.get("SPARSELOCO_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "sparseloco"


class ShardCache:
    """Files named by the sha256 of their bytes in ``root``, at most ``max_bytes`` in all (0: no cap)."""

    def __init__(self, root: str | Path, max_bytes: int = 0) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.root, self.max_bytes = Path(root), max_bytes
        self._verified: set[str] = set()  # names whose bytes this process has hashed
        self._lock = threading.Lock()  # the prefetch thread and readers share one cache

    def path(self, sha256: str) -> Path:
        return self.root / sha256

    def get(self, sha256: str, size: int) -> Path | None:
        """The file of ``sha256`` if it is here with ``size`` bytes that hash to its name (a
        damaged one is removed); its use time becomes now."""
        p = self.path(sha256)
        with self._lock:
            try:
                if p.stat().st_size != size:
                    p.unlink(missing_ok=True)
                    return None
                if sha256 not in self._verified:
                    if hashlib.sha256(p.read_bytes()).hexdigest() != sha256:
                        p.unlink(missing_ok=True)
                        return None
                    self._verified.add(sha256)
                os.utime(p)
            except FileNotFoundError:  # never there, or evicted by another process meanwhile
                self._verified.discard(sha256)
                return None
        return p

    def put(self, sha256: str, data: bytes) -> Path | None:
        """Keep verified ``data`` (its sha256 is ``sha256``) as a file, evicting the least recently
        used until it fits; None when it is larger than the whole cap."""
        if self.max_bytes and len(data) > self.max_bytes:
            return None
        with self._lock:
            self.root.mkdir(parents=True, exist_ok=True)
            self._evict(room=len(data), keep=sha256)
            atomic_write(self.path(sha256), data, durable=False)  # a torn cache file fails its hash
            self._verified.add(sha256)
        return self.path(sha256)

    def total_bytes(self) -> int:
        return sum(size for _, size, _ in self._entries())

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
        if not self.max_bytes:
            return
        entries = sorted(e for e in self._entries() if e[2].name != keep)
        total = sum(size for _, size, _ in entries)
        for _, size, p in entries:
            if total + room <= self.max_bytes:
                return
            p.unlink(missing_ok=True)
            self._verified.discard(p.name)
            total -= size

"""Object store in a local directory: the embedded default, and what a shared file system offers.

Keys map to paths under the root (``run/contrib/3/abc`` -> ``<root>/run/contrib/3/abc``) so an
operator can browse the objects. Writes go through :func:`protocol.files.atomic_write`: a hidden
temp file in the target directory, fsynced, then renamed into place, so a reader never sees half an
object and a writer killed mid-upload leaves only a dot file that listings ignore. ``if_absent``
links the temp file to the final name (``os.link`` fails atomically if the name exists), so
concurrent creators — threads or processes — get exactly one winner.

    store = LocalStore("/var/lib/sparseloco")
    store.put("run/data/shard/9f2c", shard)
    store.get_range("run/data/shard/9f2c", start=4096, length=512)   # seek and read 512 bytes

``get_range`` reads only the range from the open file; since objects are replaced by rename, the
open file is one version of the object throughout.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from protocol.errors import (
    AccessDenied,
    ObjectExists,
    ObjectNotFound,
    PayloadTooLarge,
    StoreError,
)
from protocol.files import atomic_write
from protocol.store.base import (
    DEFAULT_MAX_BYTES,
    ObjectStore,
    check_key,
    check_prefix,
    check_range,
    range_past_end,
)

_READ_CHUNK = 1 << 20
# A concurrent delete may prune the directory between makedirs and the temp file; retry that.
_MKDIR_ATTEMPTS = 5


def _os_error(exc: OSError, key: str) -> Exception:
    """Map an OSError to the store's exception for ``key``."""
    if isinstance(exc, (FileNotFoundError, NotADirectoryError, IsADirectoryError)):
        return ObjectNotFound(f"{key!r} not found")
    if isinstance(exc, PermissionError):
        return AccessDenied(f"{key!r}: {exc.strerror}")
    return StoreError(f"{key!r}: {exc}")


class LocalStore(ObjectStore):
    """Objects as files under ``root`` (created if missing)."""

    atomic_create = True

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.root = Path(root).expanduser().resolve()
        self.fsync = fsync
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create store directory {self.root}: {exc}") from exc

    def _path(self, key: str) -> Path:
        check_key(key)
        path = self.root.joinpath(*key.split("/"))
        # check_key already refuses "..": this also catches a symlinked directory inside the root.
        real = Path(os.path.realpath(path))
        if real != self.root and self.root not in real.parents:
            raise AccessDenied(f"{key!r} resolves outside the store root")
        return path

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        path = self._path(key)
        for attempt in range(_MKDIR_ATTEMPTS):
            try:
                self._make_parent(path, key)
                atomic_write(path, data, durable=self.fsync, exclusive=if_absent)
                break
            except FileNotFoundError:
                # A concurrent delete pruned the directory between mkdir and the write: retry.
                if attempt == _MKDIR_ATTEMPTS - 1:
                    raise StoreError(f"{key!r}: directory vanished while writing") from None
            except FileExistsError:
                raise ObjectExists(f"{key!r} already exists") from None
            except IsADirectoryError as exc:
                raise StoreError(f"{key!r} is a prefix of other keys in this directory store") from exc
            except OSError as exc:
                raise _os_error(exc, key) from exc
        try:
            self._sync_dir(path.parent)
        except OSError as exc:
            raise _os_error(exc, key) from exc

    @staticmethod
    def _make_parent(path: Path, key: str) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as exc:
            raise StoreError(f"{key!r} collides with an object on its path") from exc

    def _sync_dir(self, directory: Path) -> None:
        # The rename is durable only once the directory entry is on disk.
        if not self.fsync:
            return
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def get(self, key: str, *, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > max_bytes:
                    raise PayloadTooLarge(f"{key!r} is {size} bytes, cap is {max_bytes}")
                data = f.read(max_bytes + 1)
        except OSError as exc:
            raise _os_error(exc, key) from exc
        if len(data) > max_bytes:  # the file grew after fstat: still never return more than the cap
            raise PayloadTooLarge(f"{key!r} exceeds the cap of {max_bytes} bytes")
        return data

    def get_range(self, key: str, start: int, length: int) -> bytes:
        end = check_range(key, start, length)
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < end:
                    raise range_past_end(key, start, length, size)
                f.seek(start)
                data = f.read(length)
        except OSError as exc:
            raise _os_error(exc, key) from exc
        if len(data) < length:  # truncated in place after fstat (not by this store: it renames)
            raise range_past_end(key, start, length, start + len(data))
        return data

    def list(self, prefix: str) -> list[str]:
        check_prefix(prefix)
        # Walk only the deepest directory the prefix fully names.
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.root.joinpath(*base.split("/")) if base else self.root
        keys: list[str] = []
        for dirpath, dirnames, filenames in os.walk(start, onerror=None):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel = os.path.relpath(dirpath, self.root)
            head = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            keys.extend(
                head + name for name in filenames if not name.startswith(".") and (head + name).startswith(prefix)
            )
        return sorted(keys)

    def size(self, key: str) -> int:
        path = self._path(key)
        try:
            st = path.stat()
        except OSError as exc:
            raise _os_error(exc, key) from exc
        if not path.is_file():
            raise ObjectNotFound(f"{key!r} not found")
        return st.st_size

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink()
        except (FileNotFoundError, NotADirectoryError):
            return
        except IsADirectoryError:
            return
        except OSError as exc:
            raise _os_error(exc, key) from exc
        self._prune(path.parent)

    def _prune(self, directory: Path) -> None:
        """Remove directories left empty, up to the root (best effort; writers retry)."""
        while directory != self.root and self.root in directory.parents:
            try:
                directory.rmdir()
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                    raise _os_error(exc, str(directory)) from exc
                return
            directory = directory.parent

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"
